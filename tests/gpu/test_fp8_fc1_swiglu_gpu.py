"""fc2's FP8 input cast in the epilogue of fc1's grouped GEMM (`kernels.fp8_fc1_swiglu_triton`,
`scaled_mm._SwiGLUCastAhead`): the kernel writes the bytes of `grouped_mm_fprop` then the SwiGLU
cast, and the MoE layer's steps are the same bits with it on and off."""

from __future__ import annotations

import pytest
import torch
from _float8 import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]

# the library's (transposed tiles by TMA where aligned), its transposed tiles by pointers, other tiles
# (64 rows: a gap past a group's last TMA tile to zero)
LAUNCHES = [dict(), dict(col_tma=False), dict(block_m=128, block_f=64, num_warps=8, num_stages=4),
            dict(block_m=64, block_f=128, num_warps=4, num_stages=3)]


@pytest.mark.parametrize("launch", range(len(LAUNCHES)))
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_epilogue_cast_writes_the_bytes_of_the_product_then_the_cast(launch, aligned, weighted):
    """40 experts in 16-row groups (an empty one), scales positive, 0 and NaN (the latter cast after
    the GEMM from their current amax), rows past the last group, 320 SwiGLU columns (a partial column
    block), NaN and inf in ``h``: ``h``, both float8 copies, their scales and the amax record equal
    those of `grouped_mm_fprop` then `delayed_cast(h, ..., swiglu=True)`."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.fp8_fc1_swiglu_triton import grouped_mm_fprop_swiglu_cast
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop
    from lightning_moe.precision.scaled_mm import _transposed_out, _wgrad_aligned_ends

    gen = torch.Generator("cuda").manual_seed(launch + 3 * aligned + 7 * weighted)
    experts, k, f = 40, 512, 320
    sizes = torch.randint(0, 40, (experts,), device="cuda", generator=gen) * 16
    sizes[3] = 0
    ends = sizes.cumsum(0).to(torch.int32)
    rows = int(ends[-1]) + 48  # host sync: the test's sizes
    a = (torch.randn(rows, k, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(experts, 2 * f, k, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    sa = torch.rand(rows, device="cuda", generator=gen) * 0.02 + 0.005
    sb = torch.rand(experts, 2 * f, device="cuda", generator=gen) * 0.02 + 0.005
    sa[int(ends[0]) + 1] = float("inf")  # a row of h with inf and NaN
    scales = torch.rand(experts, device="cuda", generator=gen) * 4 + 0.1
    scales[::5], scales[1::7] = 0.0, float("nan")
    probs = torch.rand(rows, device="cuda", generator=gen) if weighted else None
    aligned_ends = _wgrad_aligned_ends(ends) if aligned else None
    groups = experts if aligned else 0
    end = rows - 48

    h_ref = grouped_mm_fprop(a, sa, b, sb, ends)
    col_ref = _transposed_out(h_ref, f, aligned_groups=groups)
    col_ref.view(torch.uint8).fill_(0x55)
    record_ref = torch.zeros(experts, device="cuda")
    q_ref, s_row_ref, s_col_ref = delayed_cast(h_ref, ends, scales, record_ref, out_col=col_ref,
                                               stride_out_col=col_ref.shape[1], swiglu=True,
                                               aligned_ends=aligned_ends, row_probs=probs)
    col = torch.full_like(col_ref.view(torch.uint8), 0x55).view(torch.float8_e4m3fn)
    record = torch.zeros(experts, device="cuda")
    h, q, s_row, s_col = grouped_mm_fprop_swiglu_cast(a, sa, b, sb, ends, scales, record, col,
                                                      aligned_ends=aligned_ends, row_probs=probs,
                                                      **LAUNCHES[launch])
    assert torch.equal(h[:end].view(torch.int16), h_ref[:end].view(torch.int16))
    assert same_bits(q[:end], q_ref[:end]) and same_bits(col, col_ref)
    assert torch.equal(s_row[:end], s_row_ref[:end]) and torch.equal(s_col, s_col_ref)
    assert torch.equal(record, record_ref)


def _layer_steps(monkeypatch, epilogue_cast: bool, steps: int = 3, master_fp32: bool = False) -> list:
    """Outputs, gradients and the amax histories of ``steps`` FP8-delayed MoE layer steps (a scale
    update after each), with fc2's input cast in fc1's epilogue or not."""
    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.precision import FP8Precision
    from lightning_moe.precision.delayed import delayed_state, update_delayed_scaling

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=384, num_experts=40, router_topk=4, expert_alignment=16)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.float32 if master_fp32 else torch.bfloat16)
    plugin = FP8Precision(recipe="delayed", backend="torch")
    plugin.convert_module(layer)
    results = []
    with monkeypatch.context() as m:
        m.setenv("LIGHTNING_MOE_FC1_SWIGLU_CAST", "1" if epilogue_cast else "0")
        for step in range(steps):
            x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, generator=None).requires_grad_(True)
            with plugin.forward_context():
                y = layer(x)
            y.float().square().mean().backward()
            results += [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad(set_to_none=True)
            update_delayed_scaling(plugin._delayed_modules, plugin.recipe, None)
            results.append(delayed_state(layer.experts.quantization).amax_history.clone())
    return results


@pytest.mark.parametrize("master_fp32", [False, True])
def test_layer_steps_are_the_same_bits_with_the_epilogue_cast(monkeypatch, count_calls, master_fp32):
    """Three steps of the MoE layer (FP8 delayed, the combine in the experts): the first has no
    scales (the unfused cast's amax pre-pass), the others cast fc2's input in fc1's epilogue; every
    output, gradient and amax history equals the run without it."""
    from lightning_moe.kernels import fp8_fc1_swiglu_triton

    calls = count_calls(fp8_fc1_swiglu_triton, "grouped_mm_fprop_swiglu_cast")
    with_epilogue = _layer_steps(monkeypatch, True, master_fp32=master_fp32)
    assert len(calls) == 2  # steps 2 and 3
    without = _layer_steps(monkeypatch, False, master_fp32=master_fp32)
    assert len(calls) == 2
    assert len(with_epilogue) == len(without)
    for i, (a, b) in enumerate(zip(with_epilogue, without)):
        assert a.shape == b.shape and torch.equal(a, b), i
