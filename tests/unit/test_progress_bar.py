"""MoEProgressBar: a step-limited run counts steps out of max_steps (resumed runs included), an
epoch-limited run its epoch's batches; the labels make sense; no v_num."""

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_moe.callbacks import MoEProgressBar
from lightning_moe.cli import DEFAULT_CALLBACKS
from lightning_moe.data import LMDataModule
from lightning_moe.models.lightning_module import MoELanguageModel

BATCHES_PER_EPOCH = 3


class Watch(Callback):
    """What the training bar shows after each batch: (label, count column)."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        task = self.bar.train_progress_bar
        count = self.bar.progress.columns[2].render(task).plain
        self.seen.append((task.description.split("]")[-1].strip(), count))


def _fit(tmp_path, ckpt_path=None, **limits):
    torch.manual_seed(0)
    bar = MoEProgressBar()
    watch = Watch(bar)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="logs"), enable_model_summary=False,
        limit_val_batches=0, limit_train_batches=BATCHES_PER_EPOCH, log_every_n_steps=1,
        callbacks=[bar, watch, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
        **limits,
    )  # fmt: skip
    data = LMDataModule(seq_length=16, micro_batch_size=2, max_corpus_bytes=40_000)
    model = MoELanguageModel("tiny", overrides={"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
                             warmup_steps=0, max_steps=8)  # fmt: skip
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, bar, watch.seen


def test_a_step_limited_run_counts_steps_and_resumes_at_its_step(tmp_path):
    # Two epochs of 3 batches within max_steps=5: one bar for the run, not "Epoch 0/-2".
    trainer, bar, seen = _fit(tmp_path, max_steps=5)
    assert seen == [("Epoch 0", "step 1/5"), ("Epoch 0", "step 2/5"), ("Epoch 0", "step 3/5"),
                    ("Epoch 1", "step 4/5"), ("Epoch 1", "step 5/5")]  # fmt: skip
    metrics = bar.get_metrics(trainer, trainer.lightning_module)
    assert "v_num" not in metrics and "train/loss" in metrics

    # Resumed in the middle of epoch 1 (step 4, batch 1 of 3) up to max_steps=8.
    _, _, seen = _fit(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt"), max_steps=8)
    assert seen == [("Epoch 1", "step 5/8"), ("Epoch 1", "step 6/8"),
                    ("Epoch 2", "step 7/8"), ("Epoch 2", "step 8/8")]  # fmt: skip


def test_an_epoch_limited_run_counts_the_batches_of_each_epoch(tmp_path):
    _, _, seen = _fit(tmp_path, max_epochs=2)
    assert seen == [("Epoch 0/1", "1/3"), ("Epoch 0/1", "2/3"), ("Epoch 0/1", "3/3"),
                    ("Epoch 1/1", "1/3"), ("Epoch 1/1", "2/3"), ("Epoch 1/1", "3/3")]  # fmt: skip
    _, _, seen = _fit(tmp_path, ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt"), max_epochs=2)
    assert seen == [("Epoch 1/1", "2/3"), ("Epoch 1/1", "3/3")]


def test_the_cli_uses_it():
    assert {"class_path": "lightning_moe.callbacks.MoEProgressBar"} in DEFAULT_CALLBACKS
