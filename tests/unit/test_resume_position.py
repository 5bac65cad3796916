"""Where a resumed fit starts: the training loader is stateful in Lightning's sense (no "not
resumable" warning, its position in the checkpoint), and a checkpoint saved after max_steps
stopped the fit mid-epoch records that epoch as running (epoch 0, not 1)."""

import csv
import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_moe.data import LMDataModule
from lightning_moe.data.datamodule import ResumableDataLoader, TokenWindowDataset, _ResumableSampler
from lightning_moe.models.lightning_module import MoELanguageModel

SAVE_AT, STEPS, SEQ, MICRO = 3, 5, 16, 2


class Record(Callback):
    def __init__(self):
        self.losses, self.epochs, self.batches = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.epochs.append(trainer.current_epoch)
        self.batches.append(batch["input_ids"][:, 0].tolist())


def _fit(tmp_path, steps, callbacks=(), ckpt_path=None, val_every=None, version=None):
    torch.manual_seed(0)
    record = Record()
    logger = CSVLogger(tmp_path, name="logs", version=version) if version else False
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=logger, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record, *callbacks], log_every_n_steps=1,
        limit_val_batches=1 if val_every else 0, val_check_interval=val_every, num_sanity_val_steps=0,
        default_root_dir=tmp_path, enable_checkpointing=bool(callbacks),
    )  # fmt: skip
    data = LMDataModule(seq_length=SEQ, micro_batch_size=MICRO, max_corpus_bytes=40_000)
    model = MoELanguageModel("tiny", overrides={"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
                             warmup_steps=0, max_steps=STEPS)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, record, [str(w.message) for w in caught]


def _logged_steps(tmp_path, version):
    with open(tmp_path / "logs" / version / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


@pytest.mark.parametrize("val_every", [None, SAVE_AT], ids=["no_val", "val_at_the_stop"])
@pytest.mark.parametrize("save", ["train_end", "epoch_end_hook"])
def test_a_max_steps_checkpoint_resumes_in_its_epoch_exactly(tmp_path, save, val_every):
    # Saved once when max_steps ends the first fit in the middle of epoch 0: by ModelCheckpoint's
    # on_train_end (save_last), or by its on_train_epoch_end (every_n_epochs=1), which Lightning
    # runs for a max_steps stop too; with or without a validation at that last step.
    if save == "train_end":
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True)
        path = tmp_path / "ckpt" / "last.ckpt"
    else:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, filename="end")
        path = tmp_path / "ckpt" / "end.ckpt"
    first, _, _ = _fit(tmp_path, SAVE_AT, [checkpoint], val_every=val_every)
    assert first.num_training_batches > STEPS  # the stop is in the middle of epoch 0
    saved = torch.load(path, weights_only=False)
    assert saved["epoch"] == 0 and saved["global_step"] == SAVE_AT
    loop = saved["loops"]["fit_loop"]
    assert loop["state_dict"]["combined_loader"] == [{"epoch": 0, "samples": SAVE_AT * MICRO}]

    _, full, _ = _fit(tmp_path, STEPS, val_every=val_every, version="full")
    _, resumed, messages = _fit(tmp_path, STEPS, ckpt_path=str(path), val_every=val_every, version="resumed")
    assert not [m for m in messages if "not resumable" in m], messages
    assert resumed.epochs == [0] * (STEPS - SAVE_AT)  # not "epoch 1"
    assert resumed.batches == full.batches[SAVE_AT:]  # the same windows, not epoch 1's order
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[SAVE_AT:]), rtol=0, atol=1e-6)
    # The loggers see each loss at the step of the uninterrupted run.
    logged, reference = _logged_steps(tmp_path, "resumed"), _logged_steps(tmp_path, "full")
    assert sorted(logged) == list(range(SAVE_AT, STEPS))
    assert logged == pytest.approx({step: reference[step] for step in logged}, abs=1e-6)


def _loader(replicas, rank, seed=7):
    data = TokenWindowDataset(torch.arange(10_000).numpy(), seq_length=4)
    sampler = _ResumableSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return ResumableDataLoader(data, batch_size=3, sampler=sampler, drop_last=True)


def _first_tokens(loader, count):
    out = []
    for batch in loader:
        out += batch["input_ids"][:, 0].tolist()
        if len(out) >= count:
            return out[:count]
    return out


def test_the_loader_state_follows_the_global_order_across_data_parallel_sizes():
    # 2 ranks trained 5 batches of epoch 1 each; one process resumes: it reads the windows the
    # global permutation puts next (rank r took every 2nd entry of it).
    loaders = [_loader(2, r) for r in range(2)]
    for loader in loaders:
        loader.sampler.set_epoch(1)
        _first_tokens(loader, 15)  # a plain loop: 5 batches handed out
    state = loaders[0].state_dict()
    assert isinstance(loaders[0], _Stateful) and state == {"epoch": 1, "samples": 2 * 5 * 3}

    single = _loader(1, 0)
    single.load_state_dict(state)
    single.sampler.set_epoch(1)  # what Lightning does at the epoch's start
    permutation = torch.utils.data.DistributedSampler(single.dataset, num_replicas=1, rank=0, seed=7)
    permutation.set_epoch(1)
    order = list(permutation)  # window i starts with token 4 * i
    assert _first_tokens(single, 6) == [4 * i for i in order[30:36]]


def test_a_finished_epoch_resumes_at_the_next_and_load_sets_the_epoch():
    loader = _loader(1, 0)
    loader.sampler.set_epoch(2)
    assert len(_first_tokens(loader, 10**6)) == len(loader) * 3
    assert loader.state_dict() == {"epoch": 3, "samples": 0}
    fresh = _loader(1, 0)
    fresh.load_state_dict({"epoch": 4, "samples": 6})
    # The epoch is set on load: a loader with workers draws indices when its iterator is made,
    # which Lightning does before its own set_epoch.
    assert fresh.sampler.epoch == 4
    reference = _loader(1, 0)
    reference.sampler.set_epoch(4)
    assert _first_tokens(fresh, 3) == _first_tokens(reference, 9)[6:9]
