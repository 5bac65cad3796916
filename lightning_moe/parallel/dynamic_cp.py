"""Dynamic context parallelism: which sub-group of the DP x CP ranks runs each sequence.

Plain Python (no torch.distributed, no Lightning): given the lengths of one micro-batch's
sequences (the documents of every data-parallel replica's packed rows), choose

* a partition of the ``P = DP x CP`` ranks into aligned sub-groups of sizes ``1, 2, 4, ...,
  max_cp`` (a group of size ``c`` covers ranks ``[o, o + c)`` with ``o`` a multiple of ``c``, so
  the groups are among those made once at setup, :func:`aligned_blocks`), and
* the sub-group of every sequence (a sequence runs context-parallel over its group: each rank
  holds chunks ``i`` and ``2c-1-i`` of its ``2c`` chunks, :func:`chunk_bounds`),

minimizing the largest per-rank cost of :class:`CostModel` while no rank holds more than
``memory_limit_tokens`` tokens. The search is deterministic (same lengths, same plan on every
rank, no communication): the static layout (each DP replica's sequences over its CP group) is the
first candidate; hill climbs over partitions (split a group in two halves, merge two equal groups)
from it, from all groups at the largest size, from all ranks alone and from a partition sized to
the lengths place the sequences of each candidate by longest-first greedy and keep the best. The
result is never worse than the static layout on the cost model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

#: Calibration file written by ``benchmarks/dynamic_cp_sim.py --calibrate``.
CALIBRATION_FORMAT = "lightning_moe.dynamic_cp.calibration/1"


@dataclass(frozen=True)
class CostModel:
    """Per-rank time of one micro-batch's forward and backward, in seconds.

    A rank of a sub-group of ``c`` ranks running sequences of lengths ``L_j`` costs::

        sum_j (attention_s_per_token_pair * L_j**2 / 2 + linear_s_per_token * L_j) / c
        + (c > 1) * (cp_s_per_token * (c - 1) / c * sum_j L_j + cp_s_per_exchange * (c - 1))

    with ``L_j**2 / 2`` replaced by ``L_j**2 (c + 1) / (2 c)`` when ``c > 1``
    (:func:`attention_pairs`: alone a rank runs causal SDPA per sequence, ``L**2 / 2`` query-key
    pairs; a group runs the ring's fp32 blocks per sequence, its own block whole and the visible
    half of the others'; everything else, MoE included, is linear in tokens; the ring passes each
    rank's keys/values ``c - 1`` times, once per group and layer stack). One attention constant
    serves both kernels: calibrated on SDPA, it under-counts the fp32 blocks of a group on a GPU.
    Constants are for the whole model (all layers). The defaults are a FLOP estimate for Qwen3-30B-A3B (`lightning_moe.models.flops`:
    1.83e10 training FLOPs per token outside attention, 2.36e6 per causal query-key pair over its
    48 layers) at 400 TFLOP/s, and the ring's traffic as ``benchmarks/dynamic_cp_sim.py`` assumes
    it (2 KiB of bf16 keys/values per token and layer moved 3 times per ring step at 150 GB/s;
    20 us per step and layer). Replace them by a measurement: ``CostModel.from_json(path)`` reads
    what ``benchmarks/dynamic_cp_sim.py --calibrate`` writes on the target GPU.
    """

    attention_s_per_token_pair: float = 5.9e-9
    linear_s_per_token: float = 4.6e-5
    cp_s_per_token: float = 2.0e-6
    cp_s_per_exchange: float = 2.9e-3
    source: str = "default: FLOP estimate (not measured)"

    def __post_init__(self) -> None:
        for name in ("attention_s_per_token_pair", "linear_s_per_token", "cp_s_per_token", "cp_s_per_exchange"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}.")

    def compute(self, length: int, cp: int) -> float:
        """Attention and linear time of one sequence on each of ``cp`` ranks: the query-key pairs
        the kernels compute (:func:`attention_pairs`) and the linear work, shared by the group."""
        return (self.attention_s_per_token_pair * attention_pairs(length, cp) + self.linear_s_per_token * length) / cp

    def communication(self, tokens: int, cp: int) -> float:
        """CP exchange time of a group of ``cp`` ranks sharing ``tokens`` tokens (0 for one rank)."""
        if cp == 1:
            return 0.0
        return self.cp_s_per_token * (cp - 1) / cp * tokens + self.cp_s_per_exchange * (cp - 1)

    def group_cost(self, lengths: Sequence[int], cp: int) -> float:
        """Per-rank time of a group of ``cp`` ranks running ``lengths`` (0 when empty)."""
        if not lengths:
            return 0.0
        return sum(self.compute(n, cp) for n in lengths) + self.communication(sum(lengths), cp)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "CostModel":
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown CostModel fields {unknown}; expected a subset of {sorted(names)}.")
        return cls(**values)

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> "CostModel":
        """The ``cost_model`` entry of a calibration JSON (``benchmarks/dynamic_cp_sim.py --calibrate``)."""
        data = json.loads(Path(path).read_text())
        if data.get("format") != CALIBRATION_FORMAT or "cost_model" not in data:
            raise ValueError(
                f"{path} is not a dynamic-CP calibration (format {CALIBRATION_FORMAT!r} with a 'cost_model' entry): "
                "write one with `python benchmarks/dynamic_cp_sim.py --calibrate --out <file>` on the target GPU."
            )
        return cls.from_dict({**data["cost_model"], "source": str(path)})


def attention_pairs(length: int, cp: int) -> float:
    """Query-key pairs the attention of one sequence computes over a group of ``cp`` ranks, all
    ranks together. Alone (``cp = 1``): causal SDPA, ``L**2 / 2``. Over a group: the ring's fp32
    blocks, each rank its own block whole (``(L / c)**2``, masked) and the visible half of each of
    the ``c - 1`` blocks it receives, ``L**2 (c + 1) / (2 c)`` in all (the all-gather exchange
    computes every pair, ``L**2``: more than this counts)."""
    if cp == 1:
        return length * length / 2
    return length * length * (cp + 1) / (2 * cp)


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def aligned_blocks(pool_size: int, max_cp: int) -> list[tuple[int, int]]:
    """Every sub-group a plan may use with more than one rank, as ``(offset, size)``: the aligned
    blocks of sizes ``2, 4, ..., max_cp`` of ``pool_size`` ranks (made once at setup, in this order)."""
    blocks = []
    size = 2
    while size <= max_cp:
        blocks += [(offset, size) for offset in range(0, pool_size - size + 1, size)]
        size *= 2
    return blocks


def chunk_bounds(length: int, cp: int) -> list[int]:
    """Edges of the ``2 cp`` load-balancing chunks of a sequence (``2 cp + 1`` ints from 0 to
    ``length``; chunk sizes differ by at most one, so no padding is needed)."""
    return [k * length // (2 * cp) for k in range(2 * cp + 1)]


def rank_token_counts(length: int, cp: int) -> list[int]:
    """Tokens of one sequence on each rank of a group of ``cp``: chunks ``i`` and ``2cp-1-i``."""
    edges = chunk_bounds(length, cp)
    sizes = [edges[k + 1] - edges[k] for k in range(2 * cp)]
    return [sizes[i] + sizes[2 * cp - 1 - i] for i in range(cp)]


@dataclass(frozen=True)
class Plan:
    """Where one micro-batch's sequences run.

    Attributes:
        group_sizes: size of each sub-group; group ``g`` covers the pool ranks
            ``[group_offsets[g], group_offsets[g] + group_sizes[g])``.
        group_offsets: first pool rank of each group (a multiple of its size).
        sequence_group: the group of every sequence, in input order.
        max_cost: the modelled time of the micro-batch (largest per-rank cost).
        static_cost: the same for the static layout.
        rank_tokens: tokens held by each pool rank.
    """

    group_sizes: tuple[int, ...]
    group_offsets: tuple[int, ...]
    sequence_group: tuple[int, ...]
    max_cost: float
    static_cost: float
    rank_tokens: tuple[int, ...] = field(default=())

    def group_of_rank(self, pool_rank: int) -> int:
        for g, (offset, size) in enumerate(zip(self.group_offsets, self.group_sizes)):
            if offset <= pool_rank < offset + size:
                return g
        raise ValueError(f"pool rank {pool_rank} is in no group of {self.group_sizes}.")

    def sequences_of_group(self, group: int) -> list[int]:
        return [s for s, g in enumerate(self.sequence_group) if g == group]

    def sequences_per_cp_size(self) -> dict[int, int]:
        """How many sequences run at each CP size (sizes with none left out)."""
        counts: dict[int, int] = {}
        for g in self.sequence_group:
            size = self.group_sizes[g]
            counts[size] = counts.get(size, 0) + 1
        return dict(sorted(counts.items()))


def _offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Group offsets for sizes in descending order: each a multiple of its size (powers of two)."""
    out, offset = [], 0
    for size in sizes:
        out.append(offset)
        offset += size
    return tuple(out)


class _Evaluator:
    """Places sequences on a partition and scores the result (one per plan call)."""

    def __init__(self, lengths: Sequence[int], cost: CostModel, memory_limit: Optional[int]) -> None:
        self.lengths = list(lengths)
        self.cost = cost
        self.memory_limit = memory_limit
        self._tokens: dict[tuple[int, int], list[int]] = {}

    def tokens(self, seq: int, cp: int) -> list[int]:
        key = (seq, cp)
        if key not in self._tokens:
            self._tokens[key] = rank_token_counts(self.lengths[seq], cp)
        return self._tokens[key]

    def score(
        self, sizes: Sequence[int], assignment: Sequence[int]
    ) -> Optional[tuple[tuple[float, float], tuple[int, ...]]]:
        """((largest per-rank cost, rank-seconds of all ranks), tokens per rank) of an assignment;
        None when a rank would hold no token (nothing to run) or more than the memory limit."""
        members: list[list[int]] = [[] for _ in sizes]
        for seq, g in enumerate(assignment):
            members[g].append(seq)
        worst, total, rank_tokens = 0.0, 0.0, []
        for g, size in enumerate(sizes):
            counts = [0] * size
            for seq in members[g]:
                for i, n in enumerate(self.tokens(seq, size)):
                    counts[i] += n
            if min(counts) == 0 or (self.memory_limit is not None and max(counts) > self.memory_limit):
                return None
            rank_tokens += counts
            cost = self.cost.group_cost([self.lengths[s] for s in members[g]], size)
            worst, total = max(worst, cost), total + size * cost
        return (worst, total), tuple(rank_tokens)

    def place(self, sizes: Sequence[int]) -> Optional[list[int]]:
        """Longest-first greedy: each sequence to the group where the group's cost after adding it is
        lowest (ties: the lower group index) among those where it fits in memory."""
        loads = [0.0] * len(sizes)
        tokens = [0] * len(sizes)  # total tokens per group
        peak = [[0] * size for size in sizes]
        order = sorted(range(len(self.lengths)), key=lambda s: (-self.lengths[s], s))
        assignment = [-1] * len(self.lengths)
        for seq in order:
            n = self.lengths[seq]
            best, best_cost = -1, math.inf
            for g, size in enumerate(sizes):
                if self.memory_limit is not None:
                    counts = self.tokens(seq, size)
                    if any(p + c > self.memory_limit for p, c in zip(peak[g], counts)):
                        continue
                compute = loads[g] + self.cost.compute(n, size)
                total = compute + self.cost.communication(tokens[g] + n, size)
                if total < best_cost:
                    best, best_cost = g, total
            if best < 0:
                return None
            assignment[seq] = best
            loads[best] += self.cost.compute(n, sizes[best])
            tokens[best] += n
            peak[best] = [p + c for p, c in zip(peak[best], self.tokens(seq, sizes[best]))]
        return assignment


def _neighbours(sizes: tuple[int, ...], max_cp: int) -> list[tuple[int, ...]]:
    """Partitions one step away: one group split in two halves, or two equal groups merged."""
    moves = []
    for size in sorted(set(sizes), reverse=True):
        rest = list(sizes)
        rest.remove(size)
        if size > 1:
            moves.append(tuple(sorted(rest + [size // 2, size // 2], reverse=True)))
        if size < max_cp and sizes.count(size) >= 2:
            rest.remove(size)
            moves.append(tuple(sorted(rest + [2 * size], reverse=True)))
    return moves


def _proportional_partition(
    lengths: Sequence[int], pool_size: int, max_cp: int, cost: CostModel, memory_limit: Optional[int]
) -> tuple[int, ...]:
    """A starting partition from the lengths: each sequence wants the smallest group on which it
    fits in memory and takes no longer than a balanced share of the work; each size gets ranks in
    proportion to the rank-seconds its sequences need (in whole groups, the rest at size 1)."""
    balanced = sum(cost.compute(n, 1) for n in lengths) / pool_size
    work: dict[int, float] = {}
    for n in lengths:
        size = 1
        while size < max_cp and (
            (memory_limit is not None and max(rank_token_counts(n, size)) > memory_limit)
            or cost.compute(n, size) + cost.communication(n, size) > balanced
        ):
            size *= 2
        work[size] = work.get(size, 0.0) + size * (cost.compute(n, size) + cost.communication(n, size))
    total = sum(work.values())
    sizes: list[int] = []
    for size in sorted(work, reverse=True):
        if size == 1:
            continue
        groups = max(1, round(pool_size * work[size] / total / size))
        groups = min(groups, (pool_size - sum(sizes)) // size)
        sizes += [size] * groups
    sizes += [1] * (pool_size - sum(sizes))
    return tuple(sorted(sizes, reverse=True))


def static_assignment(replicas: Sequence[int], pool_size: int, cp: int) -> tuple[list[int], list[int]]:
    """The static layout as a plan: ``pool_size / cp`` groups of ``cp`` ranks, group ``r`` running
    DP replica ``r``'s sequences. Returns (group sizes, group of each sequence)."""
    return [cp] * (pool_size // cp), list(replicas)


def static_memory_tokens(lengths: Sequence[int], replicas: Sequence[int], pool_size: int, cp: int) -> int:
    """The largest per-rank token count of the static layout (sequences chunked one by one)."""
    _, assignment = static_assignment(replicas, pool_size, cp)
    evaluator = _Evaluator(lengths, CostModel(), None)
    per_rank = [0] * pool_size
    for seq, g in enumerate(assignment):
        for i, n in enumerate(evaluator.tokens(seq, cp)):
            per_rank[g * cp + i] += n
    return max(per_rank)


def plan_micro_batch(
    lengths: Sequence[int],
    replicas: Sequence[int],
    pool_size: int,
    static_cp: int,
    max_cp: int,
    cost_model: CostModel,
    memory_limit_tokens: Optional[int] = None,
) -> Plan:
    """Plan one micro-batch.

    Args:
        lengths: tokens of every sequence of the pool's micro-batches, in a fixed order.
        replicas: the DP replica (0 .. pool_size / static_cp - 1) each sequence comes from.
        pool_size: ``DP x CP`` ranks sharing the work.
        static_cp: the strategy's context_parallel_size (the static layout, always a candidate).
        max_cp: largest sub-group; a power of two dividing ``pool_size``.
        cost_model: per-rank time model.
        memory_limit_tokens: most tokens one rank may hold; None: the static layout's largest
            per-rank count on this micro-batch (never more memory than static CP).

    Raises ValueError when no candidate fits the memory limit or gives every rank a token.
    """
    if len(lengths) != len(replicas):
        raise ValueError(f"{len(lengths)} lengths but {len(replicas)} replica indices.")
    for name, value in (("static_cp", static_cp), ("max_cp", max_cp)):
        if not is_power_of_two(value):
            raise ValueError(f"{name}={value} must be a power of two.")
    if pool_size % max_cp or pool_size % static_cp:
        raise ValueError(f"max_cp={max_cp} and static_cp={static_cp} must divide the pool of {pool_size} ranks.")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least one token.")
    if memory_limit_tokens is None:
        memory_limit_tokens = static_memory_tokens(lengths, replicas, pool_size, static_cp)
    evaluator = _Evaluator(lengths, cost_model, memory_limit_tokens)
    static_sizes, static_groups = static_assignment(replicas, pool_size, static_cp)
    static_scored = evaluator.score(static_sizes, static_groups) if static_cp <= max_cp else None
    static_cost = max(
        cost_model.group_cost([lengths[s] for s, g in enumerate(static_groups) if g == group], static_cp)
        for group in range(len(static_sizes))
    )
    # Candidates compare by their largest per-rank cost, then by the rank-seconds of all ranks (the
    # second lets the climb cross plateaus where one of several slowest groups improves).
    best: Optional[tuple[tuple[float, float], tuple[int, ...], list[int], tuple[int, ...]]] = None
    if static_scored is not None:
        best = (static_scored[0], tuple(static_sizes), static_groups, static_scored[1])

    def consider(sizes: tuple[int, ...]) -> Optional[tuple[float, float]]:
        nonlocal best
        assignment = evaluator.place(sizes)
        if assignment is None:
            return None
        scored = evaluator.score(sizes, assignment)
        if scored is None:
            return None
        if best is None or scored[0] < best[0]:
            best = (scored[0], sizes, assignment, scored[1])
        return scored[0]

    # Hill climbs over partitions (sizes in descending order: aligned offsets); each step moves to
    # the best neighbour while it improves.
    seen: set[tuple[int, ...]] = set()
    starts = (
        tuple([min(static_cp, max_cp)] * (pool_size // min(static_cp, max_cp))),
        tuple([max_cp] * (pool_size // max_cp)),
        tuple([1] * pool_size),
        _proportional_partition(lengths, pool_size, max_cp, cost_model, memory_limit_tokens),
    )
    for start in starts:
        if start in seen:
            continue
        seen.add(start)
        current, current_key = start, consider(start) or (math.inf, math.inf)
        while True:
            step = None
            for move in _neighbours(current, max_cp):
                if move in seen:
                    continue
                seen.add(move)
                key = consider(move)
                if key is not None and key < current_key and (step is None or key < step[1]):
                    step = (move, key)
            if step is None:
                break
            current, current_key = step
    if best is None:
        longest = max(lengths)
        raise ValueError(
            f"no placement of {len(lengths)} sequences (longest {longest} tokens) on {pool_size} ranks with at most "
            f"{memory_limit_tokens} tokens per rank and groups of up to {max_cp} ranks gives every rank a token and "
            "stays within memory: raise memory_limit_tokens or max_context_parallel_size, or give the micro-batch "
            "at least one token per rank."
        )
    (cost, _), sizes, assignment, rank_tokens = best
    return Plan(
        group_sizes=tuple(sizes),
        group_offsets=_offsets(sizes),
        sequence_group=tuple(assignment),
        max_cost=cost,
        static_cost=static_cost,
        rank_tokens=rank_tokens,
    )
