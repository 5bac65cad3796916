"""Delayed-scaling float8 casts for the native FP8 GEMMs, one read of the operand (more for
token groups without history, see below). The operand may also be computed on the way in: the
SwiGLU of a fused projection output, or the rows of a permutation gathered from the tokens.

Delayed scaling (TE's ``DelayedScaling``) quantizes each token group (or expert weight) with a
scale derived from previous steps' amaxes, so unlike rowwise scaling no amax pass has to run
before the cast: one kernel reads ``x [R, C]`` once and writes every copy the GEMMs need,
recording this micro-batch's per-group amax on the way for the next scale update. Both copies
share the group's scale, so the transposed one is the same float8 values transposed:

- the row copy ``[R, C]`` (fprop / dgrad operand, and the data-gradient weight layout) with
  its per-row ``scale_inv [R]`` (the group's, repeated);
- the per-group transposed copy at caller-chosen strides (the weight-gradient operand ``x^T``,
  or the forward weight layout ``[E, N, K]``) with ``scale_inv [G, C]`` (the group's,
  repeated over columns, as the grouped kernel's 2-D x 2-D form takes them).

Dense linears (one group) take the row copy alone, in E5M2 for the hybrid format's gradients, or
both copies from the tile kernel (their input in E4M3, their gradient in E5M2 under hybrid; see
`native_casts.dense_input_both_layouts` and `dense_grad_both_layouts`); the grouped kernels take
E4M3 only.

Numbers are those of the generic path (``precision.operands``): a group without history
(scale 0: first step, or an expert never routed to) is scaled from its current amax. The tile
kernel finds it itself (each program of such a group reads the whole group first, which happens
only where no history exists yet; a cast in row runs takes the pre-pass instead), so a cast is one
launch; the row kernel, one program per row,
needs a pre-pass that skips every group that has a scale. Rows past the last group (the extra
tail group of ``groups_axis``, read by no GEMM) take their current amax in the row kernel, as in
the generic path, and scale 1 in the tile kernel. Scale, cast and rounding
follow ``fp8_quant_triton`` (``x * scale`` in fp32, saturating round to nearest even,
``scale_inv = 1 / scale`` in IEEE division).

The tile case of bf16 operands, plain or gathered (not the SwiGLU kinds, not E5M2, not a one-group cast
split into row runs by `SINGLE_GROUP_CHUNK_ROWS`), runs the CUDA C kernel of `fp8_cast_cuda` instead
where it compiles (the same bytes, fewer instructions per element; see there).
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels import fp8_cast_cuda
from lightning_moe.kernels.fp8_quant_triton import (
    _abs_ignoring_nan,
    _aligned_body,
    _aligned_group_shift,
    _column_layout,
    _group_bounds,
    _scale_for_format,
    _zero_aligned_gap,
)
from lightning_moe.kernels.launch import cdiv, launch, next_power_of_2, on_launch_stream

# The tile kernel's launch shape (rows, columns, warps) per operand kind: "plain" (weights, data
# gradients), "gather" (fc1's input read through the permutation), "swiglu" (fc2's input computed from
# fc1's output) and "swiglu_grad" (`swiglu_grad_cast_triton`: fc1's output gradient computed from fc1's
# output and fc2's data gradient). Chosen by sweeping shapes at the benchmark models' operands with
# every shape's bytes checked equal (`benchmarks/fp8_quant_tune.py --delayed-fused`,
# `benchmarks/best_cast_tiles.py`). The SwiGLU kinds read two or three tiles per tile cast: larger
# tiles spill registers there, and the spills, not the bytes, bound them. Benchmarks comparing launch
# shapes patch these dicts.
TILE_SHAPES: dict[str, tuple[int, int, int]] = {"plain": (64, 128, 4), "gather": (64, 128, 4), "swiglu": (64, 32, 8),
                                                "swiglu_grad": (64, 32, 8)}

# The per-element amax accumulator of the tile kernels (this one and `swiglu_grad_cast_triton`) folded
# onto fewer rows, per operand kind: each tile's rows r, r + 16, ... are max-folded onto an [AMAX_ROWS, BC]
# accumulator before it is kept (0 or absent: the tile's own rows). The casts are issue-bound with every
# register taken; the fold frees registers for 64 x 128 tiles, where it measured about 1.2x the
# bandwidth of unfolded 128 x 64 tiles. It costs other shapes a layout conversion per tile.
AMAX_FOLD_ROWS: dict[str, int] = {"plain": 16, "gather": 16}

# A cap on the tile kernels' registers per thread, per kind (Triton's ``maxnreg``; absent or 0: the
# compiler's choice, which takes up to 255 wherever it may and so holds a cast to few programs per
# multiprocessor). The SwiGLU casts at 64 x 32 x 8 warps ran fastest capped (a few spilled bytes, more
# warps resident); capping the plain and gathered casts lost.
MAX_REGISTERS: dict[str, int] = {"swiglu": 64, "swiglu_grad": 128}

# Experiment toggle (benchmarks patch it; `train_step.py --single-group-chunk-rows`): rows per program
# of a one-group tile cast of plain rows (a dense operand's both-layout cast), a multiple of 16, on the
# Triton kernel (256: 8,192 tokens of 2,048 columns run 32 x 16 programs instead of 16, one per column
# block). 0: one program per column block, bf16 operands on the CUDA kernel. The same bytes either way.
# Off: measured slower together with the dense gradient's both-layout cast (see benchmarks/NOTES.md).
SINGLE_GROUP_CHUNK_ROWS = 0

# The largest finite values of the float8 formats, the scales' targets.
E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
E5M2_MAX: tl.constexpr = tl.constexpr(57344.0)


def register_cap(kind: str) -> dict:
    """The launch option capping ``kind``'s registers per thread (`MAX_REGISTERS`), or none."""
    cap = MAX_REGISTERS.get(kind, 0)
    return {"maxnreg": cap} if cap > 0 else {}


def amax_rows(kind: str, block_r: int) -> int:
    """The amax accumulator's rows for ``kind``'s tiles of ``block_r`` rows (`AMAX_FOLD_ROWS`)."""
    fold = AMAX_FOLD_ROWS.get(kind, 0)
    if not 0 < fold < block_r:
        return block_r
    if block_r % fold:
        raise ValueError(f"AMAX_FOLD_ROWS[{kind!r}] = {fold} does not divide the tile's {block_r} rows")
    return fold


# The tile casts' amax accumulation: ``acc`` ``[AMAX_ROWS, BC]`` max-folded with ``|x|`` ``[BR, BC]``
# (rows r, r + AMAX_ROWS, ... onto row r), NaN ignored. The compiler lowers a NaN-ignoring maximum (the
# ``where(x == x, ...)`` guard, or ``tl.maximum``'s maxNum) to a NaN test, a select and a max per
# element; PTX's ``max.f32`` ignores a NaN operand by itself (IEEE maxNum), about 12% fewer
# instructions in the plain cast's loop, which is issue-bound. Triton's interpreter runs no PTX: it
# takes the guarded form.
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    @triton.jit
    def _fold_abs_max(acc, x, AMAX_ROWS: tl.constexpr):
        a = _abs_ignoring_nan(x)
        if AMAX_ROWS < x.shape[0]:
            a = tl.max(tl.reshape(a, (x.shape[0] // AMAX_ROWS, AMAX_ROWS, x.shape[1])), axis=0)
        return tl.maximum(acc, a)
else:
    @triton.jit
    def _max_f32(a, b):
        # PTX max.f32: the other operand where one is NaN, the larger otherwise
        return tl.inline_asm_elementwise("max.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _fold_abs_max(acc, x, AMAX_ROWS: tl.constexpr):
        a = tl.abs(x)
        if AMAX_ROWS < x.shape[0]:
            a = tl.reduce(tl.reshape(a, (x.shape[0] // AMAX_ROWS, AMAX_ROWS, x.shape[1])), 0, _max_f32)
        return _max_f32(acc, a)


@triton.jit
def _load_raw(x_ptr, rows, row_mask, cols, m, C, SWIGLU: tl.constexpr, src_ptr, T, GATHER: tl.constexpr):
    # The tile(s) of ``x`` the operand's rows are made of, in ``x``'s dtype, as a pair: (gate, up)
    # with SWIGLU, else the rows twice (see `_operand_from_raw`). ``m`` is ``row_mask`` x the
    # columns'.
    if GATHER:
        src = tl.load(src_ptr + rows, mask=row_mask, other=T)
        held = m & (src < T)[:, None]
        a = tl.load(x_ptr + src[:, None].to(tl.int64) * C + cols[None, :], mask=held, other=0.0)
        return a, a
    if SWIGLU:
        base = rows[:, None].to(tl.int64) * (2 * C) + cols[None, :]
        return tl.load(x_ptr + base, mask=m, other=0.0), tl.load(x_ptr + base + C, mask=m, other=0.0)
    a = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0)
    return a, a


@triton.jit
def _load_probs(prob_ptr, rows, row_mask, ROW_PROBS: tl.constexpr):
    # The rows' routing probabilities (fp32 [BR]) under ROW_PROBS, else a placeholder that reads
    # nothing (its mask is constant false). Rows outside ``row_mask`` get 0.
    return tl.load(prob_ptr + rows, mask=row_mask & ROW_PROBS, other=0.0)


@triton.jit
def _operand_from_raw(a, b, SWIGLU: tl.constexpr, p, ROW_PROBS: tl.constexpr):
    # fp32 tile of the operand from `_load_raw`'s pair. With SWIGLU the pair is (gate, up) of the
    # fused projection output ``h = [gate | up]`` and the operand is ``silu(gate) * up`` computed
    # and rounded to ``h``'s dtype exactly as ``kernels.swiglu_triton`` does, so the cast sees the
    # values the SwiGLU kernel would have written. With ROW_PROBS (SWIGLU only) each row is also
    # weighted by its routing probability ``p`` (fp32 [BR], `_load_probs`) before that one
    # rounding, as Megatron-Core's weighted SwiGLU computes it.
    if SWIGLU:
        gate = a.to(tl.float32)
        act = gate * tl.sigmoid(gate) * b.to(tl.float32)
        if ROW_PROBS:
            act = act * p[:, None]
        return act.to(a.dtype).to(tl.float32)
    return a.to(tl.float32)


@triton.jit
def _load_operand(x_ptr, rows, row_mask, cols, m, C, SWIGLU: tl.constexpr, src_ptr, T, GATHER: tl.constexpr,
                  prob_ptr, ROW_PROBS: tl.constexpr):
    # fp32 tile of the operand ``[R, C]``. With SWIGLU ``x`` is ``h = [gate | up]`` ``[R, 2C]``
    # (see `_operand_from_raw`). With GATHER ``x`` is ``[T, C]`` and operand row ``r`` is
    # ``x[src[r]]``, zero where ``src[r] == T`` (a padding row): the permutation's gather, read
    # straight into the cast instead of written out first.
    a, b = _load_raw(x_ptr, rows, row_mask, cols, m, C, SWIGLU, src_ptr, T, GATHER)
    return _operand_from_raw(a, b, SWIGLU, _load_probs(prob_ptr, rows, row_mask, ROW_PROBS), ROW_PROBS)


@triton.jit
def _operand_column_amax(x_ptr, start, end, cols, cmask, C, BR: tl.constexpr, SWIGLU: tl.constexpr, src_ptr, T,
                         GATHER: tl.constexpr, prob_ptr, ROW_PROBS: tl.constexpr):
    # Per-column amax ``[BC]`` of rows [start, end) of the operand as `_load_operand` reads it
    # (with SWIGLU: of the SwiGLU output computed from ``h``).
    amax = tl.zeros(cols.shape, dtype=tl.float32)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        row_mask = rows < end
        m = row_mask[:, None] & cmask[None, :]
        x = _load_operand(x_ptr, rows, row_mask, cols, m, C, SWIGLU, src_ptr, T, GATHER, prob_ptr, ROW_PROBS)
        amax = tl.maximum(amax, tl.max(_abs_ignoring_nan(x), 0))
    return amax


@triton.jit
def _missing_amax_kernel(x_ptr, offsets_ptr, scale_ptr, amax_ptr, R, C, G, src_ptr, T, prob_ptr, SWIGLU: tl.constexpr,
                         GATHER: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROW_PROBS: tl.constexpr = False):
    # Program (group, column block): the current amax of groups without a scale (and of the
    # tail group G), by atomic max over column blocks; groups with a scale return at once.
    group = tl.program_id(0)
    have = tl.load(scale_ptr + group, mask=group < G, other=0.0)
    if (have > 0.0) == 0:  # also a NaN scale, which the casts replace by the current one too
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cols < C
        start, end = _group_bounds(offsets_ptr, group, G, R)
        amax = _operand_column_amax(x_ptr, start, end, cols, cmask, C, BR, SWIGLU, src_ptr, T, GATHER, prob_ptr,
                                    ROW_PROBS)
        tl.atomic_max(amax_ptr + group, tl.max(amax, 0))


@triton.jit
def _delayed_cast_tile(x_ptr, q_row_ptr, q_col_ptr, r0, lo, hi, cols, cmask, scale, in_group, out_base, C,
                       stride_qc, amax, src_ptr, T, WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr,
                       SWIGLU: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr, prob_ptr,
                       ROW_PROBS: tl.constexpr, E5M2: tl.constexpr = False):
    # Rows [max(r0, lo), min(r0 + BR, hi)) cast with the group's scale into the requested
    # copies (a group's unaligned head and tail); returns the running per-column amax ``[BC]``.
    rows = r0 + tl.arange(0, BR)
    row_mask = (rows >= lo) & (rows < hi)
    m = row_mask[:, None] & cmask[None, :]
    x = _load_operand(x_ptr, rows, row_mask, cols, m, C, SWIGLU, src_ptr, T, GATHER, prob_ptr, ROW_PROBS)
    return _cast_store(x, rows, m, q_row_ptr, q_col_ptr, cols, scale, in_group, out_base, C, stride_qc, amax,
                       WRITE_ROW, WRITE_COL, False, E5M2)


@triton.jit
def _to_fp8(x, E5M2: tl.constexpr):
    # The fp32 values (already scaled) to E5M2 or E4M3, round to nearest even, as the module docstring says.
    if E5M2:
        q = x.to(tl.float8e5)
    else:
        q = x.to(tl.float8e4nv)
    return q


@triton.jit
def _cast_store(x, rows, m, q_row_ptr, q_col_ptr, cols, scale, in_group, out_base, C, stride_qc, amax,
                WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, AMAX_ROWS: tl.constexpr, E5M2: tl.constexpr = False):
    # The fp32 operand tile ``x`` (rows ``rows``, valid where ``m``) cast into the requested copies;
    # returns the running amax (for the record): per column ``[BC]`` (AMAX_ROWS 0), or per element
    # of an ``[AMAX_ROWS, BC]`` accumulator, which needs no reduction across the tile's rows
    # (threads and warps) until the loop ends. AMAX_ROWS below the tile's rows folds the tile's
    # row blocks onto it first (rows r, r + AMAX_ROWS, ...: the same thread's under the tile's
    # layout), so the accumulator holds fewer registers. E5M2: both copies in E5M2 (a dense
    # GEMM's hybrid-format gradient), else E4M3.
    if WRITE_ROW:
        tl.store(q_row_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], _to_fp8(x * scale, E5M2), mask=m)
    if WRITE_COL:
        # The same values, cast again from a per-column copy of the scale rather than storing the
        # row copy's float8 tile transposed: with fp32 input that transposed float8 store wrote
        # wrong bytes on the H200 (GPU test with fp32 input; bf16 was right).
        col_scale = tl.zeros_like(cols).to(tl.float32) + scale
        # Explicitly transposed tiles (the fp32 values, or the float8 bytes) measured no faster
        # than letting the compiler reshuffle this one (measured).
        tl.store(q_col_ptr + out_base + cols[None, :].to(tl.int64) * stride_qc + rows[:, None],
                 _to_fp8(x * col_scale[None, :], E5M2), mask=m & in_group)
    if AMAX_ROWS > 0:
        return _fold_abs_max(amax, x, AMAX_ROWS)
    return tl.maximum(amax, tl.max(_abs_ignoring_nan(x), 0))


@triton.jit
def _store_row_scales(s_row_ptr, start, end, scale_inv):
    # ``scale_inv`` into the row copy's scales of rows [start, end) (one program of the group does it).
    for r0 in range(start, end, 1024):
        rows = r0 + tl.arange(0, 1024)
        tl.store(s_row_ptr + rows, tl.zeros([1024], dtype=tl.float32) + scale_inv, mask=rows < end)


@triton.jit
def _delayed_cast_kernel(x_ptr, offsets_ptr, scale_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr,
                         record_ptr, R, C, G, stride_qc, stride_qg, src_ptr, T, aligned_ends_ptr, prob_ptr,
                         WRITE_ROW: tl.constexpr, WRITE_COL: tl.constexpr, RECORD: tl.constexpr,
                         SWIGLU: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, GROUP_AXIS: tl.constexpr = 0,
                         GATHER: tl.constexpr = False, ALIGN: tl.constexpr = 0, ROW_PROBS: tl.constexpr = False,
                         AMAX_ROWS: tl.constexpr = 0, CHUNK_ROWS: tl.constexpr = 0, E5M2: tl.constexpr = False):
    # Program (group, column block, row chunk); GROUP_AXIS = 1 puts the column blocks on the
    # grid's fastest axis, so the programs resident together read neighbouring columns of the same
    # rows. CHUNK_ROWS > 0: the grid's third axis splits each group's rows into runs of that many
    # (a dense operand is one group: without the split it would run one program per column block);
    # 0: one program casts its whole group.
    group = tl.program_id(GROUP_AXIS)
    cols = tl.program_id(1 - GROUP_AXIS) * BC + tl.arange(0, BC)
    cmask = cols < C
    in_group = group < G
    start, end = _group_bounds(offsets_ptr, group, G, R)
    history = tl.load(scale_ptr + group, mask=in_group, other=1.0)
    scale = history
    if (history > 0.0) == 0:  # a group without history (also a NaN scale): its current amax decides
        # Over every column of the group, so each of its column blocks' programs reads the whole
        # group: only where no history exists yet (the first step; an expert that never had a
        # token is empty), in place of a separate amax pass launched at every cast.
        group_amax = 0.0
        for c0 in range(0, C, BC):
            block = c0 + tl.arange(0, BC)
            group_amax = tl.maximum(group_amax, tl.max(_operand_column_amax(
                x_ptr, start, end, block, block < C, C, 32, SWIGLU, src_ptr, T, GATHER, prob_ptr, ROW_PROBS), 0))
        scale = _scale_for_format(group_amax, E5M2_MAX if E5M2 else E4M3_MAX)
    scale_inv = tl.math.div_rn(1.0, scale)
    out_base = group.to(tl.int64) * stride_qg + _aligned_group_shift(aligned_ends_ptr, group, in_group, start, ALIGN)
    group_start, group_end = start, end
    if CHUNK_ROWS > 0:  # this program's run of the group's rows
        start = tl.minimum(start + tl.program_id(2).to(tl.int64) * CHUNK_ROWS, group_end)
        end = tl.minimum(start + CHUNK_ROWS, group_end)
    lo, hi = _aligned_body(start, end)
    amax = tl.zeros([BC], dtype=tl.float32)
    amax = _delayed_cast_tile(x_ptr, q_row_ptr, q_col_ptr, start, start, tl.minimum(lo, end), cols, cmask, scale,
                              in_group, out_base, C, stride_qc, amax, src_ptr, T, WRITE_ROW, WRITE_COL, SWIGLU,
                              GATHER, 16, prob_ptr, ROW_PROBS, E5M2)
    # The body [lo, hi), whose bounds are multiples of 16: the next tile's load is issued before
    # this tile is cast, so two tiles are in flight per program, the next one held in ``x``'s
    # dtype (about 1.17x the bandwidth of one tile at a time; the compiler's software pipelining
    # measured no faster). The amax is kept per element.
    # AMAX_ROWS 0 (the launch default): the tile's own rows, no fold
    BODY_AMAX_ROWS: tl.constexpr = AMAX_ROWS if AMAX_ROWS > 0 else BR
    body_amax = tl.zeros([BODY_AMAX_ROWS, BC], dtype=tl.float32)
    tile_rows = lo + tl.arange(0, BR)
    ahead_a, ahead_b = _load_raw(x_ptr, tile_rows, tile_rows < hi, cols,
                                 (tile_rows < hi)[:, None] & cmask[None, :], C, SWIGLU, src_ptr, T, GATHER)
    ahead_p = _load_probs(prob_ptr, tile_rows, tile_rows < hi, ROW_PROBS)  # in flight with the tile
    for r0 in tl.range(lo, hi, BR, num_stages=1):
        tile_rows = r0 + tl.arange(0, BR)
        x = _operand_from_raw(ahead_a, ahead_b, SWIGLU, ahead_p, ROW_PROBS)
        next_rows = tile_rows + BR
        ahead_a, ahead_b = _load_raw(x_ptr, next_rows, next_rows < hi, cols,
                                     (next_rows < hi)[:, None] & cmask[None, :], C, SWIGLU, src_ptr, T, GATHER)
        ahead_p = _load_probs(prob_ptr, next_rows, next_rows < hi, ROW_PROBS)
        body_amax = _cast_store(x, tile_rows, (tile_rows < hi)[:, None] & cmask[None, :], q_row_ptr, q_col_ptr,
                                cols, scale, in_group, out_base, C, stride_qc, body_amax, WRITE_ROW, WRITE_COL,
                                BODY_AMAX_ROWS, E5M2)
    amax = tl.maximum(amax, tl.max(body_amax, 0))
    amax = _delayed_cast_tile(x_ptr, q_row_ptr, q_col_ptr, hi, hi, end, cols, cmask, scale, in_group, out_base, C,
                              stride_qc, amax, src_ptr, T, WRITE_ROW, WRITE_COL, SWIGLU, GATHER, 16, prob_ptr,
                              ROW_PROBS, E5M2)
    if WRITE_ROW:
        if tl.program_id(1 - GROUP_AXIS) == 0:  # one column block writes the row scales of its run
            _store_row_scales(s_row_ptr, start, end, scale_inv)
    if WRITE_COL:
        _zero_aligned_gap(q_col_ptr, out_base, group_start, group_end, cols, cmask, stride_qc,
                          in_group & (end == group_end), ALIGN)  # by the group's last run
        tl.store(s_col_ptr + group.to(tl.int64) * C + cols, tl.zeros([BC], dtype=tl.float32) + scale_inv,
                 mask=cmask & in_group & (end == group_end))  # by the group's last run
    if RECORD:
        tl.atomic_max(record_ptr + group, tl.max(amax, 0), mask=in_group)


@triton.jit
def _fill_missing_scales_kernel(scale_ptr, amax_ptr, out_ptr, G, BLOCK: tl.constexpr, FMT_MAX: tl.constexpr = 448.0):
    # out[g] = scale[g] where it is > 0, else the scale of the current amax (a NaN scale too) for
    # the format whose largest value is FMT_MAX.
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = g < G
    history = tl.load(scale_ptr + g, mask=m, other=1.0)
    current = _scale_for_format(tl.load(amax_ptr + g, mask=m, other=0.0), FMT_MAX)
    tl.store(out_ptr + g, tl.where(history > 0.0, history, current), mask=m)


@triton.jit
def _delayed_row_kernel(x_ptr, offsets_ptr, scale_ptr, cur_amax_ptr, q_ptr, s_ptr, record_ptr, C, G, src_ptr, T,
                        SEARCH_STEPS: tl.constexpr, RECORD: tl.constexpr, E5M2: tl.constexpr, BL: tl.constexpr,
                        GATHER: tl.constexpr = False):
    # Program per row: the row copy alone (no transposed store to shape the tiles around), read
    # as whole rows like the rowwise quantizer. The row's group by binary search of the ends.
    row = tl.program_id(0).to(tl.int64)
    lo = 0
    hi = G
    for _ in tl.static_range(SEARCH_STEPS):  # first group whose end is past the row (G: the tail)
        mid = (lo + hi) // 2
        past = tl.load(offsets_ptr + mid, mask=mid < G, other=0).to(tl.int64) > row
        go_left = (lo < hi) & past
        go_right = (lo < hi) & ~past
        hi = tl.where(go_left, mid, hi)
        lo = tl.where(go_right, mid + 1, lo)
    group = lo
    history = tl.load(scale_ptr + group, mask=group < G, other=0.0)
    current = _scale_for_format(tl.load(cur_amax_ptr + group), E5M2_MAX if E5M2 else E4M3_MAX)
    scale = tl.where(history > 0.0, history, current)
    base = row * C
    source = base  # with GATHER: row src[row] of x [T, C], zeros for the padding sentinel T
    held = True
    if GATHER:
        src = tl.load(src_ptr + row)
        source = src.to(tl.int64) * C
        held = src < T
    amax = tl.zeros([BL], dtype=tl.float32)
    for c0 in range(0, C, BL):
        cols = c0 + tl.arange(0, BL)
        x = tl.load(x_ptr + source + cols, mask=(cols < C) & held, other=0.0).to(tl.float32)
        tl.store(q_ptr + base + cols, _to_fp8(x * scale, E5M2), mask=cols < C)
        if RECORD:
            amax = tl.maximum(amax, _abs_ignoring_nan(x))
    tl.store(s_ptr + row, tl.math.div_rn(1.0, scale))
    if RECORD:
        tl.atomic_max(record_ptr + group, tl.max(amax, 0), mask=group < G)


def delayed_cast(
    x_RC: Tensor,
    offsets_G: Tensor,
    scale_G: Tensor,
    record_G: Optional[Tensor],
    write_row: bool = True,
    out_col: Optional[Tensor] = None,
    stride_out_col: int = 0,
    stride_out_group: int = 0,
    e5m2: bool = False,
    swiglu: bool = False,
    launch_stream: Optional[torch.cuda.Stream] = None,
    gather_rows: Optional[Tensor] = None,
    aligned_ends: Optional[Tensor] = None,
    row_probs: Optional[Tensor] = None,
    amax_prepass: bool = False,
    reduce_amax: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Cast ``x [R, C]`` (rows in token groups, cumulative int32 ends ``offsets [G]``) to E4M3
    (or E5M2) with per-group delayed scales ``scale_G [G]`` (0: none yet, the current amax
    decides).

    Args:
        record_G: fp32 ``[G]`` this micro-batch's per-group amax is max-folded into (the amax
            history's current row), or None to record nothing (evaluation).
        write_row: write the row copy (float8 ``[R, C]``, every row incl. the tail, which is
            cast with scale 1 when ``out_col`` is given) and its ``scale_inv [R]``.
        out_col: preallocated float8 buffer for the transposed copy: row ``r`` of group ``g``,
            column ``c`` goes to ``out_col.flatten()[g * stride_out_group + c * stride_out_col
            + r]`` (rows past the last group are not written); None: no transposed copy.
        e5m2: cast to E5M2 instead (hybrid-format gradients of dense GEMMs; ``out_col`` then
            float8_e5m2 too, with one group: the grouped kernels take E4M3 only).
        swiglu: ``x`` is a fused projection output ``h = [gate | up]`` ``[R, 2C]`` and the
            operand cast is ``silu(gate) * up`` ``[R, C]``, computed on the fly with the SwiGLU
            kernel's arithmetic and rounding (the same bits as casting its output), so the
            SwiGLU output is never written. Needs ``out_col`` (the per-group tile kernel).
        launch_stream: run the kernels there (see `on_launch_stream`); the outputs are
            allocated on the current stream, which must wait for ``launch_stream`` before
            reading them.
        gather_rows: int64 ``[R]``: ``x`` is then ``[T, C]`` and the operand's row ``r`` is
            ``x[gather_rows[r]]``, zeros where it is ``T`` (a padding row): the permutation's
            gather read straight into the cast, so the permuted rows are never written in
            ``x``'s dtype. Not with ``swiglu``.
        aligned_ends: int32 ``[G]``: the transposed copy in the aligned group layout of
            `grouped_mm_wgrad` (``r`` above becomes ``aligned_ends[g-1] + r - start_g``, zeros
            after the group's rows up to ``aligned_ends[g]``). Needs every group end on a multiple of
            16 rows and ``aligned_ends`` at least the cumulated sizes so rounded (as the FP8 path pads
            and `native_casts.assert_groups_aligned` checks on the device: this function reads no
            device value); otherwise two groups' programs write the same bytes.
        row_probs: fp32 ``[R]`` with ``swiglu``: the operand is ``prob[r] * silu(gate) * up``
            (Megatron-Core's weighted SwiGLU: the routing probabilities applied before the
            second projection, so the combine after it is an unweighted sum).
        amax_prepass: the tile kernel takes the current amax of groups without a scale from a
            pre-pass (as the row kernel always does and evaluation does) instead of finding it
            itself, which reads such a group once per column block: for a state that has no
            scales yet (`DelayedState.fresh`). The same values either way.
        reduce_amax: applied to the pre-pass's per-group current amaxes ``[G]`` before the cast
            (a fresh state's max-reduction over the ranks holding the tensor,
            `delayed.reduce_current_amax`); implies ``amax_prepass``. Called for an empty operand
            too (with zeros), so that a collective inside it runs on every rank.
    Returns:
        (row copy, row ``scale_inv [R]``, group-column ``scale_inv [G, C]``), None for a copy
        not asked for.
    """
    if not write_row and out_col is None:
        raise ValueError("delayed_cast: nothing to write; ask for the row copy, the transposed one or both")
    if e5m2 and out_col is not None and (offsets_G.numel() != 1 or swiglu or gather_rows is not None
                                         or aligned_ends is not None or out_col.dtype != torch.float8_e5m2):
        raise ValueError("delayed_cast: an E5M2 transposed copy is for one group of plain rows (a dense gradient), "
                         "into a float8_e5m2 buffer")
    if swiglu and out_col is None:
        raise ValueError("delayed_cast: swiglu=True needs out_col (the transposed copy's buffer)")
    if aligned_ends is not None and out_col is None:
        raise ValueError("delayed_cast: aligned_ends lays out the transposed copy; it needs out_col")
    if swiglu and gather_rows is not None:
        raise ValueError("delayed_cast: gather_rows is for a permutation's rows, not with swiglu=True")
    if row_probs is not None and not swiglu:
        raise ValueError("delayed_cast: row_probs weights the SwiGLU's rows; it needs swiglu=True")
    if row_probs is not None and (row_probs.dtype != torch.float32 or row_probs.shape != (x_RC.shape[0],)):
        raise ValueError(f"delayed_cast: row_probs must be fp32 [{x_RC.shape[0]}] (one per row of h), got "
                         f"{row_probs.dtype} {tuple(row_probs.shape)}")
    x_RC = x_RC.contiguous()
    rows, cols = x_RC.shape[0], x_RC.shape[1] // 2 if swiglu else x_RC.shape[1]
    if gather_rows is not None:
        gather_rows = gather_rows.contiguous()
        rows = gather_rows.shape[0]
    groups = offsets_G.numel()
    device = x_RC.device
    row_dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    q_row = torch.empty(rows, cols, dtype=row_dtype, device=device) if write_row else None
    s_row = torch.empty(rows, dtype=torch.float32, device=device) if write_row else None
    s_col = torch.empty(groups, cols, dtype=torch.float32, device=device) if out_col is not None else None
    if not (rows and cols):  # nothing to cast; no amax to record
        if reduce_amax is not None:  # the group's other ranks reduce theirs: take part with zeros
            reduce_amax(torch.zeros(groups, dtype=torch.float32, device=device))
        # The generic path's scales: the history's where there is one, else 1 (an empty
        # group's amax is 0); the tail group has no history.
        inv_G = torch.where(scale_G > 0, 1.0 / scale_G, torch.ones_like(scale_G)).to(torch.float32)
        if s_col is not None:
            s_col.copy_(inv_G[:, None].expand(groups, cols))
        if s_row is not None and rows:
            row_group = torch.searchsorted(offsets_G.long(), torch.arange(rows, device=device), right=True)
            s_row.copy_(torch.cat([inv_G, inv_G.new_ones(1)])[row_group])
        return q_row, s_row, s_col
    offsets_G = offsets_G.contiguous()
    scale_G = scale_G.contiguous()
    row_probs = None if row_probs is None else row_probs.contiguous()
    with on_launch_stream(launch_stream, x_RC, offsets_G, scale_G, record_G, q_row, s_row, out_col, s_col,
                          gather_rows, aligned_ends, row_probs):
        _launch_delayed_cast(x_RC, rows, cols, offsets_G, scale_G, record_G, q_row, s_row, out_col, s_col,
                             stride_out_col, stride_out_group, e5m2, swiglu, gather_rows, aligned_ends, row_probs,
                             amax_prepass or reduce_amax is not None, reduce_amax)
    return q_row, s_row, s_col


def _single_group_chunk_rows(rows: int, groups: int, special: bool) -> int:
    """Rows per program of a one-group tile cast of plain rows (`SINGLE_GROUP_CHUNK_ROWS`, at least
    what keeps the grid's third axis within CUDA's 65,535), or 0: one program per column block."""
    if not SINGLE_GROUP_CHUNK_ROWS or groups != 1 or special:
        return 0
    if SINGLE_GROUP_CHUNK_ROWS % 16:
        raise ValueError(f"SINGLE_GROUP_CHUNK_ROWS = {SINGLE_GROUP_CHUNK_ROWS}: use a multiple of 16 rows (or 0)")
    return max(SINGLE_GROUP_CHUNK_ROWS, cdiv(cdiv(rows, 65535), 16) * 16)


def _current_amaxes(x_RC: Tensor, offsets_G: Tensor, scale_G: Tensor, rows: int, cols: int, amax_groups: int,
                    src: Tensor, num_src: int, row_probs: Optional[Tensor], swiglu: bool, gather: bool) -> Tensor:
    """fp32 ``[amax_groups]``: the current amax of every group without a scale (0 elsewhere) by the
    pre-pass; ``amax_groups`` is the group count, plus one for the tail group's."""
    cur_amax = torch.zeros(amax_groups, dtype=torch.float32, device=x_RC.device)  # atomic-max target
    launch(_missing_amax_kernel, (amax_groups, cdiv(cols, 64)), x_RC, offsets_G, scale_G, cur_amax, rows, cols,
           offsets_G.numel(), src, num_src, cur_amax if row_probs is None else row_probs, SWIGLU=swiglu,
           GATHER=gather, BR=128, BC=64, ROW_PROBS=row_probs is not None, num_warps=4)
    return cur_amax


def _launch_delayed_cast(x_RC: Tensor, rows: int, cols: int, offsets_G: Tensor, scale_G: Tensor,
                         record_G: Optional[Tensor], q_row: Optional[Tensor], s_row: Optional[Tensor],
                         out_col: Optional[Tensor], s_col: Optional[Tensor], stride_out_col: int,
                         stride_out_group: int, e5m2: bool, swiglu: bool, gather_rows: Optional[Tensor],
                         aligned_ends: Optional[Tensor], row_probs: Optional[Tensor], amax_prepass: bool,
                         reduce_amax: Optional[Callable[[Tensor], Tensor]]) -> None:
    # The kernels of `delayed_cast` (the operand is ``rows x cols`` after the SwiGLU or the
    # gather, if any).
    groups = offsets_G.numel()
    write_row = q_row is not None
    gather = gather_rows is not None
    weighted = row_probs is not None
    if out_col is None:
        # The row copy alone: one program per whole row, as the rowwise quantizer (its launch
        # shape), instead of per-group column tiles. A program sees one row,
        # so the current amax of groups without history (and of the tail) comes from a pre-pass.
        src, num_src = (gather_rows, x_RC.shape[0]) if gather else (scale_G, 0)
        cur_amax = _current_amaxes(x_RC, offsets_G, scale_G, rows, cols, groups + 1, src, num_src, None, swiglu, gather)
        if reduce_amax is not None:  # the tail's amax (its own, no history) stays local
            cur_amax = torch.cat([reduce_amax(cur_amax[:groups]), cur_amax[groups:]])
        block = min(next_power_of_2(cols), 2048)
        launch(
            _delayed_row_kernel, (rows,),
            x_RC, offsets_G, scale_G, cur_amax, q_row, s_row, record_G if record_G is not None else cur_amax,
            cols, groups, src, num_src, SEARCH_STEPS=max(groups, 1).bit_length(), RECORD=record_G is not None,
            E5M2=e5m2, BL=block, GATHER=gather,
            num_warps=2 if cols <= 4096 else 16,
        )
        return
    # The tile kernel finds the current amax of a group without history itself (one launch per
    # cast, no pre-pass and no zeroed buffer: two launches fewer on the host). The tail group
    # only exists for the row copy (no GEMM reads a transposed tail).
    cast_groups = groups + 1 if write_row else groups
    dummy = scale_G  # pointer for the operands a launch does not touch (never dereferenced)
    src, num_src = (gather_rows, x_RC.shape[0]) if gather else (dummy, 0)
    probs = row_probs if weighted else dummy
    chunk_rows = _single_group_chunk_rows(rows, groups, swiglu or gather or aligned_ends is not None)
    # In row runs each program of a group without a scale would read the whole group: the pre-pass instead.
    if record_G is None or amax_prepass or chunk_rows:
        # Evaluation (amax recording paused) may run on groups that never get a history (a loaded
        # checkpoint holds no FP8 state, and evaluation updates none), and a state's first step
        # has no scale at all: there the kernel's own amax would read each group once per column
        # block. Here the amax pre-pass runs instead and the missing scales are filled in before
        # the cast, so the kernel never takes that branch; the same scales, so the same bits.
        cur_amax = _current_amaxes(x_RC, offsets_G, scale_G, rows, cols, groups, src, num_src, row_probs, swiglu,
                                   gather)
        if reduce_amax is not None:
            cur_amax = reduce_amax(cur_amax)
        filled = torch.empty_like(scale_G)
        launch(_fill_missing_scales_kernel, (cdiv(groups, 1024),), scale_G, cur_amax, filled, groups, BLOCK=1024,
               FMT_MAX=(E5M2_MAX if e5m2 else E4M3_MAX).value, num_warps=4)
        scale_G = filled
    if not chunk_rows and fp8_cast_cuda.applies(x_RC, cols, offsets_G, swiglu, out_col, e5m2, gather_rows):
        fp8_cast_cuda.launch_delayed_cast(x_RC, rows, cols, offsets_G, scale_G, record_G, q_row, s_row, out_col, s_col,
                                          stride_out_col, stride_out_group, gather_rows, aligned_ends)
        return
    align, aligned_ends_ptr = _column_layout(aligned_ends, dummy)
    # Launch: amax kept per element until the loop ends and column blocks on the grid's fast axis
    # (each measured faster than an amax reduced per tile or groups on the fast axis), tiles with
    # the next one's load in flight; the tile shape per operand kind: `TILE_SHAPES`.
    kind = "swiglu" if swiglu else "gather" if gather else "plain"
    block_r, block_c, warps = TILE_SHAPES[kind]
    options = register_cap(kind)
    launch(
        _delayed_cast_kernel, (cdiv(cols, block_c), cast_groups, cdiv(rows, chunk_rows) if chunk_rows else 1),
        x_RC, offsets_G, scale_G,
        q_row if write_row else dummy, s_row if write_row else dummy,
        out_col if out_col is not None else dummy, s_col if s_col is not None else dummy,
        record_G if record_G is not None else dummy,
        rows, cols, groups, stride_out_col, stride_out_group, src, num_src, aligned_ends_ptr, probs,
        WRITE_ROW=write_row, WRITE_COL=out_col is not None, RECORD=record_G is not None, SWIGLU=swiglu,
        BR=block_r, BC=block_c, GROUP_AXIS=1, GATHER=gather, ALIGN=align, ROW_PROBS=weighted,
        AMAX_ROWS=amax_rows(kind, block_r), CHUNK_ROWS=chunk_rows, E5M2=e5m2, num_warps=warps, **options,
    )
