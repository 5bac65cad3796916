"""`DeferredCombine`: experts handed the dispatcher's combine give what the dispatcher would, on
every path that does not fuse it (here: CPU, bf16-free, no FP8), and refuse what they cannot do."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.nn.permutation import DeferredCombine, permute, plan_permutation, unpermute


def _routed(tokens: int = 24, experts: int = 4, topk: int = 2):
    gen = torch.Generator().manual_seed(0)
    experts_TK = torch.rand(tokens, experts, generator=gen).argsort(1)[:, :topk]
    probs_TK = torch.rand(tokens, topk, generator=gen).requires_grad_(True)
    return plan_permutation(experts_TK, experts, alignment=4), probs_TK


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_experts_given_the_combine_equal_the_dispatchers_combine(activation):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32, activation=activation, backend="grouped_mm")
    plan, probs_TK = _routed()
    x_TD = torch.randn(24, 16, requires_grad=True)
    results = []
    for deferred in (True, False):
        experts.zero_grad()
        x_TD.grad = probs_TK.grad = None
        x_RD = permute(x_TD, plan)
        if deferred:
            y_TD = experts(x_RD, plan.group_sizes_E, combine=DeferredCombine(plan, probs_TK))
        else:
            y_TD = unpermute(experts(x_RD, plan.group_sizes_E), probs_TK, plan)
        y_TD.square().sum().backward()
        results.append([y_TD.detach(), x_TD.grad, probs_TK.grad] + [p.grad for p in experts.parameters()])
    assert results[0][0].shape == (24, 16)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_experts_refuse_the_combine_with_an_unwritten_tail():
    experts = GroupedExperts(4, 16, 32, backend="grouped_mm")
    plan, probs_TK = _routed()
    with pytest.raises(ValueError, match="tail_unwritten=False"):
        experts(torch.randn(plan.num_rows, 16), plan.group_sizes_E, tail_unwritten=True,
                combine=DeferredCombine(plan, probs_TK))


def test_cpu_experts_do_not_ask_for_the_combine():
    """Only the fused FP8 path takes the combine from the dispatcher (the layer asks first)."""
    experts = GroupedExperts(4, 16, 32, backend="grouped_mm")
    assert not experts.takes_deferred_combine(torch.randn(8, 16))


def test_fp8_experts_whose_swiglu_gemm_predates_the_combine_do_not_take_it(monkeypatch):
    """A subclass overriding ``grouped_mm_swiglu`` without ``combine=`` (declared by its flag) is never
    handed the combine (it would fail on the keyword); the library's own class would be, where its casts run."""
    from lightning_moe.precision import FP8GroupedGemm

    class OldSwiGLU(FP8GroupedGemm):
        swiglu_takes_combine = False

        def grouped_mm_swiglu(self, h_RF2, w_EFN, offsets_E, projection=""):
            return None

    tokens = torch.randn(8, 16)
    monkeypatch.setattr(FP8GroupedGemm, "takes_deferred_permutation", lambda self, tokens: True)
    assert FP8GroupedGemm("delayed", backend="torch").takes_deferred_combine(tokens)
    assert not OldSwiGLU("delayed", backend="torch").takes_deferred_combine(tokens)


def test_experts_handed_the_combine_directly_keep_an_old_signature_swiglu_gemm_working():
    """Experts called with ``combine=`` by hand (not through the layer, which asks first) and a
    quantization whose ``grouped_mm_swiglu`` predates ``combine``: the combine is carried out after
    the GEMM instead of passed to it, so the old override is called as it was written."""
    from lightning_moe.precision import FP8GroupedGemm

    calls = []

    class OldSwiGLU(FP8GroupedGemm):
        swiglu_takes_combine = False

        def grouped_mm_swiglu(self, h_RF2, w_EFN, offsets_E, projection=""):
            calls.append(projection)
            return None  # declines: the experts apply the SwiGLU and fc2 themselves

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 32, backend="grouped_mm")
    experts.quantization = OldSwiGLU("delayed", backend="emulated")
    plan, probs_TK = _routed()
    x_RD = permute(torch.randn(24, 16), plan)
    y_TD = experts(x_RD, plan.group_sizes_E, combine=DeferredCombine(plan, probs_TK))
    assert calls == ["fc2"] and y_TD.shape == (24, 16)
    torch.testing.assert_close(y_TD, unpermute(experts(x_RD, plan.group_sizes_E), probs_TK, plan))
