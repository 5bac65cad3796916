"""Dynamic context parallelism, the data side: the sequences of a micro-batch and one rank's share.

The pool batch is every DP replica's micro-batch stacked along the batch dimension (``[R, S]``
rows, replica ``r`` holding rows ``r * B .. (r + 1) * B - 1``). Its sequences are the documents
of packed rows (runs of equal ``document_ids``) or, unpacked, the rows themselves.
:func:`rank_batch` lays out one rank's tokens as a single row ``[1, T]``: for each sequence of
its sub-group (in pool order), chunks ``i`` and ``2c-1-i`` of the sequence's ``2c`` chunks
(`lightning_moe.parallel.dynamic_cp.chunk_bounds`), with document ids numbering the group's
sequences and each token's index in the group's sequences laid end to end for the attention
(`lightning_moe.parallel.context_parallel.TokenShards`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_moe.parallel.context_parallel import SEQUENCE_KEYS
from lightning_moe.parallel.dynamic_cp import Plan, chunk_bounds, rank_token_counts


@dataclass(frozen=True)
class PoolSequences:
    """The sequences of a pool batch, in row-major order.

    Attributes:
        lengths: tokens of each sequence.
        replicas: the DP replica each comes from.
        flat_starts: index of its first token in the flattened ``[R * S]`` pool batch.
    """

    lengths: list[int]
    replicas: list[int]
    flat_starts: list[int]


def find_sequences(document_ids_RS: Optional[Tensor], rows: int, seq_len: int, rows_per_replica: int) -> PoolSequences:
    """The sequences of a pool batch of ``rows x seq_len`` tokens: runs of equal ids in each row of
    ``document_ids_RS`` (a CPU tensor), or each whole row when it is None."""
    lengths, replicas, starts = [], [], []
    if document_ids_RS is None:
        for row in range(rows):
            lengths.append(seq_len)
            replicas.append(row // rows_per_replica)
            starts.append(row * seq_len)
        return PoolSequences(lengths, replicas, starts)
    change_RS = torch.ones(rows, seq_len, dtype=torch.bool)
    change_RS[:, 1:] = document_ids_RS[:, 1:] != document_ids_RS[:, :-1]
    flat_starts = change_RS.reshape(-1).nonzero().squeeze(1).tolist()
    ends = flat_starts[1:] + [rows * seq_len]
    for start, end in zip(flat_starts, ends):
        lengths.append(end - start)
        replicas.append(start // seq_len // rows_per_replica)
        starts.append(start)
    return PoolSequences(lengths, replicas, starts)


@dataclass(frozen=True)
class RankShare:
    """One rank's tokens under a plan.

    Attributes:
        flat_index_T: index of each of its tokens in the flattened pool batch.
        document_ids_T: the number of its sequence within the sub-group (0, 1, ...).
        index_T: its place in the sub-group's sequences laid end to end.
        group: the rank's sub-group in the plan.
        max_tokens: the most tokens any rank of that sub-group holds.
        sequence_tokens: ``[group rank][sequence]`` tokens of each of the group's sequences on each
            of its ranks (`lightning_moe.parallel.context_parallel.TokenShards`).
        first_chunk_tokens: ``[group rank][sequence]`` how many of those are the rank's early chunk.
    """

    flat_index_T: Tensor
    document_ids_T: Tensor
    index_T: Tensor
    group: int
    max_tokens: int
    sequence_tokens: tuple[tuple[int, ...], ...]
    first_chunk_tokens: tuple[tuple[int, ...], ...]


def rank_share(sequences: PoolSequences, plan: Plan, pool_rank: int) -> RankShare:
    """Which tokens of the pool batch ``pool_rank`` holds under ``plan``, in the order it holds them."""
    group = plan.group_of_rank(pool_rank)
    offset, size = plan.group_offsets[group], plan.group_sizes[group]
    i = pool_rank - offset
    flat, docs, index = [], [], []
    end_to_end = 0
    for doc, seq in enumerate(plan.sequences_of_group(group)):
        length, start = sequences.lengths[seq], sequences.flat_starts[seq]
        edges = chunk_bounds(length, size)
        for chunk in (i, 2 * size - 1 - i):
            lo, hi = edges[chunk], edges[chunk + 1]
            flat.append(torch.arange(start + lo, start + hi))
            index.append(torch.arange(end_to_end + lo, end_to_end + hi))
            docs.append(torch.full((hi - lo,), doc))
        end_to_end += length
    flat_index_T = torch.cat(flat)
    if plan.rank_tokens and flat_index_T.numel() != plan.rank_tokens[pool_rank]:
        raise AssertionError(
            f"rank {pool_rank}: {flat_index_T.numel()} tokens, the plan says {plan.rank_tokens[pool_rank]}"
        )
    max_tokens = max(plan.rank_tokens[offset : offset + size]) if plan.rank_tokens else flat_index_T.numel()
    members = plan.sequences_of_group(group)
    per_sequence = [rank_token_counts(sequences.lengths[seq], size) for seq in members]
    sequence_tokens = tuple(tuple(counts[r] for counts in per_sequence) for r in range(size))
    edges = [chunk_bounds(sequences.lengths[seq], size) for seq in members]
    first_chunk_tokens = tuple(tuple(e[r + 1] - e[r] for e in edges) for r in range(size))
    return RankShare(
        flat_index_T, torch.cat(docs), torch.cat(index), group, max_tokens, sequence_tokens, first_chunk_tokens
    )


def rank_batch(pool_batch: dict, share: RankShare, position_ids_RS: Tensor) -> dict:
    """The rank's batch ``[1, T]``: every sequence tensor of the pool batch (``SEQUENCE_KEYS``)
    gathered at ``share.flat_index_T``; ``position_ids`` from ``position_ids_RS`` (the pool's, or
    derived), ``document_ids`` the share's. Other tensor entries are refused: their meaning per
    token is unknown."""
    out: dict = {}
    for key, value in pool_batch.items():
        if key in ("position_ids", "document_ids"):
            continue
        if key in SEQUENCE_KEYS and isinstance(value, Tensor):
            out[key] = _gather(value, share.flat_index_T)
        elif isinstance(value, Tensor):
            raise ValueError(
                f"DynamicContextParallel moves sequences between ranks and does not know how to move batch entry "
                f"{key!r}: keep only {SEQUENCE_KEYS} (tensors [B, S]) in the batch, or use static context parallelism."
            )
        else:
            out[key] = value
    device = pool_batch["input_ids"].device  # the plan's indices live on the host
    out["position_ids"] = _gather(position_ids_RS, share.flat_index_T)
    out["document_ids"] = share.document_ids_T.to(device).unsqueeze(0)
    return out


def _gather(t_RS: Tensor, flat_index_T: Tensor) -> Tensor:
    rows, seq = t_RS.shape[:2]
    return t_RS.reshape(rows * seq, *t_RS.shape[2:]).index_select(0, flat_index_T.to(t_RS.device)).unsqueeze(0)
