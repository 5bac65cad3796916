"""The dynamic-CP planner and the rank layout it implies: deterministic, every sequence placed once,
the memory limit respected, never worse than the static layout on the cost model; every token of
the pool on exactly one rank, in chunks whose causal indices cover each sequence."""

import json
import math
import random

import pytest
import torch

from lightning_moe.parallel.dynamic_cp import (
    CALIBRATION_FORMAT,
    CostModel,
    attention_pairs,
    aligned_blocks,
    chunk_bounds,
    plan_micro_batch,
    rank_token_counts,
    static_memory_tokens,
)
from lightning_moe.parallel.dynamic_cp_batch import find_sequences, rank_share

COST_MODELS = {
    "default": CostModel(),
    "attention_heavy": CostModel(attention_s_per_token_pair=1e-6, linear_s_per_token=1e-6, cp_s_per_token=1e-7,
                                 cp_s_per_exchange=5e-3),
    "free_exchange": CostModel(attention_s_per_token_pair=1e-9, linear_s_per_token=1e-6, cp_s_per_token=0.0,
                               cp_s_per_exchange=0.0),
}


def _packed_mix(rng: random.Random, replicas: int, tokens_per_replica: int, shape: str) -> tuple[list[int], list[int]]:
    """Documents filling each replica's micro-batch exactly: uniform 16-512, lognormal up to the budget,
    or all one length."""
    lengths, owners = [], []
    for r in range(replicas):
        left = tokens_per_replica
        while left:
            if shape == "uniform":
                n = rng.randint(16, 512)
            elif shape == "lognormal":
                n = max(16, int(rng.lognormvariate(math.log(256), 1.2)))
            else:
                n = 128
            n = min(n, left)
            lengths.append(n)
            owners.append(r)
            left -= n
    return lengths, owners


MIXES = [
    (pool, cp, max_cp, shape, seed)
    for pool, cp, max_cp in ((4, 4, 4), (4, 2, 4), (8, 4, 8), (8, 8, 8), (16, 4, 4))
    for shape in ("uniform", "lognormal", "equal")
    for seed in range(3)
]


@pytest.mark.parametrize("cost_name", list(COST_MODELS))
def test_plans_place_every_sequence_once_within_memory_and_never_worse_than_static(cost_name):
    cost = COST_MODELS[cost_name]
    for pool, cp, max_cp, shape, seed in MIXES:
        rng = random.Random(seed)
        lengths, owners = _packed_mix(rng, pool // cp, 512 * cp, shape)
        limit = int(static_memory_tokens(lengths, owners, pool, cp) * rng.choice([1.0, 1.5, 2.0]))
        plan = plan_micro_batch(lengths, owners, pool, cp, max_cp, cost, limit)
        case = (cost_name, pool, cp, max_cp, shape, seed)
        # a partition of the pool into aligned power-of-two groups of at most max_cp ranks
        assert sum(plan.group_sizes) == pool, case
        for offset, size in zip(plan.group_offsets, plan.group_sizes):
            assert size <= max_cp and offset % size == 0
            assert size == 1 or (offset, size) in aligned_blocks(pool, max_cp)
        # every sequence in exactly one existing group
        assert len(plan.sequence_group) == len(lengths)
        assert all(0 <= g < len(plan.group_sizes) for g in plan.sequence_group)
        # memory: the tokens each rank really holds (recomputed from the chunks)
        held = [0] * pool
        for seq, g in enumerate(plan.sequence_group):
            for i, n in enumerate(rank_token_counts(lengths[seq], plan.group_sizes[g])):
                held[plan.group_offsets[g] + i] += n
        assert tuple(held) == plan.rank_tokens, case
        assert max(held) <= limit and min(held) > 0, case
        # the modelled time, recomputed, and never above the static layout's
        worst = max(
            cost.group_cost([lengths[s] for s, h in enumerate(plan.sequence_group) if h == g], size)
            for g, size in enumerate(plan.group_sizes)
        )
        assert worst == pytest.approx(plan.max_cost, rel=1e-12), case
        static = max(cost.group_cost([n for n, o in zip(lengths, owners) if o == r], cp) for r in range(pool // cp))
        assert plan.static_cost == pytest.approx(static, rel=1e-12)
        assert plan.max_cost <= plan.static_cost * (1 + 1e-12), case


def test_attention_pairs_count_what_the_kernels_compute():
    # alone: causal SDPA; a group of c: its own block whole, half of each received block
    assert attention_pairs(512, 1) == 512 * 512 / 2
    assert attention_pairs(512, 2) == 512 * 512 * 3 / 4
    assert attention_pairs(512, 4) == 512 * 512 * 5 / 8


def test_plans_are_deterministic_and_use_small_groups_for_short_sequences():
    lengths, owners = _packed_mix(random.Random(1), 2, 2048, "lognormal")
    cost = COST_MODELS["attention_heavy"]
    plans = [plan_micro_batch(lengths, owners, 8, 4, 8, cost, 2048) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    # a costly exchange: the 366-token document on two ranks, the others on one each, beats CP4
    plan = plan_micro_batch([100, 30, 16, 366, 256, 256], [0] * 6, 4, 4, 4, cost, 512)
    assert plan.group_sizes == (2, 1, 1) and plan.group_sizes[plan.sequence_group[3]] == 2
    assert plan.sequences_per_cp_size() == {1: 5, 2: 1}
    assert plan.max_cost < 0.95 * plan.static_cost


def test_long_sequences_get_the_cp_their_memory_needs():
    cost = COST_MODELS["free_exchange"]  # linear: one rank per sequence would balance best
    plan = plan_micro_batch([1024, 256, 256, 256, 256], [0] * 5, 4, 4, 4, cost, 512)
    group = plan.sequence_group[0]
    assert plan.group_sizes[group] >= 2  # 1024 tokens cannot sit on one rank of 512
    assert max(plan.rank_tokens) <= 512


def test_impossible_memory_limit_names_the_fix():
    with pytest.raises(ValueError, match="raise memory_limit_tokens or max_context_parallel_size"):
        plan_micro_batch([4096, 16], [0, 0], 4, 4, 4, CostModel(), 512)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        plan_micro_batch([64], [0], 6, 3, 3, CostModel())
    with pytest.raises(ValueError, match="must divide the pool"):
        plan_micro_batch([64], [0], 4, 4, 8, CostModel())


def test_chunks_cover_each_sequence_once_with_sizes_within_one():
    for length in (1, 7, 16, 37, 512):
        for cp in (1, 2, 4, 8):
            edges = chunk_bounds(length, cp)
            assert edges[0] == 0 and edges[-1] == length and len(edges) == 2 * cp + 1
            sizes = [b - a for a, b in zip(edges, edges[1:])]
            assert max(sizes) - min(sizes) <= 1
            assert sum(rank_token_counts(length, cp)) == length


def test_rank_shares_hold_every_token_of_the_pool_once():
    rows, seq = 4, 64
    lengths_per_row = [[64], [16, 20, 28], [5, 59], [32, 32]]
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row])
    sequences = find_sequences(docs, rows, seq, rows_per_replica=2)
    assert sequences.lengths == [n for r in lengths_per_row for n in r]
    assert sequences.replicas == [0, 0, 0, 0, 1, 1, 1, 1]
    plan = plan_micro_batch(sequences.lengths, sequences.replicas, 8, 4, 4, COST_MODELS["attention_heavy"], 64)
    seen = torch.zeros(rows * seq, dtype=torch.long)
    for rank in range(8):
        share = rank_share(sequences, plan, rank)
        seen[share.flat_index_T] += 1
        assert share.flat_index_T.numel() == plan.rank_tokens[rank] <= share.max_tokens
        # the end-to-end index follows the token order inside each of the group's sequences
        members = plan.sequences_of_group(share.group)
        starts = torch.tensor([sequences.flat_starts[s] for s in members])
        offsets = torch.tensor([0] + [sequences.lengths[s] for s in members]).cumsum(0)[:-1]
        doc = share.document_ids_T
        assert torch.equal(share.index_T - offsets[doc], share.flat_index_T - starts[doc])
    assert torch.equal(seen, torch.ones_like(seen))


def test_unpacked_rows_are_one_sequence_each():
    sequences = find_sequences(None, 3, 32, rows_per_replica=3)
    assert sequences.lengths == [32, 32, 32] and sequences.flat_starts == [0, 32, 64]


def test_cost_model_reads_a_calibration_file(tmp_path):
    path = tmp_path / "calibration.json"
    values = dict(attention_s_per_token_pair=2e-11, linear_s_per_token=1e-6, cp_s_per_token=3e-8,
                  cp_s_per_exchange=4e-5)
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "cost_model": values}))
    cost = CostModel.from_json(path)
    assert cost.linear_s_per_token == 1e-6 and cost.source == str(path)
    assert cost.group_cost([100, 200], 2) == pytest.approx(
        (2e-11 * (100**2 + 200**2) * 3 / 4 + 1e-6 * 300) / 2 + 3e-8 * 300 / 2 + 4e-5  # CP2: 3/4 L^2 pairs
    )
    path.write_text(json.dumps({"cost_model": values}))
    with pytest.raises(ValueError, match="--calibrate"):
        CostModel.from_json(path)
    with pytest.raises(ValueError, match="finite number"):
        CostModel(linear_s_per_token=-1.0)
