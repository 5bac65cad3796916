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


def test_emulated_gemms_ignore_an_active_cache():
    """The emulated backend quantizes every call (numerics studies); a cache never changes it."""
    from lightning_moe.precision.modules import FP8GroupedGemm

    torch.manual_seed(0)
    gemm = FP8GroupedGemm("rowwise", backend="emulated")
    x, w = torch.randn(32, 16), torch.randn(2, 16, 8)
    offsets = torch.tensor([16, 32], dtype=torch.int32)
    cache = FP8WeightCache()
    plain = gemm.grouped_mm(x, w, offsets, "fc1")
    with caching_fp8_weights(cache):
        again = gemm.grouped_mm(x, w, offsets, "fc1")
    assert torch.equal(plain, again) and len(cache) == 0
