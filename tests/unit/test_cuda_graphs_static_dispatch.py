"""`CUDAGraphs` with the dropless all-to-all dispatcher, on CPU: the captured modules run the
dispatcher's static path (sizes fixed by the token count, a device overflow flag), and a window
whose dispatch overflowed its budget runs again eagerly from the state it started with, so the
fit is the eager one. The capture is an eager stand-in whose "replays" run the static path, as the
graphs would; one process, its all-to-all over a gloo group of one rank."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader
from test_cuda_graphs_callback import Tokens, _OnCPU, tiny_model

import lightning_moe.callbacks.cuda_graphs as callback_module
from lightning_moe.callbacks import CUDAGraphs
from lightning_moe.nn import MoELayer
from lightning_moe.parallel.dispatchers import AllToAllDispatcher


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _module():
    module = tiny_model(router_score_function="sigmoid", router_enable_expert_bias=True, aux_loss_coeff=1e-2)
    torch.manual_seed(0)
    module.configure_model()
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            layer.dispatcher = AllToAllDispatcher(layer.config, dist.group.WORLD)
    return module


@dataclass
class _StaticReplays:
    """Stands in for the graphs: each replay runs the captured forward on the static path with the
    budget the test gives that replay (a tiny one forces an overflow)."""

    modules: list
    forwards: list
    accumulate_grads: bool
    budgets: dict
    default: float
    replays: int = 0

    def replay(self, slot, *tensors):
        budget = self.budgets.get(self.replays, self.default)
        self.replays += 1
        dispatchers = [m.dispatcher for m in self.modules if isinstance(m, MoELayer)]
        for d in dispatchers:
            d.static_budget = budget
        try:
            return self.forwards[slot](*tensors)
        finally:
            for d in dispatchers:
                d.static_budget = None

    def clear_stale_grads(self):
        pass

    def release(self):
        pass


def _fit(module, callbacks, steps, accumulate):
    losses, counts = [], []

    class Keep(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            # the routers' token counts of the window, before the step's bias update reads them
            counts.append([b.clone() for n, b in pl_module.named_buffers() if n.endswith("local_tokens_per_expert")])

    torch.manual_seed(0)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[*callbacks, Keep()],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=accumulate, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(Tokens(64), batch_size=2))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state.update({f"counts.{step}.{i}": c for step, window in enumerate(counts) for i, c in enumerate(window)})
    return losses, state


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_overflowing_window_runs_again_and_the_fit_is_the_eager_one(monkeypatch, one_rank_group, accumulate):
    reference_losses, reference = _fit(_module(), [], steps=5, accumulate=accumulate)
    made = []
    # replay 0 onward belong to steps 1..4 (warm-up 1); two MoE layers a micro-batch: force the
    # overflow in the first MoE layer of step 2's first micro-batch
    overflow_at = 2 * accumulate

    def fake(modules, samples, num_warmup_iters, accumulate_grads, forwards):
        made.append(_StaticReplays(list(modules), list(forwards), accumulate_grads, {overflow_at: 1e-3}, 2.0))
        return made[-1]

    monkeypatch.setattr(callback_module, "capture_modules", fake)
    callback = _OnCPU(scope="moe", warmup_steps=1)
    losses, state = _fit(_module(), [callback], steps=5, accumulate=accumulate)
    (replays,) = made
    assert replays.replays == 4 * accumulate * 2  # steps 1..4, every micro-batch, two MoE layers
    assert callback.reruns == 1
    assert state.keys() == reference.keys()
    for key, value in reference.items():  # parameters, router counts and biases: the eager fit's bits
        assert torch.equal(state[key], value), key
    step_of_overflow = 2  # the closure's loss of the overflowed micro-batch is the static pass's
    eager_of = [i for i in range(5 * accumulate) if i // accumulate != step_of_overflow]
    assert [losses[i] for i in eager_of] == [reference_losses[i] for i in eager_of]
    assert losses[step_of_overflow * accumulate] != reference_losses[step_of_overflow * accumulate]


def test_without_overflow_nothing_runs_again(monkeypatch, one_rank_group):
    reference_losses, reference = _fit(_module(), [], steps=4, accumulate=1)

    def fake(modules, samples, num_warmup_iters, accumulate_grads, forwards):
        return _StaticReplays(list(modules), list(forwards), accumulate_grads, {}, 2.0)

    monkeypatch.setattr(callback_module, "capture_modules", fake)
    callback = _OnCPU(scope="moe", warmup_steps=1)
    losses, state = _fit(_module(), [callback], steps=4, accumulate=1)
    assert callback.reruns == 0 and losses == reference_losses
    assert all(torch.equal(state[k], v) for k, v in reference.items())


def test_the_factor_is_validated_and_none_refuses_the_all_to_all(one_rank_group):
    with pytest.raises(ValueError, match="expert_rank_capacity_factor=0"):
        CUDAGraphs(expert_rank_capacity_factor=0)
    module = _module()
    with pytest.raises(ValueError, match="all-to-all.*expert_rank_capacity_factor.*allgather"):
        CUDAGraphs(scope="moe", expert_rank_capacity_factor=None).plan(module)
    targets = CUDAGraphs(scope="moe").plan(module)
    assert len(targets) == 2


def test_the_capture_check_takes_the_static_path_only(one_rank_group):
    """`capture_modules`' own check: the all-to-all passes it with a static budget and is refused
    without one (on CPU it goes on to refuse the CPU tensors, past the dispatcher)."""
    from lightning_moe.cuda_graphs import _check_capturable

    layer = next(m for m in _module().modules() if isinstance(m, MoELayer))
    x = torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match="split sizes on the host.*static_budget"):
        _check_capturable(layer, (x,))
    layer.dispatcher.static_budget = 1.25
    with pytest.raises(ValueError, match="needs the module and its inputs on a CUDA device"):
        _check_capturable(layer, (x,))


class _DrawingTokens(Tokens):
    """Draws from the global RNG in the data pipeline (between micro-batches), as augmentations do."""

    def __init__(self, count, draws):
        super().__init__(count)
        self.draws = draws

    def __getitem__(self, i):
        self.draws.append(torch.rand(()).item())
        return super().__getitem__(i)


def test_a_rerun_keeps_hooks_rng_and_step_signature_as_eager(monkeypatch, one_rank_group):
    """A ``training_step(batch)`` without ``batch_idx`` runs again; random draws between
    micro-batches continue as in the eager fit; a callback's ``on_after_backward`` sees each
    micro-batch once, and the window's last one with the rerun's gradients."""

    class NoIndex(type(_module())):
        def training_step(self, batch):
            return super().training_step(batch, 0)

    def module():
        m = _module()
        m.__class__ = NoIndex
        return m

    def fit(callbacks):
        draws, norms = [], []

        class GradNorms(Callback):
            def on_after_backward(self, trainer, pl_module):
                norms.append(sum(float(p.grad.norm()) for p in pl_module.parameters() if p.grad is not None))

        torch.manual_seed(0)
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False,
                          callbacks=[GradNorms(), *callbacks], enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, accumulate_grad_batches=2, num_sanity_val_steps=0)
        m = module()
        trainer.fit(m, DataLoader(_DrawingTokens(64, draws), batch_size=2))
        return draws, norms, {k: v.clone() for k, v in m.state_dict().items()}

    reference = fit([])

    def fake(modules, samples, num_warmup_iters, accumulate_grads, forwards):
        return _StaticReplays(list(modules), list(forwards), accumulate_grads, {4: 1e-3}, 2.0)

    monkeypatch.setattr(callback_module, "capture_modules", fake)
    callback = _OnCPU(scope="moe", warmup_steps=1)
    draws, norms, state = fit([callback])
    assert callback.reruns == 1
    assert draws == reference[0]
    # replay 4: step 2's first micro-batch (index 4; two MoE layers a micro-batch, one warm-up step).
    # Its norm is the first pass's; the window's last one (index 5) the rerun's, which is the eager one
    assert len(norms) == len(reference[1])
    assert norms[4] != reference[1][4]
    assert [n for i, n in enumerate(norms) if i != 4] == [n for i, n in enumerate(reference[1]) if i != 4]
    assert all(torch.equal(state[k], v) for k, v in reference[2].items())


def test_steps_a_rerun_cannot_repeat_are_refused(one_rank_group):
    """Manual optimization, and a training_step reading dataloader_iter, are refused at fit start
    with the all-to-all captured (the callback could not run their window again)."""

    class Manual(type(_module())):
        pass

    class Iterating(type(_module())):
        def training_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            return super().training_step(batch, 0)

    for cls, match in ((Manual, "automatic optimization"), (Iterating, "dataloader_iter")):
        module = _module()
        module.__class__ = cls
        if cls is Manual:
            module.automatic_optimization = False
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[_OnCPU(scope="moe")],
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(ValueError, match=match):
            trainer.fit(module, DataLoader(Tokens(8), batch_size=2))
