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


def refuse_pipeline_parallelism(trainer: Trainer, callback: str, reason: str) -> None:
    """Raise, naming the fix, when ``callback`` runs under pipeline parallelism (``reason``: why it cannot)."""
    if pipeline_parallel_size(trainer) > 1:
        raise ValueError(f"{callback} runs with pipeline_parallel_size=1: {reason}. Set pipeline_parallel_size=1, "
                         "or drop the callback.")
