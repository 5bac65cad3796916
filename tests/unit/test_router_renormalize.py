"""``MoEConfig.router_topk_renormalize``: whether `route` divides the chosen top-k weights by their
sum. None keeps Megatron-Core's rule (checked against ``topk_routing_with_score_function``); True and
False force it (HF's ``norm_topk_prob``, also for one expert per token). Checked against a naive
per-token reference, under router replay, and for the refused combination."""

import pytest
import torch

from lightning_moe.nn import MoEConfig, TopKRouter, route
from lightning_moe.nn.router_replay import RouterReplay

E = 8


def _config(score_function, k, renormalize, pre_softmax=False, scaling=None, bias=False):
    return MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=E, router_topk=k,
                     router_score_function=score_function, router_pre_softmax=pre_softmax,
                     router_topk_renormalize=renormalize, router_topk_scaling_factor=scaling,
                     router_enable_expert_bias=bias)


def _naive(logits_TE, bias_E, cfg):
    """Dense ``[T, E]`` float64 weights, token by token: scores, top-k (biased for sigmoid), then the
    sum-to-one division where the config asks for it (None: Megatron's rule), then the scaling."""
    k, sigmoid = cfg.router_topk, cfg.router_score_function == "sigmoid"
    renormalize = cfg.router_topk_renormalize
    if renormalize is None:
        renormalize = k > 1 if sigmoid else not cfg.router_pre_softmax
    out = torch.zeros(logits_TE.shape, dtype=torch.float64)
    for t, logits in enumerate(logits_TE.double()):
        if sigmoid:
            scores = torch.sigmoid(logits)
            ranked = scores + (bias_E.double() if bias_E is not None else 0)
        else:
            scores = torch.softmax(logits, dim=0) if cfg.router_pre_softmax else logits
            ranked = scores
        chosen = sorted(range(E), key=lambda e: ranked[e].item(), reverse=True)[:k]
        if not sigmoid and not cfg.router_pre_softmax:  # softmax over the chosen logits
            weights = torch.softmax(torch.stack([logits[e] for e in chosen]), dim=0).tolist()
        else:
            weights = [scores[e].item() for e in chosen]
        total = sum(weights) if renormalize else 1.0
        for e, w in zip(chosen, weights):
            out[t, e] = w / total * (cfg.router_topk_scaling_factor or 1.0)
    return out


CASES = [
    ("sigmoid", k, renormalize, pre, bias)
    for k in (1, 3) for renormalize in (None, True, False) for pre, bias in ((False, False), (False, True))
] + [
    ("softmax", k, renormalize, True, False) for k in (1, 3) for renormalize in (None, True, False)
] + [
    ("softmax", 3, renormalize, False, False) for renormalize in (None, True)
]


@pytest.mark.parametrize("score_function, k, renormalize, pre_softmax, bias", CASES)
def test_route_matches_naive_reference(score_function, k, renormalize, pre_softmax, bias):
    cfg = _config(score_function, k, renormalize, pre_softmax, scaling=2.5, bias=bias)
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(32, E, generator=gen) * 2
    bias_E = torch.randn(E, generator=gen) * 0.3 if bias else None
    probs_TE, _ = route(logits, cfg, expert_bias=bias_E).dense()
    torch.testing.assert_close(probs_TE.double(), _naive(logits, bias_E, cfg), rtol=1e-6, atol=1e-7)
    sums_T = probs_TE.sum(dim=1) / 2.5
    if cfg.router_topk_renormalize:  # True: every token's weights sum to one, one weight included
        torch.testing.assert_close(sums_T, torch.ones(32), rtol=1e-6, atol=1e-6)
    if cfg.router_topk_renormalize is False:
        assert not torch.allclose(sums_T, torch.ones(32))  # the scores as they are


@pytest.mark.parametrize("score_function, k, pre_softmax", [("sigmoid", 1, False), ("sigmoid", 3, False),
                                                            ("softmax", 1, True), ("softmax", 3, True),
                                                            ("softmax", 3, False)])
def test_default_is_megatron_rule(score_function, k, pre_softmax):
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    cfg = _config(score_function, k, None, pre_softmax, scaling=2.5)
    logits = torch.randn(32, E, generator=torch.Generator().manual_seed(3))
    want_probs, want_map = moe_utils.topk_routing_with_score_function(
        logits, k, use_pre_softmax=pre_softmax, scaling_factor=2.5, score_function=score_function
    )
    probs_TE, map_TE = route(logits, cfg).dense()
    torch.testing.assert_close(probs_TE, want_probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(map_TE, want_map)


@pytest.mark.parametrize("renormalize", [True, False])
def test_replayed_forward_computes_the_same_weights(renormalize):
    cfg = _config("sigmoid", 1 if renormalize else 3, renormalize, bias=True)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    with RouterReplay.record(router) as recording:
        recorded = router(x)
    with torch.no_grad():
        router.expert_bias.zero_()  # a replay keeps the recorded experts whatever the bias now says
    with recording.replay(router):
        replayed = router(x)
    assert torch.equal(replayed.experts_TK, recorded.experts_TK)
    torch.testing.assert_close(replayed.probs_TK, recorded.probs_TK, rtol=0, atol=0)


def test_no_renormalization_of_softmax_over_topk_logits_is_refused():
    with pytest.raises(ValueError, match="set router_pre_softmax=True"):
        _config("softmax", 2, False)
