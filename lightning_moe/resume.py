"""Checkpoints written after a fit stopped in the middle of an epoch resume in that epoch.

When ``max_steps`` (or ``trainer.should_stop``) ends a fit before the epoch's data ran out,
Lightning 2.6 still closes the epoch: its fit loop marks the epoch processed, runs the
``on_train_epoch_end`` hooks, then marks it completed, so ``trainer.current_epoch`` becomes 1
in epoch 0. A checkpoint saved from then on (``ModelCheckpoint``'s save at the end of training
or of the epoch, ``last.ckpt``) recorded that epoch as finished: ``epoch: 1``, and a run
resumed from it labelled itself epoch 1 and started epoch 1's data order, while an
uninterrupted run would have gone on in epoch 0.

:func:`record_mid_epoch_stop` rewrites such a checkpoint's fit-loop state to what it is: in the
middle of the epoch, after its last trained batch (the form Lightning itself writes from
``on_train_batch_end``). Lightning then resumes it as a mid-epoch restart, in the same epoch,
after the same batch, with the same step numbers for the loggers.
:class:`~lightning_moe.models.MoELanguageModel` calls it from ``on_save_checkpoint``, and
:class:`~lightning_moe.MegatronMoEStrategy` for every module it saves.
"""

from __future__ import annotations

from typing import Any


def stopped_mid_epoch(trainer: Any) -> bool:
    """Whether the fit loop closed an epoch whose data had not run out (a max_steps/should_stop stop)."""
    loop = getattr(trainer, "fit_loop", None)
    if loop is None:
        return False
    epochs = loop.epoch_progress.current
    if epochs.ready == 0 or epochs.processed != epochs.ready:
        return False  # no epoch started, or the current one still running
    batches = loop.epoch_loop.batch_progress
    if batches.is_last_batch or batches.current.ready == 0:
        return False  # the epoch's data ran out: a real epoch end
    num_batches = trainer.num_training_batches
    return num_batches == float("inf") or batches.current.ready < num_batches


def record_mid_epoch_stop(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Rewrite ``checkpoint`` (Lightning's dict) in place when it was saved after a stop in the
    middle of an epoch (see the module doc): ``epoch`` and the fit loop's epoch progress then say
    the epoch is running, not finished. Any other checkpoint is left as it is; calling it twice
    changes nothing more."""
    if not stopped_mid_epoch(trainer):
        return
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    epochs = loop.get("epoch_progress")
    batches = loop.get("epoch_loop.batch_progress")
    stepped = loop.get("epoch_loop.state_dict", {})
    if epochs is None or batches is None or "_batches_that_stepped" not in stepped:
        return
    if epochs["current"]["processed"] != epochs["current"]["started"]:
        return  # already rewritten
    for counts in (epochs["total"], epochs["current"]):
        counts["processed"] = counts["completed"] = counts["started"] - 1
    # The last batch as a checkpoint from on_train_batch_end records it (its step counted, the
    # batch not yet completed nor counted for the loggers): Lightning's resume completes it. A
    # finished batch instead (RESTARTED_ON_LAST) would, when validation was due at that step,
    # make Lightning count one step twice for the loggers.
    for counts in (batches["total"], batches["current"]):
        if counts["completed"] == counts["processed"]:
            counts["completed"] -= 1
    stepped["_batches_that_stepped"] -= 1
    checkpoint["epoch"] = epochs["current"]["completed"]


__all__ = ["record_mid_epoch_stop", "stopped_mid_epoch"]
