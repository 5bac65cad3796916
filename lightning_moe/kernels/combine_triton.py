"""Triton kernels for the weighted gather-reduce that combines expert outputs per token.

``combine``:  out[t] = sum_k w[t,k] * y[dest[t,k]]            (dest == R: dropped, skipped)
``combine_backward``: grad_y[dest[t,k]] = w[t,k] * g[t]  and  grad_w[t,k] = <y[dest[t,k]], g[t]>

One program per token streams over D in blocks; the K rows of a token are loaded together, so
no [T, K, D] intermediate is written, accumulation is fp32 and activations keep their dtype.
Every permuted row belongs to at most one (t, k), so the backward scatter needs no atomics.

Fused with the expert-parallel exchange (``combine_to_peers`` / ``combine_own`` and
``combine_backward(g_ptrs_G=...)``): the partial sums of other ranks' tokens are stored straight
into their symmetric-memory buffers, and the gradient rows of other ranks' tokens are loaded from
theirs, so the reduce-scatter after the combine and the all-gather before its backward run
inside these kernels instead of as separate collectives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import launch


@triton.jit
def _weighted_rows(y_ptr, dest_ptr, w_ptr, t, offs_d, dmask, num_rows, D, K: tl.constexpr, BD: tl.constexpr):
    """fp32 ``sum_k w[t,k] * y[dest[t,k], offs_d]``; the K rows are visited in an unrolled loop so
    the sum stays in registers (no cross-warp reduction)."""
    acc = tl.zeros([BD], dtype=tl.float32)
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + t * K + k)
        w = tl.load(w_ptr + t * K + k).to(tl.float32)
        y = tl.load(y_ptr + dest.to(tl.int64) * D + offs_d, mask=dmask & (dest < num_rows), other=0.0)
        acc += y.to(tl.float32) * w
    return acc


@triton.jit
def _combine_fwd_kernel(y_ptr, dest_ptr, w_ptr, out_ptr, num_rows, D, K: tl.constexpr, BD: tl.constexpr):
    # One program per (token, D-block).
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = offs_d < D
    acc = _weighted_rows(y_ptr, dest_ptr, w_ptr, t, offs_d, dmask, num_rows, D, K, BD)
    tl.store(out_ptr + t.to(tl.int64) * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _combine_to_peers_kernel(
    y_ptr, dest_ptr, w_ptr, slot_ptrs, num_rows, D, T, me, K: tl.constexpr, BD: tl.constexpr
):
    # One program per (token of a peer's block, D-block): the tokens are ordered by owning rank,
    # T per rank. Rank b's partial sums are stored straight into rank b's symmetric buffer (its
    # base address is slot_ptrs[b]), in the slot of this rank: row me*T + (t mod T).
    i = tl.program_id(0)
    block = i // T
    block = block + (block >= me).to(block.dtype)  # skip this rank's own block
    within = i % T
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = offs_d < D
    acc = _weighted_rows(y_ptr, dest_ptr, w_ptr, block * T + within, offs_d, dmask, num_rows, D, K, BD)
    base = tl.load(slot_ptrs + block).to(tl.pointer_type(y_ptr.dtype.element_ty))
    tl.store(base + (me * T + within).to(tl.int64) * D + offs_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _combine_own_kernel(
    y_ptr, dest_ptr, w_ptr, slots_ptr, out_ptr, num_rows, D, T, me, G, K: tl.constexpr, BD: tl.constexpr
):
    # One program per (token of this rank's block, D-block): its own partial sum, rounded to the
    # row dtype as every peer rounded the partial it sent, plus the peers' partials from this
    # rank's slots, summed in fp32 and rounded once.
    i = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = offs_d < D
    acc = _weighted_rows(y_ptr, dest_ptr, w_ptr, me * T + i, offs_d, dmask, num_rows, D, K, BD)
    total = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    for g in range(G):
        if g != me:
            part = tl.load(slots_ptr + (g * T + i).to(tl.int64) * D + offs_d, mask=dmask, other=0.0)
            total += part.to(tl.float32)
    tl.store(out_ptr + i.to(tl.int64) * D + offs_d, total.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _combine_bwd_kernel(
    y_ptr, dest_ptr, w_ptr, g_ptr, grad_y_ptr, grad_w_ptr, num_rows, D, g_ptrs, T,
    K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, NEED_GW: tl.constexpr, NEED_GY: tl.constexpr,
    G_REMOTE: tl.constexpr,
):
    t = tl.program_id(0)
    if G_REMOTE:
        # Token t's gradient row lives on its owner, rank t // T, at row t mod T of that rank's
        # symmetric buffer (base address g_ptrs[t // T]): loaded over the peer link.
        g_row = tl.load(g_ptrs + t // T).to(tl.pointer_type(g_ptr.dtype.element_ty)) + (t % T).to(tl.int64) * D
    else:
        g_row = g_ptr + t.to(tl.int64) * D
    offs_k = tl.arange(0, KP)
    kmask = offs_k < K
    dest = tl.load(dest_ptr + t * K + offs_k, mask=kmask, other=num_rows)
    w = tl.load(w_ptr + t * K + offs_k, mask=kmask, other=0.0).to(tl.float32)
    valid = kmask & (dest < num_rows)
    row_off = dest.to(tl.int64) * D
    dot = tl.zeros([KP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        dmask = offs_d < D
        g = tl.load(g_row + offs_d, mask=dmask, other=0.0).to(tl.float32)
        m2 = valid[:, None] & dmask[None, :]
        if NEED_GW:
            y = tl.load(y_ptr + row_off[:, None] + offs_d[None, :], mask=m2, other=0.0)
            dot += tl.sum(y.to(tl.float32) * g[None, :], axis=1)
        if NEED_GY:
            gy = w[:, None] * g[None, :]
            tl.store(grad_y_ptr + row_off[:, None] + offs_d[None, :], gy.to(grad_y_ptr.dtype.element_ty), mask=m2)
    if NEED_GW:
        tl.store(grad_w_ptr + t * K + offs_k, dot, mask=kmask)


@triton.jit
def _zero_unowned_rows_kernel(out_ptr, row_token_ptr, end_ptr, num_tokens, R, D, BR: tl.constexpr,
                              BD: tl.constexpr, HAS_END: tl.constexpr):
    # Rows whose token is the sentinel T (padding: no assignment writes them) become zero;
    # every other row is left alone, so only the padding is written, not the whole buffer.
    # With HAS_END rows from *end_ptr on are left alone too (nobody reads them).
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < R
    if HAS_END:
        rmask = rmask & (rows < tl.load(end_ptr))
    unowned = rmask & (tl.load(row_token_ptr + rows, mask=rmask, other=0) == num_tokens)
    if tl.sum(unowned.to(tl.int32), 0) > 0:
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            zeros = tl.zeros([BR, BD], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], zeros,
                     mask=unowned[:, None] & (offs_d < D)[None, :])


def _meta(D: int, K: int) -> tuple[int, int, int]:
    kp = triton.next_power_of_2(K)
    bd = min(triton.next_power_of_2(D), max(128, 4096 // kp))
    warps = 4 if bd * kp <= 2048 else 8
    return kp, bd, warps


def combine(y_RD: Tensor, dest_TK: Tensor, w_TK: Tensor) -> Tensor:
    """``out[t] = sum_k w[t,k] * y[dest[t,k]]`` -> [T, D] in ``y``'s dtype."""
    y_RD = y_RD.contiguous()
    num_tokens, k = dest_TK.shape
    d = y_RD.shape[1]
    out = torch.empty(num_tokens, d, dtype=y_RD.dtype, device=y_RD.device)
    if num_tokens == 0:
        return out
    bd = min(triton.next_power_of_2(d), 1024)
    launch(
        _combine_fwd_kernel, (num_tokens, triton.cdiv(d, bd)),
        y_RD, dest_TK.contiguous(), w_TK.contiguous(), out, y_RD.shape[0], d, K=k, BD=bd, num_warps=4
    )
    return out


def combine_to_peers(
    y_RD: Tensor, dest_TK: Tensor, w_TK: Tensor, slot_ptrs_G: Tensor, rank: int, load_only: bool = False
) -> None:
    """The partial sums of :func:`combine` for the tokens of every other rank, stored into their
    symmetric buffers: ``dest_TK``/``w_TK`` cover ``G*T`` tokens ordered by owning rank (``T``
    each); rank ``b``'s buffer (base address ``slot_ptrs_G[b]``, int64, viewed as [G, T, D] in
    ``y``'s dtype) receives its tokens' partials in slot ``rank``. The caller orders the stores
    with the peers' reads (symmetric-memory barriers). ``load_only``: compile and load the
    kernel for exactly these arguments, launch nothing (see `combine_exchange`)."""
    y_RD = y_RD.contiguous()
    num_ranks = slot_ptrs_G.numel()
    per_rank = dest_TK.shape[0] // num_ranks
    d = y_RD.shape[1]
    if per_rank == 0 or num_ranks < 2 or d == 0:
        return
    bd = min(triton.next_power_of_2(d), 1024)
    launch(
        _combine_to_peers_kernel, (0 if load_only else (num_ranks - 1) * per_rank, triton.cdiv(d, bd)),
        y_RD, dest_TK.contiguous(), w_TK.contiguous(), slot_ptrs_G, y_RD.shape[0], d, per_rank, rank,
        K=dest_TK.shape[1], BD=bd, num_warps=4,
    )


def combine_own(
    y_RD: Tensor, dest_TK: Tensor, w_TK: Tensor, slots_GTD: Tensor, rank: int, load_only: bool = False
) -> Tensor:
    """This rank's block of the reduce-scattered :func:`combine`: [T, D] in ``y``'s dtype.

    Its own partial sums (tokens ``rank*T ... rank*T+T-1`` of ``dest_TK``), rounded to ``y``'s
    dtype like the peers' partials in ``slots_GTD`` (this rank's symmetric buffer, [G, T, D],
    slot ``g`` from rank ``g``; slot ``rank`` unused), all summed in fp32 and rounded once."""
    y_RD = y_RD.contiguous()
    num_ranks, per_rank, d = slots_GTD.shape
    out = torch.empty(per_rank, d, dtype=y_RD.dtype, device=y_RD.device)
    if per_rank == 0 or d == 0:
        return out
    bd = min(triton.next_power_of_2(d), 1024)
    launch(
        _combine_own_kernel, (0 if load_only else per_rank, triton.cdiv(d, bd)),
        y_RD, dest_TK.contiguous(), w_TK.contiguous(), slots_GTD, out, y_RD.shape[0], d, per_rank, rank, num_ranks,
        K=dest_TK.shape[1], BD=bd, num_warps=4,
    )
    return out


def combine_backward(
    y_RD: Tensor | None, dest_TK: Tensor, w_TK: Tensor, g_TD: Tensor, num_rows: int, row_token_R: Tensor | None,
    need_grad_w: bool, rows_end: Tensor | None = None, g_ptrs_G: Tensor | None = None, load_only: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of :func:`combine`: ``grad_y`` [R, D] and ``grad_w`` [T, K] fp32 (when
    ``need_grad_w``). ``row_token_R`` (int64 [R], ``T`` for rows no assignment holds) is needed
    when some rows are padding: those rows of ``grad_y`` are zeroed; None when every row is held.
    ``rows_end`` (0-dim device index): rows from it on hold no token and are left unwritten.

    ``g_ptrs_G`` (int64 [G] base addresses of the ranks' symmetric buffers): the ``T = len(dest_TK)
    / G`` gradient rows of each rank's tokens are read from that rank's buffer, over the peer
    link; ``g_TD`` is then this rank's own rows (their dtype and width). The caller orders the
    reads after the peers' writes (symmetric-memory barriers). ``load_only``: as in
    :func:`combine_to_peers` (the results are then uninitialised)."""
    g_TD = g_TD.contiguous()
    num_tokens, k = dest_TK.shape
    d = g_TD.shape[1]
    grad_y = torch.empty(num_rows, d, dtype=g_TD.dtype, device=g_TD.device)
    grad_w = torch.empty(num_tokens, k, dtype=torch.float32, device=g_TD.device) if need_grad_w else None
    if row_token_R is not None and num_rows and d:
        block_rows = 64
        launch(
            _zero_unowned_rows_kernel, (0 if load_only else triton.cdiv(num_rows, block_rows),),
            grad_y, row_token_R.contiguous(), row_token_R if rows_end is None else rows_end, num_tokens, num_rows,
            d, BR=block_rows, BD=min(triton.next_power_of_2(d), 256), HAS_END=rows_end is not None, num_warps=4,
        )
    if num_tokens == 0:
        return grad_y, grad_w
    kp, bd, warps = _meta(d, k)
    launch(
        _combine_bwd_kernel, (0 if load_only else num_tokens,),
        y_RD.contiguous() if need_grad_w else g_TD, dest_TK.contiguous(), w_TK.contiguous(), g_TD, grad_y,
        grad_w if need_grad_w else g_TD, num_rows, d, g_TD if g_ptrs_G is None else g_ptrs_G,
        num_tokens if g_ptrs_G is None else num_tokens // g_ptrs_G.numel(),
        K=k, KP=kp, BD=bd, NEED_GW=need_grad_w, NEED_GY=True, G_REMOTE=g_ptrs_G is not None, num_warps=warps,
    )
    return grad_y, grad_w
