"""FP8WeightCache: one quantization per weight state, keyed by owner, dropped on any change."""

import pytest
import torch

from lightning_moe.precision import FP8Precision, FP8WeightCache, caching_fp8_weights
from lightning_moe.precision.weight_cache import active_cache, cached


def _counting():
    calls = []

    def quantize(w):
        calls.append(1)
        return w * 2

    return calls, quantize


def test_hits_until_the_weight_changes_in_place():
    cache, (calls, quantize) = FP8WeightCache(), _counting()
    w = torch.randn(4, 4)
    first = cache.get("fc1", w, "fprop", lambda: quantize(w))
    assert cache.get("fc1", w, "fprop", lambda: quantize(w)) is first
    assert (cache.hits, cache.misses, len(calls)) == (1, 1, 1)
    w.add_(1.0)  # an optimizer update outside the plugin: version counter moves
    again = cache.get("fc1", w, "fprop", lambda: quantize(w))
    assert len(calls) == 2 and torch.equal(again, w * 2)


def test_layouts_and_owners_are_separate_and_new_storage_misses():
    cache, (calls, quantize) = FP8WeightCache(), _counting()
    w = torch.randn(4, 4)
    cache.get("fc1", w, "fprop", lambda: quantize(w))
    cache.get("fc1", w, "dgrad", lambda: quantize(w))
    cache.get("fc2", w, "fprop", lambda: quantize(w))
    assert len(calls) == 3 and len(cache) == 3
    replaced = w.clone()  # same values and shape, other storage (e.g. re-gathered by FSDP)
    cache.get("fc1", replaced, "fprop", lambda: quantize(replaced))
    assert len(calls) == 4
    cache.clear()
    assert len(cache) == 0


def test_context_and_no_owner_mean_no_caching():
    cache, (calls, quantize) = FP8WeightCache(), _counting()
    w = torch.randn(2, 2)
    assert active_cache() is None
    with caching_fp8_weights(cache):
        assert active_cache() is cache
        cached(active_cache(), None, w, "fprop", lambda: quantize(w))
        cached(active_cache(), None, w, "fprop", lambda: quantize(w))
    assert active_cache() is None and len(calls) == 2 and len(cache) == 0


def test_cache_needs_the_native_backend():
    with pytest.raises(ValueError, match="cache_fp8_weights needs the native backend"):
        FP8Precision(recipe="rowwise", backend="emulated", cache_fp8_weights=True, device="cpu")


def test_no_caching_outside_training_passes():
    """Evaluation (no_grad / inference mode) and inference tensors get no cache."""
    from lightning_moe.precision.weight_cache import training_cache

    cache, w = FP8WeightCache(), torch.randn(4, 4)
    with caching_fp8_weights(cache):
        assert training_cache(w) is cache
        with torch.no_grad():
            assert training_cache(w) is None
        with torch.inference_mode():
            assert training_cache(w) is None
            frozen = torch.randn(4, 4)  # an inference tensor
        assert training_cache(frozen) is None
    assert training_cache(w) is None


def _native_plugin(monkeypatch, **kwargs):
    """An FP8Precision with the native backend on a CPU machine (the backend check patched)."""
    from lightning_moe.precision import plugin as plugin_module

    monkeypatch.setattr(plugin_module, "resolve_backend", lambda recipe, backend, device: "torch")
    return FP8Precision(recipe="rowwise", backend="torch", device="cpu", **kwargs)


def test_plugin_clears_after_each_optimizer_step_and_not_in_evaluation(monkeypatch):
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = _native_plugin(monkeypatch, cache_fp8_weights=True)
    w = torch.randn(2, 2)
    with plugin.forward_context():
        active_cache().get("fc1", w, "fprop", lambda: w * 2)
        with plugin.val_step_context():
            assert active_cache() is None  # evaluation runs without the cache
        assert active_cache() is plugin.weight_cache
    assert len(plugin.weight_cache) == 1
    monkeypatch.setattr(MixedPrecision, "optimizer_step", lambda self, optimizer, model, closure, **kw: closure())
    plugin.optimizer_step(None, model=None, closure=lambda: None)
    assert len(plugin.weight_cache) == 0
    assert "cached per optimizer step" in plugin.backend_description()


def test_the_delayed_scaling_update_alone_clears_the_cache(monkeypatch):
    """A loop that steps by hand calls `update_delayed_scaling` once per optimizer step: the cached
    FP8 weights were quantized with the scales it replaces, so it drops them itself."""
    plugin = _native_plugin(monkeypatch, cache_fp8_weights=True)
    w = torch.randn(2, 2)
    with plugin.forward_context():
        active_cache().get("fc1", w, "fprop", lambda: w * 2)
    assert len(plugin.weight_cache) == 1
    plugin.update_delayed_scaling()
    assert len(plugin.weight_cache) == 0


def test_strategy_refuses_the_cache_with_fsdp(monkeypatch):
    from lightning_moe.strategies import MegatronMoEStrategy

    strategy = MegatronMoEStrategy()
    strategy._precision_plugin = _native_plugin(monkeypatch, cache_fp8_weights=True)
    strategy._check_fp8_options()  # nothing sharded yet: fine
    strategy._experts_fsdp = True
    with pytest.raises(ValueError, match="expert_sharding='ddp'"):
        strategy._check_fp8_options()


def test_the_default_caches_on_the_native_backend_and_stands_down_under_fsdp(monkeypatch):
    from lightning_moe.strategies import MegatronMoEStrategy

    assert FP8Precision(recipe="rowwise", backend="emulated", device="cpu").weight_cache is None
    assert _native_plugin(monkeypatch, cache_fp8_weights=False).weight_cache is None
    strategy = MegatronMoEStrategy()
    strategy._precision_plugin = plugin = _native_plugin(monkeypatch)
    assert plugin.weight_cache is not None  # the default on the native backend
    strategy._check_fp8_options()
    assert plugin.weight_cache is not None  # nothing sharded: kept
    strategy._dense_fsdp = True
    strategy._check_fp8_options()  # the default is not refused: it is turned off
    assert plugin.weight_cache is None


@pytest.mark.parametrize("experts_fsdp", [False, True])
@pytest.mark.parametrize("requested", [None, True, False])
def test_fsdp_experts_turn_off_quantizing_weights_once_unless_asked(monkeypatch, experts_fsdp, requested):
    """`FP8Recipe.quantize_weights_once` left at None is turned off when FSDP shards the experts
    (the saved copy would be of the unsharded weight); an explicit choice is kept."""
    from lightning_moe.precision import FP8Recipe
    from lightning_moe.precision.native_casts import both_weight_layouts_now
    from lightning_moe.strategies import MegatronMoEStrategy

    strategy = MegatronMoEStrategy()
    plugin = _native_plugin(monkeypatch)
    plugin.recipe = FP8Recipe("rowwise", quantize_weights_once=requested)
    strategy._precision_plugin = plugin
    strategy._experts_fsdp = experts_fsdp
    strategy._check_fp8_options()
    want = requested if requested is not None else not experts_fsdp
    assert both_weight_layouts_now(plugin.recipe, needs_backward=True) is want
    assert not both_weight_layouts_now(plugin.recipe, needs_backward=False)
    assert plugin.recipe.name == "rowwise" and plugin.recipe.alignment == 16


def test_every_quantized_grouped_gemm_takes_the_projection_name():
    """`GroupedExperts` calls ``quantization.grouped_mm(x, w, offsets, projection)``."""
    import inspect

    from lightning_moe.precision._te import HighPrecisionGroupedGemm
    from lightning_moe.precision.modules import FP8GroupedGemm

    for gemm in (FP8GroupedGemm("rowwise"), HighPrecisionGroupedGemm()):
        inspect.signature(gemm.grouped_mm).bind("x", "w", "offsets", "fc1")
