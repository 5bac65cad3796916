"""Aux-loss-free balancing: expert bias updates, token counters and their state."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.router import TopKRouter

D, E, K = 32, 16, 2


def _cfg(**kw) -> MoEConfig:
    kw.setdefault("router_bias_update_rate", 1e-2)
    return MoEConfig(
        hidden_size=D,
        ffn_hidden_size=64,
        num_experts=E,
        router_topk=K,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        **kw,
    )


def _skewed_router(cfg: MoEConfig) -> TopKRouter:
    """A router whose experts 0..2 win almost every token (input feature 0 is always ~1)."""
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight[:3, 0] = 3.0
    return router


def _tokens(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(num_tokens, D, generator=gen)
    x[:, 0] = 1.0 + 0.1 * x[:, 0]
    return x


def _max_over_mean(router: TopKRouter, x: torch.Tensor) -> float:
    with torch.no_grad():
        counts = router(x).tokens_per_expert_E.float()
    return (counts.max() / counts.mean()).item()


def test_bias_updates_balance_a_skewed_router() -> None:
    router = _skewed_router(_cfg(init_method_std=0.1))
    gen = torch.Generator().manual_seed(1)
    probe = _tokens(1024, gen)
    before = _max_over_mean(router, probe)
    for _step in range(100):
        for _micro_batch in range(2):
            router(_tokens(128, gen))
        router.update_expert_bias()
    after = _max_over_mean(router, probe)
    assert before > 4.0, before
    assert after < 1.6, after
    assert after < before / 3


def test_update_is_rate_times_sign_of_mean_minus_count() -> None:
    cfg = _cfg(router_bias_update_rate=3e-3)
    router = TopKRouter(cfg)
    bias = torch.randn(E)
    router.expert_bias.copy_(bias)
    counts = torch.full((E,), 10.0)
    counts[0], counts[1], counts[2] = 25.0, 0.0, 5.0  # mean stays 10: experts 3.. do not move
    router.local_tokens_per_expert.copy_(counts)
    router.update_expert_bias()
    step = torch.sign(counts.mean() - counts) * 3e-3
    assert torch.equal(router.expert_bias, bias + step)
    assert torch.equal(router.expert_bias[3:], bias[3:])
    assert torch.count_nonzero(router.local_tokens_per_expert) == 0

    # Counts handed in by the strategy (already summed over ranks) take precedence over local ones.
    router.local_tokens_per_expert.fill_(7.0)
    given = torch.randint(0, 100, (E,))
    before = router.expert_bias.clone()
    router.update_expert_bias(given)
    given_f = given.float()
    assert torch.equal(router.expert_bias, before + torch.sign(given_f.mean() - given_f) * 3e-3)
    assert torch.count_nonzero(router.local_tokens_per_expert) == 0
    assert router.expert_bias.dtype == torch.float32


def test_counts_accumulate_over_micro_batches_and_reset() -> None:
    router = TopKRouter(_cfg())
    total = torch.zeros(E, dtype=torch.int64)
    for _ in range(3):
        total += router(torch.randn(2, 10, D)).tokens_per_expert_E
    assert torch.equal(router.local_tokens_per_expert, total.float())
    assert router.local_tokens_per_expert.sum() == 3 * 20 * K
    with torch.no_grad():  # evaluation/recomputation under no_grad does not count
        router(torch.randn(2, 10, D))
    assert torch.equal(router.local_tokens_per_expert, total.float())
    router.update_expert_bias()
    assert torch.count_nonzero(router.local_tokens_per_expert) == 0
    router(torch.randn(4, D))
    router.reset_step_state()
    assert torch.count_nonzero(router.local_tokens_per_expert) == 0


def test_counts_are_kept_tokens_under_capacity() -> None:
    router = TopKRouter(_cfg(expert_capacity_factor=0.5))
    result = router(torch.randn(64, D))
    assert torch.equal(router.local_tokens_per_expert, result.tokens_per_expert_E.float())
    assert router.local_tokens_per_expert.max() <= result.capacity

    # Megatron counts its padded routing map: every expert min(capacity, T), so the bias stays put.
    padded = TopKRouter(_cfg(expert_capacity_factor=0.5, pad_expert_input_to_capacity=True))
    result = padded(torch.randn(64, D))
    assert torch.equal(padded.local_tokens_per_expert, torch.full((E,), float(result.capacity)))


def test_state_dict_holds_fp32_bias_and_counts() -> None:
    router = TopKRouter(_cfg())
    router(torch.randn(16, D))
    router.update_expert_bias()
    router(torch.randn(16, D))
    state = router.state_dict()
    assert set(state) == {"weight", "expert_bias", "local_tokens_per_expert"}
    assert state["expert_bias"].dtype == torch.float32 and state["local_tokens_per_expert"].dtype == torch.float32
    assert torch.count_nonzero(state["expert_bias"]) > 0 and state["local_tokens_per_expert"].sum() == 16 * K

    other = TopKRouter(_cfg()).to(torch.bfloat16)
    other.load_state_dict(state)
    assert torch.equal(other.expert_bias, router.expert_bias)
    assert torch.equal(other.local_tokens_per_expert, router.local_tokens_per_expert)
    assert other.expert_bias.dtype == torch.float32


def test_no_bias_state_without_expert_bias() -> None:
    cfg = MoEConfig(hidden_size=D, ffn_hidden_size=64, num_experts=E, router_topk=K)
    router = TopKRouter(cfg)
    assert router.expert_bias is None and router.local_tokens_per_expert is None
    assert set(router.state_dict()) == {"weight"}
    with pytest.raises(RuntimeError, match="router_enable_expert_bias"):
        router.update_expert_bias()
