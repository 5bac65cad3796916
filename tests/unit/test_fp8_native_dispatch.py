"""The native FP8 grouped GEMM's dispatch, run on CPU: per-expert ``torch._scaled_mm`` (CPU has
it) against a reference ``torch._scaled_grouped_mm`` (CUDA only, so a dequantizing stand-in
here), the accumulation flag each GEMM receives, and the weight cache inside training."""

import sys
import types

import pytest
import torch

from lightning_moe.precision import FP8Recipe, FP8WeightCache, caching_fp8_weights, native_casts, native_gemms, scaled_mm


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch build's CPU ``_scaled_mm`` takes per-row scales (2.13 does; older
    builds only per-tensor ones)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_rowwise = pytest.mark.skipif(not _cpu_rowwise_scaled_mm(),
                                       reason="this torch's CPU _scaled_mm has no per-row scales")


def _fake_grouped(calls):
    """``torch._scaled_grouped_mm`` semantics for the two layouts the backend uses, in fp32."""

    def run(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        calls.append(use_fast_accum)
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        if b.dim() == 3:  # [R, K] x [E, K, N], per-row / per-(expert, column) scales
            out = torch.zeros(a.shape[0], b.shape[2])
            for e, (s, t) in enumerate(zip(starts, ends)):
                out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e][None])
            return out.to(out_dtype)
        k, n = a.shape[0], b.shape[1]  # [K, R] x [R, N], group-major scales
        out = torch.zeros(len(ends), k, n)
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[e] = (a[:, s:t].float() * scale_a[e * k:(e + 1) * k, None]) @ (
                b[s:t].float() * scale_b[e * n:(e + 1) * n][None])
        return out.to(out_dtype)

    return run


def _recording_scaled_mm(calls):
    real = torch._scaled_mm

    def run(*args, **kwargs):
        calls.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    return run


def _weight(seed=0):
    torch.manual_seed(seed)
    return (torch.randn(3, 64, 32) / 8).requires_grad_(True)


def _step(recipe, offsets, w=None):
    w = _weight() if w is None else w
    torch.manual_seed(1)
    x = torch.randn(int(offsets[-1]), 64, dtype=torch.bfloat16, requires_grad=True)
    w.grad = None
    y = scaled_mm.scaled_grouped_mm(x, w, offsets, recipe, None, weight_key=("experts", "fc1"))
    y.float().square().sum().backward()
    return y.detach().float(), x.grad.float(), w.grad.clone()


@needs_cpu_rowwise
@pytest.mark.parametrize("fast", [None, ("fprop", "dgrad", "wgrad")])
def test_per_expert_gemms_match_the_grouped_kernel_and_honour_the_accumulation(monkeypatch, fast):
    recipe = FP8Recipe("rowwise", fast_accumulation=fast)
    offsets = torch.tensor([32, 32, 80], dtype=torch.int32)  # expert 1 has no tokens
    grouped_calls, single_calls = [], []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_grouped(grouped_calls))
    monkeypatch.setattr(torch, "_scaled_mm", _recording_scaled_mm(single_calls))

    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 0)
    grouped = _step(recipe, offsets)
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 32)
    per_expert = _step(recipe, offsets)

    expected = [recipe.fast(g) for g in ("fprop", "dgrad", "wgrad")]
    assert grouped_calls == expected
    # per expert: fprop and dgrad skip the empty expert (2 calls each), wgrad zero-fills it
    assert single_calls == [expected[0]] * 2 + [expected[1]] * 2 + [expected[2]] * 2
    for a, b in zip(per_expert, grouped):
        assert float((a - b).norm() / b.norm()) < 1e-2
    assert not per_expert[2][1].any()  # the empty expert has no weight gradient


@needs_cpu_rowwise
def test_cached_weights_are_reused_across_micro_batches_and_give_the_same_result(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_grouped([]))
    offsets = torch.tensor([32, 48, 80], dtype=torch.int32)
    recipe = FP8Recipe("rowwise")
    w, other = _weight(0), _weight(1)  # both alive: different storage
    plain, plain_other = _step(recipe, offsets, w), _step(recipe, offsets, other)
    cache = FP8WeightCache()
    with caching_fp8_weights(cache):
        first = _step(recipe, offsets, w)  # forward and backward layouts quantized: 2 misses
        second = _step(recipe, offsets, w)  # the next micro-batch: 2 hits
        replaced = _step(recipe, offsets, other)  # same owner, another tensor: 2 misses
    assert (cache.misses, cache.hits) == (4, 2)
    for a, b, c in zip(plain, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)
    for a, b in zip(plain_other, replaced):
        assert torch.equal(a, b)
    with torch.no_grad():
        w.add_(1.0)  # the optimizer's in-place update moves the version counter
    with caching_fp8_weights(cache):
        _step(recipe, offsets, w)
    assert cache.misses == 6


def test_evaluation_calls_neither_fill_nor_read_the_cache(monkeypatch):
    """Decided where the GEMM is called: no_grad and inference-mode passes (Lightning's
    evaluation loops, whose offsets are inference tensors) quantize afresh and cache nothing."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_grouped([]))
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 32)  # the host-ends path too
    recipe = FP8Recipe("tensorwise")
    w, dense = _weight(), torch.randn(16, 64, requires_grad=True)
    x = torch.randn(80, 64, dtype=torch.bfloat16)
    cache = FP8WeightCache()
    with caching_fp8_weights(cache):
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                offsets = torch.tensor([32, 48, 80], dtype=torch.int32)
                y = scaled_mm.scaled_grouped_mm(x, w, offsets, recipe, None, ("experts", "fc1"))
                scaled_mm.scaled_linear(x, dense, None, recipe, None, ("dense", "weight"))
        assert len(cache) == 0 and cache.misses == 0
        scaled_mm.scaled_linear(x, dense, None, recipe, None, ("dense", "weight"))  # a training pass
    assert len(cache) == 1 and y.shape == (80, 32)


def test_host_group_ends_follow_in_place_updates():
    offsets = torch.tensor([16, 32], dtype=torch.int32)
    assert native_gemms.host_group_ends(offsets, 2) == [16, 32]
    offsets.copy_(torch.tensor([8, 32], dtype=torch.int32))
    assert native_gemms.host_group_ends(offsets, 2) == [8, 32]
    assert native_gemms.host_group_ends(offsets, native_gemms.PER_EXPERT_MAX_EXPERTS + 1) is None


@needs_cpu_rowwise
def test_activation_checkpointing_recomputes_outside_the_cache(monkeypatch):
    """Non-reentrant checkpointing recomputes the forward during backward, outside the cache
    context: the recompute must save what the first forward saved, and the gradients stay those
    of a run without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_grouped([]))
    offsets = torch.tensor([32, 48, 80], dtype=torch.int32)
    recipe = FP8Recipe("rowwise")
    w = _weight(0)
    plain = _step(recipe, offsets, w)
    torch.manual_seed(1)
    x = torch.randn(80, 64, dtype=torch.bfloat16, requires_grad=True)
    w.grad = None
    cache = FP8WeightCache()
    with caching_fp8_weights(cache):
        y = checkpoint(lambda t: scaled_mm.scaled_grouped_mm(t, w, offsets, recipe, None,
                                                             weight_key=("experts", "fc1")),
                       x, use_reentrant=False)
    y.float().square().sum().backward()
    assert torch.equal(y.detach().float(), plain[0]) and torch.equal(x.grad.float(), plain[1])
    assert torch.equal(w.grad, plain[2])
    assert cache.misses == 2  # forward and backward layouts of the first forward; the recompute has no cache


def test_fused_quantizers_leave_dtensor_operands_to_the_generic_path(monkeypatch, tmp_path):
    """A Triton kernel sees only a tensor's local memory (a DTensor reports no usable pointer),
    so tensor-parallel shards must take the generic quantizers, whose amax is reduced over the
    shards, and torch's float8 transpose."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import lightning_moe.kernels as kernels
    from lightning_moe.precision.delayed import DelayedState

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)  # as on a GPU
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        local = torch.randn(8, 16)
        sharded = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Shard(0)])
        state = DelayedState(torch.zeros(2, 3, 1), torch.zeros(3, 1))
        rowwise, delayed = FP8Recipe("rowwise"), FP8Recipe("delayed")
        assert native_casts.fused_rowwise(rowwise, None, local) and native_casts.fused_delayed(delayed, state, local)
        assert not native_casts.fused_rowwise(rowwise, None, sharded)
        assert not native_casts.fused_delayed(delayed, state, sharded)
        # the float8 transposes too: a shard is transposed by torch, a local tensor by the tiled kernel
        tiled = []
        monkeypatch.setattr(native_gemms, "TILED_FP8_TRANSPOSES", True)
        monkeypatch.setattr("lightning_moe.kernels.transpose_triton.transpose_bytes",
                            lambda q, multiple=1: tiled.append(1) or q.t().contiguous())
        q = local.to(torch.float8_e4m3fn)
        native_gemms.transposed_fp8(q)
        assert tiled == [1]
        q_sharded = DTensor.from_local(q, sharded.device_mesh, [Shard(0)])
        assert native_gemms.transposed_fp8(q_sharded).to_local().shape == (16, 8) and tiled == [1]
    finally:
        if created:
            dist.destroy_process_group()


def _stand_in_triton_kernels(monkeypatch) -> tuple[list, list, list]:
    """`triton_grouped` forced on, ``kernels.fp8_grouped_gemm_triton`` replaced by a stand-in module
    (CPU CI has no Triton GPU kernels) and ``torch._scaled_grouped_mm`` by `_fake_grouped`; returns
    the logs of the stand-in's calls (``precise`` each), of torch's grouped kernel's
    (``use_fast_accum`` each) and of the host lists of group ends made."""
    triton_log, grouped_log, host_log = [], [], []
    kernel = types.ModuleType("lightning_moe.kernels.fp8_grouped_gemm_triton")
    kernel.MAX_EXPERTS = 4096
    kernel.tma_operands = lambda *tensors: True

    def grouped_mm_fprop(a, sa, b_EOK, sb, ends, precise):
        triton_log.append(precise)
        return _fake_grouped([])(a, b_EOK.transpose(1, 2), sa, sb, ends, torch.bfloat16, True)

    kernel.grouped_mm_fprop = grouped_mm_fprop
    monkeypatch.setitem(sys.modules, kernel.__name__, kernel)
    monkeypatch.setattr(scaled_mm, "triton_grouped", lambda t: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _fake_grouped(grouped_log))
    host_group_ends = native_gemms.host_group_ends
    monkeypatch.setattr(scaled_mm, "host_group_ends", lambda *a: host_log.append(1) or host_group_ends(*a))
    return triton_log, grouped_log, host_log


@pytest.mark.parametrize("fast", [("fprop", "dgrad", "wgrad"), ("fprop",), ()])
def test_the_triton_grouped_gemm_takes_the_grouped_products(monkeypatch, fast):
    """Where ``triton_grouped`` holds (CUDA Hopper with Triton; forced here), the forward and
    data-gradient products go to ``kernels.fp8_grouped_gemm_triton`` (a stand-in module: CPU CI has
    no Triton) with fast or split accumulation as the recipe says; the layer makes no host list of
    group ends, and its weight gradient takes the grouped kernel."""
    triton_log, grouped_log, host_log = _stand_in_triton_kernels(monkeypatch)
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 32)
    # every split product on ours too (the large-expert exception is the next test's)
    monkeypatch.setattr(native_gemms, "SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS", 1 << 62)
    recipe = FP8Recipe("rowwise", fast_accumulation=fast)
    offsets = torch.tensor([32, 32, 80], dtype=torch.int32)
    got = _step(recipe, offsets)
    # forward then data gradient, each split unless the recipe accumulates it fast
    assert triton_log == ["fprop" not in fast, "dgrad" not in fast] and len(grouped_log) == 1
    assert len(host_log) == 0
    with torch.no_grad():  # evaluation: the forward alone, on the Triton kernel; no host list either
        host_log.clear()
        scaled_mm.scaled_grouped_mm(torch.randn(80, 64, dtype=torch.bfloat16), _weight(), offsets.clone(), recipe,
                                    None)
        assert len(host_log) == 0 and len(triton_log) == 3
    monkeypatch.setattr(scaled_mm, "triton_grouped", lambda t: False)
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 0)
    reference = _step(recipe, offsets)
    for a, b in zip(got, reference):
        assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.parametrize("large", [True, False])
def test_split_accumulation_over_large_experts_takes_torchs_grouped_kernel(monkeypatch, large):
    """Where the Triton kernels are on, a split-accumulation forward or data-gradient product whose
    experts hold at least `SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS` elements each runs on
    ``torch._scaled_grouped_mm`` (split: ``use_fast_accum=False``), the fast forward on ours; smaller
    experts keep both on ours. No host list of group ends either way."""
    triton_log, grouped_log, host_log = _stand_in_triton_kernels(monkeypatch)
    w = _weight()
    elements = w.shape[1] * w.shape[2]
    limit = elements if large else elements + 1
    monkeypatch.setattr(native_gemms, "SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS", limit)
    offsets = torch.tensor([32, 32, 80], dtype=torch.int32)  # 3 experts
    _step(FP8Recipe("rowwise"), offsets, w)  # fast forward, split data and weight gradients
    if large:
        # the forward on ours; the data gradient then the weight gradient on torch's, both split
        assert triton_log == [False] and grouped_log == [False, False]
    else:
        assert triton_log == [False, True] and grouped_log == [False]
    assert host_log == []
