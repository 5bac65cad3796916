"""FP8Precision(cache_fp8_weights=True): gradient accumulation with cached FP8 weights trains
exactly as without the cache, quantizing each weight once per optimizer step (CUDA, Hopper)."""

import sys

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.precision import FP8Precision

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]


def _train(recipe, cache: bool, steps: int = 3, accumulate: int = 2):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=4, router_topk=2, expert_alignment=16,
                    shared_expert_intermediate_size=256)
    layer = MoELayer(cfg).cuda()
    plugin = FP8Precision(recipe=recipe, backend="torch", cache_fp8_weights=cache)
    plugin.convert_module(layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    data = torch.randn(steps * accumulate, 2, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            with plugin.forward_context():
                loss = layer(data[step * accumulate + micro]).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        plugin.update_delayed_scaling()  # what optimizer_step does; no-op unless delayed
        if plugin.weight_cache is not None:
            plugin.weight_cache.clear()  # what FP8Precision.optimizer_step does after the step
    return torch.stack(losses), [p.detach().clone() for p in layer.parameters()], plugin.weight_cache


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_cached_fp8_weights_train_identically(recipe):
    from lightning_moe.precision import FP8Recipe

    # against quantizing every weight in every pass (each layout by its own quantizer)
    losses, params, _ = _train(FP8Recipe(recipe, quantize_weights_once=False), cache=False)
    cached_losses, cached_params, cache = _train(recipe, cache=True)
    assert torch.equal(losses, cached_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, cached_params))
    # Per optimizer step, rowwise: one entry per weight (2 expert projections, 2 shared-expert
    # linears), holding both layouts from the fused quantizer; tensorwise: the expert
    # projections' forward and backward layouts, the linears' forward copy (the backward reuses
    # it). The second micro-batch hits every time.
    per_step = 4 if recipe == "rowwise" else 4 + 2
    assert cache.misses == 3 * per_step and cache.hits == cache.misses


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_weights_quantized_once_train_identically(monkeypatch, recipe):
    """FP8Recipe(quantize_weights_once), on by default: the forward makes each expert weight's
    data-gradient copy as well, so no backward quantizes an expert weight; the bits are those
    of quantizing it again in the backward."""
    from lightning_moe.precision import FP8Recipe, native_casts, scaled_mm

    calls = {"grouped": 0, "dense": 0}
    grouped_dgrad, dense_columns = native_casts.FusedGroupedOperands.weight_dgrad, native_casts.fused_columns

    def count_grouped(self, w):
        calls["grouped"] += 1
        return grouped_dgrad(self, w)

    def count_dense(t, offsets):
        # a weight's transposed copy quantized by a backward (_fused_both calls this too, for
        # weights in the forward and for gradients in the backward)
        calls["dense"] += isinstance(t, torch.nn.Parameter) and sys._getframe(1).f_code.co_name == "backward"
        return dense_columns(t, offsets)

    monkeypatch.setattr(native_casts.FusedGroupedOperands, "weight_dgrad", count_grouped)
    monkeypatch.setattr(scaled_mm, "fused_columns", count_dense)
    # 3 steps x 2 micro-batches, 2 expert projections; the 2 shared-expert linears quantize their
    # weights in the backward either way under rowwise (dense weights take two single quantizers
    # anyway) and keep their per-tensor FP8 weight under delayed
    dense = 12 if recipe == "rowwise" else 0
    once_losses, once_params, _ = _train(FP8Recipe(recipe), cache=False)
    assert calls == {"grouped": 0, "dense": dense}
    losses, params, _ = _train(FP8Recipe(recipe, quantize_weights_once=False), cache=False)
    assert calls == {"grouped": 12, "dense": 2 * dense}
    assert torch.equal(once_losses, losses)
    assert all(torch.equal(a, b) for a, b in zip(once_params, params))


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_prefetched_weights_train_identically(monkeypatch, recipe):
    """MoELayer starts the expert weights' FP8 copies on a side stream before routing
    (``GroupedExperts.prefetch``); every training forward takes them (but the first under
    delayed scaling), evaluation makes none, and the bits equal casting them in the forward."""
    from lightning_moe.nn.experts import GroupedExperts
    from lightning_moe.precision import FP8Recipe, native_casts

    streams = {"side": 0, "main": 0}
    weight_both = native_casts.FusedGroupedOperands.weight_both

    def counting(self, w, launch_stream=None):
        # the prefetch allocates on the current stream and launches on its side stream
        streams["side" if launch_stream is not None else "main"] += 1
        assert launch_stream is None or launch_stream != torch.cuda.current_stream()
        return weight_both(self, w, launch_stream)

    monkeypatch.setattr(native_casts.FusedGroupedOperands, "weight_both", counting)
    losses, params, _ = _train(FP8Recipe(recipe), cache=False)
    # 3 steps x 2 micro-batches x 2 projections; under delayed scaling the first forward casts
    # its own (its scaling state does not exist before it, and a prefetch never allocates it)
    first = 0 if recipe == "rowwise" else 2
    assert streams == {"side": 12 - first, "main": first}
    with torch.no_grad():
        layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=4, expert_alignment=16)).cuda()
        FP8Precision(recipe=FP8Recipe(recipe), backend="torch").convert_module(layer)
        layer(torch.randn(2, 64, 256, device="cuda"))
    assert streams == {"side": 12 - first, "main": first}  # evaluation: one layout, no weight_both
    monkeypatch.setattr(GroupedExperts, "prefetch", lambda self: None)
    plain_losses, plain_params, _ = _train(FP8Recipe(recipe), cache=False)
    assert streams == {"side": 12 - first, "main": first + 12}
    assert torch.equal(losses, plain_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


@pytest.mark.parametrize("once", [True, False])
@pytest.mark.parametrize("cache", [False, True])
def test_fused_rowwise_under_activation_checkpointing(cache, once):
    """The fused path saves FP8 copies for backward; a non-reentrant checkpoint recompute (run
    outside the cache context) must save the same tensors and give the same gradients."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.precision import FP8Recipe, FP8WeightCache, caching_fp8_weights
    from lightning_moe.precision.gemm import fp8_grouped_mm, fp8_linear

    recipe = FP8Recipe("rowwise", quantize_weights_once=once)

    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_grouped = torch.randn(4, 256, 128, device="cuda", requires_grad=True)
    w_dense = torch.randn(128, 256, device="cuda", requires_grad=True)
    offsets = torch.tensor([128, 128, 384, 512], device="cuda", dtype=torch.int32)

    def block(t):
        y = fp8_grouped_mm(t, w_grouped, offsets, recipe, backend="torch", weight_key=("experts", "fc1"))
        z = fp8_linear(t, w_dense, recipe, backend="torch", weight_key=("dense",))
        return y.float().square().sum() + z.float().square().sum()

    def grads(checkpointed):
        for t in (x, w_grouped, w_dense):
            t.grad = None
        with caching_fp8_weights(FP8WeightCache() if cache else None):
            loss = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        loss.backward()
        return [t.grad.clone() for t in (x, w_grouped, w_dense)]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)
