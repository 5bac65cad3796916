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
from dataclasses import dataclass
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
    q_BHSd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """fp32 attention of one query block over one key block: output ``[B, H, S, d]`` and the
    log-sum-exp of the scores ``[B, H, S]``; ``visible`` ``[S, T]`` or ``[B, 1, S, T]``.

    Hidden scores take the lowest finite fp32 value, not -inf: a query row that sees no key of
    this block gets a log-sum-exp near that value, so its weight in the merge is exactly 0 and
    its gradients are 0, not NaN.
    """
    scores = torch.matmul(q_BHSd, k_BHTd.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
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
    document_ids_BS: Optional[Tensor] = None,
) -> Tensor:
    """Causal attention of this rank's load-balanced shard over the whole sequence of the CP group.

    A drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``
    where ``q``/``k``/``v`` are this rank's shard (:func:`shard_sequence` order, ``S = S_full / CP``)
    and ``group`` is the CP group (the strategy's ``context_parallel_group``; None or one rank:
    plain causal attention), or a :class:`TokenShards` (dynamic context parallelism: shards of
    any sizes, each token's index given). ``G`` key/value heads serve ``H`` query heads (grouped-query
    attention, ``H % G == 0``). ``document_ids_BS``: this rank's shard of a packed batch's
    document ids (`lightning_moe.models.document_mask`); a query then sees only keys of its own
    document (they travel with the keys). Returns ``[B, H, S, d]`` in the query dtype.
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r}: choose one of {CP_COMM_TYPES}.")
    if isinstance(group, TokenShards):
        return _token_shards_attention(q_BHSd, k_BGSd, v_BGSd, group, comm_type, scale, document_ids_BS)
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

    def attend(kv: Tensor, k_idx: Tensor, k_docs_BT: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        visible = k_idx.unsqueeze(0) <= q_idx.unsqueeze(1)  # [S, T]
        if k_docs_BT is not None:  # [B, 1, S, T]: also the same document
            visible = (visible & (document_ids_BS.unsqueeze(2) == k_docs_BT.unsqueeze(1))).unsqueeze(1)
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in kv.unbind(0))
        return _block_attention(q, k, v, visible, scale)

    if cp_size == 1:
        out, _ = attend(kv_2BGSd, q_idx, document_ids_BS)
    elif comm_type == "allgather":
        kv_C2BGSd = _AllGather.apply(kv_2BGSd, group)
        # every rank's keys at once: the ranks' shards side by side along the sequence
        kv_all = torch.cat(kv_C2BGSd.unbind(0), dim=-2)
        k_idx = torch.cat([load_balanced_indices(seq_full, cp_size, r, device) for r in range(cp_size)])
        k_docs = None
        if document_ids_BS is not None:
            parts = [torch.empty_like(document_ids_BS) for _ in range(cp_size)]
            dist.all_gather(parts, document_ids_BS.contiguous(), group=group)
            k_docs = torch.cat(parts, dim=1)
        out, _ = attend(kv_all, k_idx, k_docs)
    else:
        # Step 0 is this rank's own block (every query sees at least itself: a finite lse);
        # step s holds rank (r - s)'s keys/values while they travel on around the ring.
        out, lse = attend(kv_2BGSd, q_idx, document_ids_BS)
        kv, k_docs = kv_2BGSd, document_ids_BS
        for step in range(1, cp_size):
            kv = _RingShift.apply(kv, group)
            if k_docs is not None:
                k_docs = _shift(k_docs.contiguous(), group, step=1)
            k_idx = load_balanced_indices(seq_full, cp_size, (cp_rank - step) % cp_size, device)
            out, lse = _merge(out, lse, *attend(kv, k_idx, k_docs))
    return out.to(q_BHSd.dtype)


@dataclass(frozen=True)
class TokenShards:
    """This rank's tokens under dynamic context parallelism (`lightning_moe.parallel.dynamic_cp`):
    shards of uneven sizes, so the causal order comes with the tokens instead of from the chunk
    arithmetic of :func:`load_balanced_indices`.

    Attributes:
        group: the sub-group sharing this rank's sequences (None: this rank alone).
        index_BS: ``[B, S]`` int64, each local token's place in its sub-group's sequences laid end
            to end (a query sees keys of its sequence with an index not above its own).
        max_tokens: the largest ``S`` of any rank of the group (known from the plan: no sync);
            keys/values are padded to it for the exchange.
        sequence_tokens: ``[group rank][sequence]`` tokens of each of the group's sequences on each
            rank of the group (from the plan); every rank holds its sequences one after the other
            in that order, so these counts give each sequence's slice of every rank's block.
        first_chunk_tokens: ``[group rank][sequence]`` how many of those are the rank's early
            chunk (``i`` of ``2c``); the rest are its late chunk ``2c-1-i``.
    """

    group: Optional[dist.ProcessGroup]
    index_BS: Tensor
    max_tokens: int
    sequence_tokens: tuple[tuple[int, ...], ...]
    first_chunk_tokens: tuple[tuple[int, ...], ...]


def _slices(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive runs of ``counts`` tokens."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def _token_shards_attention(
    q_BHSd: Tensor,
    k_BGSd: Tensor,
    v_BGSd: Tensor,
    shards: TokenShards,
    comm_type: CPCommType,
    scale: Optional[float],
    document_ids_BS: Optional[Tensor],
) -> Tensor:
    """:func:`context_parallel_attention` over shards of uneven sizes (:class:`TokenShards`).

    Attention is computed sequence by sequence, never across sequences: a rank alone runs causal
    ``F.scaled_dot_product_attention`` on each of its (whole, in-order) sequences; a group runs the
    ring's (or the all-gather's) fp32 block attention per sequence, on that sequence's slices of the
    query and key blocks (``sequence_tokens``). The ring computes only the visible part of each
    block it receives (the chunk order says which, so no mask): from a rank ``j < i`` all queries
    over ``j``'s early chunk, from a rank ``j > i`` the late-chunk queries over all of ``j``'s keys;
    its own block is masked by the tokens' indices. The all-gather attends each query to all of its
    sequence's keys, masked. The sequences are those of ``shards``, whose numbering
    ``document_ids_BS`` repeats (it is not read).
    """
    heads, groups = q_BHSd.shape[1], k_BGSd.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads are not a multiple of {groups} key/value heads.")
    scale = 1.0 / math.sqrt(q_BHSd.shape[-1]) if scale is None else scale
    group = shards.group
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if len(shards.sequence_tokens) != size or sum(shards.sequence_tokens[rank]) != q_BHSd.shape[2]:
        raise ValueError(
            f"TokenShards.sequence_tokens gives {len(shards.sequence_tokens)} ranks (the group has {size}) or "
            f"tokens that do not add up to this rank's {q_BHSd.shape[2]}: build it from the same plan as the batch."
        )
    slices_R = [_slices(counts) for counts in shards.sequence_tokens]
    mine = slices_R[rank]
    if size == 1:  # whole sequences in causal order: the kernel one process uses, per sequence
        gqa = heads != groups
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                q_BHSd[:, :, a:b], k_BGSd[:, :, a:b], v_BGSd[:, :, a:b], is_causal=True, scale=scale, enable_gqa=gqa
            )
            for a, b in mine
        ]
        return torch.cat(outs, dim=2)
    q = q_BHSd.float()
    q_idx_BS = shards.index_BS
    kv_2BGSd = torch.stack([k_BGSd, v_BGSd]).float()

    Part = Optional[tuple[Tensor, Tensor]]  # a sequence's (output, log-sum-exp), None: no keys

    def attend(kv: Tensor, k_idx_BT: Tensor, key_slices: list[tuple[int, int]]) -> list[Part]:
        """Each sequence's queries over its keys in ``kv`` (None where this block holds none)."""
        parts: list[Part] = []
        for (qa, qb), (ka, kb) in zip(mine, key_slices):
            if kb == ka or qb == qa:
                parts.append(None)
                continue
            visible = k_idx_BT[:, ka:kb].unsqueeze(1) <= q_idx_BS[:, qa:qb].unsqueeze(2)  # [B, n, m]
            k, v = (t[:, :, ka:kb].repeat_interleave(heads // groups, dim=1) for t in kv.unbind(0))
            parts.append(_block_attention(q[:, :, qa:qb], k, v, visible.unsqueeze(1), scale))
        return parts

    pad = shards.max_tokens - q_BHSd.shape[2]
    kv_pad = torch.nn.functional.pad(kv_2BGSd, (0, 0, 0, pad))
    idx_pad = torch.nn.functional.pad(q_idx_BS, (0, pad))
    if comm_type == "allgather":
        kv_R2BGTd = _AllGather.apply(kv_pad, group)
        idx_parts = [torch.empty_like(idx_pad) for _ in range(size)]
        dist.all_gather(idx_parts, idx_pad.contiguous(), group=group)
        outs = []
        for j, (qa, qb) in enumerate(mine):
            if qb == qa:
                outs.append(q_BHSd.new_zeros(*q_BHSd.shape[:2], 0, q_BHSd.shape[3]).float())
                continue
            kv_j = torch.cat([kv_R2BGTd[r][..., slices_R[r][j][0]:slices_R[r][j][1], :] for r in range(size)], dim=-2)
            idx_j = torch.cat([idx_parts[r][:, slices_R[r][j][0]:slices_R[r][j][1]] for r in range(size)], dim=-1)
            visible = idx_j.unsqueeze(1) <= q_idx_BS[:, qa:qb].unsqueeze(2)
            k, v = (t.repeat_interleave(heads // groups, dim=1) for t in kv_j.unbind(0))
            outs.append(_block_attention(q[:, :, qa:qb], k, v, visible.unsqueeze(1), scale)[0])
        return torch.cat(outs, dim=2).to(q_BHSd.dtype)
    # Ring: step 0 is this rank's own block (every query sees itself: a finite lse); step s holds
    # rank (r - s)'s block while it travels on.
    merged = attend(kv_2BGSd, q_idx_BS, mine)
    all_visible = torch.ones((), dtype=torch.bool, device=q.device)
    firsts = shards.first_chunk_tokens
    kv = kv_pad
    for step in range(1, size):
        kv = _RingShift.apply(kv, group)
        src = (rank - step) % size
        for j, ((qa, qb), (ka, kb)) in enumerate(zip(mine, slices_R[src])):
            if merged[j] is None:  # no queries of this sequence here
                continue
            if src < rank:  # every query over the source's early chunk
                q_lo, q_hi, k_hi = qa, qb, ka + firsts[src][j]
            else:  # the late-chunk queries over all of the source's keys
                q_lo, q_hi, k_hi = qa + firsts[rank][j], qb, kb
            if q_hi == q_lo or k_hi == ka:
                continue
            k, v = (t[:, :, ka:k_hi].repeat_interleave(heads // groups, dim=1) for t in kv.unbind(0))
            part = _block_attention(q[:, :, q_lo:q_hi], k, v, all_visible, scale)
            out, lse = merged[j]
            lo, hi = q_lo - qa, q_hi - qa
            new_out, new_lse = _merge(out[:, :, lo:hi], lse[:, :, lo:hi], *part)
            merged[j] = (
                torch.cat([out[:, :, :lo], new_out, out[:, :, hi:]], dim=2),
                torch.cat([lse[:, :, :lo], new_lse, lse[:, :, hi:]], dim=2),
            )
    outs = [
        part[0] if part is not None else q.new_zeros(*q.shape[:2], 0, q.shape[3])
        for part in merged
    ]
    return torch.cat(outs, dim=2).to(q_BHSd.dtype)


#: Batch entries whose dimension 1 is the sequence: sharded by :func:`shard_batch`.
SEQUENCE_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids", "document_ids", "loss_mask")


def shard_batch(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's load-balanced shard of a batch dict: every ``SEQUENCE_KEYS`` tensor ``[B, S, ...]``
    cut along dim 1; other entries unchanged. Without ``position_ids`` the global positions
    ``0..S-1`` are added first (RoPE must see each token's position in the whole sequence).

    Raises (before any collective): ``S`` not divisible by ``2 x cp_size``; a packed batch
    (``document_ids``) without ``position_ids``.
    """
    input_ids = batch["input_ids"]
    batch_size, seq_len = input_ids.shape[:2]
    check_sequence_length(seq_len, cp_size)
    out = dict(batch)
    if "position_ids" not in out:
        if "document_ids" in out:
            raise ValueError(
                "a packed batch (document_ids) needs position_ids under context parallelism: positions restart at "
                "each document, which a shard cannot see; add them in the data module (LMDataModule does)."
            )
        out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len)
    for key in SEQUENCE_KEYS:
        value = out.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            out[key] = shard_sequence(value, cp_size, cp_rank, dim=1)
    return out


def token_mean_over_group(
    local_mean: Tensor, labels: Tensor, group: Optional[dist.ProcessGroup], ignore_index: int = -100
) -> Tensor:
    """A CP rank's token-mean loss turned into the CP group's (one all-reduce of two scalars).

    Value: the mean over every labelled token of the group's sequences (what one process gets).
    Gradient: that of ``CP x n_local / n_group x local_mean``, so that gradients averaged over
    the CP ranks (with DP: over DP x CP) are the gradient of the group's token mean, also when
    ranks hold different numbers of labelled tokens. With equal counts it is ``local_mean``'s.
    """
    if group is None or dist.get_world_size(group) == 1:
        return local_mean
    cp_size = dist.get_world_size(group)
    count = (labels != ignore_index).sum().to(torch.float32)
    stats = torch.stack([count, local_mean.detach().float() * count])
    dist.all_reduce(stats, group=group)
    total = stats[0].clamp(min=1.0)
    for_grad = local_mean * (count * cp_size / total).to(local_mean.dtype)
    value = (stats[1] / total).to(local_mean.dtype)
    return for_grad + (value - for_grad).detach()
