"""The SwiGLU's backward and the delayed FP8 cast of its result in one read: fc1's output
gradient ``grad_h = [d gate | d up]`` ``[R, 2F]`` cast straight from the SwiGLU's input
``h = [gate | up]`` and its output's gradient ``g`` ``[R, F]`` (fc2's data gradient), so
``grad_h`` is never written in bf16 and read back.

Unfused, fc2's backward runs `swiglu_triton.weighted_swiglu_backward` (reads ``h`` and ``g``,
writes ``grad_h`` in ``h``'s dtype) and fc1's backward casts that ``grad_h`` with
`fp8_delayed_triton.delayed_cast` (reads it again, writes both float8 copies). At qwen3's shape
that is 0.8 GB of bf16 written and read back per layer step. Here one kernel computes each tile of
``grad_h`` with the SwiGLU kernel's arithmetic, rounds it to ``h``'s dtype as that kernel stores it,
and casts it as the delayed cast does: the same float8 bytes, scales and amax record (GPU test and
the CPU interpreter test).

The routing probabilities' gradient ``grad_p[r] = sum_f g * silu(gate) * up`` is a row reduction
across every column block, while each program here owns one column block of one group. Each writes
its block's partial sums (fp32 ``[F / BC, R]``, 1/BC of ``grad_h``'s bf16 bytes) and one reduction over
the blocks follows: no atomics, the same bits on every run. It agrees with the unfused kernel's
sums (another order) to fp32 rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.fp8_delayed_triton import (
    TILE_SHAPES,
    _cast_store,
    _store_row_scales,
    amax_rows,
    register_cap,
)
from lightning_moe.kernels.fp8_quant_triton import (
    _abs_ignoring_nan,
    _aligned_body,
    _aligned_group_shift,
    _column_layout,
    _group_bounds,
    _scale_from_amax,
    _zero_aligned_gap,
)
from lightning_moe.kernels.launch import cdiv, launch
from lightning_moe.kernels.swiglu_triton import _swiglu_grads


@triton.jit
def _load_grad_raw(h_ptr, g_ptr, prob_ptr, rows, row_mask, cols, m, F, WEIGHTED: tl.constexpr):
    # (gate, up, g) tiles ``[BR, BC]`` in their dtypes and the rows' probabilities (fp32 [BR]; 1
    # unweighted, where the mask is constant false and nothing is read).
    base = rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
    half = rows[:, None].to(tl.int64) * F + cols[None, :]
    gate = tl.load(h_ptr + base, mask=m, other=0.0)
    up = tl.load(h_ptr + base + F, mask=m, other=0.0)
    g = tl.load(g_ptr + half, mask=m, other=0.0)
    p = tl.load(prob_ptr + rows, mask=row_mask & WEIGHTED, other=1.0)
    return gate, up, g, p


@triton.jit
def _grads_from_raw(gate_raw, up_raw, g_raw, p):
    # fp32 (d gate, d up) of ``p * silu(gate) * up`` rounded to ``h``'s dtype as
    # `swiglu_triton._weighted_swiglu_bwd_kernel` stores them (``g * 1`` is ``g`` exactly, so
    # the unweighted kernel's values too), and the per-row partial sums of ``g * silu * up``.
    gate = gate_raw.to(tl.float32)
    up = up_raw.to(tl.float32)
    g = g_raw.to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    partial = tl.sum(g * silu * up, 1)
    d_gate, d_up = _swiglu_grads(gate, up, g * p[:, None], sig, silu)
    return d_gate.to(gate_raw.dtype).to(tl.float32), d_up.to(gate_raw.dtype).to(tl.float32), partial


@triton.jit
def _grad_group_amax(h_ptr, g_ptr, prob_ptr, start, end, F, BR: tl.constexpr, BC: tl.constexpr,
                     WEIGHTED: tl.constexpr):
    # amax of the group's whole ``grad_h`` (every column): for a group without a history scale.
    amax = 0.0
    for c0 in range(0, F, BC):
        cols = c0 + tl.arange(0, BC)
        for r0 in range(start, end, BR):
            rows = r0 + tl.arange(0, BR)
            row_mask = rows < end
            m = row_mask[:, None] & (cols < F)[None, :]
            gate, up, g, p = _load_grad_raw(h_ptr, g_ptr, prob_ptr, rows, row_mask, cols, m, F, WEIGHTED)
            d_gate, d_up, _ = _grads_from_raw(gate, up, g, p)
            amax = tl.maximum(amax, tl.max(tl.max(tl.maximum(_abs_ignoring_nan(d_gate), _abs_ignoring_nan(d_up)), 1),
                                           0))
    return amax


@triton.jit
def _cast_grad_tile(gate, up, g, p, rows, row_mask, m, q_row_ptr, q_col_ptr, cols, F, scale, in_group, out_base,
                    stride_qc, amax, partial_ptr, R, AMAX_ROWS: tl.constexpr, WEIGHTED: tl.constexpr):
    # One tile of ``grad_h``: both halves cast into both copies, the partial sums stored (WEIGHTED:
    # only the probabilities have a gradient); returns the running amax (see `_cast_store`).
    d_gate, d_up, partial = _grads_from_raw(gate, up, g, p)
    amax = _cast_store(d_gate, rows, m, q_row_ptr, q_col_ptr, cols, scale, in_group, out_base, 2 * F, stride_qc,
                       amax, True, True, AMAX_ROWS)
    amax = _cast_store(d_up, rows, m, q_row_ptr, q_col_ptr, cols + F, scale, in_group, out_base, 2 * F, stride_qc,
                       amax, True, True, AMAX_ROWS)
    if WEIGHTED:
        tl.store(partial_ptr + tl.program_id(0).to(tl.int64) * R + rows, partial, mask=row_mask)
    return amax


@triton.jit
def _edge_tile(h_ptr, g_ptr, prob_ptr, q_row_ptr, q_col_ptr, r0, lo, hi, cols, cmask, F, scale, in_group, out_base,
               stride_qc, amax, partial_ptr, R, WEIGHTED: tl.constexpr):
    # Rows [max(r0, lo), min(r0 + 16, hi)): a group's unaligned head or tail.
    rows = r0 + tl.arange(0, 16)
    row_mask = (rows >= lo) & (rows < hi)
    m = row_mask[:, None] & cmask[None, :]
    gate, up, g, p = _load_grad_raw(h_ptr, g_ptr, prob_ptr, rows, row_mask, cols, m, F, WEIGHTED)
    return _cast_grad_tile(gate, up, g, p, rows, row_mask, m, q_row_ptr, q_col_ptr, cols, F, scale, in_group, out_base,
                           stride_qc, amax, partial_ptr, R, 0, WEIGHTED)


@triton.jit
def _swiglu_grad_cast_kernel(h_ptr, g_ptr, prob_ptr, offsets_ptr, scale_ptr, q_row_ptr, s_row_ptr, q_col_ptr,
                             s_col_ptr, record_ptr, partial_ptr, R, F, G, stride_qc, aligned_ends_ptr,
                             WEIGHTED: tl.constexpr, RECORD: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                             ALIGN: tl.constexpr = 0, AMAX_ROWS: tl.constexpr = 0):
    # Program (column block of the F gate columns, group); group G is the rows after the last
    # group (row copy only, scale 1, as `fp8_delayed_triton._delayed_cast_kernel` casts them).
    group = tl.program_id(1)
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    cmask = cols < F
    in_group = group < G
    start, end = _group_bounds(offsets_ptr, group, G, R)
    scale = tl.load(scale_ptr + group, mask=in_group, other=1.0)
    if (scale > 0.0) == 0:  # no history yet (also a NaN scale): the group's current amax decides
        scale = _scale_from_amax(_grad_group_amax(h_ptr, g_ptr, prob_ptr, start, end, F, 32, BC, WEIGHTED))
    scale_inv = tl.math.div_rn(1.0, scale)
    out_base = _aligned_group_shift(aligned_ends_ptr, group, in_group, start, ALIGN)
    lo, hi = _aligned_body(start, end)
    amax = tl.zeros([BC], dtype=tl.float32)
    amax = _edge_tile(h_ptr, g_ptr, prob_ptr, q_row_ptr, q_col_ptr, start, start, tl.minimum(lo, end), cols, cmask, F,
                      scale, in_group, out_base, stride_qc, amax, partial_ptr, R, WEIGHTED)
    # The body, 16-row aligned, with the next tile's loads in flight while this one is cast (as
    # the delayed cast's body; the amax kept per element until the loop ends).
    # AMAX_ROWS 0 (the launch default): the tile's own rows, no fold
    BODY_AMAX_ROWS: tl.constexpr = AMAX_ROWS if AMAX_ROWS > 0 else BR
    body_amax = tl.zeros([BODY_AMAX_ROWS, BC], dtype=tl.float32)
    rows = lo + tl.arange(0, BR)
    live = rows < hi
    a_gate, a_up, a_g, a_p = _load_grad_raw(h_ptr, g_ptr, prob_ptr, rows, live, cols, live[:, None] & cmask[None, :],
                                            F, WEIGHTED)
    for r0 in tl.range(lo, hi, BR, num_stages=1):
        rows = r0 + tl.arange(0, BR)
        row_mask = rows < hi
        m = row_mask[:, None] & cmask[None, :]
        gate, up, g, p = a_gate, a_up, a_g, a_p
        ahead = rows + BR
        live = ahead < hi
        a_gate, a_up, a_g, a_p = _load_grad_raw(h_ptr, g_ptr, prob_ptr, ahead, live, cols,
                                                live[:, None] & cmask[None, :], F, WEIGHTED)
        body_amax = _cast_grad_tile(gate, up, g, p, rows, row_mask, m, q_row_ptr, q_col_ptr, cols, F, scale, in_group,
                                    out_base, stride_qc, body_amax, partial_ptr, R, BODY_AMAX_ROWS, WEIGHTED)
    amax = tl.maximum(amax, tl.max(body_amax, 0))
    amax = _edge_tile(h_ptr, g_ptr, prob_ptr, q_row_ptr, q_col_ptr, hi, hi, end, cols, cmask, F, scale, in_group,
                      out_base, stride_qc, amax, partial_ptr, R, WEIGHTED)
    if tl.program_id(0) == 0:  # one column block writes the group's row scales
        _store_row_scales(s_row_ptr, start, end, scale_inv)
    for half in tl.static_range(2):
        _zero_aligned_gap(q_col_ptr, out_base, start, end, cols + half * F, cmask, stride_qc, in_group, ALIGN)
        tl.store(s_col_ptr + group.to(tl.int64) * (2 * F) + half * F + cols,
                 tl.zeros([BC], dtype=tl.float32) + scale_inv, mask=cmask & in_group)
    if RECORD:
        tl.atomic_max(record_ptr + group, tl.max(amax, 0), mask=in_group)


def delayed_swiglu_grad_cast(
    h_RF2: Tensor,
    g_RF: Tensor,
    row_probs: Optional[Tensor],
    offsets_G: Tensor,
    scale_G: Tensor,
    record_G: Optional[Tensor],
    out_col: Tensor,
    stride_out_col: int,
    aligned_ends: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """The delayed E4M3 cast of ``grad_h`` ``[R, 2F]``, the gradient of ``p[r] * silu(gate) * up``
    (``p`` = 1 without ``row_probs``) with respect to ``h = [gate | up]``, computed from ``h`` and
    that output's gradient ``g`` ``[R, F]`` inside the cast: the same results as
    ``delayed_cast(weighted_swiglu_backward(h, g, p)[0], offsets, scale, record, out_col=...)``
    (or `swiglu_backward` without ``p``).

    Args:
        row_probs: fp32 ``[R]`` routing probabilities of the rows (Megatron-Core's weighted
            SwiGLU), or None.
        offsets_G / scale_G / record_G: the token groups' cumulative int32 ends, their E4M3 scales
            (0: none yet, the current amax decides) and the amax row to max-fold into (or None).
        out_col / stride_out_col / aligned_ends: the transposed copy's buffer ``[2F, width]``, its
            row stride, and the weight-gradient kernel's aligned group layout (see `delayed_cast`).
    Returns:
        (row copy float8 ``[R, 2F]``, its ``scale_inv [R]``, group-column ``scale_inv [G, 2F]``,
        ``grad_p`` fp32 ``[R]`` with ``row_probs`` else None).
    """
    rows, f2 = h_RF2.shape
    f = f2 // 2
    if f2 % 2 or g_RF.shape != (rows, f):
        raise ValueError(f"delayed_swiglu_grad_cast: h must be [R, 2F] and g [R, F], got {tuple(h_RF2.shape)} and "
                         f"{tuple(g_RF.shape)}")
    if row_probs is not None and (row_probs.dtype != torch.float32 or row_probs.shape != (rows,)):
        raise ValueError(f"delayed_swiglu_grad_cast: row_probs must be fp32 [{rows}], got {row_probs.dtype} "
                         f"{tuple(row_probs.shape)}")
    if out_col.dtype != torch.float8_e4m3fn or out_col.shape[0] != f2:
        raise ValueError(f"delayed_swiglu_grad_cast: out_col must be float8_e4m3fn [{f2}, width], got "
                         f"{out_col.dtype} {tuple(out_col.shape)}")
    h_RF2, g_RF = h_RF2.contiguous(), g_RF.contiguous()
    groups = offsets_G.numel()
    device = h_RF2.device
    q_row = torch.empty(rows, f2, dtype=torch.float8_e4m3fn, device=device)
    s_row = torch.empty(rows, dtype=torch.float32, device=device)
    s_col = torch.empty(groups, f2, dtype=torch.float32, device=device)
    block_r, block_c, warps = TILE_SHAPES["swiglu_grad"]
    col_blocks = cdiv(f, block_c)
    # Every row belongs to a group or to the tail group, so every partial sum is written.
    partial = torch.empty(col_blocks, rows, dtype=torch.float32, device=device) if row_probs is not None else None
    if not (rows and f):  # nothing to cast: `delayed_cast`'s scales (the history's, else 1; the tail's 1)
        inv_G = torch.where(scale_G > 0, 1.0 / scale_G, torch.ones_like(scale_G)).to(torch.float32)
        s_col.copy_(inv_G[:, None].expand(groups, f2))
        if rows:
            row_group = torch.searchsorted(offsets_G.long(), torch.arange(rows, device=device), right=True)
            s_row.copy_(torch.cat([inv_G, inv_G.new_ones(1)])[row_group])
        return q_row, s_row, s_col, None if row_probs is None else torch.zeros(rows, device=device)
    dummy = scale_G  # pointer for the operands a launch does not touch (never dereferenced)
    align, aligned_ends_ptr = _column_layout(aligned_ends, dummy)
    launch(
        _swiglu_grad_cast_kernel, (col_blocks, groups + 1),
        h_RF2, g_RF, row_probs.contiguous() if row_probs is not None else dummy, offsets_G.contiguous(),
        scale_G.contiguous(), q_row, s_row, out_col, s_col, record_G if record_G is not None else dummy,
        partial if partial is not None else dummy,
        rows, f, groups, stride_out_col, aligned_ends_ptr,
        WEIGHTED=row_probs is not None, RECORD=record_G is not None, BR=block_r, BC=block_c, ALIGN=align,
        AMAX_ROWS=amax_rows("swiglu_grad", block_r), num_warps=warps, **register_cap("swiglu_grad"),
    )
    # fixed-order reduction over the column blocks (deterministic)
    grad_p = partial.sum(0) if partial is not None else None
    return q_row, s_row, s_col, grad_p
