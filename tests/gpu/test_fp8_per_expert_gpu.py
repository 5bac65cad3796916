"""Native FP8 grouped GEMMs: one ``_scaled_mm`` per expert (few experts) and the grouped
``_scaled_grouped_mm`` kernel (many experts) compute the same products (CUDA, Hopper)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]


def _grads(x, w, offsets, recipe):
    from lightning_moe.precision.gemm import fp8_grouped_mm

    x.grad = w.grad = None
    y = fp8_grouped_mm(x, w, offsets, recipe=recipe, backend="torch")
    y.float().square().sum().backward()
    return y.float(), x.grad.float(), w.grad.float()


def _rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_per_expert_and_grouped_kernels_agree(monkeypatch, host_syncs, recipe):
    from lightning_moe.precision import native_gemms

    torch.manual_seed(0)
    experts, k, n = 4, 256, 384
    # expert 1 is empty; rows 496..511 lie past the last group (alignment padding)
    offsets = torch.tensor([128, 128, 304, 496], device="cuda", dtype=torch.int32)
    x = torch.randn(512, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, k, n, device="cuda") / k**0.5).requires_grad_(True)
    monkeypatch.setattr(native_gemms, "TRITON_GROUPED_GEMM", False)  # torch's two paths alone
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 32)
    y_pe, dx_pe, dw_pe = _grads(x, w, offsets, recipe)
    assert len(host_syncs) == 1  # forward only; the backward reuses the host list
    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", 0)
    y_g, dx_g, dw_g = _grads(x, w, offsets, recipe)
    assert len(host_syncs) == 1

    valid = slice(0, 496)
    assert _rel(y_pe[valid], y_g[valid]) < 1e-2
    assert not y_pe[496:].any()
    assert _rel(dx_pe[valid], dx_g[valid]) < 1e-2
    assert _rel(dw_pe, dw_g) < 1e-2
    assert not dw_pe[1].any() and not dw_g[1].any()  # the empty expert gets no gradient
    # and both are FP8-accurate against fp32
    ends = offsets.tolist()
    ref = torch.cat([x[s:e].float() @ w[i].float() for i, (s, e) in enumerate(zip([0] + ends[:-1], ends))])
    assert _rel(y_pe[valid], ref) < 0.05


@pytest.mark.parametrize("per_expert_max", [0, 32])
def test_fast_accumulation_everywhere_stays_fp8_accurate(monkeypatch, per_expert_max):
    from lightning_moe.precision import FP8Recipe, native_gemms

    monkeypatch.setattr(native_gemms, "PER_EXPERT_MAX_EXPERTS", per_expert_max)
    torch.manual_seed(0)
    experts, k, n = 4, 1024, 512
    offsets = torch.tensor([256, 512, 768, 1024], device="cuda", dtype=torch.int32)
    x = torch.randn(1024, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, k, n, device="cuda") / k**0.5).requires_grad_(True)
    fast = _grads(x, w, offsets, FP8Recipe("rowwise", fast_accumulation=("fprop", "dgrad", "wgrad")))
    split = _grads(x, w, offsets, FP8Recipe("rowwise"))
    xr, wr = x.detach().float().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y = torch.cat([xr[e * 256:(e + 1) * 256] @ wr[e] for e in range(experts)])
    y.square().sum().backward()
    for got, same_quant, ref in zip(fast, split, (y.detach(), xr.grad, wr.grad)):
        assert _rel(got, ref) < 0.05
        assert _rel(got, same_quant) < 1e-2  # the accumulator adds little to the quantization error


@pytest.mark.parametrize("triton", [True, False])
def test_host_syncs_per_layer_forward(monkeypatch, host_syncs, triton):
    """Our Triton grouped kernels read no group size on the host; torch's per-expert GEMMs (both
    projections share one offsets tensor) sync once per forward."""
    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.precision import FP8Precision, native_gemms

    monkeypatch.setattr(native_gemms, "TRITON_GROUPED_GEMM", triton)

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=4, router_topk=2, expert_alignment=16)
    x = torch.randn(2, 64, 256, device="cuda")
    bf16 = MoELayer(cfg).cuda()
    with torch.autocast("cuda", torch.bfloat16):
        bf16(x).float().sum().backward()
    baseline = len(host_syncs)
    layer = MoELayer(cfg).cuda()
    plugin = FP8Precision(recipe="rowwise", backend="torch")
    plugin.convert_module(layer)
    with plugin.forward_context():
        y = layer(x)
    y.float().sum().backward()
    assert len(host_syncs) - baseline == baseline + (0 if native_gemms.triton_grouped(x) else 1)


@pytest.mark.parametrize("experts", [4, 64])  # per-expert cuBLAS GEMMs / torch's grouped kernel
def test_fp8_plugin_pads_the_expert_groups_the_kernels_need(experts):
    """A layer built without alignment (as the model configs are) trains under the FP8 plugin:
    cuBLAS rejected a 907-row expert group before the plugin padded the groups to 16."""
    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.precision import FP8Precision

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=experts, router_topk=2)).cuda()
    plugin = FP8Precision(recipe="rowwise", backend="torch")
    plugin.convert_module(layer)
    assert layer.config.expert_alignment == 16 and plugin.summary.expert_alignment == 16
    x = torch.randn(2, 999, 256, device="cuda", requires_grad=True)  # odd token count: odd group sizes
    with plugin.forward_context():
        y = layer(x)
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.experts.parameters())
