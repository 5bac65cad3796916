"""Shared by the callbacks: argument checks and sending metrics to the Trainer's loggers."""

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


def check_positive_int_or_none(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is None or a positive int (a logging interval)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
