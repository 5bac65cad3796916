"""The Transformer Engine experts backend equals the native grouped GEMM (bf16, CUDA, TE installed)."""

import copy

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer

pytestmark = pytest.mark.gpu


def test_te_experts_match_grouped_mm():
    pytest.importorskip("transformer_engine.pytorch")
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, router_topk=2, expert_backend="grouped_mm")
    native = MoELayer(cfg).cuda()
    native.experts.to(torch.bfloat16)
    te_layer = copy.deepcopy(native)
    te_layer.experts.backend = "te"
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for layer in (native, te_layer):
        xx = x.clone().requires_grad_(True)
        y = layer(xx)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append((xx.grad.float(), layer.experts.fc1_weight.grad.float(), layer.experts.fc2_weight.grad.float()))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(outs[1], outs[0]) < 1e-2
    for a, b in zip(grads[1], grads[0]):
        assert rel(a, b) < 2e-2
