"""Per-head RMSNorm (optional) and rotary embedding of queries or keys in one pass, and its backward.

For ``x`` ``[B, S, H, hd]`` (rows ``(b, s, h)`` of ``hd`` elements, any row strides, unit column
stride), a weight ``w`` ``[hd]`` and ``cos``/``sin`` ``[B, S, hd]`` (fp32; a batch stride of 0 for
one table shared by every row of the batch), the forward writes, per row, in ``x``'s dtype::

    n = round_to_dtype(x * rsqrt(mean(x^2) + eps) * w)      (n = x without the norm)
    y = n * cos + [-n2, n1] * sin                            (n1, n2 the halves of n)

with the math in fp32 and ``n`` rounded to the activation dtype before the rotation, as the
eager formulation (`RMSNorm` returning ``x.dtype``, then `apply_rotary`) rounds it. The backward
reads ``dy`` and ``x`` and writes ``dx`` (the gradient of ``n`` rounded to the dtype first, as
eager's casts round it) and, with the norm, per-program fp32 partial sums of the weight gradient
``sum over rows dn * x * rsqrt(mean(x^2) + eps)``, which the caller adds up (a fixed order: the
same bits every run).

The eager path makes about ten fp32 full-size temporaries of each of q and k forward and more in
backward; here one read and one write each way (plus ``x`` re-read in backward), no fp32 copies.
No host synchronisation: launches are fixed by shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import launch

ELEMENTS_PER_PROGRAM = 4096  # rows per program: this many elements over the (padded) head width
MAX_BACKWARD_PROGRAMS = 1024  # the backward loops over row blocks: this many weight-gradient partials at most


@triton.jit
def _row_offsets(rows_start, rows, S, H, stride_b, stride_s, stride_h, BLOCK_R: tl.constexpr):
    r = (rows_start + tl.arange(0, BLOCK_R)).to(tl.int64)
    h = r % H
    s = (r // H) % S
    b = r // (H * S)
    return r, r < rows, b * stride_b + s * stride_s + h * stride_h, b, s


@triton.jit
def _norm_rotary_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, rows, S, H, sxb, sxs, sxh, scb, scs, eps,
                            HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                            NORM: tl.constexpr):
    r, rmask, xo, b, s = _row_offsets(tl.program_id(0) * BLOCK_R, rows, S, H, sxb, sxs, sxh, BLOCK_R)
    d = tl.arange(0, BLOCK_H)
    dmask = d < HALF
    mask = rmask[:, None] & dmask[None, :]
    x_at = x_ptr + xo[:, None] + d[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        x1 = (x1 * inv[:, None] * w1[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv[:, None] * w2[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
    c_at = (b * scb + s * scs)[:, None] + d[None, :]
    c1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + c_at + HALF, mask=mask, other=0.0)
    y_at = y_ptr + r[:, None] * (2 * HALF) + d[None, :]
    tl.store(y_at, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_at + HALF, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rotary_bwd_kernel(dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr, rows, S, H,
                            sgb, sgs, sgh, sxb, sxs, sxh, scb, scs, eps, programs,
                            HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                            NORM: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_H)
    dmask = d < HALF
    dw1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    if NORM:
        w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    for start in range(pid * BLOCK_R, rows, programs * BLOCK_R):
        r, rmask, go, b, s = _row_offsets(start, rows, S, H, sgb, sgs, sgh, BLOCK_R)
        mask = rmask[:, None] & dmask[None, :]
        g_at = dy_ptr + go[:, None] + d[None, :]
        gy1 = tl.load(g_at, mask=mask, other=0.0).to(tl.float32)
        gy2 = tl.load(g_at + HALF, mask=mask, other=0.0).to(tl.float32)
        c_at = (b * scb + s * scs)[:, None] + d[None, :]
        c1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + c_at + HALF, mask=mask, other=0.0)
        # the rotation's transpose, rounded to the dtype as the eager path's cast of n rounds it
        gn1 = (gy1 * c1 + gy2 * s2).to(dx_ptr.dtype.element_ty).to(tl.float32)
        gn2 = (gy2 * c2 - gy1 * s1).to(dx_ptr.dtype.element_ty).to(tl.float32)
        dx_at = dx_ptr + r[:, None] * (2 * HALF) + d[None, :]
        if NORM:
            xo = (b * sxb + s * sxs + (r % H) * sxh)
            x_at = x_ptr + xo[:, None] + d[None, :]
            x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            dw1 += tl.sum(gn1 * x1 * inv[:, None], 0)
            dw2 += tl.sum(gn2 * x2 * inv[:, None], 0)
            g1 = gn1 * w1[None, :]
            g2 = gn2 * w2[None, :]
            dot = (tl.sum(g1 * x1, 1) + tl.sum(g2 * x2, 1)) / (2 * HALF)
            k = (inv * inv * inv * dot)[:, None]
            tl.store(dx_at, (inv[:, None] * g1 - x1 * k).to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_at + HALF, (inv[:, None] * g2 - x2 * k).to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dx_at, gn1.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_at + HALF, gn2.to(dx_ptr.dtype.element_ty), mask=mask)
    if NORM:
        tl.store(dw_ptr + pid * (2 * HALF) + d, dw1, mask=dmask)
        tl.store(dw_ptr + pid * (2 * HALF) + HALF + d, dw2, mask=dmask)


def _layout(x_BSHd: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """``x`` with unit column stride, ``cos``/``sin`` as ``[B, S, hd]`` views of unit column and
    common strides, their (batch, sequence) strides."""
    batch, seq, _, hd = x_BSHd.shape
    if hd % 2:
        raise ValueError(f"rotary embedding needs an even head width, got {hd}")
    if x_BSHd.stride(-1) != 1:
        x_BSHd = x_BSHd.contiguous()
    cos = (cos if cos.dim() == 3 else cos.unsqueeze(0)).expand(batch, seq, hd)
    sin = (sin if sin.dim() == 3 else sin.unsqueeze(0)).expand(batch, seq, hd)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    return x_BSHd, cos, sin, cos.stride(0), cos.stride(1)


def _blocks(hd: int) -> tuple[int, int]:
    block_h = triton.next_power_of_2(hd // 2)
    return block_h, max(1, ELEMENTS_PER_PROGRAM // (2 * block_h))


def norm_rotary_forward(x_BSHd: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """``rotary(round(rms_norm(x) * weight))`` (``weight`` None: ``rotary(x)``), contiguous, in
    ``x``'s dtype; ``cos``/``sin`` fp32 ``[S, hd]`` or ``[B, S, hd]``."""
    x_BSHd, cos, sin, scb, scs = _layout(x_BSHd, cos, sin)
    batch, seq, heads, hd = x_BSHd.shape
    y = torch.empty(x_BSHd.shape, dtype=x_BSHd.dtype, device=x_BSHd.device)
    rows = batch * seq * heads
    block_h, block_r = _blocks(hd)
    if rows:
        launch(_norm_rotary_fwd_kernel, (triton.cdiv(rows, block_r),), x_BSHd, x_BSHd if weight is None else weight,
               cos, sin, y, rows, seq, heads, *x_BSHd.stride()[:3], scb, scs, eps,
               HALF=hd // 2, BLOCK_R=block_r, BLOCK_H=block_h, NORM=weight is not None, num_warps=4)
    return y


def norm_rotary_backward(dy_BSHd: Tensor, x_BSHd: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor,
                         eps: float) -> tuple[Tensor, Optional[Tensor]]:
    """(gradient of ``x`` in its dtype, gradient of ``weight`` in its dtype or None without the norm)
    of `norm_rotary_forward` given its output's gradient ``dy``."""
    x_BSHd, cos, sin, scb, scs = _layout(x_BSHd, cos, sin)
    if dy_BSHd.stride(-1) != 1:
        dy_BSHd = dy_BSHd.contiguous()
    batch, seq, heads, hd = x_BSHd.shape
    dx = torch.empty(x_BSHd.shape, dtype=x_BSHd.dtype, device=x_BSHd.device)
    rows = batch * seq * heads
    block_h, block_r = _blocks(hd)
    programs = max(1, min(triton.cdiv(rows, block_r), MAX_BACKWARD_PROGRAMS))
    norm = weight is not None
    partial = torch.zeros((programs, hd) if norm else (1,), dtype=torch.float32, device=x_BSHd.device)
    if rows:
        launch(_norm_rotary_bwd_kernel, (programs,), dy_BSHd, x_BSHd, x_BSHd if weight is None else weight,
               cos, sin, dx, partial, rows, seq, heads, *dy_BSHd.stride()[:3], *x_BSHd.stride()[:3], scb, scs, eps,
               programs, HALF=hd // 2, BLOCK_R=block_r, BLOCK_H=block_h, NORM=norm, num_warps=4)
    return dx, partial.sum(0).to(weight.dtype) if norm else None
