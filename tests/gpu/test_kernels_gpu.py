"""Triton kernels against their plain-torch definitions (fp32, CUDA)."""

import pytest
import torch

from lightning_moe.nn.permutation import permute, plan_permutation, unpermute

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("d", [64, 1000, 4096])
def test_combine_forward_backward(k, d):
    from lightning_moe.kernels.combine_triton import combine, combine_backward

    torch.manual_seed(k + d)
    t, r = 300, 300 * k + 17
    dest = torch.randperm(r + 1, device="cuda")[: t * k].view(t, k)  # r = dropped sentinel sometimes
    y = torch.randn(r, d, device="cuda")
    w = torch.rand(t, k, device="cuda")
    g = torch.randn(t, d, device="cuda")
    y_ext = torch.cat([y, y.new_zeros(1, d)])
    ref = (w.unsqueeze(-1) * y_ext[dest]).sum(1)
    torch.testing.assert_close(combine(y, dest, w), ref, rtol=1e-5, atol=1e-5)
    row_token = torch.full((r + 1,), t, dtype=torch.long, device="cuda")  # rows no assignment holds: T
    row_token[dest.flatten()] = torch.arange(t * k, device="cuda") // k
    torch.full((r, d), float("nan"), device="cuda")  # a freed NaN block, which the caching allocator likely hands to torch.empty next
    gy, gw = combine_backward(y, dest, w, g, r, row_token[:r], need_grad_w=True)
    ref_gw = (y_ext[dest] * g.unsqueeze(1)).sum(-1)
    ref_gy = torch.zeros(r + 1, d, device="cuda")
    ref_gy[dest.flatten()] = (w.unsqueeze(-1) * g.unsqueeze(1)).reshape(-1, d)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gy, ref_gy[:r], rtol=1e-6, atol=1e-6)  # unowned rows zero, not stale memory


@pytest.mark.parametrize("weighted", [False, True])
def test_combine_into_fp32_equals_combining_the_widened_rows(weighted):
    """``combine(y, ..., out_dtype=fp32)`` over bf16 rows: the bits of widening the rows first (the
    permutation's backward under an fp32 residual stream), without the widened copy."""
    from lightning_moe.kernels.combine_triton import combine

    torch.manual_seed(3)
    t, k, d = 700, 8, 2048
    r = t * k + 5
    dest = torch.randperm(r + 1, device="cuda")[: t * k].view(t, k)
    y = torch.randn(r, d, device="cuda").to(torch.bfloat16)
    w = torch.rand(t, k, device="cuda") if weighted else None
    out = combine(y, dest, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out.view(torch.int32), combine(y.float(), dest, w).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_torch(dtype):
    from lightning_moe.kernels.swiglu_triton import swiglu

    h = torch.randn(513, 2 * 200, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(513, 200, device="cuda", dtype=dtype)
    out = swiglu(h)
    (gh,) = torch.autograd.grad(out, h, g)
    h2 = h.detach().float().requires_grad_(True)
    gate, up = h2.chunk(2, -1)
    ref = torch.nn.functional.silu(gate) * up
    (gh_ref,) = torch.autograd.grad(ref, h2, g.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(gh.float(), gh_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("alignment,drop", [(1, False), (16, True)])
def test_permutation_cuda_equals_cpu(alignment, drop):
    torch.manual_seed(0)
    t, k, e, d = 257, 4, 16, 96
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    keep = torch.rand(t, k) > 0.3 if drop else None
    probs = torch.rand(t, k)
    x = torch.randn(t, d)
    results = []
    for device in ("cpu", "cuda"):
        plan = plan_permutation(experts.to(device), e, keep_TK=None if keep is None else keep.to(device), alignment=alignment)
        xx = x.detach().clone().to(device).requires_grad_(True)
        pp = probs.detach().clone().to(device).requires_grad_(True)
        out = unpermute(permute(xx, plan) * 2.0 + 1.0 * (plan.row_token_R < t).unsqueeze(1), pp, plan)
        out.backward(torch.ones_like(out))
        results.append((out.cpu(), xx.grad.cpu(), pp.grad.cpu()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("end", [0, 1, 31, 32, 700, 1023, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_from_touches_only_the_tail(end, dtype):
    from lightning_moe.kernels.tail_triton import zero_rows_from_triton
    from lightning_moe.nn.grouped_gemm import zero_rows_from_torch

    y = torch.randn(1024, 300, device="cuda", dtype=dtype)
    want = y.clone()
    zero_rows_from_torch(want, torch.tensor(end, device="cuda"))
    strided = torch.randn(1024, 320, device="cuda", dtype=dtype)[:, :300]  # row stride 320
    strided.copy_(y)
    end_t = torch.tensor([5, end], device="cuda", dtype=torch.int32)[1]
    zero_rows_from_triton(y, end_t)
    zero_rows_from_triton(strided, end_t)
    assert torch.equal(y, want) and torch.equal(strided, want)


def _free_nan_blocks(*shapes):
    """Allocate and free NaN-filled bf16 blocks of these shapes, so the caching allocator is
    likely to hand them to the next ``torch.empty`` calls of the same sizes: a row the code
    forgets to write then shows up as NaN instead of as fresh (often zero) memory."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16) for shape in shapes]
    del blocks


@pytest.mark.parametrize("sizes", [[96, 0, 160], [0, 0, 0], [256, 128, 128], [0, 32, 0]])
def test_grouped_mm_leaves_padding_rows_out_and_zero(sizes):
    """The covered-rows grouped GEMM equals one matmul per group on the covered rows, gives
    zero padding rows in the output and the input gradient (whatever the allocator hands out),
    and its weight gradient ignores the padding."""
    from lightning_moe.nn.grouped_gemm import grouped_mm

    torch.manual_seed(len(sizes) + sum(sizes))
    rows, used = 512, sum(sizes)
    x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    x[used:] = 0
    w = torch.randn(3, 256, 128, device="cuda", dtype=torch.bfloat16) / 16
    g = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    sizes_t = torch.tensor(sizes, device="cuda")
    _free_nan_blocks((rows, 128))  # the output's size: torch.empty inside likely gets this block
    y = grouped_mm(xa, wa, sizes_t)
    _free_nan_blocks((rows, 256))  # the input gradient's
    y.backward(g)
    assert torch.equal(y[used:], torch.zeros_like(y[used:]))
    assert torch.equal(xa.grad[used:], torch.zeros_like(xa.grad[used:]))
    starts = [sum(sizes[:e]) for e in range(3)]
    for e, (start, size) in enumerate(zip(starts, sizes)):
        xs, gs = x[start:start + size].float(), g[start:start + size].float()
        torch.testing.assert_close(y[start:start + size].float(), xs @ w[e].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(xa.grad[start:start + size].float(), gs @ w[e].float().t(), rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(wa.grad[e].float(), xs.t() @ gs, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("n", [1, 8191, 8192, 3 * 8192 + 5])
def test_widen_to_fp32_is_exact(n):
    """The widening kernel gives every bf16 value's fp32 bits (infinities, signed zeros and
    subnormals included), NaN where the input is NaN, for sizes around its block."""
    from lightning_moe.kernels.widen_triton import widen_to_fp32

    torch.manual_seed(n)
    x = (torch.randn(n, device="cuda") * 1e3).to(torch.bfloat16)
    specials = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40, float("nan")], device="cuda")
    x[:min(n, 5)] = specials[:min(n, 5)].to(torch.bfloat16)
    out = widen_to_fp32(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    want = x.float()
    assert torch.equal(out.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32))
    with pytest.raises(ValueError, match="contiguous bf16"):
        widen_to_fp32(x.float())


@pytest.mark.parametrize("n", [1, 8191, 3 * 8192 + 5])
def test_accumulate_widened_adds_in_place_with_the_bits_of_widen_then_add(n):
    """``dst += src`` in one pass: the same bits as widening ``src`` and adding it, into the same
    tensor (the in-place gradient accumulation of `ComputeWeightCache`)."""
    from lightning_moe.kernels import accumulate_widened_

    torch.manual_seed(n)
    dst = torch.randn(n, device="cuda") * 3
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    want = dst + src.float()
    ptr = dst.data_ptr()
    out = accumulate_widened_(dst, src)
    assert out.data_ptr() == ptr and torch.equal(dst, want)


def test_in_place_accumulation_on_the_gpu_matches_autograds_accumulation():
    """Experts on fp32 masters over three micro-batches: the same ``.grad`` bits with the cache's
    in-place accumulation (Triton kernel) as with autograd's widen-then-add."""
    from lightning_moe.nn.compute_weights import ComputeWeightCache
    from lightning_moe.nn.experts import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 32, activation="swiglu", backend="grouped_mm").cuda()
    xs = [torch.randn(96, 64, device="cuda") for _ in range(3)]
    sizes = torch.tensor([16, 32, 0, 48], device="cuda")
    grads = []
    for in_place in (False, True):
        experts.zero_grad(set_to_none=True)
        cache = ComputeWeightCache(accumulate_grads_in_place=in_place)
        for x in xs:
            with cache.active(), torch.autocast("cuda", dtype=torch.bfloat16):
                y = experts(x, sizes)
            y.float().square().mean().backward()
        grads.append([p.grad.clone() for p in experts.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_torch_grouped_mm_writes_only_its_operands_dtype():
    """Why bf16 experts on fp32 master weights widen their weight gradient in a pass of its own
    (`compute_weights._MasterWeightCast`) while the FP8 kernel writes it in fp32: torch's grouped
    GEMM (2.11) refuses an fp32 output for bf16 operands. If this fails, torch writes it: pass
    ``out_dtype`` in `_GroupedMMCoveredRows`' weight gradient instead."""
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 96, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([128, 256], device="cuda", dtype=torch.int32)
    assert torch._grouped_mm(x.t(), dy, offs=offsets).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="output dtype must match"):
        torch._grouped_mm(x.t(), dy, offs=offsets, out_dtype=torch.float32)


def test_fp32_master_weights_get_autocasts_gradients_from_the_widening_kernel(monkeypatch):
    """The covered-rows grouped GEMM on fp32 master weights (bf16 activations, as under bf16
    autocast) casts them through `_MasterWeightCast`: the same output and gradients, bit for bit,
    as ``w.to(bf16)`` under autograd, with the weight gradient widened by our kernel."""
    import lightning_moe.kernels.widen_triton as widen
    import lightning_moe.nn.grouped_gemm as grouped_gemm

    calls = []
    real = widen.widen_to_fp32
    monkeypatch.setattr(widen, "widen_to_fp32", lambda g: calls.append(g.shape) or real(g))
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 256, 384, device="cuda") / 16
    g = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor([96, 0, 320], device="cuda")

    def run():
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_gemm.grouped_mm(xa, wa, sizes)
        y.backward(g)
        return y, xa.grad, wa.grad

    fused = run()
    assert calls == [torch.Size([3, 256, 384])]
    monkeypatch.setattr(grouped_gemm, "compute_weight", lambda w_, dtype: w_.to(dtype))
    plain = run()
    assert len(calls) == 1
    assert fused[2].dtype == torch.float32
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


def test_grouped_experts_under_autocast_widen_their_gradients_through_our_kernel(monkeypatch):
    """SwiGLU experts on fp32 master weights under bf16 autocast (fc1 a flattened view of its 4-D
    parameter): both weight gradients are widened by our kernel, fp32 and shaped as the
    parameters, with the same output and gradients, bit for bit, as ``w.to(bf16)``."""
    import lightning_moe.kernels.widen_triton as widen
    import lightning_moe.nn.grouped_gemm as grouped_gemm
    from lightning_moe.nn.experts import GroupedExperts

    calls = []
    real = widen.widen_to_fp32
    monkeypatch.setattr(widen, "widen_to_fp32", lambda g: calls.append(tuple(g.shape)) or real(g))
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96, activation="swiglu", backend="grouped_mm").cuda()
    x = torch.randn(256, 64, device="cuda")
    sizes = torch.tensor([64, 0, 100, 92], device="cuda")

    def run():
        experts.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = experts(x, sizes)
        y.float().square().sum().backward()
        return [y.detach()] + [p.grad for p in experts.parameters()]

    fused = run()
    assert sorted(calls) == [(4, 64, 192), (4, 96, 64)]
    assert all(p.grad.dtype == torch.float32 and p.grad.shape == p.shape for p in experts.parameters())
    import lightning_moe.nn.experts as experts_module

    # the plain cast where either module casts: autograd's own widening of the bf16 gradients
    for module in (grouped_gemm, experts_module):
        monkeypatch.setattr(module, "compute_weight", lambda w, dtype, **_: w.to(dtype))
    plain = run()
    assert len(calls) == 2
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("end", [0, 5, 16, 300, 513])
def test_swiglu_rows_end_neither_reads_nor_writes_the_tail(end):
    from lightning_moe.kernels.swiglu_triton import _BF, _BR, _grid, _swiglu_bwd_kernel, _swiglu_fwd_kernel, swiglu

    torch.manual_seed(end)
    h = torch.randn(513, 2 * 200, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(513, 200, device="cuda", dtype=torch.bfloat16)
    h_tail, g_tail = h.clone(), g.clone()
    h_tail[end:], g_tail[end:] = float("nan"), float("nan")  # what an unwritten tail may hold
    a = h.clone().requires_grad_(True)
    b = h_tail.clone().requires_grad_(True)
    end_t = torch.tensor(end, device="cuda")
    out_full = swiglu(a)
    out_full.backward(g)
    out_end = swiglu(b, end_t)
    out_end.backward(g_tail)
    assert torch.equal(out_end[:end], out_full[:end]) and torch.equal(b.grad[:end], a.grad[:end])
    # The kernels on buffers filled with a marker: rows from the end on keep it (not written).
    out = torch.full((513, 200), 7.0, device="cuda", dtype=torch.bfloat16)
    grad_h = torch.full((513, 400), 7.0, device="cuda", dtype=torch.bfloat16)
    _swiglu_fwd_kernel[_grid(513, 200)](h_tail, h_tail, out, end_t, 513, 200, HAS_END=True, HAS_P=False,  # no p
                                        BR=_BR, BF=_BF)
    _swiglu_bwd_kernel[_grid(513, 200)](h_tail, g_tail, grad_h, end_t, 513, 200, HAS_END=True, BR=_BR, BF=_BF)
    assert torch.equal(out[:end], out_full[:end]) and torch.equal(grad_h[:end], a.grad[:end])
    assert (out[end:] == 7).all() and (grad_h[end:] == 7).all()


@pytest.mark.parametrize("end", [0, 1, 100, 700, 800])
@pytest.mark.parametrize("d", [96, 3000])
def test_gather_rows_until_writes_the_rows_before_the_end_only(end, d):
    """The permutation's gather with ``rows_end``: rows before the end are the token rows (zero
    for the sentinel token T), rows from it on are not written."""
    from lightning_moe.kernels.permute_triton import _gather_rows_kernel, gather_rows_until

    torch.manual_seed(end + d)
    t, rows = 250, 800
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    row_token = torch.randint(0, t + 1, (rows,), device="cuda")  # T: a padding row
    end_t = torch.tensor(end, device="cuda")
    want = torch.cat([x, x.new_zeros(1, d)])[row_token]
    got = gather_rows_until(x, row_token, end_t)
    assert torch.equal(got[:end], want[:end])
    marked = torch.full((rows, d), 7.0, device="cuda", dtype=torch.bfloat16)
    _gather_rows_kernel[(rows,)](x, row_token, marked, end_t, t, d, BD=min(triton_next_pow2(d), 2048))
    assert torch.equal(marked[:end], want[:end]) and (marked[end:] == 7).all()


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_combine_backward_leaves_rows_from_the_end_alone():
    """``rows_end``: unowned rows before it are zeroed, rows from it on are not written."""
    from lightning_moe.kernels.combine_triton import _zero_unowned_rows_kernel, combine_backward

    torch.manual_seed(3)
    t, k, d, rows, end = 64, 2, 256, 200, 150
    dest = torch.randperm(end, device="cuda")[: t * k].view(t, k)  # 128 of the first 150 rows held
    w = torch.rand(t, k, device="cuda")
    g = torch.randn(t, d, device="cuda")
    row_token = torch.full((rows,), t, dtype=torch.long, device="cuda")
    row_token[dest.flatten()] = torch.arange(t * k, device="cuda") // k
    end_t = torch.tensor(end, device="cuda")
    gy_all, _ = combine_backward(None, dest, w, g, rows, row_token, need_grad_w=False)
    gy, _ = combine_backward(None, dest, w, g, rows, row_token, need_grad_w=False, rows_end=end_t)
    assert torch.equal(gy[:end], gy_all[:end])
    marked = torch.full((rows, d), 7.0, device="cuda")
    _zero_unowned_rows_kernel[(triton_next_pow2(rows) // 64,)](marked, row_token, end_t, t, rows, d, BR=64, BD=256,
                                                               HAS_END=True)
    unowned = row_token == t
    assert (marked[:end][unowned[:end]] == 0).all() and (marked[:end][~unowned[:end]] == 7).all()
    assert (marked[end:] == 7).all()


def test_grouped_experts_with_padding_rows_match_the_loop_backend():
    """The CUDA bf16 SwiGLU path (covered-row GEMMs, unzeroed intermediate tails) against the
    per-expert loop on the same weights: equal on the covered rows, zero on the padding rows of
    the output and of the input gradient."""
    from lightning_moe.nn.experts import GroupedExperts

    torch.manual_seed(0)
    sizes = torch.tensor([40, 0, 88, 25], device="cuda")
    rows, used = 300, int(sizes.sum())
    fast = GroupedExperts(4, 128, 96, backend="grouped_mm").cuda().to(torch.bfloat16)
    loop = GroupedExperts(4, 128, 96, backend="loop").cuda().to(torch.bfloat16)
    loop.load_state_dict(fast.state_dict())
    x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    x[used:] = 0
    g = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    outs = []
    for module in (fast, loop):
        xx = x.clone().requires_grad_(True)
        _free_nan_blocks((rows, 192), (rows, 96), (rows, 128))  # h, SwiGLU out, y: stale NaN tails
        y = module(xx, sizes)
        _free_nan_blocks((rows, 96), (rows, 192), (rows, 128))  # their gradients
        y.backward(g)
        outs.append((y, xx.grad, module.fc1_weight.grad, module.fc2_weight.grad))
    (y, gx, g1, g2), (y_ref, gx_ref, g1_ref, g2_ref) = outs
    assert torch.equal(y[used:], torch.zeros_like(y[used:]))
    assert torch.equal(gx[used:], torch.zeros_like(gx[used:]))
    torch.testing.assert_close(y[:used], y_ref[:used], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx[:used], gx_ref[:used], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g1, g1_ref, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(g2, g2_ref, rtol=2e-2, atol=5e-2)

    # tail_unwritten: a NaN tail in the input (what the permutation leaves) reaches nothing.
    x_nan = x.clone()
    x_nan[used:] = float("nan")
    xx = x_nan.requires_grad_(True)
    fast.zero_grad()
    y_u = fast(xx, sizes, tail_unwritten=True)
    g_nan = g.clone()
    g_nan[used:] = float("nan")  # nor does a NaN tail in the output's gradient
    y_u.backward(g_nan)
    assert torch.equal(y_u[:used], y[:used]) and torch.equal(xx.grad[:used], gx[:used])
    assert torch.equal(fast.fc1_weight.grad, g1) and torch.equal(fast.fc2_weight.grad, g2)


def _router_keep(experts, capacity, num_experts):
    """At most ``capacity`` kept assignments per expert, in token order (as the router keeps)."""
    keep = torch.zeros(experts.shape, dtype=torch.bool)
    counts = [0] * num_experts
    for i in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[i, j])
            if counts[e] < capacity:
                keep[i, j] = True
                counts[e] += 1
    return keep


@pytest.mark.parametrize("mode", ["align", "keep", "marked", "capacity", "override", "aligned_override"])
def test_padded_plan_kernels_equal_the_torch_plan(mode, monkeypatch):
    """The CUDA plan (Triton kernels for rows by group start) equals the CPU plan (torch) in
    every field, over random routings: alignments 1/16/32, drops by mask or marked ids, capacity
    padding, a buffer larger than the assignments (with and without alignment), no tokens."""
    import random

    import lightning_moe.kernels.plan_triton as plan_triton

    kernel_plans = []
    real = plan_triton.plan_rows
    monkeypatch.setattr(plan_triton, "plan_rows", lambda *a, **k: kernel_plans.append(1) or real(*a, **k))
    gen = random.Random(mode)
    for case in range(12):
        t, e = (0 if case == 0 else gen.choice([1, 37, 200, 1000])), gen.choice([1, 8, 40, 130])
        k = min(gen.choice([1, 2, 8]), e)
        experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.long)
        if case % 2:
            experts = experts.int()
        kw, alignment = {}, (gen.choice([1, 16, 32]) if mode != "override" else 1)
        if mode == "aligned_override":
            alignment = gen.choice([16, 32])
            rows = -(-(t * k + e * (alignment - 1)) // alignment) * alignment
            kw["num_rows"] = rows + gen.choice([0, 16, 64])
        if mode == "keep":
            kw["keep_TK"] = torch.rand(t, k) > 0.3
        elif mode == "marked":
            experts = torch.where(torch.rand(t, k) > 0.3, experts, e)
            kw["dropped_marked"] = True
        elif mode == "capacity":
            capacity = max(1, t * k // e // 2)
            kw.update(keep_TK=_router_keep(experts, capacity, e), capacity=capacity, pad_to_capacity=True)
        elif mode == "override":
            kw.update(num_rows=t * k + gen.choice([0, 3, 50]), keep_TK=torch.rand(t, k) > 0.2)
        plans = []
        for device in ("cpu", "cuda"):
            on = {name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in kw.items()}
            plans.append(plan_permutation(experts.to(device), e, alignment=alignment, **on))
        cpu, cuda = plans
        for name in ("row_assignment_R", "row_token_R", "dest_TK", "group_sizes_E", "tokens_per_expert_E"):
            a, b = getattr(cpu, name), getattr(cuda, name).cpu()
            assert a.dtype == b.dtype and torch.equal(a, b), (name, t, e, k, alignment, kw.keys())
        for name in ("num_tokens", "num_rows", "dense_rows", "padding_rows"):
            assert getattr(cpu, name) == getattr(cuda, name), name
    if mode != "keep":  # keep with alignment 1 takes the sorted-position path
        assert kernel_plans, "the CUDA plans never took the Triton kernels"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_aligned_group_ends_kernel_equals_the_torch_ops(dtype):
    """One launch for the weight gradient's aligned ends and the 16-row check: the ends of the
    torch ops (group sizes rounded up to 128, summed) and the flag of ``(offsets % 16 == 0).all()``,
    for empty groups, one expert, ends past int16, and a misaligned end anywhere."""
    from lightning_moe.kernels.aligned_ends_triton import aligned_group_ends

    gen = torch.Generator().manual_seed(7)
    for experts in (1, 3, 128, 257):
        for misaligned in (None, 0, experts - 1):
            sizes = torch.randint(0, 200, (experts,), generator=gen) * 16
            sizes[torch.randint(0, experts, (experts // 3,), generator=gen)] = 0  # empty groups
            ends = sizes.cumsum(0)
            if misaligned is not None:
                ends[misaligned:] += 3
            offsets = ends.to(dtype).to("cuda")
            aligned, ok = aligned_group_ends(offsets, 128, 16)
            prev = torch.cat([ends.new_zeros(1), ends[:-1]])
            reference = ((ends - prev + 127) // 128 * 128).cumsum(0).to(torch.int32)
            assert aligned.dtype == torch.int32 and torch.equal(aligned.cpu(), reference)
            assert ok.item() == int(bool((ends % 16 == 0).all()))
    aligned, ok = aligned_group_ends(torch.zeros(0, dtype=dtype, device="cuda"), 128, 16)  # no experts
    assert aligned.shape == (0,) and ok.item() == 1


def test_wgrad_aligned_ends_do_the_alignment_check_for_their_offsets(count_calls):
    """On CUDA the aligned ends' kernel also issues the 16-row check, so the forward's
    `_assert_groups_aligned` on the same offsets (same version) launches nothing more; a new
    version is checked again."""
    from lightning_moe.precision import native_casts

    offsets = torch.tensor([16, 48, 48, 96], dtype=torch.int32, device="cuda")
    ends = native_casts.wgrad_aligned_ends(offsets)
    assert ends.tolist() == [128, 256, 256, 384]
    asserts = count_calls(torch, "_assert_async")
    native_casts.assert_groups_aligned(offsets)
    assert len(asserts) == 0
    offsets.add_(16)  # a new version: the torch check runs
    native_casts.assert_groups_aligned(offsets)
    assert len(asserts) == 1
