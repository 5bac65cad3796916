"""Triton kernels for the weighted gather-reduce that combines expert outputs per token.

``combine``:  out[t] = sum_k w[t,k] * y[dest[t,k]]            (dest == R: dropped, skipped)
``combine_backward``: grad_y[dest[t,k]] = w[t,k] * g[t]  and  grad_w[t,k] = <y[dest[t,k]], g[t]>

One program per token streams over D in blocks; the K rows of a token are loaded together, so
no [T, K, D] intermediate is written, accumulation is fp32 and activations keep their dtype.
Every permuted row belongs to at most one (t, k), so the backward scatter needs no atomics.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch, next_power_of_2


@triton.jit
def _combine_fwd_kernel(y_ptr, dest_ptr, w_ptr, out_ptr, num_rows, D, K: tl.constexpr, BD: tl.constexpr,
                        HAS_W: tl.constexpr = True):
    # One program per (token, D-block); the K rows are visited in an unrolled loop so the sum
    # stays in registers (no cross-warp reduction). Without HAS_W the rows are summed unweighted
    # (``w_ptr`` is not read): the same bits as weights of one.
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = offs_d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + t * K + k)
        y = tl.load(y_ptr + dest.to(tl.int64) * D + offs_d, mask=dmask & (dest < num_rows), other=0.0)
        if HAS_W:
            acc += y.to(tl.float32) * tl.load(w_ptr + t * K + k).to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * D + offs_d, acc.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _combine_bwd_kernel(
    y_ptr, dest_ptr, w_ptr, g_ptr, grad_y_ptr, grad_w_ptr, num_rows, D,
    K: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr, NEED_GW: tl.constexpr, NEED_GY: tl.constexpr,
):
    t = tl.program_id(0)
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
        g = tl.load(g_ptr + t.to(tl.int64) * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
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
    kp = next_power_of_2(K)
    bd = min(next_power_of_2(D), max(128, 4096 // kp))
    warps = 4 if bd * kp <= 2048 else 8
    return kp, bd, warps


def combine(y_RD: Tensor, dest_TK: Tensor, w_TK: Optional[Tensor] = None,
            out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``out[t] = sum_k w[t,k] * y[dest[t,k]]`` -> [T, D] in ``out_dtype`` (default ``y``'s; ``w``
    None: all ones, each token's rows summed as they are). The sum is fp32 either way, so an fp32
    ``out_dtype`` gives the bits of widening ``y`` first, without writing the widened rows (another
    ``out_dtype`` rounds the fp32 sum once, unlike rounding each row first)."""
    y_RD = y_RD.contiguous()
    num_tokens, k = dest_TK.shape
    dest_TK = dest_TK.contiguous()
    d = y_RD.shape[1]
    out = torch.empty(num_tokens, d, dtype=out_dtype or y_RD.dtype, device=y_RD.device)
    if num_tokens == 0:
        return out
    bd = min(next_power_of_2(d), 1024)
    launch(
        _combine_fwd_kernel, (num_tokens, cdiv(d, bd)),
        # without weights any pointer fills w_ptr (never read)
        y_RD, dest_TK, dest_TK if w_TK is None else w_TK.contiguous(), out, y_RD.shape[0], d, K=k, BD=bd,
        HAS_W=w_TK is not None, num_warps=4
    )
    return out


def combine_backward(
    y_RD: Tensor | None, dest_TK: Tensor, w_TK: Tensor, g_TD: Tensor, num_rows: int, row_token_R: Tensor | None,
    need_grad_w: bool, rows_end: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of :func:`combine`: ``grad_y`` [R, D] and ``grad_w`` [T, K] fp32 (when
    ``need_grad_w``). ``row_token_R`` (int64 [R], ``T`` for rows no assignment holds) is needed
    when some rows are padding: those rows of ``grad_y`` are zeroed; None when every row is held.
    ``rows_end`` (0-dim device index): rows from it on hold no token and are left unwritten."""
    g_TD = g_TD.contiguous()
    num_tokens, k = dest_TK.shape
    d = g_TD.shape[1]
    grad_y = torch.empty(num_rows, d, dtype=g_TD.dtype, device=g_TD.device)
    grad_w = torch.empty(num_tokens, k, dtype=torch.float32, device=g_TD.device) if need_grad_w else None
    if row_token_R is not None and num_rows and d:
        block_rows = 64
        launch(
            _zero_unowned_rows_kernel, (cdiv(num_rows, block_rows),),
            grad_y, row_token_R.contiguous(), row_token_R if rows_end is None else rows_end, num_tokens, num_rows,
            d, BR=block_rows, BD=min(next_power_of_2(d), 256), HAS_END=rows_end is not None, num_warps=4,
        )
    if num_tokens == 0:
        return grad_y, grad_w
    kp, bd, warps = _meta(d, k)
    launch(
        _combine_bwd_kernel, (num_tokens,),
        y_RD.contiguous() if need_grad_w else g_TD, dest_TK.contiguous(), w_TK.contiguous(), g_TD, grad_y,
        grad_w if need_grad_w else g_TD, num_rows, d, K=k, KP=kp, BD=bd, NEED_GW=need_grad_w, NEED_GY=True,
        num_warps=warps,
    )
    return grad_y, grad_w
