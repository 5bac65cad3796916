"""Our Triton FP8 grouped GEMM against ``torch._scaled_grouped_mm`` (Hopper): the same bits for
the forward / data-gradient product (both accumulate each 128-deep block on the tensor cores in
the same order and scale in fp32 the same way), and the FP8 grouped layer trains identically
with the Triton kernel on and off."""

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
    from lightning_moe.precision import FP8Recipe, scaled_mm
    from lightning_moe.precision.gemm import fp8_grouped_mm

    calls = count_calls(kernels, "grouped_mm_fprop")
    recipe = FP8Recipe(recipe_name, fast_accumulation=("fprop", "dgrad", "wgrad"))
    offsets = torch.tensor([64, 64, 208, 400, 512], device="cuda", dtype=torch.int32)

    # Off: torch's grouped kernel, not the per-expert cuBLAS products (other bits) that a layer of
    # 5 experts would take without the Triton kernel.
    monkeypatch.setattr(scaled_mm, "PER_EXPERT_MAX_EXPERTS", 0)

    def run(triton_on):
        monkeypatch.setattr(scaled_mm, "TRITON_GROUPED_GEMM", triton_on)
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
    assert not calls
    on = run(True)
    assert len(calls) == 2  # the forward and the data gradient
    for a, b in zip(on, off):
        assert torch.equal(a, b)


def test_few_experts_make_no_host_sync_when_the_triton_kernel_takes_both_products(monkeypatch, host_syncs):
    """With fast accumulation in the forward and data-gradient products, a layer of <= 32 experts
    needs no host list of group ends (the weight gradient takes torch's grouped kernel)."""
    from lightning_moe.precision import FP8Recipe, scaled_mm
    from lightning_moe.precision.gemm import fp8_grouped_mm

    monkeypatch.setattr(scaled_mm, "PER_EXPERT_MAX_EXPERTS", 32)
    offsets = torch.tensor([64, 64, 208, 400], device="cuda", dtype=torch.int32)
    x = torch.randn(400, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 256, 384, device="cuda") / 16).requires_grad_(True)
    for fast, expected in [(("fprop", "dgrad", "wgrad"), 0), (("fprop", "dgrad"), 0), (("fprop",), 1)]:
        host_syncs.clear()
        offsets = offsets.clone()  # the host list is kept per offsets tensor
        y = fp8_grouped_mm(x, w, offsets, recipe=FP8Recipe("rowwise", fast_accumulation=fast), backend="torch")
        y.float().square().sum().backward()
        assert len(host_syncs) == expected, fast
