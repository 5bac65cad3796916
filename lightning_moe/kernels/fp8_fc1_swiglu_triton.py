"""fc1's FP8 grouped GEMM with fc2's input cast in its epilogue (Hopper, Triton).

An expert layer with a SwiGLU runs ``h = x @ w1`` (``h = [gate | up]`` ``[R, 2F]``), then casts
``silu(gate) * up`` (times each row's routing probability, where the combine is deferred) to
float8 for fc2 with fc2's delayed scales: ``kernels.fp8_delayed_triton.delayed_cast(h, ...,
swiglu=True)`` reads ``h`` back (0.4 GB at qwen3's shapes). Here each program of fc1's grouped GEMM
holds a row block of a gate column block and of the matching up column block (two accumulators,
the same operand traffic as one tile twice as wide), and its epilogue writes ``h`` (kept for the
SwiGLU's backward) and both float8 copies of the SwiGLU's output: the row copy for fc2's forward
and the per-group transposed copy for fc2's weight gradient, recording each group's amax.

The same bytes as `grouped_mm_fprop` then `delayed_cast(..., swiglu=True)`: the epilogue rounds
``h`` to bf16 first and computes the SwiGLU from those values as the cast kernel does. A group
whose delayed scale is missing (0 or NaN: no history yet) cannot be cast before its amax is known;
the epilogue skips its copies and `cast_groups_without_scale` finishes them from ``h`` afterwards
(a launch whose programs return at once where every group has a scale). A state with no scales at
all (its first step) should take the unfused path, which finds the amaxes in one pre-pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.fp8_delayed_triton import _load_probs, _operand_from_raw, cast_groups_without_scale
from lightning_moe.kernels.fp8_grouped_gemm_triton import _multiprocessors
from lightning_moe.kernels.fp8_quant_triton import (
    _abs_ignoring_nan,
    _aligned_group_shift,
    _column_layout,
    _zero_aligned_gap,
)
from lightning_moe.kernels.launch import launch, next_power_of_2


@triton.jit
def _fprop_swiglu_cast_kernel(a_desc, b_desc, h_ptr, scale_a_ptr, scale_b_ptr, ends_ptr, cast_scale_ptr, q_row_ptr,
                              s_row_ptr, q_col_ptr, s_col_ptr, record_ptr, prob_ptr, aligned_ends_ptr,
                              E, R, F, stride_qc,
                              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_E: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
                              RECORD: tl.constexpr, ROW_PROBS: tl.constexpr, ALIGN: tl.constexpr,
                              col_desc=None, COL_TMA: tl.constexpr = False, WRITE_ROW: tl.constexpr = True,
                              WRITE_COL: tl.constexpr = True):
    """The tiles of `fp8_grouped_gemm_triton._grouped_fprop_kernel` (round-robin over persistent
    programs, group by group, row block fastest) over the SwiGLU's ``F`` columns: tile (rows,
    columns c) accumulates gate columns c and up columns ``F + c`` of ``h``.

    COL_TMA (the aligned layout, ``ALIGN`` a multiple of ``BLOCK_M``; ``col_desc``: the transposed
    copy's descriptor of ``[BLOCK_F, BLOCK_M]`` blocks): the transposed tile leaves by TMA, whole. A
    group's row tiles then land inside its aligned columns, the rows past its end as zeros (its gap).
    WRITE_ROW / WRITE_COL False leave a copy out (timing the epilogue's parts only)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(F, BLOCK_F)
    k_tiles: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    groups = tl.arange(0, BLOCK_E)
    ends = tl.minimum(tl.load(ends_ptr + groups, mask=groups < E, other=0), R)
    starts = tl.minimum(tl.load(ends_ptr + groups - 1, mask=(groups > 0) & (groups < E), other=0), R)
    tiles = tl.cdiv(tl.where(groups < E, tl.maximum(ends - starts, 0), 0), BLOCK_M) * n_tiles
    tile_ends = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    for t in tl.range(pid, total, NUM_PROGRAMS, flatten=True):
        g = tl.sum((tile_ends <= t).to(tl.int32), 0)
        tile_base = tl.sum(tl.where(groups < g, tiles, 0), 0)
        start = tl.minimum(tl.load(ends_ptr + g - 1, mask=g > 0, other=0), R)
        end = tl.minimum(tl.load(ends_ptr + g), R)  # > start: this group has tiles
        m_tiles = tl.cdiv(end - start, BLOCK_M)
        local = t - tile_base
        row0 = start + (local % m_tiles) * BLOCK_M
        col0 = (local // m_tiles) * BLOCK_F
        acc_gate = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        for ki in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([row0, ki * BLOCK_K])
            b_gate = b_desc.load([g * 2 * F + col0, ki * BLOCK_K])
            b_up = b_desc.load([g * 2 * F + F + col0, ki * BLOCK_K])
            acc_gate = tl.dot(a, b_gate.T, acc_gate)
            acc_up = tl.dot(a, b_up.T, acc_up)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_F)
        row_ok = rows < end
        col_ok = cols < F
        m = row_ok[:, None] & col_ok[None, :]
        sa = tl.load(scale_a_ptr + rows, mask=row_ok, other=0.0)[:, None]
        scale_b_row = scale_b_ptr + g * 2 * F
        gate = (acc_gate * sa * tl.load(scale_b_row + cols, mask=col_ok, other=0.0)[None, :]).to(
            h_ptr.dtype.element_ty)
        up = (acc_up * sa * tl.load(scale_b_row + F + cols, mask=col_ok, other=0.0)[None, :]).to(
            h_ptr.dtype.element_ty)
        h_tile = h_ptr + rows[:, None].to(tl.int64) * (2 * F) + cols[None, :]
        tl.store(h_tile, gate, mask=m)
        tl.store(h_tile + F, up, mask=m)
        # The SwiGLU (weighted) as the cast kernel computes it from the stored h; rows of the next
        # group in this tile's last rows are out of the copies and the amax.
        act = tl.where(m, _operand_from_raw(gate, up, True, _load_probs(prob_ptr, rows, row_ok, ROW_PROBS),
                                            ROW_PROBS), 0.0)
        # A group without a scale (0 or NaN) is cast by `cast_groups_without_scale` after the GEMM,
        # which writes all of its rows and its gap: here its copies are masked off (or, by TMA, written
        # and then overwritten), with no branch in the tile loop.
        scale = tl.load(cast_scale_ptr + g)
        # the per-column copy of the scale, as the cast kernel's transposed store takes it
        col_scale = tl.zeros([BLOCK_F], dtype=tl.float32) + scale
        has_scale = col_scale > 0.0  # [BLOCK_F], all alike (a scalar mask: the interpreter refuses it)
        mq = m & has_scale[None, :]
        if WRITE_ROW:
            tl.store(q_row_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], (act * scale).to(tl.float8e4nv),
                     mask=mq)
        out_base = _aligned_group_shift(aligned_ends_ptr, g, True, start.to(tl.int64), ALIGN)
        if WRITE_COL:
            q_t = (act * col_scale[None, :]).to(tl.float8e4nv)
            if COL_TMA:
                col_desc.store([col0, (out_base + row0).to(tl.int32)], tl.trans(q_t))
                if (BLOCK_M < ALIGN) & (row0 + BLOCK_M >= end):
                    # the gap past the last tile (none where BLOCK_M == ALIGN: the tiles end at the aligned end)
                    _zero_aligned_gap(q_col_ptr, out_base, start.to(tl.int64), (row0 + BLOCK_M).to(tl.int64), cols,
                                      col_ok, stride_qc, True, ALIGN)
            else:
                tl.store(q_col_ptr + out_base + cols[None, :].to(tl.int64) * stride_qc + rows[:, None], q_t, mask=mq)
                if row0 + BLOCK_M >= end:
                    _zero_aligned_gap(q_col_ptr, out_base, start.to(tl.int64), end.to(tl.int64), cols,
                                      col_ok & has_scale, stride_qc, True, ALIGN)
        scale_inv = tl.math.div_rn(1.0, scale)
        if col0 == 0:
            tl.store(s_row_ptr + rows, tl.zeros([BLOCK_M], dtype=tl.float32) + scale_inv,
                     mask=row_ok & (tl.zeros([BLOCK_M], dtype=tl.float32) + scale > 0.0))
        if row0 == start:
            tl.store(s_col_ptr + g * F + cols, tl.zeros([BLOCK_F], dtype=tl.float32) + scale_inv,
                     mask=col_ok & has_scale)
        if RECORD:
            tl.atomic_max(record_ptr + g, tl.max(tl.max(_abs_ignoring_nan(act), 1), 0))


def grouped_mm_fprop_swiglu_cast(a_RK: Tensor, scale_a_R: Tensor, b_EOK: Tensor, scale_b_EO: Tensor, ends_E: Tensor,
                                 cast_scale_E: Tensor, record_E: Optional[Tensor], out_col: Tensor,
                                 aligned_ends: Optional[Tensor] = None, row_probs: Optional[Tensor] = None,
                                 block_m: int = 128, block_f: int = 128, block_k: int = 128, num_warps: int = 8,
                                 num_stages: Optional[int] = None, programs: Optional[int] = None,
                                 col_tma: Optional[bool] = None, parts: tuple[str, ...] = ("row", "col")
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fc1's product and fc2's input cast: ``(h, q_row, s_row, s_col)``.

    - ``h`` bf16 ``[R, 2F]``: ``grouped_mm_fprop(a, scale_a, b, scale_b, ends)`` (``b`` float8
      ``[E, 2F, K]``, gate rows first), rows past the last end unwritten;
    - ``q_row`` float8 ``[R, F]`` with ``s_row`` fp32 ``[R]``, ``out_col`` (written) and ``s_col``
      fp32 ``[E, F]``: `delayed_cast(h, ends, cast_scale, record, out_col=out_col, stride_out_col=
      out_col.shape[1], swiglu=True, aligned_ends=aligned_ends, row_probs=row_probs)`'s copies,
      rows past the last end not written.

    ``cast_scale_E`` fp32: fc2's input scales (0: none yet, see the module docstring); ``record_E``:
    fc2's amax row, or None. Launch options as `grouped_mm_fprop`'s (``block_f``: SwiGLU columns per
    tile, so ``2 * block_f`` columns of ``h``). ``col_tma``: the transposed tiles leave by TMA (default:
    where it can, the aligned layout, see `COL_TMA`). ``parts``: the float8 copies written (a benchmark
    leaves one out to time the other; the result is then incomplete)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = a_RK.shape
    experts, o, k_b = b_EOK.shape
    assert k == k_b and a_RK.dtype == b_EOK.dtype == torch.float8_e4m3fn and o % 2 == 0
    f = o // 2
    if row_probs is not None and (row_probs.dtype != torch.float32 or row_probs.shape != (rows,)):
        raise ValueError(f"grouped_mm_fprop_swiglu_cast: row_probs must be fp32 [{rows}], got {row_probs.dtype} "
                         f"{tuple(row_probs.shape)}")
    device = a_RK.device
    h = torch.empty(rows, o, dtype=torch.bfloat16, device=device)
    q_row = torch.empty(rows, f, dtype=torch.float8_e4m3fn, device=device)
    s_row = torch.empty(rows, dtype=torch.float32, device=device)
    s_col = torch.empty(experts, f, dtype=torch.float32, device=device)
    if rows == 0 or experts == 0:
        return h, q_row, s_row, s_col
    cast_scale_E = cast_scale_E.contiguous()
    a_desc = TensorDescriptor(a_RK, [rows, k], [a_RK.stride(0), 1], [block_m, block_k])
    b_rows = b_EOK.reshape(experts * o, k)
    b_desc = TensorDescriptor(b_rows, [experts * o, k], [b_rows.stride(0), 1], [block_f, block_k])
    programs = programs or _multiprocessors(device.index or 0)
    align, aligned_ends_ptr = _column_layout(aligned_ends, cast_scale_E)
    can_tma = bool(align) and align % block_m == 0 and out_col.shape[1] % 16 == 0 and out_col.data_ptr() % 16 == 0
    if col_tma is None:
        col_tma = can_tma
    elif col_tma and not can_tma:
        raise ValueError("grouped_mm_fprop_swiglu_cast(col_tma=True) needs the aligned layout (aligned_ends) with "
                         f"block_m ({block_m}) dividing its alignment and a 16-byte aligned transposed copy")
    if num_stages is None:
        # as grouped_mm_fprop; 4 stages and the TMA store's staging tile overflow shared memory at 128 x 128 x 128
        num_stages = 4 if k < 2048 and not col_tma else 3
    col_options = {}
    if col_tma:
        col_options = dict(col_desc=TensorDescriptor(out_col, list(out_col.shape), [out_col.stride(0), 1],
                                                     [block_f, block_m]), COL_TMA=True)
    launch(_fprop_swiglu_cast_kernel, (programs,),
           a_desc, b_desc, h, scale_a_R, scale_b_EO, ends_E, cast_scale_E, q_row, s_row, out_col, s_col,
           record_E if record_E is not None else cast_scale_E, row_probs if row_probs is not None else cast_scale_E,
           aligned_ends_ptr, experts, rows, f, out_col.shape[1],
           K=k, BLOCK_M=block_m, BLOCK_F=block_f, BLOCK_K=block_k, BLOCK_E=next_power_of_2(experts),
           NUM_PROGRAMS=programs, NUM_STAGES=num_stages, RECORD=record_E is not None, ROW_PROBS=row_probs is not None,
           ALIGN=align, WRITE_ROW="row" in parts, WRITE_COL="col" in parts, num_warps=num_warps, **col_options)
    cast_groups_without_scale(h, ends_E, cast_scale_E, q_row, s_row, out_col, s_col, out_col.shape[1], aligned_ends,
                              row_probs)
    return h, q_row, s_row, s_col
