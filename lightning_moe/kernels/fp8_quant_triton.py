"""Fused E4M3 quantizers for the native FP8 GEMMs (rowwise recipe), one Triton kernel each;
their scale, amax and tiling helpers also serve the delayed casts (``fp8_delayed_triton``).

The generic tile quantizer (``precision.quantize``) takes 6-10 memory passes per operand (fp32
copies, ``nan_to_num``, scatter-reduce amax for token groups, index-select of the scales, a
separate transposing copy). These kernels read the operand twice (amax, then scale + cast) and
write the float8 values once, already in the layout the GEMM wants, with the same numbers:

- ``scale = (1 / amax) * 448`` in fp32 as torch evaluates ``448 / amax`` (IEEE reciprocal via
  ``div_rn``, since Triton's default ``/`` is approximate), ``FLT_MAX`` when that overflows, 1
  when ``amax`` is 0 or ``inf``; NaN is ignored by the amax;
- ``q = fp8(x * scale)``: round to nearest even, saturating (``cvt.rn.satfinite``), which
  equals torch's ``clamp(-448, 448).to(float8_e4m3fn)``;
- ``scale_inv = 1 / scale`` (IEEE).

``rowwise_quantize``: one scale per row of a row-major ``[P, L]`` operand.
``group_column_quantize``: ``x [R, C]`` whose rows form token groups (``offsets``, cumulative
ends); one scale per (group, column) over the group's rows, written transposed per group at
caller-chosen strides: the weight-gradient operands ``x^T`` / ``dy^T`` (``[C, R]``) and the
forward weight ``[E, K, N] -> [E, N, K]`` (groups = experts) come from the same kernel.
``dual_quantize``: both of the above from two reads of ``x`` instead of four (one amax pass
for rows and group columns together, one pass writing both copies). Every operand that a
GEMM and a transposed GEMM both consume needs the two copies: activations (forward or data
gradient, and weight gradient) and weights (forward and data gradient).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch, next_power_of_2, on_launch_stream

_E4M3_MAX = 448.0
_FLT_MAX = 3.4028234663852886e38


@triton.jit
def _scale_for_format(amax, FMT_MAX: tl.constexpr):
    # torch's ``FMT_MAX / amax`` is ``reciprocal(amax) * FMT_MAX`` (two roundings); the same
    # here, so both quantizers give the same bits.
    scale = tl.math.div_rn(tl.zeros_like(amax) + 1.0, amax) * FMT_MAX
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    return tl.where((amax == 0.0) | (amax == float("inf")), 1.0, scale)


@triton.jit
def _scale_from_amax(amax):
    return _scale_for_format(amax, 448.0)  # E4M3


@triton.jit
def _abs_ignoring_nan(x):
    return tl.where(x == x, tl.abs(x), 0.0)  # x != x: NaN, which no amax counts


@triton.jit
def _group_bounds(offsets_ptr, group, G, R):
    # Rows [start, end) of `group`; group G (one past the last) is the rows after the last
    # offset, up to R.
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + group, mask=group < G, other=R).to(tl.int64)
    return start, end


@triton.jit
def _column_amax(x_ptr, start, end, cols, cmask, C, BR: tl.constexpr):
    # Per-column amax ``[BC]`` of rows [start, end) of a row-major ``[R, C]`` operand.
    amax = tl.zeros(cols.shape, dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        m = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(_abs_ignoring_nan(x), 0))
    return amax


@triton.jit
def _rowwise_kernel(x_ptr, q_ptr, s_ptr, L, BL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * L
    amax = tl.zeros([BL], dtype=tl.float32)
    for c0 in range(0, L, BL):
        cols = c0 + tl.arange(0, BL)
        x = tl.load(x_ptr + base + cols, mask=cols < L, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, _abs_ignoring_nan(x))
    scale = _scale_from_amax(tl.max(amax, 0))
    for c0 in range(0, L, BL):
        cols = c0 + tl.arange(0, BL)
        x = tl.load(x_ptr + base + cols, mask=cols < L, other=0.0).to(tl.float32)
        tl.store(q_ptr + base + cols, (x * scale).to(tl.float8e4nv), mask=cols < L)
    tl.store(s_ptr + row, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))


@triton.jit
def _aligned_body(start, end):
    # [start, end) as a head [start, min(lo, end)), a body [lo, hi) whose ends are multiples of
    # 16 and a tail [hi, end): in the body the compiler can prove 16-row runs unmasked and (with
    # an output whose pointer and strides are multiples of 16, as the GEMM operands' are) 16-byte
    # aligned, so the transposed float8 stores go out 16 bytes at a time instead of one.
    lo = (start + 15) // 16 * 16
    hi = tl.maximum(end // 16 * 16, lo)
    return lo, hi


@triton.jit
def _aligned_group_shift(aligned_ends_ptr, group, in_group, start, ALIGN: tl.constexpr):
    # How far the group's rows move in the aligned group layout of a transposed copy (see
    # `fp8_grouped_gemm_triton.grouped_mm_wgrad`): its aligned start minus its start, 0 without
    # one (ALIGN 0). A multiple of 16 written as one, so the compiler still proves the body's
    # transposed stores 16-byte aligned (see `_aligned_body`).
    if ALIGN == 0:
        return tl.zeros_like(start)
    aligned_start = tl.load(aligned_ends_ptr + group - 1, mask=(group > 0) & in_group, other=0).to(tl.int64)
    return (aligned_start - start) // 16 * 16


@triton.jit
def _zero_aligned_gap(q_ptr, out_base, start, end, cols, cmask, stride_qc, in_group, ALIGN: tl.constexpr):
    # Zeros in the transposed copy after the group's last row, up to its aligned end (the next
    # group's aligned start): the weight-gradient kernel's contraction reads them.
    if ALIGN > 0:
        gap = end + tl.arange(0, ALIGN)
        aligned_end = start + (end - start + ALIGN - 1) // ALIGN * ALIGN
        m = (gap < aligned_end)[:, None] & cmask[None, :] & in_group
        zeros = tl.zeros([ALIGN, cols.shape[0]], dtype=tl.float32).to(tl.float8e4nv)
        tl.store(q_ptr + out_base + cols[None, :].to(tl.int64) * stride_qc + gap[:, None], zeros, mask=m)


@triton.jit
def _column_cast_tile(x_ptr, q_ptr, r0, lo, hi, cols, cmask, scale, out_base, C, stride_qc, BR: tl.constexpr):
    # Rows [max(r0, lo), min(r0 + BR, hi)) times the columns' scales, stored transposed.
    rows = r0 + tl.arange(0, BR)
    m = ((rows >= lo) & (rows < hi))[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q = (x * scale[None, :]).to(tl.float8e4nv)
    tl.store(q_ptr + out_base + cols[None, :].to(tl.int64) * stride_qc + rows[:, None], q, mask=m)


@triton.jit
def _group_column_kernel(
    x_ptr, offsets_ptr, q_ptr, s_ptr, C, stride_qc, stride_qg, BR: tl.constexpr, BC: tl.constexpr
):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    end = tl.load(offsets_ptr + group).to(tl.int64)
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    scale = _scale_from_amax(_column_amax(x_ptr, start, end, cols, cmask, C, BR))
    out_base = group.to(tl.int64) * stride_qg
    lo, hi = _aligned_body(start, end)
    _column_cast_tile(x_ptr, q_ptr, start, start, tl.minimum(lo, end), cols, cmask, scale, out_base, C, stride_qc, 16)
    for r0 in range(lo, hi, BR):
        _column_cast_tile(x_ptr, q_ptr, r0, lo, hi, cols, cmask, scale, out_base, C, stride_qc, BR)
    _column_cast_tile(x_ptr, q_ptr, hi, hi, end, cols, cmask, scale, out_base, C, stride_qc, 16)
    tl.store(s_ptr + group.to(tl.int64) * C + cols, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=cmask)


@triton.jit
def _dual_amax_kernel(x_ptr, offsets_ptr, row_amax_ptr, col_amax_ptr, R, C, G,
                      BR: tl.constexpr, BC: tl.constexpr):
    # Program (group, column block): the group's column amax in registers, each row's amax by
    # atomic max over the column blocks (abs values are >= 0, so float max is exact). Group G
    # (one past the last) covers the rows after the last offset: rowwise only.
    group = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    start, end = _group_bounds(offsets_ptr, group, G, R)
    amax = tl.zeros([BC], dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rmask = rows < end
        x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        a = _abs_ignoring_nan(x)
        amax = tl.maximum(amax, tl.max(a, 0))
        tl.atomic_max(row_amax_ptr + rows, tl.max(a, 1), mask=rmask)
    tl.store(col_amax_ptr + group.to(tl.int64) * C + cols, amax, mask=cmask & (group < G))


@triton.jit
def _dual_cast_tile(x_ptr, row_amax_ptr, q_row_ptr, s_row_ptr, q_col_ptr, r0, lo, hi, cols, cmask, col_scale, in_group,
                    out_base, C, stride_qc, BR: tl.constexpr):
    # Rows [max(r0, lo), min(r0 + BR, hi)): the rowwise copy, its row scales (from the first
    # column block only) and the group-column copy stored transposed (groups < G only).
    rows = r0 + tl.arange(0, BR)
    rmask = (rows >= lo) & (rows < hi)
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    row_scale = _scale_from_amax(tl.load(row_amax_ptr + rows, mask=rmask, other=1.0))
    tl.store(q_row_ptr + rows[:, None] * C + cols[None, :], (x * row_scale[:, None]).to(tl.float8e4nv), mask=m)
    tl.store(q_col_ptr + out_base + cols[None, :].to(tl.int64) * stride_qc + rows[:, None],
             (x * col_scale[None, :]).to(tl.float8e4nv), mask=m & in_group)
    tl.store(s_row_ptr + rows, tl.math.div_rn(tl.zeros_like(row_scale) + 1.0, row_scale),
             mask=rmask & (tl.program_id(1) == 0))


@triton.jit
def _dual_cast_kernel(x_ptr, offsets_ptr, row_amax_ptr, col_amax_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr,
                      R, C, G, stride_qc, stride_qg, aligned_ends_ptr, BR: tl.constexpr, BC: tl.constexpr,
                      ALIGN: tl.constexpr = 0):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    in_group = group < G
    start, end = _group_bounds(offsets_ptr, group, G, R)
    col_scale = _scale_from_amax(tl.load(col_amax_ptr + group.to(tl.int64) * C + cols, mask=cmask & in_group,
                                         other=1.0))
    out_base = group.to(tl.int64) * stride_qg + _aligned_group_shift(aligned_ends_ptr, group, in_group, start, ALIGN)
    lo, hi = _aligned_body(start, end)
    _dual_cast_tile(x_ptr, row_amax_ptr, q_row_ptr, s_row_ptr, q_col_ptr, start, start, tl.minimum(lo, end), cols,
                    cmask, col_scale, in_group, out_base, C, stride_qc, 16)
    for r0 in range(lo, hi, BR):
        _dual_cast_tile(x_ptr, row_amax_ptr, q_row_ptr, s_row_ptr, q_col_ptr, r0, lo, hi, cols, cmask, col_scale,
                        in_group, out_base, C, stride_qc, BR)
    _dual_cast_tile(x_ptr, row_amax_ptr, q_row_ptr, s_row_ptr, q_col_ptr, hi, hi, end, cols, cmask, col_scale,
                    in_group, out_base, C, stride_qc, 16)
    _zero_aligned_gap(q_col_ptr, out_base, start, end, cols, cmask, stride_qc, in_group, ALIGN)
    tl.store(s_col_ptr + group.to(tl.int64) * C + cols, tl.math.div_rn(tl.zeros_like(col_scale) + 1.0, col_scale),
             mask=cmask & in_group)


def rowwise_quantize(x_PL: Tensor) -> tuple[Tensor, Tensor]:
    """``[P, L]`` -> (float8_e4m3fn ``[P, L]``, fp32 ``scale_inv [P]``), one scale per row."""
    x_PL = x_PL.contiguous()
    rows, length = x_PL.shape
    q = torch.empty(rows, length, dtype=torch.float8_e4m3fn, device=x_PL.device)
    scale_inv = torch.empty(rows, dtype=torch.float32, device=x_PL.device)
    if rows and length:
        # measured on H200: short rows want few warps, long rows many
        block = min(next_power_of_2(length), 2048)
        launch(_rowwise_kernel, (rows,), x_PL, q, scale_inv, length, BL=block, num_warps=2 if length <= 4096 else 16)
    elif rows:
        scale_inv.fill_(1.0)
    return q, scale_inv


def group_column_quantize(
    x_RC: Tensor, offsets_G: Tensor, out: Tensor, stride_out_col: int, stride_out_group: int
) -> Tensor:
    """Quantize ``x [R, C]`` per (row group, column) into ``out`` (float8_e4m3fn, preallocated).

    Row ``r`` of group ``g`` and column ``c`` go to ``out.flatten()[g * stride_out_group +
    c * stride_out_col + r]``; rows past the last offset are not written. Returns the fp32
    ``scale_inv [G, C]``.
    """
    x_RC = x_RC.contiguous()
    groups, cols = offsets_G.numel(), x_RC.shape[1]
    scale_inv = torch.empty(groups, cols, dtype=torch.float32, device=x_RC.device)
    if groups and cols:
        block_c = 64  # with 128-row tiles: 1.4x the bandwidth of 64 x 64 (H200)
        launch(
            _group_column_kernel, (groups, cdiv(cols, block_c)),
            x_RC, offsets_G.contiguous(), out, scale_inv, cols, stride_out_col, stride_out_group,
            BR=128, BC=block_c, num_warps=4,
        )
    return scale_inv


def dual_quantize(
    x_RC: Tensor, offsets_G: Tensor, out_col: Tensor, stride_out_col: int, stride_out_group: int,
    launch_stream: Optional[torch.cuda.Stream] = None, aligned_ends: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`rowwise_quantize` and `group_column_quantize` of ``x [R, C]`` together, same numbers.

    Returns (float8 ``[R, C]``, fp32 row ``scale_inv [R]``, fp32 group-column ``scale_inv
    [G, C]``); the group-column copy goes to ``out_col`` as in `group_column_quantize`. Rows
    past the last offset get their rowwise copy only. ``launch_stream``: run the kernels
    there (`kernels.launch.on_launch_stream`; the outputs are allocated on the current stream).
    ``aligned_ends``: int32 ``[G]``, the group-column copy in the aligned group layout of
    `grouped_mm_wgrad` (group ``g``'s row ``r`` at column ``aligned_ends[g-1] + r - start_g``,
    zeros up to ``aligned_ends[g]``; needs groups of whole 16-row runs).
    """
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape
    groups = offsets_G.numel()
    q_row = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x_RC.device)
    s_row = torch.empty(rows, dtype=torch.float32, device=x_RC.device)  # every row written below
    s_col = torch.empty(groups, cols, dtype=torch.float32, device=x_RC.device)
    if rows and cols:
        offsets_G = offsets_G.contiguous()
        align, aligned_ends = _column_layout(aligned_ends, s_col)
        with on_launch_stream(launch_stream, x_RC, offsets_G, out_col, q_row, s_row, s_col, aligned_ends):
            row_amax = torch.zeros(rows, dtype=torch.float32, device=x_RC.device)  # atomic-max target
            col_amax = torch.empty(groups, cols, dtype=torch.float32, device=x_RC.device)
            grid = (groups + 1, cdiv(cols, 64))
            # fastest on H200: 128-row tiles for the amax, 64-row for the cast
            launch(_dual_amax_kernel, grid, x_RC, offsets_G, row_amax, col_amax, rows, cols, groups, BR=128, BC=64,
                   num_warps=4)
            launch(_dual_cast_kernel, grid, x_RC, offsets_G, row_amax, col_amax, q_row, s_row, out_col, s_col, rows,
                   cols, groups, stride_out_col, stride_out_group, aligned_ends, BR=64, BC=64, ALIGN=align,
                   num_warps=4)
    else:  # nothing to scale
        s_row.fill_(1.0)
        s_col.fill_(1.0)
    return q_row, s_row, s_col


def _column_layout(aligned_ends: Optional[Tensor], dummy: Tensor) -> tuple[int, Tensor]:
    """(the cast kernels' ``ALIGN``, the pointer for ``aligned_ends_ptr``): `grouped_mm_wgrad`'s
    group alignment with ``aligned_ends``, else 0 and ``dummy`` (never dereferenced)."""
    if aligned_ends is None:
        return 0, dummy
    from lightning_moe.kernels import WGRAD_GROUP_ALIGN

    return WGRAD_GROUP_ALIGN, aligned_ends.contiguous()
