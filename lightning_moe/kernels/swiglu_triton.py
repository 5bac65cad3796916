"""Fused SwiGLU on the fused projection output ``h = [gate | up]`` ([R, 2F] -> [R, F]).

Forward reads ``h`` once and writes ``silu(gate) * up``; backward reads ``h`` and the incoming
gradient once and writes ``grad_h`` directly in the fused layout (no chunk/cat copies, no
separate silu and multiply passes). Math in fp32, storage in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch


@triton.jit
def _live_rows(rows, R, end_ptr, HAS_END: tl.constexpr):
    """Rows below ``R`` and, with ``HAS_END``, below the device index ``*end_ptr``."""
    live = rows < R
    if HAS_END:
        live = live & (rows < tl.load(end_ptr))
    return live


@triton.jit
def _block_live(R, end_ptr, BR: tl.constexpr, HAS_END: tl.constexpr):
    """Whether this program's row block starts before ``R`` (and before ``*end_ptr``): blocks
    wholly past the end skip everything (at EP=2 about half the grid of the all-gather buffer)."""
    row0 = tl.program_id(0) * BR
    go = row0 < R
    if HAS_END:
        go = go & (row0 < tl.load(end_ptr))
    return go


@triton.jit
def _load_tile(h_ptr, end_ptr, R, F, HAS_END: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
    """This program's ``[BR, BF]`` tile: rows, columns, live mask (rows past the end are neither
    read nor written), the offsets of its gate columns in ``h`` [R, 2F] and of its rows in a
    [R, F] tensor, and gate and up in fp32."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    live = _live_rows(rows, R, end_ptr, HAS_END)[:, None] & (cols[None, :] < F)
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    half = rows.to(tl.int64)[:, None] * F + cols[None, :]
    gate = tl.load(h_ptr + base, mask=live, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + base + F, mask=live, other=0.0).to(tl.float32)
    return live, base, half, gate, up


@triton.jit
def _swiglu_fwd_kernel(h_ptr, p_ptr, out_ptr, end_ptr, R, F, HAS_END: tl.constexpr, HAS_P: tl.constexpr,
                       BR: tl.constexpr, BF: tl.constexpr):
    if _block_live(R, end_ptr, BR, HAS_END):
        live, base, half, gate, up = _load_tile(h_ptr, end_ptr, R, F, HAS_END, BR, BF)
        out = gate * tl.sigmoid(gate) * up
        if HAS_P:  # the weighted SwiGLU: the row's routing probability, in fp32 before the one rounding
            rows = tl.program_id(0) * BR + tl.arange(0, BR)
            p = tl.load(p_ptr + rows, mask=_live_rows(rows, R, end_ptr, HAS_END), other=0.0)
            out = out * p[:, None]
        tl.store(out_ptr + half, out.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_grads(gate, up, g, sig, silu):
    """``(d gate, d up)`` of ``silu(gate) * up`` given its output's gradient ``g`` (fp32 tiles;
    ``sig = sigmoid(gate)``, ``silu = gate * sig``)."""
    return g * up * (sig + silu * (1.0 - sig)), g * silu


@triton.jit
def _swiglu_bwd_kernel(h_ptr, g_ptr, grad_h_ptr, end_ptr, R, F, HAS_END: tl.constexpr, BR: tl.constexpr,
                       BF: tl.constexpr):
    if _block_live(R, end_ptr, BR, HAS_END):
        live, base, half, gate, up = _load_tile(h_ptr, end_ptr, R, F, HAS_END, BR, BF)
        g = tl.load(g_ptr + half, mask=live, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate, d_up = _swiglu_grads(gate, up, g, sig, gate * sig)
        tl.store(grad_h_ptr + base, d_gate.to(grad_h_ptr.dtype.element_ty), mask=live)
        tl.store(grad_h_ptr + base + F, d_up.to(grad_h_ptr.dtype.element_ty), mask=live)


@triton.jit
def _weighted_swiglu_bwd_kernel(h_ptr, g_ptr, p_ptr, grad_h_ptr, grad_p_ptr, end_ptr, R, F, HAS_END: tl.constexpr,
                                BR: tl.constexpr, BF: tl.constexpr):
    # Gradients of ``p[r] * silu(gate) * up``. One program per row block walks the columns, so
    # each row's probability gradient ``sum_f g * silu(gate) * up`` is reduced in registers: no
    # atomics, the same bits on every run. Rows past the end (``HAS_END``) are neither read nor
    # written in ``grad_h``; their ``grad_p`` is 0.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = _live_rows(rows, R, end_ptr, HAS_END)
    p = tl.load(p_ptr + rows, mask=row_ok, other=0.0)
    grad_p = tl.zeros([BR], dtype=tl.float32)
    for f0 in range(0, F, BF):
        cols = f0 + tl.arange(0, BF)
        live = row_ok[:, None] & (cols < F)[None, :]
        base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
        half = rows.to(tl.int64)[:, None] * F + cols[None, :]
        gate = tl.load(h_ptr + base, mask=live, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + base + F, mask=live, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + half, mask=live, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        grad_p += tl.sum(g * silu * up, 1)
        d_gate, d_up = _swiglu_grads(gate, up, g * p[:, None], sig, silu)
        tl.store(grad_h_ptr + base, d_gate.to(grad_h_ptr.dtype.element_ty), mask=live)
        tl.store(grad_h_ptr + base + F, d_up.to(grad_h_ptr.dtype.element_ty), mask=live)
    tl.store(grad_p_ptr + rows, grad_p, mask=rows < R)


_BR, _BF = 16, 128


def _grid(r: int, f: int):
    return (cdiv(r, _BR), cdiv(f, _BF))


class SwiGLUFunction(torch.autograd.Function):
    """`swiglu` (``p_R`` None) and `weighted_swiglu`: one forward kernel, the backward of each."""

    @staticmethod
    def forward(ctx, h_RF2: Tensor, p_R: Tensor | None, rows_end: Tensor | None) -> Tensor:
        h_RF2 = h_RF2.contiguous()
        r, f2 = h_RF2.shape
        if p_R is not None:
            if p_R.dtype != torch.float32 or p_R.shape != (r,):
                raise ValueError(f"weighted_swiglu: p must be fp32 [{r}], got {p_R.dtype} {tuple(p_R.shape)}")
            p_R = p_R.contiguous()
        out = torch.empty(r, f2 // 2, dtype=h_RF2.dtype, device=h_RF2.device)
        if r:  # unused pointers get h's
            launch(_swiglu_fwd_kernel, _grid(r, f2 // 2), h_RF2, h_RF2 if p_R is None else p_R, out,
                   h_RF2 if rows_end is None else rows_end, r, f2 // 2, HAS_END=rows_end is not None,
                   HAS_P=p_R is not None, BR=_BR, BF=_BF, num_warps=4)
        ctx.save_for_backward(h_RF2, p_R, rows_end)
        return out

    @staticmethod
    def backward(ctx, g_RF: Tensor):
        h_RF2, p_R, rows_end = ctx.saved_tensors
        if p_R is None:
            return _tail_zeroed_for_anomaly_mode(swiglu_backward(h_RF2, g_RF, rows_end), rows_end), None, None
        grad_h, grad_p = weighted_swiglu_backward(h_RF2, g_RF, p_R, rows_end)
        return _tail_zeroed_for_anomaly_mode(grad_h, rows_end), grad_p, None


def _tail_zeroed_for_anomaly_mode(grad_h: Tensor, rows_end: Tensor | None) -> Tensor:
    """``grad_h`` with its unwritten rows (from ``rows_end`` on) zeroed under anomaly mode, which
    checks every gradient for NaN, those rows included."""
    if rows_end is not None and torch.is_anomaly_enabled():
        from lightning_moe.kernels.tail_triton import zero_rows_from_triton

        zero_rows_from_triton(grad_h, rows_end)
    return grad_h


def swiglu_backward(h_RF2: Tensor, g_RF: Tensor, rows_end: Tensor | None = None) -> Tensor:
    """``grad_h [R, 2F]`` of `swiglu` from its input ``h`` and its output's gradient ``g``."""
    h_RF2 = h_RF2.contiguous()
    r, f2 = h_RF2.shape
    grad_h = torch.empty_like(h_RF2)
    if r:
        launch(_swiglu_bwd_kernel, _grid(r, f2 // 2), h_RF2, g_RF.contiguous(), grad_h,
               h_RF2 if rows_end is None else rows_end, r, f2 // 2, HAS_END=rows_end is not None, BR=_BR, BF=_BF,
               num_warps=4)
    return grad_h


def weighted_swiglu_backward(h_RF2: Tensor, g_RF: Tensor, p_R: Tensor,
                             rows_end: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gradients of the weighted SwiGLU ``p[r] * silu(gate) * up`` (Megatron-Core's
    ``weighted_bias_swiglu``: routing probabilities applied before the second projection) from
    its input ``h [R, 2F]``, its row weights ``p`` fp32 ``[R]`` and its output's gradient
    ``g [R, F]``: ``(grad_h [R, 2F]`` in ``h``'s dtype, ``grad_p`` fp32 ``[R])``, math in fp32.
    ``rows_end`` as in `swiglu` (the rows from it on: ``grad_h`` unwritten, ``grad_p`` 0)."""
    h_RF2 = h_RF2.contiguous()
    r, f2 = h_RF2.shape
    if p_R.dtype != torch.float32 or p_R.shape != (r,):
        raise ValueError(f"weighted_swiglu_backward: p must be fp32 [{r}], got {p_R.dtype} {tuple(p_R.shape)}")
    grad_h = torch.empty_like(h_RF2)
    grad_p = torch.empty(r, dtype=torch.float32, device=h_RF2.device)
    if r:
        launch(_weighted_swiglu_bwd_kernel, (cdiv(r, _BR),), h_RF2, g_RF.contiguous(), p_R.contiguous(),
               grad_h, grad_p, h_RF2 if rows_end is None else rows_end, r, f2 // 2, HAS_END=rows_end is not None,
               BR=_BR, BF=_BF, num_warps=4)
    return grad_h, grad_p


def weighted_swiglu(h_RF2: Tensor, p_R: Tensor, rows_end: Tensor | None = None) -> Tensor:
    """``p[r] * silu(gate) * up`` of ``h = [gate | up]`` and fp32 row weights ``p [R]`` (the
    routing probabilities of the permuted rows, so that the combine after the second projection
    is an unweighted sum), computed in fp32 and rounded once; differentiable in ``h`` and ``p``.
    ``rows_end`` as in `swiglu`."""
    return SwiGLUFunction.apply(h_RF2, p_R, rows_end)


def swiglu(h_RF2: Tensor, rows_end: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]``.

    rows_end: optional 0-dim integer device tensor; rows from it on are neither read nor
    written, in the output and in the gradient (the padding rows after the last group of a
    grouped GEMM that leaves them out: its consumers never read them either).
    """
    return SwiGLUFunction.apply(h_RF2, None, rows_end)
