"""What an EP=2 fit on 2 CPU processes reports and resumes from (the setup of
examples/configs/ep2_cpu.yaml, smaller): the logged train/loss is the mean over the ranks; the
optimizer's groups, which mix DTensor and plain parameters, run torch's foreach kernels (as on
CUDA, where they are the default) with nothing warned; the layout table names the precision; a
checkpoint that max_steps wrote in the middle of epoch 0 records epoch 0 and resumes exactly,
with the loader's position restored by Lightning (no "not resumable" warning)."""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed

SAVE_AT, STEPS = 3, 6


def _fit(rank, world, tmp, steps, save, ckpt_path):
    import warnings

    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.distributed.tensor import DTensor

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.data import LMDataModule
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.parallel.param_groups import step_by_tensor_kind

    class Record(Callback):
        def __init__(self):
            self.local, self.logged, self.epochs = [], [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.local.append(float(outputs["loss"]))
            self.logged.append(float(trainer.callback_metrics["train/loss"]))
            self.epochs.append(trainer.current_epoch)

    class ForeachModel(MoELanguageModel):
        """The model's AdamW with foreach kernels asked for, as they are by default on CUDA."""

        def configure_optimizers(self):
            config = super().configure_optimizers()
            for group in config["optimizer"].param_groups:
                group["foreach"] = True
            return config

    torch.manual_seed(0)
    record = Record()
    callbacks = [record]
    if save:  # one save, when max_steps ends the fit in the middle of epoch 0
        callbacks.append(ModelCheckpoint(dirpath=tmp / "ckpt", save_top_k=0, save_last=True))
    strategy = MegatronMoEStrategy(expert_parallel_size=2, print_layout=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1, callbacks=callbacks,
    )  # fmt: skip
    data = LMDataModule(seq_length=16, micro_batch_size=2, max_corpus_bytes=40_000)
    model = ForeachModel("tiny", overrides={"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2},
                         warmup_steps=0, max_steps=STEPS)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    groups = [(g["name"], g["foreach"], sorted({isinstance(p, DTensor) for p in g["params"]}))
              for g in optimizer.param_groups]  # fmt: skip
    steps_by_kind = any(optimizer is split for split in strategy._steps_by_tensor_kind)
    # composed by the strategy, not patched in (torch's LR scheduler wraps the step it finds: the optimizer's own)
    steps_by_kind = steps_by_kind and getattr(optimizer.step, "__module__", "").startswith("torch.optim")
    # The kind-by-kind foreach step is the update of a step without foreach.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in params]
    results = []
    for foreach in (True, False):
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        adam = torch.optim.AdamW(copies, lr=0.1, foreach=foreach)
        for _ in range(2):
            for copy, grad in zip(copies, grads):
                copy.grad = grad.clone()
            step_by_tensor_kind(adam) if foreach else adam.step()
        results.append([c.detach().full_tensor() if isinstance(c, DTensor) else c.detach() for c in copies])
    same_update = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*results))
    # An optimizer that is no torch Optimizer: foreach off, with a warning that says what to do.

    class Duck:
        param_groups = [{"params": params, "foreach": True, "name": "all"}]

    strategy.optimizers = [Duck()]
    with warnings.catch_warnings(record=True) as user_caught:
        warnings.simplefilter("always")
        strategy._avoid_mixed_foreach()
    user = {"foreach": Duck.param_groups[0]["foreach"], "warnings": [str(w.message) for w in user_caught]}
    local = [None] * world
    dist.all_gather_object(local, record.local)
    return {
        "local": local, "logged": record.logged, "epochs": record.epochs,
        "warnings": [str(w.message) for w in caught], "precision": strategy.backend_summary()["precision"],
        "num_batches": trainer.num_training_batches, "user": user, "groups": groups,
        "steps_by_kind": steps_by_kind, "same_update": same_update,
    }  # fmt: skip


@pytest.mark.timeout(180)
def test_ep2_run_reports_means_and_resumes_mid_epoch_in_its_epoch(tmp_path):
    full = run_distributed(_fit, 2, tmp_path, STEPS, False, None, timeout=150)
    run_distributed(_fit, 2, tmp_path, SAVE_AT, True, None, timeout=150)
    last = tmp_path / "ckpt" / "last.ckpt"
    resumed = run_distributed(_fit, 2, tmp_path, STEPS, False, str(last), timeout=150)

    run = full[0]
    assert run["num_batches"] > STEPS  # every stop below is in the middle of epoch 0
    # train/loss: the mean over the ranks (which differ: each reads its own batches), on every rank.
    for step in range(STEPS):
        per_rank = [run["local"][r][step] for r in range(2)]
        assert per_rank[0] != per_rank[1]
        for r in range(2):
            assert full[r]["logged"][step] == pytest.approx(sum(per_rank) / 2, rel=1e-6)
    # The groups as built (the same in every layout; no_decay mixes both kinds), still foreach.
    assert run["groups"] == [("decay", True, [True]), ("no_decay", True, [False, True])]
    assert run["steps_by_kind"] and run["same_update"]
    assert not [m for m in run["warnings"] if "foreach" in m], run["warnings"]
    assert run["precision"] == "32-true"
    assert run["user"]["foreach"] is False
    (message,) = run["user"]["warnings"]
    assert "mixes DTensor" in message and "split_by_tensor_kind(groups)" in message, message

    meta = torch.load(last / "meta.pt", weights_only=False)
    assert meta["epoch"] == 0 and meta["global_step"] == SAVE_AT
    assert meta["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "samples": SAVE_AT * 2 * 2}]

    assert not [m for m in resumed[0]["warnings"] if "not resumable" in m], resumed[0]["warnings"]
    assert resumed[0]["epochs"] == [0] * (STEPS - SAVE_AT)
    for r in range(2):
        torch.testing.assert_close(
            torch.tensor(resumed[0]["local"][r]), torch.tensor(run["local"][r][SAVE_AT:]), rtol=1e-6, atol=1e-7
        )
