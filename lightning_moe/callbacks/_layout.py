"""What a callback reads of the strategy's parallel layout, for strategies that have one or not."""

from __future__ import annotations

from lightning.pytorch import Trainer


def pipeline_parallel_size(trainer: Trainer) -> int:
    """The strategy's pipeline size (`MegatronMoEStrategy`'s layout), 1 for a strategy without one."""
    try:
        layout = trainer.strategy.layout
    except (AttributeError, RuntimeError):
        return 1
    return getattr(layout, "pipeline_parallel_size", 1)
