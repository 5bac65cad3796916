"""The router's fp32 logits from bf16 tokens by exact bf16 splits of the weight (`router_logits`):
the split itself, and the split products' forward and backward against fp64, run on CPU through
fp32 products of the bf16 parts (torch has no bf16 GEMM with an fp32 output on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.nn.router_logits import router_logits, split_applies, split_bf16x3, split_router_logits


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float() @ b.float()


def _mm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()).to(torch.bfloat16)


def test_three_bf16_parts_sum_to_the_fp32_tensor_exactly():
    gen = torch.Generator().manual_seed(0)
    # exact between 2^-100 (below, the low parts underflow) and bf16's largest finite value
    t = torch.randn(4096, generator=gen) * torch.logspace(-25, 30, 4096)
    t = torch.cat([t, torch.tensor([0.0, -0.0, -1.0 / 3.0, 2.0**-100, 3.3e38])])
    hi, mid, lo = split_bf16x3(t)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal((hi.float() + mid.float()) + lo.float(), t)
    # each part holds the next 8 significand bits: |mid| <= ulp(hi) / 2, |lo| <= ulp(mid) / 2
    nonzero = hi != 0
    assert bool((mid.float()[nonzero].abs() <= hi.float()[nonzero].abs() * 2.0**-8).all())


def _case(tokens: int = 512, hidden: int = 256, experts: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w = torch.randn(experts, hidden, generator=gen) * 0.02
    g = torch.randn(tokens, experts, generator=gen)
    return x, w, g


def test_split_products_match_fp64_to_fp32_rounding():
    """Also each gradient alone (the other input without one)."""
    x, w, g = _case()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.linear(x64, w64)
    ref.backward(g.double())
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = split_router_logits(xs, ws, _mm_fp32, _mm_bf16)
    out.backward(g)
    assert out.dtype == torch.float32 and xs.grad.dtype == torch.bfloat16 and ws.grad.dtype == torch.float32
    # the plain fp32 product's own distance from fp64 sets the scale
    plain = F.linear(x.float(), w)
    plain_err = (plain.double() - ref).abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 4 * plain_err + 1e-7
    # the weight's gradient: fp32 products of the exact bf16 token values and g's three parts
    dw_err = ((ws.grad.double() - w64.grad).norm() / w64.grad.norm()).item()
    assert dw_err < 1e-6, dw_err
    # the tokens' gradient: rounded once to bf16 from an fp32-accurate sum
    dx_ref = x64.grad.to(torch.bfloat16)
    mismatch = (xs.grad != dx_ref).float().mean().item()
    assert mismatch < 1e-3, mismatch
    assert ((xs.grad.double() - x64.grad).abs() <= x64.grad.abs() * 2.0**-8 + 1e-30).all()
    for needs in ((True, False), (False, True)):
        xo, wo = x.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])
        split_router_logits(xo, wo, _mm_fp32, _mm_bf16).backward(g)
        assert (xo.grad is not None) == needs[0] and (wo.grad is not None) == needs[1]
        if needs[0]:
            assert torch.equal(xo.grad, xs.grad)
        else:
            assert torch.equal(wo.grad, ws.grad)


def test_dropping_a_split_part_is_detected():
    """The test above would catch a split that lost its lowest part."""
    x, w, _ = _case()
    hi, mid, _ = split_bf16x3(w)
    ref = F.linear(x.double(), w.double())
    truncated = F.linear(x.float(), hi.float() + mid.float())
    plain_err = (F.linear(x.float(), w).double() - ref).abs().max().item()
    assert (truncated.double() - ref).abs().max().item() > 4 * plain_err + 1e-7


def test_cpu_and_fp32_tokens_take_the_plain_product():
    x, w, _ = _case(tokens=8)
    for tokens in (x, x.float()):
        assert not split_applies(tokens, w)  # CPU; fp32 tokens anywhere
        assert router_logits(tokens, w).dtype == torch.float32
        assert torch.equal(router_logits(tokens, w), F.linear(tokens.float(), w))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert router_logits(tokens, w).dtype == torch.float32


def test_asking_for_the_split_where_it_cannot_run_warns_once(recwarn):
    import lightning_moe.nn.router_logits as module

    module._WARNED.clear()
    x, w, _ = _case(tokens=8)
    for _ in range(2):
        assert torch.equal(router_logits(x, w, split=True), F.linear(x.float(), w))
    messages = [str(w.message) for w in recwarn.list if "router_logits_gemm='bf16x3'" in str(w.message)]
    assert len(messages) == 1 and "got torch.bfloat16 Tensor tokens on cpu" in messages[0]


def test_router_with_the_option_routes_like_the_default_on_cpu():
    from lightning_moe.nn import MoEConfig, TopKRouter

    torch.manual_seed(0)
    cfgs = [MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, router_topk=2, router_logits_gemm=gemm)
            for gemm in ("fp32", "bf16x3")]
    routers = [TopKRouter(cfg) for cfg in cfgs]
    routers[1].load_state_dict(routers[0].state_dict())
    x = torch.randn(2, 16, 32).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="router_logits_gemm='bf16x3'"):
        results = [router(x) for router in routers]
    assert torch.equal(results[0].experts_TK, results[1].experts_TK)
    assert torch.equal(results[0].probs_TK, results[1].probs_TK)


def test_router_logits_gemm_is_validated():
    from lightning_moe.nn import MoEConfig

    with pytest.raises(ValueError, match="router_logits_gemm='tf32' is not one of"):
        MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, router_topk=2, router_logits_gemm="tf32")
    assert MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, router_topk=2).router_logits_gemm == "fp32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [False, True])
def test_low_precision_tokens_keep_their_own_dtype_for_the_backward_with_the_same_bits(dtype, autocast):
    torch.manual_seed(3)
    x = torch.randn(24, 2, 96).to(dtype)[:, 1]  # a strided view, as a sliced batch gives
    w = torch.randn(16, 96)
    g = torch.randn(24, 16)
    grads = []
    for widened in (True, False):
        x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if widened:
                y = router_logits(x_leaf, w_leaf)
            else:  # autograd's own formulas on the fp32 copy, outside autocast as the router runs
                with torch.autocast("cpu", enabled=False):
                    y = F.linear(x_leaf.float(), w_leaf)
        y.backward(g)
        grads.append((y.detach(), x_leaf.grad, w_leaf.grad))
        if widened:  # the tokens in their own dtype, never an fp32 copy of them
            assert {t.dtype for t in saved if t.shape == x.shape} == {dtype}
    for ours, reference in zip(*grads):
        assert ours.dtype == reference.dtype and torch.equal(ours, reference)
