"""Sizes whose rows are not 16 bytes wide run on every expert backend.

``torch._grouped_mm`` needs 16-byte row strides on both operands (K and N a multiple of 4
elements in fp32, of 8 in bf16 / fp16); `MoEConfig` accepts any positive sizes, and expert
tensor parallelism splits F further. The "grouped_mm" backend pads such operands; every backend
must equal the per-expert "loop" backend (and the naive per-token reference), forward and
backward, with the padding rows after the groups keeping their meaning.
"""

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.nn.grouped_gemm import grouped_mm, loop_mm
from lightning_moe.nn.reference import naive_moe_forward

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SIZES = [(32, 18), (36, 20), (30, 14), (17, 9)]  # (D, F): none of them all-aligned in bf16
ACTIVATIONS = ["swiglu", "gelu", "relu", "squared_relu"]
BACKENDS = ["grouped_mm", "loop", "auto"]


def _close(actual, expected, dtype, msg=""):
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=msg)


def _operand_grads(mm, x_RK, w_EKN, sizes_E, g_RN):
    x_RK = x_RK.detach().clone().requires_grad_(True)
    w_EKN = w_EKN.detach().clone().requires_grad_(True)
    y_RN = mm(x_RK, w_EKN, sizes_E)
    y_RN.backward(g_RN)
    return y_RN.detach(), x_RK.grad, w_EKN.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, n", [(18, 32), (32, 18), (17, 9), (30, 14), (36, 20), (4, 6), (2, 1)])
def test_grouped_mm_takes_unaligned_operands(dtype, k, n):
    """Any K and N (an ETP shard of F included): an empty group, and padding rows after the
    groups that come out zero in the output and in the input gradient."""
    gen = torch.Generator().manual_seed(k * 100 + n)
    sizes_E = torch.tensor([5, 0, 7, 3])
    rows, used = 21, 15
    x_RK = torch.randn(rows, k, generator=gen).to(dtype)
    x_RK[used:] = 0
    w_EKN = (torch.randn(4, k, n, generator=gen) / k**0.5).to(dtype)
    g_RN = torch.randn(rows, n, generator=gen).to(dtype)
    y, gx, gw = _operand_grads(grouped_mm, x_RK, w_EKN, sizes_E, g_RN)
    y_ref, gx_ref, gw_ref = _operand_grads(loop_mm, x_RK, w_EKN, sizes_E, g_RN)
    assert y.shape == (rows, n) and gx.shape == x_RK.shape and gw.shape == w_EKN.shape
    _close(y, y_ref, dtype, "output")
    _close(gx[:used], gx_ref[:used], dtype, "input gradient")
    _close(gw, gw_ref, dtype, "weight gradient")
    assert torch.all(y[used:] == 0) and torch.all(gx[used:] == 0)
    assert torch.all(gw[1] == 0)  # the empty group's weight


def test_unaligned_grouped_mm_is_sync_free(monkeypatch):
    """The padding adds no host sync (no ``tolist`` / ``item``)."""
    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    x_RK = torch.randn(12, 18, requires_grad=True)
    w_EKN = torch.randn(3, 18, 9, requires_grad=True)
    sizes_E = torch.tensor([4, 0, 6])
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    grouped_mm(x_RK, w_EKN, sizes_E).sum().backward()
    assert x_RK.grad is not None and w_EKN.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_aligned_operands_reach_the_kernel_as_they_are(monkeypatch, dtype):
    """No padding copy where the sizes are aligned: the caller's tensors go to ``torch._grouped_mm``."""
    seen = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, **kw: seen.append((a, b)) or real(a, b, **kw))
    x_RK = torch.randn(12, 16, dtype=dtype)
    w_EKN = torch.randn(3, 16, 24, dtype=dtype)
    grouped_mm(x_RK, w_EKN, torch.tensor([4, 0, 6]))
    (a, b), = seen
    assert a.data_ptr() == x_RK.data_ptr() and b.data_ptr() == w_EKN.data_ptr()


def _layer(d, f, activation, backend, dtype, **overrides):
    torch.manual_seed(d * 1000 + f)
    cfg = MoEConfig(hidden_size=d, ffn_hidden_size=f, num_experts=4, router_topk=2, activation=activation,
                    expert_backend=backend, init_method_std=0.2, **overrides)
    layer = MoELayer(cfg)
    if dtype == torch.float64:
        return layer.to(dtype)
    layer.experts.to(dtype)  # the router stays fp32, as the precision plugins keep it
    if layer.shared_experts is not None:
        layer.shared_experts.to(dtype)
    return layer


def _layer_grads(layer, x, forward):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = forward(layer, x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    y.backward(g)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


VARIANTS = {
    "plain": {},
    # shared experts of another unaligned width, gated
    "shared": dict(shared_expert_intermediate_size=11, shared_expert_gate=True),
    # groups padded to 8 rows: padding rows inside the groups and after the last one, and drops
    "padded": dict(expert_alignment=8, expert_capacity_factor=1.0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("d, f", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_matches_loop_backend(dtype, d, f, activation, backend, variant):
    layer = _layer(d, f, activation, backend, dtype, **VARIANTS[variant])
    x = torch.randn(16, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    y, gx, grads = _layer_grads(layer, x, lambda m, a: m(a))
    layer.experts.backend = "loop"
    y_ref, gx_ref, grads_ref = _layer_grads(layer, x, lambda m, a: m(a))
    _close(y, y_ref, dtype, "output")
    _close(gx, gx_ref, dtype, "input gradient")
    assert grads.keys() == grads_ref.keys()
    assert {"router.weight", "experts.fc1_weight", "experts.fc2_weight"} <= grads.keys()
    for name in grads:
        _close(grads[name], grads_ref[name], dtype, name)
    if dtype in (torch.float32, torch.float64):  # the per-token definition, where it is exact enough
        y_naive, gx_naive, grads_naive = _layer_grads(layer, x, naive_moe_forward)
        _close(y, y_naive, dtype, "output against the naive reference")
        _close(gx, gx_naive, dtype, "input gradient against the naive reference")
        for name in grads:
            _close(grads[name], grads_naive[name], dtype, f"{name} against the naive reference")


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_unwritten_tail_is_never_read_at_unaligned_sizes(dtype, activation):
    """``tail_unwritten=True`` (the all-gather dispatcher's buffer) at D=18, F=9: NaN in the rows
    after the groups, in the input and the output's gradient, reaches neither the grouped rows
    nor the weight gradients; those equal the loop backend's on a zero tail."""
    torch.manual_seed(0)
    sizes_E = torch.tensor([7, 0, 12, 5])
    rows, used = 40, 24
    experts = GroupedExperts(4, 18, 9, activation=activation, backend="grouped_mm", init_std=0.3).to(dtype)
    loop = GroupedExperts(4, 18, 9, activation=activation, backend="loop").to(dtype)
    loop.load_state_dict(experts.state_dict())
    x_RD = torch.randn(rows, 18).to(dtype)
    g_RD = torch.randn(rows, 18).to(dtype)
    x_RD[used:], g_RD[used:] = float("nan"), float("nan")
    assert experts.reads_only_grouped_rows(dtype)
    xx = x_RD.clone().requires_grad_(True)
    y = experts(xx, sizes_E, tail_unwritten=True)
    y.backward(g_RD)
    x_ref, g_ref = x_RD.clone(), g_RD.clone()
    x_ref[used:], g_ref[used:] = 0, 0
    x_ref.requires_grad_(True)
    y_ref = loop(x_ref, sizes_E)
    y_ref.backward(g_ref)
    _close(y[:used], y_ref[:used], dtype, "output")
    _close(xx.grad[:used], x_ref.grad[:used], dtype, "input gradient")
    for name in ("fc1_weight", "fc2_weight"):
        mine, ref = getattr(experts, name).grad, getattr(loop, name).grad
        assert torch.isfinite(mine).all(), name
        _close(mine, ref, dtype, name)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expert_tensor_parallel_shards_of_unaligned_width(dtype, activation):
    """Expert tensor parallelism splits F: each rank holds fc1's columns of its slice (gate and
    up alike under SwiGLU) and fc2's rows, and the partial outputs sum to the full output.
    F=20 over 2 ranks gives shards of 10, unaligned in fp32 and in bf16 although F=20 is aligned
    in fp32; one process plays both ranks. The shards' outputs, input gradients (summed, as the
    ranks' all-reduce does) and weight gradients equal the full loop backend's."""
    torch.manual_seed(0)
    d, f, etp = 24, 20, 2
    sizes_E = torch.tensor([7, 0, 12, 5])
    full = GroupedExperts(4, d, f, activation=activation, backend="loop", init_std=0.3).to(dtype)
    shards = []
    for rank in range(etp):
        shard = GroupedExperts(4, d, f // etp, activation=activation, backend="grouped_mm").to(dtype)
        cols = slice(rank * f // etp, (rank + 1) * f // etp)
        with torch.no_grad():
            shard.fc1_weight.copy_(full.fc1_weight[..., cols])
            shard.fc2_weight.copy_(full.fc2_weight[:, cols])
        shards.append((cols, shard))
    x_RD = torch.randn(28, d).to(dtype)
    x_RD[24:] = 0  # padding rows after the groups
    g_RD = torch.randn(28, d).to(dtype)
    x_ref = x_RD.clone().requires_grad_(True)
    full(x_ref, sizes_E).backward(g_RD)
    x = x_RD.clone().requires_grad_(True)
    y = sum(shard(x, sizes_E).float() for _, shard in shards)
    y.to(dtype).backward(g_RD)
    y_ref = full(x_RD, sizes_E)
    _close(y.to(dtype)[:24], y_ref[:24], dtype, "output")
    _close(x.grad[:24], x_ref.grad[:24], dtype, "input gradient")
    for cols, shard in shards:
        _close(shard.fc1_weight.grad, full.fc1_weight.grad[..., cols], dtype, "fc1 shard gradient")
        _close(shard.fc2_weight.grad, full.fc2_weight.grad[:, cols], dtype, "fc2 shard gradient")


@pytest.mark.parametrize("k, n", [(18, 32), (17, 9), (30, 14), (2, 1)])
def test_emulated_fp8_grouped_gemm_takes_unaligned_operands(k, n):
    """The emulated FP8 backend's GEMM on dequantized operands: rows grouped, and the weight
    gradient's form (groups along the contraction), equal per-group products."""
    from lightning_moe.precision.gemm import _grouped_gemm

    gen = torch.Generator().manual_seed(k * 10 + n)
    offsets = torch.tensor([5, 5, 12, 15], dtype=torch.int32)
    x_MK, w_EKN = torch.randn(15, k, generator=gen), torch.randn(4, k, n, generator=gen)
    starts = [0, *offsets.tolist()[:-1]]
    expected = torch.cat([x_MK[s:e] @ w_EKN[g] for g, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    torch.testing.assert_close(_grouped_gemm(x_MK, w_EKN, offsets), expected)
    x_KT, dy_TN = torch.randn(k, 16, generator=gen), torch.randn(16, n, generator=gen)
    expected = torch.stack([x_KT[:, s:e] @ dy_TN[s:e] for s, e in zip(starts, offsets.tolist())])
    torch.testing.assert_close(_grouped_gemm(x_KT, dy_TN, offsets), expected)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise"])
@pytest.mark.parametrize("d, f", [(32, 18), (17, 9)])
def test_emulated_fp8_experts_run_unaligned_sizes(recipe, d, f):
    """FP8 experts (emulated) at unaligned sizes: forward and backward run, within FP8's error of
    the high-precision loop backend."""
    from lightning_moe.precision import FP8GroupedGemm

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=d, ffn_hidden_size=f, num_experts=4, router_topk=2, expert_backend="loop"))
    x = torch.randn(16, d)
    outs = []
    for quantization in (None, FP8GroupedGemm(recipe, "emulated")):
        layer.experts.quantization = quantization
        layer.zero_grad()
        xx = x.clone().requires_grad_(True)
        y = layer(xx)
        y.square().sum().backward()
        outs.append((y.detach(), xx.grad, layer.experts.fc1_weight.grad.clone()))
    for got, want in zip(outs[1], outs[0]):
        assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 0.15
