"""Our Triton FP8 grouped GEMMs against ``torch._scaled_grouped_mm`` (Hopper): the same bits for
the forward / data-gradient product and for the weight gradient on the aligned group layout
(both accumulate each 128-deep block on the tensor cores in the same order and scale in fp32 the
same way); the casts write that layout; and the FP8 grouped layer trains identically with the
Triton kernels on and off."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper (sm90) GPU"),
]


def _operands(ends, k, o, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    experts, rows = len(ends), ends[-1] + 48  # rows past the last group: never written
    a = torch.randn(rows, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = (torch.randn(experts, o, k, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    sa = torch.rand(rows, device="cuda", generator=g) + 0.5
    sb = torch.rand(experts, o, device="cuda", generator=g) + 0.5
    return a, sa, b, sb, torch.tensor(ends, device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("ends, k, o", [
    ([128, 128, 304, 496], 256, 384),        # an empty expert; O not a multiple of the 256-wide tile
    ([16], 128, 256),                        # one group smaller than a tile
    ([1040 * (e + 1) for e in range(9)], 768, 2048),
    ([96 * (e + 1) - (16 if e % 3 else 0) for e in range(40)], 2048, 768),
    ([64, 144, 144, 320], 192, 256),         # K not a multiple of the 128-deep block (zero-filled)
    ([16 * (e + 1) + 16 * (e // 7) for e in range(1000)], 128, 256),  # 1,000 experts (MAX_EXPERTS 1,024)
])
def test_forward_product_has_torchs_bits(ends, k, o):
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    a, sa, b, sb, ends_t = _operands(ends, k, o)
    ref = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=ends_t, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)
    out = grouped_mm_fprop(a, sa, b, sb, ends_t)
    valid = ends[-1]
    assert torch.equal(out[:valid], ref[:valid])
    # and against fp32 products of the dequantized operands (bf16 output, fast accumulation)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            exact = (a[start:end].float() @ b[e].float().t()) * sa[start:end, None] * sb[e][None]
            assert float((out[start:end].float() - exact).norm() / exact.norm()) < 4e-3
        start = end


def test_offsets_past_the_rows_never_write_outside_the_output():
    """Group ends beyond ``R`` (a caller's bug) are clamped: the rows that exist are computed, and
    the rows of a larger buffer after the output stay untouched."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    a, sa, b, sb, _ = _operands([256, 512], 256, 256)
    a, sa = a[:400], sa[:400]
    ends = torch.tensor([256, 512], device="cuda", dtype=torch.int32)  # ends at 512 > R = 400
    buffer = torch.full((528, 256), 7.0, device="cuda", dtype=torch.bfloat16)
    out = grouped_mm_fprop(a, sa, b, sb, ends, out=buffer[:400])
    clamped = torch.tensor([256, 400], device="cuda", dtype=torch.int32)
    ref = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=clamped, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(out, ref)
    assert (buffer[400:] == 7.0).all()


def test_launch_configurations_agree():
    """Tile shape and pipeline depth change neither the tiles' order of accumulation nor the bits."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    a, sa, b, sb, ends = _operands([200, 200, 560, 1024], 512, 512, seed=1)
    base = grouped_mm_fprop(a, sa, b, sb, ends)[:1024]
    for bm, bn, warps, stages, programs in [(128, 128, 4, 4, None), (64, 256, 4, 3, 7), (256, 128, 8, 3, 1)]:
        out = grouped_mm_fprop(a, sa, b, sb, ends, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                               programs=programs)
        assert torch.equal(out[:1024], base)


@pytest.mark.parametrize("recipe_name", ["rowwise", "delayed"])
def test_grouped_layer_trains_identically_with_the_triton_kernel(monkeypatch, count_calls, recipe_name):
    import lightning_moe.kernels.fp8_grouped_gemm_triton as kernels
    from lightning_moe.precision import FP8Recipe, native_gemms
    from lightning_moe.precision.gemm import fp8_grouped_mm

    calls = count_calls(kernels, "grouped_mm_fprop")
    wgrad_calls = count_calls(kernels, "grouped_mm_wgrad")
    recipe = FP8Recipe(recipe_name, fast_accumulation=("fprop", "dgrad", "wgrad"))
    offsets = torch.tensor([64, 64, 208, 400, 512], device="cuda", dtype=torch.int32)

    # Off: torch's grouped kernel, not the per-expert cuBLAS products (other bits) that a layer of
    # 5 experts would take without the Triton kernel.
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 0)

    def run(triton_on):
        monkeypatch.setattr(native_gemms, "TRITON_GROUPED_GEMM", triton_on)
        torch.manual_seed(0)
        x = torch.randn(528, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(5, 256, 384, device="cuda") / 16).requires_grad_(True)
        from lightning_moe.precision.delayed import DelayedState

        # no history yet: each operand's scale comes from its own amax (5 groups)
        state = (DelayedState(torch.zeros(4, 3, 5, device="cuda"), torch.zeros(3, 5, device="cuda"))
                 if recipe_name == "delayed" else None)
        kwargs = {"state": state} if state is not None else {}
        y = fp8_grouped_mm(x, w, offsets, recipe=recipe, backend="torch", **kwargs)
        y[:512].float().square().sum().backward()
        return y[:512], x.grad[:512], w.grad

    off = run(False)
    assert not calls and not wgrad_calls
    on = run(True)
    assert len(calls) == 2 and len(wgrad_calls) == 1  # the forward and the data gradient; the weight gradient
    for a, b in zip(on[:2], off[:2]):
        assert torch.equal(a, b)
    # fp32 weights: our kernel writes their gradient in fp32, torch's grouped kernel in bf16 (widened after)
    assert on[2].dtype == off[2].dtype == torch.float32
    assert torch.equal(on[2].to(torch.bfloat16), off[2].to(torch.bfloat16))
    assert not torch.equal(on[2], off[2])  # the fp32 gradient keeps bits bf16 drops


def test_few_experts_make_no_host_sync_in_any_accumulation_mode(monkeypatch, host_syncs):
    """A layer of <= 32 experts needs no host list of group ends whichever products use fast
    accumulation: our kernel takes all three, fast or split (``max_num_imprecise_acc``)."""
    from lightning_moe.precision import FP8Recipe, native_gemms
    from lightning_moe.precision.gemm import fp8_grouped_mm

    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 32)
    offsets = torch.tensor([64, 64, 208, 400], device="cuda", dtype=torch.int32)
    x = torch.randn(400, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 256, 384, device="cuda") / 16).requires_grad_(True)
    for fast in [("fprop", "dgrad", "wgrad"), ("fprop", "dgrad"), ("fprop",), ()]:
        host_syncs.clear()
        offsets = offsets.clone()  # the host list is kept per offsets tensor
        y = fp8_grouped_mm(x, w, offsets, recipe=FP8Recipe("rowwise", fast_accumulation=fast), backend="torch")
        y.float().square().sum().backward()
        assert len(host_syncs) == 0, fast


def _in_aligned_layout(t_MR, ends, aligned_ends):
    """``t [M, R]`` (groups ending at ``ends``) copied into the aligned group layout, zero gaps."""
    out = torch.zeros(t_MR.shape[0], aligned_ends[-1], dtype=t_MR.dtype, device=t_MR.device)
    start = aligned = 0
    for end, aligned_end in zip(ends, aligned_ends):
        out[:, aligned:aligned + end - start] = t_MR[:, start:end]
        start, aligned = end, aligned_end
    return out


def _wgrad_operands(ends, m, n, seed=0):
    from lightning_moe.precision.native_casts import wgrad_aligned_ends

    g = torch.Generator(device="cuda").manual_seed(seed)
    experts, rows = len(ends), ends[-1] + 16  # a padding column past the last group: never read
    a = torch.randn(m, rows, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, rows, device="cuda", generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(experts, m, device="cuda", generator=g) + 0.5
    sb = torch.rand(experts, n, device="cuda", generator=g) + 0.5
    ends_t = torch.tensor(ends, device="cuda", dtype=torch.int32)
    aligned_ends = wgrad_aligned_ends(ends_t)
    host_aligned = aligned_ends.tolist()
    return (a, sa, b, sb, ends_t, _in_aligned_layout(a, ends, host_aligned), _in_aligned_layout(b, ends, host_aligned),
            aligned_ends)


@pytest.mark.parametrize("ends, m, n", [
    ([128, 128, 304, 496], 256, 384),        # an empty expert; N not a multiple of the 256-wide tile
    ([16], 128, 256),                        # one group smaller than a contraction block
    ([1040 * (e + 1) for e in range(9)], 768, 2048),
    ([96 * (e + 1) - (16 if e % 3 else 0) for e in range(40)], 192, 320),  # M, N not multiples of the tile
])
def test_weight_gradient_has_torchs_bits(ends, m, n):
    """`grouped_mm_wgrad` on the aligned layout: torch's 2-D x 2-D product on the 16-aligned one,
    bit for bit; an expert without tokens gets zeros; and close to fp32 products."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

    a, sa, b, sb, ends_t, a_aligned, b_aligned, aligned_ends = _wgrad_operands(ends, m, n)
    ref = torch._scaled_grouped_mm(a, b.t(), sa.reshape(-1), sb.reshape(-1), offs=ends_t, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)
    out = grouped_mm_wgrad(a_aligned, sa, b_aligned, sb, aligned_ends)
    out32 = grouped_mm_wgrad(a_aligned, sa, b_aligned, sb, aligned_ends, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and out32.dtype == torch.float32
    # the fp32 output is the value the bf16 output rounds (to nearest even)
    assert torch.equal(out32.to(torch.bfloat16), out)
    start = 0
    for e, end in enumerate(ends):
        if end == start:
            assert (out[e] == 0).all() and (out32[e] == 0).all()
        else:
            assert torch.equal(out[e], ref[e]), e
            exact = (a[:, start:end].float() @ b[:, start:end].float().t()) * sa[e][:, None] * sb[e][None]
            error = float((out[e].float() - exact).norm() / exact.norm())
            error32 = float((out32[e] - exact).norm() / exact.norm())
            assert error < 4e-3 and error32 < error, (error, error32)
        start = end


def test_weight_gradient_launch_configurations_agree():
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

    _, sa, _, sb, _, a, b, aligned_ends = _wgrad_operands([200 // 16 * 16, 208, 560, 1024], 384, 512, seed=1)
    base = grouped_mm_wgrad(a, sa, b, sb, aligned_ends)
    for bm, bn, bk, warps, stages, programs in [(128, 128, 128, 4, 4, None), (256, 128, 128, 8, 3, 7),
                                                (128, 256, 64, 8, 4, 1)]:
        out = grouped_mm_wgrad(a, sa, b, sb, aligned_ends, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                               num_stages=stages, programs=programs)
        assert torch.equal(out, base)


@pytest.mark.parametrize("ends, m, n", [
    ([128, 128, 304, 496], 256, 384),
    ([96 * (e + 1) - (16 if e % 3 else 0) for e in range(40)], 192, 320),  # M, N not multiples of the tile
])
@pytest.mark.parametrize("out_dtype, stages", [(torch.bfloat16, 4), (torch.float32, 3)])
@pytest.mark.parametrize("store_halves, columns_first", [(True, False), (False, False), (False, True)])
def test_weight_gradient_tiles_stored_by_tma_are_the_same(ends, m, n, out_dtype, stages, store_halves, columns_first):
    """`grouped_mm_wgrad(tma_store=True)`: the same output as the plain stores, the tiles that
    cross the expert's or the output's bounds clipped by the descriptor (nothing written into the
    next expert), in halves or whole, dealt down the columns or along the rows first; rows that
    are no multiple of 16 bytes are refused."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

    _, sa, _, sb, _, a, b, aligned_ends = _wgrad_operands(ends, m, n)
    plain = grouped_mm_wgrad(a, sa, b, sb, aligned_ends, out_dtype=out_dtype)
    # a whole 128 x 256 bf16 tile's staging leaves room for 3 operand stages: the wrapper's rule picks them
    stored = grouped_mm_wgrad(a, sa, b, sb, aligned_ends, out_dtype=out_dtype, tma_store=True,
                              num_stages=stages if store_halves else None, store_halves=store_halves,
                              columns_first=columns_first)
    assert torch.equal(stored, plain)
    with pytest.raises(ValueError, match="multiple of 16"):
        grouped_mm_wgrad(a, sa, b[:100 - 3], sb[:, :100 - 3].contiguous(), aligned_ends, tma_store=True)


def _relative_error(got, exact):
    return float((got.float() - exact).norm() / exact.norm())


@pytest.mark.parametrize("ends, k, o", [
    ([1040 * (e + 1) for e in range(9)], 768, 2048),
    ([512, 1536], 8192, 256),  # a long contraction, where the accumulators differ most
])
def test_split_accumulation_forward_product(ends, k, o):
    """``precise=True`` (the recipe's split accumulation): close to torch's split-accumulation
    kernel, and at least as close to fp32 products as fast accumulation."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    a, sa, b, sb, ends_t = _operands(ends, k, o, seed=2)
    split_ref = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=ends_t, out_dtype=torch.bfloat16,
                                         use_fast_accum=False)
    precise = grouped_mm_fprop(a, sa, b, sb, ends_t, precise=True)
    fast = grouped_mm_fprop(a, sa, b, sb, ends_t)
    start = 0
    for e, end in enumerate(ends):
        exact = (a[start:end].float() @ b[e].float().t()) * sa[start:end, None] * sb[e][None]
        assert _relative_error(precise[start:end], split_ref[start:end].float()) < 2e-3
        assert _relative_error(precise[start:end], exact) <= _relative_error(fast[start:end], exact) * 1.001 + 1e-5
        start = end


@pytest.mark.parametrize("ends, m, n", [
    ([1040 * (e + 1) for e in range(9)], 768, 2048),
    ([8192, 8192 + 4096], 256, 384),  # thousands of tokens per expert: the contraction of a weight gradient
])
def test_split_accumulation_weight_gradient(ends, m, n):
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

    a, sa, b, sb, ends_t, a_aligned, b_aligned, aligned_ends = _wgrad_operands(ends, m, n)
    split_ref = torch._scaled_grouped_mm(a, b.t(), sa.reshape(-1), sb.reshape(-1), offs=ends_t,
                                         out_dtype=torch.bfloat16, use_fast_accum=False)
    precise = grouped_mm_wgrad(a_aligned, sa, b_aligned, sb, aligned_ends, out_dtype=torch.float32, precise=True)
    fast = grouped_mm_wgrad(a_aligned, sa, b_aligned, sb, aligned_ends, out_dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends):
        exact = (a[:, start:end].float() @ b[:, start:end].float().t()) * sa[e][:, None] * sb[e][None]
        assert _relative_error(precise[e], split_ref[e].float()) < 2e-3
        assert _relative_error(precise[e], exact) <= _relative_error(fast[e], exact) * 1.001 + 1e-6
        start = end


@pytest.mark.parametrize("large_experts_on_torch", [False, True])
def test_grouped_layer_with_the_default_recipe_takes_the_triton_kernels(monkeypatch, large_experts_on_torch):
    """FP8Recipe's default (fast forward, split data and weight gradients) runs all three grouped
    products on the Triton kernels, the gradients with split accumulation; with experts counted large
    (`SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS`) the split data gradient runs on torch's grouped
    kernel, with the same data gradient."""
    import lightning_moe.kernels.fp8_grouped_gemm_triton as kernels
    from lightning_moe.precision import FP8Recipe, native_gemms
    from lightning_moe.precision.gemm import fp8_grouped_mm

    monkeypatch.setattr(native_gemms, "SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS",
                        1 if large_experts_on_torch else 1 << 62)

    def logged(name):
        calls, real = [], getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, **k: calls.append((a, k)) or real(*a, **k))
        return calls

    calls, wgrad_calls = logged("grouped_mm_fprop"), logged("grouped_mm_wgrad")
    offsets = torch.tensor([64, 64, 208, 400, 512], device="cuda", dtype=torch.int32)
    x = torch.randn(528, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5, 256, 384, device="cuda") / 16).requires_grad_(True)
    y = fp8_grouped_mm(x, w, offsets, recipe=FP8Recipe("rowwise"), backend="torch")
    y[:512].float().square().sum().backward()
    assert [c[1].get("precise", False) for c in calls] == ([False] if large_experts_on_torch else [False, True])
    assert len(wgrad_calls) == 1 and wgrad_calls[0][1].get("precise") is True
    if large_experts_on_torch:  # the same split sums as ours: the data gradient of the all-Triton run
        x_grad = x.grad[:512].clone()
        monkeypatch.setattr(native_gemms, "SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS", 1 << 62)
        x.grad = None
        y = fp8_grouped_mm(x, w, offsets, recipe=FP8Recipe("rowwise"), backend="torch")
        y[:512].float().square().sum().backward()
        torch.testing.assert_close(x.grad[:512], x_grad, rtol=0, atol=0)


@pytest.mark.parametrize("groups", ["uneven", "full"])
@pytest.mark.parametrize("kind", ["delayed", "swiglu", "gather", "rowwise"])
def test_casts_write_the_aligned_group_layout(kind, groups):
    """Each cast that makes a weight-gradient operand writes, with ``aligned_ends``, the same bytes
    as into the 16-aligned layout, each group moved to its aligned start, and zeros up to its
    aligned end, over a buffer filled with other bytes that stay past the last aligned end; the
    scales are the same. "full": groups of 16 rows and no tail, whose aligned layout fills the
    buffer to its last column."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize
    from lightning_moe.precision.native_casts import transposed_out, wgrad_aligned_ends

    torch.manual_seed(0)
    if groups == "uneven":
        rows, cols, tokens = 700, 200, 300
        ends = [0, 48, 48, 352, 688]  # an empty first group, an empty middle one; rows 688.. are the tail
    else:
        rows, cols, tokens = 80, 200, 30
        ends = [16, 32, 48, 64, 80]
    offsets = torch.tensor(ends, device="cuda", dtype=torch.int32)
    aligned_ends = wgrad_aligned_ends(offsets)
    scale = torch.tensor([0.0, 2.0, 0.0, 0.5, 0.0], device="cuda")
    x = torch.randn(tokens if kind == "gather" else rows, 2 * cols if kind == "swiglu" else cols, device="cuda",
                    dtype=torch.bfloat16) * 3
    gather = torch.randint(0, tokens + 1, (rows,), device="cuda") if kind == "gather" else None

    def cast(out_col, aligned):
        if kind == "rowwise":
            return dual_quantize(x, offsets, out_col, out_col.shape[1], 0, aligned_ends=aligned)
        return delayed_cast(x, offsets, scale, torch.zeros(5, device="cuda"), out_col=out_col,
                            stride_out_col=out_col.shape[1], swiglu=kind == "swiglu", gather_rows=gather,
                            aligned_ends=aligned)

    plain = torch.zeros(cols, -(-rows // 16) * 16, device="cuda", dtype=torch.float8_e4m3fn)
    ref = cast(plain, None)
    aligned = transposed_out(x, cols, rows=rows, aligned_groups=len(ends))
    aligned.view(torch.uint8).fill_(0x55)
    got = cast(aligned, aligned_ends)
    for r, g in zip(ref, got):
        assert torch.equal(r.view(torch.uint8) if r.dtype == torch.float8_e4m3fn else r,
                           g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g)
    start = aligned_start = 0
    for end, aligned_end in zip(ends, aligned_ends.tolist()):
        moved = aligned[:, aligned_start:aligned_start + end - start].view(torch.uint8)
        assert torch.equal(moved, plain[:, start:end].view(torch.uint8))
        assert (aligned[:, aligned_start + end - start:aligned_end].view(torch.uint8) == 0).all()
        start, aligned_start = end, aligned_end
    assert (aligned[:, aligned_start:].view(torch.uint8) == 0x55).all()  # nothing written past the layout
    assert groups == "uneven" or aligned_start == aligned.shape[1]
