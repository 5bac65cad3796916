"""A fit resumed mid-epoch reads the same data as an uninterrupted one (exact loss curve)."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_moe.data import LMDataModule
from lightning_moe.models.lightning_module import MoELanguageModel

STEPS, SAVE_AT = 6, 3


class Record(Callback):
    def __init__(self, save_path=None):
        self.losses, self.save_path = [], save_path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.save_path is not None and trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.save_path)


def _fit(tmp_path, save_path=None, ckpt_path=None, limit_train_batches=None):
    torch.manual_seed(0)
    record = Record(save_path)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[record],
        default_root_dir=tmp_path, limit_train_batches=limit_train_batches,
    )
    data = LMDataModule(seq_length=32, micro_batch_size=4, max_corpus_bytes=100_000)
    model = MoELanguageModel("tiny", overrides={"num_layers": 1}, warmup_steps=0, max_steps=STEPS)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return record.losses


@pytest.mark.parametrize("epoch_batches", [None, SAVE_AT], ids=["mid_epoch", "epoch_end"])
def test_resume_continues_the_loss_curve(tmp_path, epoch_batches):
    ckpt = str(tmp_path / "mid.ckpt")
    full = _fit(tmp_path, save_path=ckpt, limit_train_batches=epoch_batches)
    resumed = _fit(tmp_path, ckpt_path=ckpt, limit_train_batches=epoch_batches)
    assert len(full) == STEPS and len(resumed) == STEPS - SAVE_AT
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[SAVE_AT:]), rtol=0, atol=1e-6)
