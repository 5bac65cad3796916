"""Sizes whose rows are not 16 bytes wide on CUDA: the default "grouped_mm" experts (padded
``torch._grouped_mm``, the Triton SwiGLU path included) equal the per-expert loop backend in bf16,
forward and backward (the CPU twin: tests/unit/test_unaligned_sizes.py)."""

import copy

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.nn.grouped_gemm import grouped_mm, loop_mm

pytestmark = pytest.mark.gpu

SIZES = [(32, 18), (36, 20), (30, 14), (17, 9), (520, 84)]  # (D, F): none all multiples of 8


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(layer, x, g, autocast=False):
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xx)
    y.backward(g.to(y.dtype))
    grads = {name: p.grad.float() for name, p in layer.named_parameters() if p.grad is not None}
    return y.float(), xx.grad.float(), grads


@pytest.mark.parametrize("variant", [{}, dict(expert_alignment=8, expert_capacity_factor=1.0),
                                     dict(shared_expert_intermediate_size=11, shared_expert_gate=True)],
                         ids=["plain", "padded_groups", "shared"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("d, f", SIZES)
def test_bf16_layer_matches_loop_backend(d, f, activation, variant):
    torch.manual_seed(d * 1000 + f)
    cfg = MoEConfig(hidden_size=d, ffn_hidden_size=f, num_experts=8, router_topk=2, activation=activation,
                    init_method_std=0.2, **variant)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)  # the router stays fp32, as the precision plugins keep it
    if layer.shared_experts is not None:
        layer.shared_experts.to(torch.bfloat16)
    assert layer.experts.backend == "grouped_mm"
    loop = copy.deepcopy(layer)
    loop.experts.backend = "loop"
    x = torch.randn(4, 64, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 64, d, device="cuda", dtype=torch.bfloat16)
    y, gx, grads = _run(layer, x, g)
    y_ref, gx_ref, grads_ref = _run(loop, x, g)
    assert _rel(y, y_ref) < 1e-2
    assert _rel(gx, gx_ref) < 1e-2
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert _rel(grads[name], grads_ref[name]) < (5e-2 if name.startswith("router.") else 2e-2), name


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_bf16_autocast_over_fp32_masters(activation):
    """bf16-mixed training: fp32 expert weights under autocast take the Triton master-weight
    cast, then the padding; gradients reach the fp32 masters as the loop backend's do."""
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=36, ffn_hidden_size=20, num_experts=4, router_topk=2, activation=activation,
                    init_method_std=0.2)
    layer = MoELayer(cfg).cuda()
    loop = copy.deepcopy(layer)
    loop.experts.backend = "loop"
    x = torch.randn(128, 36, device="cuda")
    g = torch.randn(128, 36, device="cuda")
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = _run(layer, x, g, autocast=True), _run(loop, x, g, autocast=True)
    assert layer.experts.fc1_weight.grad.dtype == torch.float32
    assert _rel(y, y_ref) < 1e-2 and _rel(gx, gx_ref) < 1e-2
    for name in ("experts.fc1_weight", "experts.fc2_weight"):
        assert _rel(grads[name], grads_ref[name]) < 2e-2, name


@pytest.mark.parametrize("k, n", [(18, 32), (32, 18), (17, 9), (10, 24), (2, 1)])
def test_bf16_grouped_mm_takes_unaligned_operands(k, n):
    """Any K and N (an expert-tensor-parallel shard of F included), with an empty group and zero
    rows after the groups: zero outputs and input gradients there, as on CPU."""
    torch.manual_seed(k * 100 + n)
    sizes_E = torch.tensor([50, 0, 70, 30], device="cuda")
    rows, used = 170, 150
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x[used:] = 0
    w = (torch.randn(4, k, n, device="cuda") / k**0.5).bfloat16()
    g = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    results = []
    for mm in (grouped_mm, loop_mm):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = mm(xx, ww, sizes_E)
        y.backward(g)
        results.append((y.float(), xx.grad.float(), ww.grad.float()))
    (y, gx, gw), (y_ref, gx_ref, gw_ref) = results
    assert _rel(y[:used], y_ref[:used]) < 1e-2
    assert _rel(gx[:used], gx_ref[:used]) < 1e-2
    assert _rel(gw, gw_ref) < 1e-2
    assert torch.all(y[used:] == 0) and torch.all(gx[used:] == 0) and torch.all(gw[1] == 0)


@pytest.mark.parametrize("d, f", [(36, 20), (520, 84)])
def test_te_backend_at_unaligned_sizes(d, f):
    """The Transformer Engine experts (bf16, no FP8) at such sizes equal the native backend."""
    pytest.importorskip("transformer_engine.pytorch")
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=d, ffn_hidden_size=f, num_experts=8, router_topk=2, expert_backend="grouped_mm",
                    init_method_std=0.2)
    native = MoELayer(cfg).cuda()
    native.experts.to(torch.bfloat16)
    te_layer = copy.deepcopy(native)
    te_layer.experts.backend = "te"
    x = torch.randn(256, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(256, d, device="cuda", dtype=torch.bfloat16)
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = _run(te_layer, x, g), _run(native, x, g)
    assert _rel(y, y_ref) < 1e-2 and _rel(gx, gx_ref) < 2e-2
    for name in ("experts.fc1_weight", "experts.fc2_weight"):
        assert _rel(grads[name], grads_ref[name]) < 2e-2, name
