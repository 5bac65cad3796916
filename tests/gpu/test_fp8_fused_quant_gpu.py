"""The fused Triton FP8 quantizers equal the generic tile quantizer bit for bit, and the native
FP8 GEMMs give bit-identical results with either (rowwise recipe, CUDA)."""

import pytest
import torch
from _float8 import same_bits

from lightning_moe.precision.formats import E4M3
from lightning_moe.precision.operands import Layout, quantize_operand
from lightning_moe.precision.recipes import FP8Recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]
ROWWISE = FP8Recipe.of("rowwise")



def _awkward(rows, cols, dtype):
    x = torch.randn(rows, cols, device="cuda", dtype=dtype) * torch.logspace(-6, 4, rows, device="cuda")[:, None].to(dtype)
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 5] = float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_quantize_is_bit_exact(dtype):
    from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

    x = _awkward(37, 3000, dtype)
    q, scale_inv = rowwise_quantize(x)
    q_ref, s_ref, _, _ = quantize_operand(x, ROWWISE, "input", native=True, fmt=E4M3)
    assert torch.equal(scale_inv, s_ref[:, 0])
    assert same_bits(q, q_ref)


def test_both_copies_of_an_operand_are_bit_exact():
    from lightning_moe.precision.native_casts import fused_both, per_group_rows

    x = _awkward(200, 96, torch.bfloat16)
    offsets = torch.tensor([48, 48, 160, 192], device="cuda", dtype=torch.int32)  # one empty group, 8 rows after
    q, s, q_t, s_t = fused_both(x, offsets)
    q_ref, s_ref, _, _ = quantize_operand(x, ROWWISE, "input", native=True, fmt=E4M3)
    assert torch.equal(s, s_ref[:, 0]) and same_bits(q, q_ref)  # every row, also those past the last group
    q_ref, s_ref, rows, _ = quantize_operand(x[:192].t(), ROWWISE, "input", Layout(col_offsets=offsets), None, True, E4M3)
    assert torch.equal(s_t, per_group_rows(s_ref, rows, 4))
    assert q_t.shape == (96, 208) and not q_t[:, 200:].view(torch.uint8).any()  # tokens padded to 16 with zeros
    assert same_bits(q_t[:, :192], q_ref)


def test_both_copies_with_many_uneven_groups():
    """Many groups of uneven size, some larger than a tile, empty ones (also first and last) and
    rows past the last group, against the generic quantizer."""
    from lightning_moe.precision.native_casts import fused_both, per_group_rows

    torch.manual_seed(0)
    sizes = torch.randint(0, 150, (40,))
    sizes[0] = sizes[17] = sizes[-1] = 0
    sizes[5] = 700
    offsets = sizes.cumsum(0).to(device="cuda", dtype=torch.int32)
    used = int(offsets[-1])
    x = _awkward(used + 21, 272, torch.bfloat16)
    q, s, q_t, s_t = fused_both(x, offsets)
    q_ref, s_ref, _, _ = quantize_operand(x, ROWWISE, "input", native=True, fmt=E4M3)
    assert torch.equal(s, s_ref[:, 0]) and same_bits(q, q_ref)
    q_ref, s_ref, rows, _ = quantize_operand(x[:used].t(), ROWWISE, "input", Layout(col_offsets=offsets), None, True,
                                             E4M3)
    assert torch.equal(s_t, per_group_rows(s_ref, rows, 40))
    assert same_bits(q_t[:, :used], q_ref)


def test_both_weight_layouts_are_bit_exact():
    from lightning_moe.precision.native_casts import fused_weight_both, per_row

    w = torch.randn(4, 64, 48, device="cuda")
    w[1, 3, 5] = 0.0
    w[2] = 0.0  # an all-zero expert: scale 1
    q_fprop, s_fprop, q_dgrad, s_dgrad = fused_weight_both(w)
    q_ref, s_ref, rows, _ = quantize_operand(w.transpose(1, 2).reshape(4 * 48, 64), ROWWISE, "weight",
                                             Layout(batch=4), None, True, E4M3)
    assert torch.equal(s_fprop, per_row(s_ref, rows).view(4, 48))
    assert same_bits(q_fprop.reshape(4 * 48, 64), q_ref)
    q_ref, s_ref, rows, _ = quantize_operand(w.reshape(4 * 64, 48), ROWWISE, "weight", Layout(batch=4), None, True, E4M3)
    assert torch.equal(s_dgrad, per_row(s_ref, rows))
    assert same_bits(q_dgrad, q_ref)


def test_dual_quantizer_equals_the_two_single_quantizers():
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize, group_column_quantize, rowwise_quantize

    x = _awkward(700, 300, torch.bfloat16)  # column and row counts off the tile sizes
    offsets = torch.tensor([0, 130, 130, 512, 690], device="cuda", dtype=torch.int32)
    out, out_ref = (torch.zeros(300, 704, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2))
    q, s, s_col = dual_quantize(x, offsets, out, 704, 0)
    q_ref, s_ref = rowwise_quantize(x)
    s_col_ref = group_column_quantize(x, offsets, out_ref, 704, 0)
    assert torch.equal(s, s_ref) and torch.equal(s_col, s_col_ref)
    assert same_bits(q, q_ref) and same_bits(out, out_ref)


def _run(fn, inputs):
    for t in inputs:
        t.grad = None
    y = fn()
    y.float().square().sum().backward()
    return [y] + [t.grad for t in inputs]


def test_gemms_identical_with_fused_and_generic_quantizers(monkeypatch):
    """The quantizers compared, on torch's GEMMs (our Triton grouped kernels give the fused path's fp32
    weight gradient unrounded by design: test_fp8_grouped_triton_gpu.py)."""
    from lightning_moe.precision import native_gemms, scaled_mm
    from lightning_moe.precision.gemm import fp8_grouped_mm, fp8_linear

    monkeypatch.setattr(native_gemms, "TRITON_GROUPED_GEMM", False)

    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_grouped = torch.randn(4, 256, 128, device="cuda", requires_grad=True)
    offsets = torch.tensor([128, 128, 384, 512], device="cuda", dtype=torch.int32)
    w_dense = torch.randn(128, 256, device="cuda", requires_grad=True)
    cases = {
        "grouped": (lambda: fp8_grouped_mm(x, w_grouped, offsets, "rowwise", backend="torch"), [x, w_grouped]),
        "dense": (lambda: fp8_linear(x, w_dense, "rowwise", backend="torch"), [x, w_dense]),
    }
    for name, (fn, inputs) in cases.items():
        fused = _run(fn, inputs)
        with monkeypatch.context() as m:
            m.setattr(scaled_mm, "fused_rowwise", lambda *args: False)
            generic = _run(fn, inputs)
        for a, b in zip(fused, generic):
            assert torch.equal(a, b), name


def test_evaluation_makes_only_the_forward_copy(monkeypatch):
    """Without a backward to come (no_grad), activations get their rowwise copy only and weights
    their forward layout only; the forward's result is the same bits as in training."""
    from lightning_moe.kernels import fp8_quant_triton
    from lightning_moe.precision.gemm import fp8_grouped_mm, fp8_linear

    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_grouped = torch.randn(4, 256, 128, device="cuda", requires_grad=True)
    w_dense = torch.randn(128, 256, device="cuda", requires_grad=True)
    offsets = torch.tensor([128, 128, 384, 512], device="cuda", dtype=torch.int32)
    calls = []
    dual = fp8_quant_triton.dual_quantize
    monkeypatch.setattr(fp8_quant_triton, "dual_quantize", lambda *a, **k: calls.append(1) or dual(*a, **k))

    def forward():
        return (fp8_grouped_mm(x, w_grouped, offsets, "rowwise", backend="torch"),
                fp8_linear(x, w_dense, "rowwise", backend="torch"))

    training = forward()
    # x for the grouped GEMM, and the grouped weight's two layouts at once (quantize_weights_once);
    # dense operands (one group) take the single quantizers
    assert len(calls) == 2
    with torch.no_grad():
        evaluation = forward()
    assert len(calls) == 2
    for a, b in zip(training, evaluation):
        assert torch.equal(a, b)
