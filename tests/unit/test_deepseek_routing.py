"""DeepSeek-V3 routing through `route`: sigmoid scores, correction bias for selection only, groups
scored by the sum of their best two biased scores, top-k renormalised from the unbiased scores and
scaled. Checked against a naive per-token reference written from the DeepSeek-V3 paper / code,
against transformers' DeepseekV3TopkRouter, and against Megatron's group score where they differ."""

import pytest
import torch

from lightning_moe.nn import MoEConfig, route


def _naive_deepseek_v3(logits_TE, bias_E, k, num_groups, group_topk, scaling, group_score_topk=2):
    """Dense ``[T, E]`` combine weights, token by token, in float64."""
    num_tokens, num_experts = logits_TE.shape
    per_group = num_experts // num_groups
    out = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    for t in range(num_tokens):
        scores = torch.sigmoid(logits_TE[t].double())
        biased = scores + bias_E.double()
        group_scores = [
            sorted(biased[g * per_group:(g + 1) * per_group].tolist(), reverse=True)[:group_score_topk]
            for g in range(num_groups)
        ]
        best_groups = sorted(range(num_groups), key=lambda g: sum(group_scores[g]), reverse=True)[:group_topk]
        candidates = [e for g in best_groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(candidates, key=lambda e: biased[e].item(), reverse=True)[:k]
        total = sum(scores[e].item() for e in chosen)
        for e in chosen:
            out[t, e] = scores[e].item() / total * scaling
    return out


def _config(num_experts, k, num_groups, group_topk, **extra):
    return MoEConfig(
        hidden_size=16, ffn_hidden_size=8, num_experts=num_experts, router_topk=k, router_score_function="sigmoid",
        router_enable_expert_bias=True, router_num_groups=num_groups, router_group_topk=group_topk,
        router_topk_scaling_factor=2.5, **extra,
    )


def _dense(logits, cfg, bias):
    probs_TE, _ = route(logits, cfg, expert_bias=bias).dense()
    return probs_TE.double()


def _inputs(num_tokens, num_experts, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.3  # large enough to change groups and experts
    return logits, bias


@pytest.mark.parametrize("group_score_topk", [None, 2])
def test_deepseek_v3_shape_matches_naive_reference(group_score_topk):
    # 256 experts, top-8 of the best 4 of 8 groups: Megatron's k // group_topk is DeepSeek's 2 here.
    cfg = _config(256, 8, 8, 4, router_group_score_topk=group_score_topk)
    logits, bias = _inputs(64, 256, seed=0)
    expected = _naive_deepseek_v3(logits, bias, 8, 8, 4, 2.5)
    torch.testing.assert_close(_dense(logits, cfg, bias), expected, rtol=1e-6, atol=1e-7)
    # The bias must have mattered: unbiased selection picks other experts for some tokens.
    assert not torch.equal(_dense(logits, cfg, None) > 0, expected > 0)


def test_group_score_differs_from_megatron_where_k_over_group_topk_is_not_two():
    # top-6 of the best 2 of 8 groups: Megatron scores a group by its best 3, DeepSeek by its best 2.
    logits, bias = _inputs(256, 64, seed=1)
    deepseek = _naive_deepseek_v3(logits, bias, 6, 8, 2, 2.5, group_score_topk=2)
    megatron = _naive_deepseek_v3(logits, bias, 6, 8, 2, 2.5, group_score_topk=3)
    assert not torch.equal(deepseek > 0, megatron > 0)  # the choice is visible on these tokens
    torch.testing.assert_close(_dense(logits, _config(64, 6, 8, 2), bias), megatron, rtol=1e-6, atol=1e-7)
    ours = _dense(logits, _config(64, 6, 8, 2, router_group_score_topk=2), bias)
    torch.testing.assert_close(ours, deepseek, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "k, norm_topk_prob, renormalize",
    [
        (6, True, None),  # Megatron's rule renormalises sigmoid top-k for k > 1
        (6, False, False),  # sigmoid scores as they are, times the scaling factor
        (1, True, True),  # HF renormalises one weight to 1; Megatron's rule would not
        (1, False, None),  # one sigmoid weight as it is: Megatron's rule
    ],
)
def test_matches_transformers_deepseek_v3_router_values_and_gradients(k, norm_topk_prob, renormalize):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    num_experts, groups, group_topk = 64, 8, 2
    config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=num_experts, num_experts_per_tok=k, n_group=groups, topk_group=group_topk,
        routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob,
    )
    hf = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(num_experts, 16, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
    x = torch.randn(128, 16, generator=gen)
    upstream = torch.randn(128, num_experts, generator=gen)

    _, hf_weights, hf_experts = hf(x)
    hf_dense = torch.zeros(128, num_experts).scatter(1, hf_experts, hf_weights)
    (hf_dense * upstream).sum().backward()

    weight = hf.weight.detach().clone().requires_grad_(True)
    cfg = _config(num_experts, k, groups, group_topk, router_group_score_topk=2, router_topk_renormalize=renormalize)
    probs_TE, _ = route(x @ weight.T, cfg, expert_bias=hf.e_score_correction_bias).dense()
    (probs_TE * upstream).sum().backward()

    torch.testing.assert_close(probs_TE, hf_dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, hf.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(router_num_groups=None, router_group_topk=None), "needs group-limited routing"),
        (dict(router_group_score_topk=9), r"must be in \[1, 8\]"),
        (dict(router_group_score_topk=0), r"must be in \[1, 8\]"),
    ],
)
def test_group_score_topk_refusals(extra, message):
    fields = {"router_num_groups": 8, "router_group_topk": 4, "router_group_score_topk": 2, **extra}
    with pytest.raises(ValueError, match=message):
        MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=64, router_topk=8, router_score_function="sigmoid",
                  **fields)
