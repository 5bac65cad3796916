"""`MoEProgressBar`: Lightning's ``RichProgressBar`` with a training bar that counts what ends the run.

Lightning's bar counts the batches of the current epoch. For a run limited by ``max_steps``
(``max_epochs`` unset, which Lightning stores as -1) that shows ``Epoch 0/-2``, a total of
``min(batches per epoch, steps left)`` and, after a resume, the epoch's batch index over the
steps left (``500/99``). Here such a run has one bar for the whole run, ``step <global
step>/<max_steps>``, that starts at the restored step when a run resumes and does not restart
at an epoch boundary; its label is ``Epoch N``. A run limited by ``max_epochs`` keeps Lightning's
per-epoch bar (``Epoch N/<max_epochs - 1>``, batches of the epoch, continued after a mid-epoch
resume).

The logger's version (``v_num``, shown by Lightning as ``v_num: 0.000``) is left out: it is the
run directory's number, not a metric. Everything else is ``RichProgressBar``'s (theme, refresh
rate, validation bars, ``leave``; with ``leave=True`` a step-limited run still has one bar).
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar

try:  # rich is a dependency of RichProgressBar; without it, constructing the bar raises (Lightning)
    from rich.progress import ProgressColumn
    from rich.text import Text
except ImportError:  # pragma: no cover
    ProgressColumn = object  # type: ignore[assignment,misc]


class MoEProgressBar(RichProgressBar):
    """``RichProgressBar`` counting optimizer steps out of ``max_steps`` for a step-limited run
    (see the module doc); no ``v_num``. Takes ``RichProgressBar``'s arguments."""

    def step_limited(self) -> bool:
        """Whether ``max_steps`` alone ends the fit (no ``max_epochs``): the bar then counts steps."""
        trainer = self.trainer
        return trainer.max_steps is not None and trainer.max_steps > 0 and trainer.max_epochs in (None, -1)

    @property
    def total_train_batches(self) -> Union[int, float]:
        if self.step_limited():
            return self.trainer.max_steps
        return self.trainer.num_training_batches

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs > 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):
            # as Lightning: no flicker between "Epoch N" and the longer "Validation" label
            description = f"{description:{len(self.validation_description)}}"
        return description

    def _train_progress(self, batch_idx: int) -> int:
        return self.trainer.global_step if self.step_limited() else batch_idx + 1

    def _initialize_train_progress_bar_id(self) -> None:
        # Also reached when a run resumes mid-epoch (Lightning then skips on_train_epoch_start):
        # a step bar starts at the restored step, which rich does not count as speed.
        assert self.progress is not None
        steps = self.step_limited()
        self.train_progress_bar_id = self.progress.add_task(
            self._styled(self._get_train_description(self.trainer.current_epoch)),
            total=self.total_train_batches,
            completed=self.trainer.global_step if steps else 0,
            counts_steps=steps,  # a field of the task: rich may draw it before add_task returns its id
        )

    def _styled(self, description: str) -> str:
        return f"[{self.theme.description}]{description}" if self.theme.description else description

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.step_limited():
            super().on_train_epoch_start(trainer, pl_module)
            return
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        else:  # one bar for the run: a new epoch changes its label only
            self.progress.update(
                self.train_progress_bar_id,
                description=self._styled(self._get_train_description(trainer.current_epoch)),
                visible=True,
            )
        self.refresh()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, self._train_progress(batch_idx))
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def configure_columns(self, trainer: Any) -> list:
        columns = super().configure_columns(trainer)
        return [_Count(column.style) if type(column).__name__ == "BatchesProcessedColumn" else column
                for column in columns]  # fmt: skip


class _Count(ProgressColumn):  # type: ignore[misc,valid-type]
    """``done/total``; ``step done/total`` on the training bar of a step-limited run."""

    def __init__(self, style: Any) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Any) -> Any:
        total = task.total if task.total != float("inf") else "--"
        text = f"{int(task.completed)}/{total}"
        if task.fields.get("counts_steps"):
            text = f"step {text}"
        return Text(text, style=self.style)


__all__ = ["MoEProgressBar"]
