"""Regression tests: parameters outside FSDP units, several optimizers, checkpoint overwrite
crashes, weights-only checkpoints and unloadable checkpoint metadata."""

import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from _launch import DistributedTestError, run_distributed
from _parity import MicroBatches, strategy_dp_rank, tiny_config

STEPS, DP_MAX = 3, 4


def _trainer(strategy, world, steps, **kwargs):
    import lightning as L

    return L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, **kwargs,
    )


def _root_param(rank, world, sharding):
    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.decoder import causal_lm_loss
    from lightning_moe.models.lightning_module import MoELanguageModel

    torch.manual_seed(0)

    class WithTemperature(MoELanguageModel):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.logit_scale = nn.Parameter(torch.ones(()))  # on the LightningModule itself

        def training_step(self, batch, i):
            return causal_lm_loss(self.model(batch["input_ids"]) * self.logit_scale, batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    strategy = MegatronMoEStrategy(print_layout=False, sharding=sharding, expert_sharding=sharding)
    model = WithTemperature(tiny_config())
    loader = DataLoader(MicroBatches(3 * world), batch_size=None, sampler=list(range(rank, 3 * world, world)))
    _trainer(strategy, world, 3).fit(model, loader)
    value = model.logit_scale.detach().reshape(1).clone()
    out = [torch.zeros_like(value) for _ in range(world)]
    torch.distributed.all_gather(out, value)
    return [float(v) for v in out]


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_parameters_outside_fsdp_units_are_reduced(sharding):
    values = run_distributed(_root_param, 2, sharding, timeout=120)[0]
    assert values[0] == values[1] != 1.0


def _manual(rank, world, kwargs, two_optimizers):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.parallel.fsdp import expert_params

    torch.manual_seed(0)

    class Manual(MoELanguageModel):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.automatic_optimization = False

        def configure_optimizers(self):
            experts = expert_params(self)
            rest = [p for p in self.parameters() if all(p is not e for e in experts)]
            if two_optimizers:
                return [torch.optim.SGD(rest, lr=0.5), torch.optim.SGD(experts, lr=0.5)]
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def training_step(self, batch, i):
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(self.model.loss(batch["input_ids"], batch["labels"]))
            for opt in opts:
                opt.step()

    strategy = MegatronMoEStrategy(print_layout=False, **kwargs)
    dp = world // kwargs.get("tensor_parallel_size", 1)
    r = strategy_dp_rank(kwargs, rank, world)
    batches = [[s * DP_MAX + a * dp + r for a in range(DP_MAX // dp)] for s in range(STEPS)]
    collate = lambda items: {k: torch.cat([it[k] for it in items]) for k in items[0]}  # noqa: E731
    model = Manual(tiny_config(router_load_balancing_type="seq_aux_loss"))
    loader = DataLoader(MicroBatches(STEPS * DP_MAX), batch_sampler=batches, collate_fn=collate)
    _trainer(strategy, world, STEPS * (2 if two_optimizers else 1)).fit(model, loader)
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float().numpy().copy() for k, v in state.items() if torch.is_tensor(v)} if rank == 0 else None


def test_two_optimizers_reduce_gradients_once():
    result = run_distributed(_manual, 4, dict(expert_parallel_size=2), True, timeout=200)[0]
    reference = run_distributed(_manual, 1, {}, True, timeout=200)[0]
    for name, value in reference.items():
        torch.testing.assert_close(torch.from_numpy(result[name]), torch.from_numpy(value), rtol=0, atol=1e-5)


def _save(rank, world, root, crash):
    from lightning_moe.parallel import checkpoint as ckpt

    state = {"state_dict": {"w": torch.arange(4.0) + (10 if crash else 0)}}
    if crash:
        real = os.replace

        def replace(src, dst):
            real(src, dst)
            if ".tmp-old-" in str(dst):
                os._exit(9)  # killed right after moving the committed checkpoint aside

        ckpt.os.replace = replace
    ckpt.save_distributed(state, {"global_step": 1}, Path(root) / "a")


def _load(rank, world, root):
    from lightning_moe.parallel import checkpoint as ckpt

    state = {"state_dict": {"w": torch.zeros(4)}}
    ckpt.load_distributed(state, Path(root))
    return state["state_dict"]["w"].tolist()


def test_crash_while_overwriting_keeps_the_previous_checkpoint(tmp_path):
    run_distributed(_save, 2, str(tmp_path), False, timeout=60)
    with pytest.raises(DistributedTestError):
        run_distributed(_save, 2, str(tmp_path), True, timeout=60)
    assert run_distributed(_load, 2, str(tmp_path), timeout=60)[0] == [0.0, 1.0, 2.0, 3.0]


def test_unloadable_metadata_fails_at_save(tmp_path):
    from lightning_moe.parallel import checkpoint as ckpt

    # Not pathlib.Path: Megatron-Core, imported in-process by the reference tests, registers
    # PosixPath as a safe global, which made this test depend on the order tests run in.
    with pytest.raises(ValueError, match="weights_only"):
        ckpt.save_distributed({"state_dict": {"w": torch.ones(2)}}, {"hp": Fraction(1, 3)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _weights_only(rank, world, root):
    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel

    torch.manual_seed(0)
    strategy = MegatronMoEStrategy(print_layout=False, expert_parallel_size=2)
    trainer = _trainer(strategy, world, 2, limit_val_batches=2)
    data = MicroBatches(8)
    loader = DataLoader(data, batch_size=None, sampler=list(range(rank, 8, world)))
    trainer.fit(MoELanguageModel(tiny_config(), warmup_steps=0, max_steps=10), loader)
    trainer.save_checkpoint(str(Path(root) / "w"), weights_only=True)
    trainer.validate(trainer.lightning_module, loader, ckpt_path=str(Path(root) / "w"), verbose=False)
    fresh = _trainer(MegatronMoEStrategy(print_layout=False, expert_parallel_size=2), world, 4)
    with pytest.raises(KeyError, match="optimizer 0"):
        fresh.fit(MoELanguageModel(tiny_config(), warmup_steps=0, max_steps=10), loader, ckpt_path=str(Path(root) / "w"))
    return True


def test_weights_only_checkpoint_validates_and_refuses_resume(tmp_path):
    assert run_distributed(_weights_only, 2, str(tmp_path), timeout=200) == [True, True]
