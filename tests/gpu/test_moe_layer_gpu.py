"""MoELayer on CUDA in bf16 against an fp32 copy of itself (per-expert loop backend)."""

import copy

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer

pytestmark = pytest.mark.gpu


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(expert_alignment=16),
        dict(expert_capacity_factor=1.0),
        dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True),
        dict(router_score_function="sigmoid", router_enable_expert_bias=True, shared_expert_intermediate_size=256),
    ],
)
def test_bf16_grouped_mm_matches_fp32_loop(overrides):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=512, ffn_hidden_size=256, num_experts=16, router_topk=4, **overrides)
    layer = MoELayer(cfg).cuda()
    ref = copy.deepcopy(layer)
    ref.experts.backend = "loop"
    layer.experts.to(torch.bfloat16)  # the router stays fp32 (as the precision plugins keep it)
    if layer.shared_experts is not None:
        layer.shared_experts.to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda")
    x_lp = x.bfloat16().requires_grad_(True)
    y = layer(x_lp)
    x_ref = x_lp.detach().float().requires_grad_(True)
    y_ref = ref(x_ref)
    assert _rel(y.float(), y_ref) < 2e-2
    g = torch.randn_like(y_ref)
    y.backward(g.bfloat16())
    y_ref.backward(g)
    assert _rel(x_lp.grad.float(), x_ref.grad) < 2e-2
    assert _rel(layer.experts.fc1_weight.grad.float(), ref.experts.fc1_weight.grad) < 2e-2
    assert _rel(layer.router.weight.grad, ref.router.weight.grad) < 5e-2
