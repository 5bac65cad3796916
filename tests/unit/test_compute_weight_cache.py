"""ComputeWeightCache: master weights cast once per optimizer step, the same gradients bit for bit.

bf16 autocast runs on CPU, so the casts, their reuse across micro-batches and the strategy's
clearing at each optimizer step are checked here; the CUDA cast (`_MasterWeightCast`, widened by
our kernel) by tests/gpu/test_kernels_gpu.py.
"""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_moe.nn.compute_weights as compute_weights
from lightning_moe.models.decoder import Linear
from lightning_moe.nn.compute_weights import ComputeWeightCache, autocast_dtype, compute_weight
from lightning_moe.nn.experts import GroupedExperts


@pytest.fixture
def casts(monkeypatch) -> list:
    """One entry per cast made (not served from a cache)."""
    made: list = []
    real = compute_weights._cast
    monkeypatch.setattr(compute_weights, "_cast",
                        lambda w, dtype, **kw: made.append(tuple(w.shape)) or real(w, dtype, **kw))
    return made


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "proj": Linear(16, 24, 0.1),
        "experts": GroupedExperts(3, 24, 8, activation="swiglu", backend="grouped_mm"),
    })


def _accumulate(model, cache, micro_batches):
    model.zero_grad(set_to_none=True)
    for x, sizes in micro_batches:
        with cache.active() if cache is not None else torch.autocast("cpu", enabled=True, dtype=torch.bfloat16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model["experts"](model["proj"](x), sizes)
        y.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _micro_batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(20, 16, generator=g), torch.tensor([7, 0, 13])) for _ in range(n)]


def test_accumulated_gradients_are_the_same_bits_with_one_cast_per_weight(casts):
    model, data = _model(), _micro_batches(3)
    per_micro_batch = _accumulate(model, None, data)
    assert len(casts) == 3 * 3  # proj, fc1, fc2 in each of 3 micro-batches
    casts.clear()
    cache = ComputeWeightCache()
    cached = _accumulate(model, cache, data)
    assert len(casts) == 3 and len(cache) == 3
    for a, b in zip(per_micro_batch, cached):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_an_update_in_place_or_clear_casts_again(casts):
    w = torch.randn(4, 4, requires_grad=True)
    cache = ComputeWeightCache()
    with cache.active():
        first = compute_weight(w, torch.bfloat16)
        assert compute_weight(w, torch.bfloat16) is first and len(casts) == 1
        with torch.no_grad():
            w.add_(1.0)  # an optimizer step: the version counter moves
        again = compute_weight(w, torch.bfloat16)
        assert again is not first and len(casts) == 2 and torch.equal(again, w.detach().bfloat16())
        cache.clear()
        compute_weight(w, torch.bfloat16)
        assert len(casts) == 3


def test_only_recorded_leaves_are_served_from_the_cache(casts):
    w = torch.randn(4, 4, requires_grad=True)
    cache = ComputeWeightCache()
    with cache.active():
        with torch.no_grad():  # evaluation: a plain cast, nothing kept
            compute_weight(w, torch.bfloat16)
        compute_weight(w * 2, torch.bfloat16)  # not a leaf
        assert compute_weight(w, torch.float32) is w  # already in the compute dtype
    assert len(cache) == 0 and len(casts) == 1


def test_the_cache_serves_only_while_active():
    w = torch.randn(4, 4, requires_grad=True)
    cache = ComputeWeightCache()
    with cache.active():
        inside = compute_weight(w, torch.bfloat16)
    assert compute_weight(w, torch.bfloat16) is not inside and len(cache) == 1


def test_the_linear_multiplies_in_autocasts_dtype():
    x = torch.randn(3, 16)
    linear = Linear(16, 8, 0.1)
    assert autocast_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(x) == torch.bfloat16
        y = linear(x)
        want = torch.nn.functional.linear(x, linear.weight)  # autocast's own cast
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


class _Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.tokens = torch.randint(0, 64, (n, seq + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _fit(cache_weight_casts: bool, accumulate_grads_in_place: bool | None = None) -> list[torch.Tensor]:
    from lightning.pytorch import Trainer

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel

    torch.manual_seed(0)
    module = MoELanguageModel("tiny", overrides={"num_layers": 2, "vocab_size": 64}, max_steps=2)
    strategy = MegatronMoEStrategy(print_layout=False, cache_weight_casts=cache_weight_casts,
                                   accumulate_grads_in_place=accumulate_grads_in_place)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=2,
        accumulate_grad_batches=3, gradient_clip_val=1.0, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module, DataLoader(_Tokens(12, 16), batch_size=2))
    finally:  # the strategy initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert len(strategy._weight_casts) == 0  # cleared at each optimizer step
    return [p.detach().clone() for p in module.parameters()]


def test_strategy_casts_once_per_optimizer_step_with_the_same_training(casts):
    cached = _fit(True)
    per_step = len(casts)
    casts.clear()
    uncached = _fit(False)
    assert per_step > 0 and len(casts) == 3 * per_step  # 3 micro-batches per optimizer step
    for a, b in zip(cached, uncached):
        assert torch.equal(a, b)


def test_no_cache_serves_inside_uncached_weights(casts):
    from lightning_moe.nn.compute_weights import uncached_weights

    w = torch.randn(4, 4, requires_grad=True)
    cache = ComputeWeightCache()
    with cache.active():
        with uncached_weights():  # what a CUDA-graph capture runs under
            compute_weight(w, torch.bfloat16)
            compute_weight(w, torch.bfloat16)
        assert len(cache) == 0 and len(casts) == 2
        compute_weight(w, torch.bfloat16)
    assert len(cache) == 1


def test_in_place_accumulation_gives_the_same_bits_into_the_same_grad_tensor(monkeypatch):
    """``accumulate_grads_in_place``: micro-batches after the first add into the same ``.grad``
    tensor themselves; post-accumulate hooks still run for every micro-batch."""
    model, data = _model(), _micro_batches(3)
    plain = _accumulate(model, ComputeWeightCache(), data)
    hooked = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: hooked.__setitem__(name, hooked[name] + 1))
    fused = []
    real = compute_weights.accumulate_widened_
    monkeypatch.setattr(compute_weights, "accumulate_widened_",
                        lambda dst, src: fused.append(dst.shape) or real(dst, src))
    first_grads: dict[str, torch.Tensor] = {}
    model.zero_grad(set_to_none=True)
    cache = ComputeWeightCache(accumulate_grads_in_place=True)
    for i, (x, sizes) in enumerate(data):
        with cache.active(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = model["experts"](model["proj"](x), sizes)
        y.float().square().mean().backward()
        if i == 0:
            first_grads = {name: p.grad for name, p in model.named_parameters()}
    for (name, p), want in zip(model.named_parameters(), plain):
        assert torch.equal(p.grad, want), name
    cast = {"proj.weight", "experts.fc1_weight", "experts.fc2_weight"}  # the weights compute_weight casts
    for name, p in model.named_parameters():
        assert hooked[name] == 3, name
        if name in cast:
            assert p.grad is first_grads[name]  # the same tensor, added into
    assert len(fused) == 2 * 3  # the three cast weights, in the second and third micro-batches


def test_in_place_accumulation_adds_into_existing_zeros_and_leaves_views_of_part_alone():
    w = torch.randn(6, 4, requires_grad=True)
    w.grad = torch.zeros(6, 4)  # zero_grad(set_to_none=False)
    kept = w.grad
    cache = ComputeWeightCache(accumulate_grads_in_place=True)
    with cache.active():
        compute_weight(w, torch.bfloat16).float().sum().backward()
        part = compute_weight(w[:3], torch.bfloat16, source=w)  # a view of part of w: through autograd
        (2 * part.float()).sum().backward()
    want = torch.ones(6, 4)
    want[:3] += 2
    assert w.grad is kept and torch.equal(w.grad, want)


def test_strategy_accumulates_in_place_with_the_same_training():
    in_place = _fit(True)
    plain = _fit(True, accumulate_grads_in_place=False)
    for a, b in zip(in_place, plain):
        assert torch.equal(a, b)


def test_a_parameter_with_a_gradient_hook_keeps_autograds_accumulation():
    """A ``register_hook`` hook must see every micro-batch's gradient: its parameter is accumulated
    by autograd; the others in place."""
    model, data = _model(), _micro_batches(3)
    plain = _accumulate(model, ComputeWeightCache(), data)
    seen = []
    model["proj"].weight.register_hook(lambda g: seen.append(g is not None))
    cache = ComputeWeightCache(accumulate_grads_in_place=True)
    in_place = _accumulate(model, cache, data)
    assert seen == [True] * 3
    for a, b in zip(plain, in_place):
        assert torch.equal(a, b)


def test_strategy_defaults_to_in_place_accumulation_where_casts_are_cached():
    from lightning_moe import MegatronMoEStrategy

    assert MegatronMoEStrategy()._weight_casts.accumulate_grads_in_place
    assert not MegatronMoEStrategy(accumulate_grads_in_place=False)._weight_casts.accumulate_grads_in_place
    assert not MegatronMoEStrategy(cache_weight_casts=False)._weight_casts.accumulate_grads_in_place
    with pytest.raises(ValueError, match="cache_weight_casts=True"):
        MegatronMoEStrategy(cache_weight_casts=False, accumulate_grads_in_place=True)
