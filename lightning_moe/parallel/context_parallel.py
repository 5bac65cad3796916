"""Context parallelism: load-balanced sequence shards and causal attention across the CP group.

Sharding (Megatron-Core / TransformerEngine's causal load balancing): a sequence of ``S`` tokens
is cut into ``2 x CP`` equal chunks and rank ``i`` of the CP group holds chunks ``i`` and
``2CP-1-i`` concatenated. Every rank then has the same amount of causal attention work (one
early chunk that sees little, one late chunk that sees much).

Attention: each rank's queries attend to the keys/values of the whole sequence, exchanged in
one of two ways (Megatron's ``cp_comm_type``):

- ``"p2p"``: a ring. In step ``s`` rank ``r`` holds the keys/values of rank ``r - s`` and
  passes them to rank ``r + 1``; the partial results are merged with an online softmax (the
  log-sum-exp of each block's scores).
- ``"allgather"``: the keys/values of every rank are all-gathered once, then one attention.

The causal mask is taken from the global sequence index of every query and key (the chunk
order above), so it is exact for any CP size. The backward is autograd over the exchange: the
ring's shift and the all-gather are small autograd functions whose backward sends the
gradients the other way (gloo-capable: only send/recv, all_gather and all_reduce). Scores are
computed in fp32; the output is cast back to the query dtype.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

CPCommType = Literal["p2p", "allgather"]
CP_COMM_TYPES: tuple[str, ...] = ("p2p", "allgather")


def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """Raise (before any collective) when ``seq_len`` cannot be cut into ``2 x cp_size`` chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x context_parallel_size = {2 * cp_size}: pad or "
            f"truncate sequences to a multiple of {2 * cp_size} (e.g. the data module's sequence length), or "
            "choose a context_parallel_size that divides half the sequence length."
        )


def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None) -> Tensor:
    """Global sequence indices ``[seq_len / cp_size]`` held by ``cp_rank``: chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``, in that order."""
    check_sequence_length(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, device=device)])


def shard_sequence(t: Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> Tensor:
    """This rank's load-balanced shard of ``t`` along ``dim`` (the sequence dimension)."""
    if cp_size == 1:
        return t
    return t.index_select(dim, load_balanced_indices(t.shape[dim], cp_size, cp_rank, t.device))


def unshard_sequence(shards: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard (in CP rank order)."""
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


class _RingShift(torch.autograd.Function):
    """Send ``x`` to the next rank of the ring, return the previous rank's; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _shift(x.contiguous(), group, step=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _shift(grad.contiguous(), ctx.group, step=-1), None


def _shift(x: Tensor, group: dist.ProcessGroup, step: int) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + step) % size), group),
        dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % size), group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class _AllGather(torch.autograd.Function):
    """``[*shape]`` on each rank -> ``[CP, *shape]`` on every rank; backward sums the gradient of
    this rank's slot over the group (all_reduce, which gloo has; reduce_scatter it has not)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _block_attention(
    q_BHSd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, visible_ST: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """fp32 attention of one query block over one key block: output ``[B, H, S, d]`` and the
    log-sum-exp of the scores ``[B, H, S]``.

    Hidden scores take the lowest finite fp32 value, not -inf: a query row that sees no key of
    this block gets a log-sum-exp near that value, so its weight in the merge is exactly 0 and
    its gradients are 0, not NaN.
    """
    scores = torch.matmul(q_BHSd, k_BHTd.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible_ST, torch.finfo(scores.dtype).min)
    lse_BHS = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse_BHS.unsqueeze(-1))
    return torch.matmul(probs, v_BHTd), lse_BHS


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def context_parallel_attention(
    q_BHSd: Tensor,
    k_BGSd: Tensor,
    v_BGSd: Tensor,
    group: Optional[dist.ProcessGroup],
    comm_type: CPCommType = "p2p",
    scale: Optional[float] = None,
) -> Tensor:
    """Causal attention of this rank's load-balanced shard over the whole sequence of the CP group.

    A drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``
    where ``q``/``k``/``v`` are this rank's shard (:func:`shard_sequence` order, ``S = S_full / CP``)
    and ``group`` is the CP group (the strategy's ``context_parallel_group``; None or one rank:
    plain causal attention). ``G`` key/value heads serve ``H`` query heads (grouped-query
    attention, ``H % G == 0``). Returns ``[B, H, S, d]`` in the query dtype.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r}: choose one of {CP_COMM_TYPES}.")
    heads, groups = q_BHSd.shape[1], k_BGSd.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} key/value heads.")
    scale = 1.0 / math.sqrt(q_BHSd.shape[-1]) if scale is None else scale
    cp_size = 1 if group is None else dist.get_world_size(group)
    cp_rank = 0 if group is None else dist.get_rank(group)
    seq_local = q_BHSd.shape[2]
    seq_full = seq_local * cp_size
    device = q_BHSd.device
    q_idx = load_balanced_indices(seq_full, cp_size, cp_rank, device)
    q = q_BHSd.float()
    kv_2BGSd = torch.stack([k_BGSd, v_BGSd]).float()

    def attend(kv: Tensor, source_rank: int) -> tuple[Tensor, Tensor]:
        k_idx = load_balanced_indices(seq_full, cp_size, source_rank, device)
        visible_ST = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in kv.unbind(0))
        return _block_attention(q, k, v, visible_ST, scale)

    if cp_size == 1:
        out, _ = attend(kv_2BGSd, 0)
    elif comm_type == "allgather":
        kv_C2BGSd = _AllGather.apply(kv_2BGSd, group)
        # every rank's keys at once: concatenate the ranks' shards along the sequence
        kv_all = torch.cat(kv_C2BGSd.unbind(0), dim=-2)
        k_idx = torch.cat([load_balanced_indices(seq_full, cp_size, r, device) for r in range(cp_size)])
        visible_ST = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in kv_all.unbind(0))
        out, _ = _block_attention(q, k, v, visible_ST, scale)
    else:
        # Step 0 is this rank's own block (every query sees at least itself: a finite lse);
        # step s holds rank (r - s)'s keys/values while they travel on around the ring.
        out, lse = attend(kv_2BGSd, cp_rank)
        kv = kv_2BGSd
        for step in range(1, cp_size):
            kv = _RingShift.apply(kv, group)
            out, lse = _merge(out, lse, *attend(kv, (cp_rank - step) % cp_size))
    return out.to(q_BHSd.dtype)
