"""Sending a callback's metrics to the Trainer's loggers."""

from __future__ import annotations

from lightning.pytorch import Trainer


def logging_step(trainer: Trainer) -> int:
    """The step under which Lightning logs the current batch's ``self.log`` values.

    In ``on_train_batch_end`` that is the number of optimizer steps before this batch's step,
    so callback metrics land in the same row (CSV) or step (TensorBoard) as ``train/loss``.
    """
    loop = getattr(trainer, "fit_loop", None)
    return int(getattr(getattr(loop, "epoch_loop", None), "_batches_that_stepped", trainer.global_step))


def log_to_loggers(trainer: Trainer, metrics: dict[str, float]) -> None:
    """``log_metrics`` on every logger (Lightning's loggers write on global rank 0 only)."""
    step = logging_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
