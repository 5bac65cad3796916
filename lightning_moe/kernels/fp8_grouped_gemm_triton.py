"""FP8 grouped GEMMs for many small experts (Hopper, Triton): the forward and data-gradient
products of a grouped expert layer with rowwise scales (`grouped_mm_fprop`), and its weight
gradient on an aligned group layout (`grouped_mm_wgrad`, see there).

``out[rows of e] = (a[rows of e] @ b[e]^T) * scale_a[row] * scale_b[e, col]``

- ``a``: float8 ``[R, K]`` row-major, its rows grouped by expert (``ends``, int32 cumulative
  row ends ``[E]``; rows past the last end are not read into any output);
- ``b``: float8 ``[E, O, K]`` (K contiguous): each expert's weight in the layout the tensor cores
  read (both wgmma operands of an FP8 product must be K-major);
- ``scale_a`` fp32 ``[R]``, ``scale_b`` fp32 ``[E, O]``; output bf16 ``[R, O]``.

This is what ``torch._scaled_grouped_mm`` computes for the 2-D x 3-D case. torch's kernel runs
the qwen3 shapes (128 experts of ~1,024 rows, K 768-2,048) at 770-940 TFLOP/s on an H200.
Here one persistent program per multiprocessor walks the tiles of
every group in turn; operands come in by TMA descriptors (rows of the next group in a tile's
last rows are read and never stored, rows past ``R`` read as zeros); the epilogue applies both
scales and stores the group's rows only.

Accumulation: fast (``precise=False``: the tensor cores' own accumulator for the whole
contraction, as ``use_fast_accum=True``) or split (``precise=True``: each ``BLOCK_K`` slice of the
contraction is summed by the tensor cores and then added to an fp32 accumulator in registers, as
cuBLAS's split accumulator and Transformer Engine's default data and weight gradients; Hopper's
FP8 tensor-core accumulator keeps fewer mantissa bits than fp32, which a long contraction such as a
weight gradient over thousands of tokens would feel).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels import WGRAD_GROUP_ALIGN
from lightning_moe.kernels.launch import launch, next_power_of_2


@triton.jit
def _accumulate(a, b, acc, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr):
    """``acc + a @ b^T``: fast (one tensor-core accumulation over the whole contraction) or split
    (the tensor cores sum this ``BLOCK_K`` slice, which is then promoted into ``acc`` in fp32)."""
    if PRECISE:
        acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _grouped_fprop_kernel(a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, ends_ptr,
                          E, R, N_OUT, stride_out,
                          K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                          NUM_STAGES: tl.constexpr, FLATTEN: tl.constexpr = True,
                          WARP_SPECIALIZE: tl.constexpr = False, PRECISE: tl.constexpr = False):
    """Tiles are dealt round-robin to the persistent programs: group by group, each group's tiles
    row block fastest (the tiles running together share ``b``'s block). One loop over all tiles,
    a tile's group found from the groups' tile counts held in registers, which the compiler
    flattens with the K loop: the next tile's loads are issued during this tile's epilogue
    (1.04-1.27x a loop over groups with a tile loop inside).

    Group ends are clamped to ``R`` and a group ending before it starts has no rows: offsets that
    a caller got wrong cannot make the kernel write outside ``out``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    k_tiles: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    groups = tl.arange(0, BLOCK_E)
    ends = tl.minimum(tl.load(ends_ptr + groups, mask=groups < E, other=0), R)
    starts = tl.minimum(tl.load(ends_ptr + groups - 1, mask=(groups > 0) & (groups < E), other=0), R)
    tiles = tl.cdiv(tl.where(groups < E, tl.maximum(ends - starts, 0), 0), BLOCK_M) * n_tiles
    tile_ends = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    for t in tl.range(pid, total, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        g = tl.sum((tile_ends <= t).to(tl.int32), 0)
        tile_base = tl.sum(tl.where(groups < g, tiles, 0), 0)
        start = tl.minimum(tl.load(ends_ptr + g - 1, mask=g > 0, other=0), R)
        end = tl.minimum(tl.load(ends_ptr + g), R)  # > start: this group has tiles
        m_tiles = tl.cdiv(end - start, BLOCK_M)
        local = t - tile_base
        row0 = start + (local % m_tiles) * BLOCK_M
        col0 = (local // m_tiles) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(0, k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([row0, ki * BLOCK_K])
            b = b_desc.load([g * N_OUT + col0, ki * BLOCK_K])
            acc = _accumulate(a, b, acc, BLOCK_K, PRECISE)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < N_OUT
        sa = tl.load(scale_a_ptr + rows, mask=row_ok, other=0.0)
        sb = tl.load(scale_b_ptr + g * N_OUT + cols, mask=col_ok, other=0.0)
        out = (acc * sa[:, None] * sb[None, :]).to(out_ptr.dtype.element_ty)
        ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


MAX_EXPERTS = 1024  # the kernel holds every group's tile count in registers (measured up to 1,000)

# Launch shapes, (block_m, block_n, block_k, num_warps, num_stages; None: the kernel's rule,
# persistent programs per multiprocessor), that the wrappers take when the caller gives none.
# Split accumulation keeps a second fp32 copy of the tile in registers (Triton's
# ``max_num_imprecise_acc``: the tensor cores sum a ``BLOCK_K`` slice into it, which is then added
# to the accumulator), so a 128 x 256 tile over 8 warps needs about
# 256 registers a thread and spills to the stack (ptxas for sm90: 255 registers and 200 bytes of
# stack in the forward kernel, 424 in the weight gradient's) and ran at 350-730 TFLOP/s on an H100
# (`fp8_grouped_tune.py --precise`). 256 x 128 over 8 warps fits the forward kernel in 255
# registers without stack and ran fastest there (834-858 TFLOP/s at the Mixtral and Qwen3
# data-gradient shapes, 128 x 128: 731-854). The weight gradient's fp32 epilogue (fp32 master
# weights, its old value read back when it accumulates into ``.grad``) spills at 128 x 256 and
# 256 x 128, fast accumulation included; 128 x 128 with 4 stages ran fastest there (385-616
# against 313-501 TFLOP/s). Benchmarks sweeping launch shapes (``fp8_grouped_tune.py``) patch these.
FPROP_TILES = (128, 256, 128, 8, None, 1)
FPROP_PRECISE_TILES = (256, 128, 128, 8, 3, 1)
WGRAD_TILES = (128, 256, 128, 8, 4, 1)
WGRAD_FP32_OR_PRECISE_TILES = (128, 128, 128, 8, 4, 1)


# Experiment toggle (benchmarks patch it): the weight gradient's accumulation into ``.grad`` with
# TMA stores adds by TMA's reduce-add (`_grouped_wgrad_kernel`'s ``TMA_REDUCE``) instead of the
# warps loading the old values and storing the sum. The same bits in the GPU test of the
# accumulation (normal values: whether the bulk reduce keeps fp32 subnormals is not checked). On an
# H100 with the tiles in halves it was no faster (Mixtral's fc1 weight gradient 613 against 619
# TFLOP/s, Qwen3's 378 against 412, `fp8_grouped_tune.py --precise`); with whole tiles it ran
# Mixtral's fc1 in 5.95 against 6.33 ms and qwen3's training shapes no faster (1.82 against 1.73,
# 0.94 against 0.93 ms; `--epilogue`). Off until the step shows it. It needs a Triton whose device
# descriptors have ``atomic_add``; Triton's interpreter has no reduce-add.
TMA_REDUCE = False


# The accumulating weight gradient loads each tile's old ``.grad`` values before the tile's
# contraction, so the loads are in flight while it runs (their registers held through it: 221
# registers a thread at the fp32 default shape against 177, no spill, offline sm90), instead of after
# it with the warps waiting. The same bits either way. On an H100 the Mixtral-shaped training step
# ran 0.3-0.9% faster with it in every same-machine pair (benchmarks/NOTES.md). Benchmarks comparing
# the two set it False (`train_step.py --wgrad-prefetch-old off`).
WGRAD_PREFETCH_OLD = True

# The weight gradient's fp32 tiles (fp32 master weights, the accumulating path) leave by TMA whole,
# through a whole tile of staging (`_grouped_wgrad_kernel`'s ``STORE_HALVES`` off): one wait for
# the previous tile's reads instead of a second one between the halves. On an H100 the accumulating
# products ran 4-5% faster (qwen3's training micro-batch fc1 1.73 against 1.82 ms, fc2 0.93 against
# 0.98; Mixtral fc1 6.33 against 6.59; `fp8_grouped_tune.py --precise --epilogue`), the same bits.
# bf16 tiles keep the halves: a whole 128 x 256 bf16 tile's staging would cost an operand stage.
# Benchmarks comparing the two set it False (`train_step.py --wgrad-fp32-store-whole off`).
WGRAD_FP32_STORE_WHOLE = True

# Experiment toggle (benchmarks patch it): an expert's tiles dealt along the output's rows first
# (``COLUMNS_FIRST``): faster at qwen3's fc2 weight gradient (0.84 against 0.93 ms), slower at its
# fc1 and at Mixtral's (7.16 against 6.33 ms).
WGRAD_COLUMNS_FIRST = False


def _tma_reduce() -> bool:
    return (TMA_REDUCE and hasattr(getattr(tl.core, "tensor_descriptor_base", None), "atomic_add")
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


# sm90's shared memory per block (227 KB), which the operand stages and the epilogue share.
SHARED_MEMORY_BYTES = 227 * 1024


def _launch_shape(given: tuple, default: tuple, out_bytes: int, device_index: int,
                  k: Optional[int] = None, staged_fraction: float = 0.5) -> tuple:
    """``given`` (block_m, block_n, block_k, num_warps, num_stages, programs; None entries unset)
    completed from ``default`` (its last entry: programs per multiprocessor). Stages not given are
    the default's (None there: 4 for contractions shorter than 2048, else 3, as measured at the
    benchmark shapes), capped to what a program's share of shared memory holds beside the
    epilogue's staging of ``staged_fraction`` of a tile of ``out_bytes`` elements (half: what the
    compiler allocated in every shape measured with the stores in halves), so that a block size
    given without stages still compiles."""
    block_m, block_n, block_k, num_warps, num_stages = (d if g is None else g
                                                         for g, d in zip(given[:5], default[:5]))
    per_multiprocessor = default[5]
    programs = given[5] or per_multiprocessor * _multiprocessors(device_index)
    if given[4] is None:
        if num_stages is None:
            num_stages = 4 if k is not None and k < 2048 else 3
        per_stage = (block_m + block_n) * block_k  # one float8 byte per operand element
        budget = SHARED_MEMORY_BYTES // per_multiprocessor
        fit = (budget - int(block_m * block_n * staged_fraction) * out_bytes) // per_stage
        num_stages = max(1, min(num_stages, fit))
    return block_m, block_n, block_k, num_warps, num_stages, programs


def tma_operands(*tensors: Tensor) -> bool:
    """Whether every tensor can back a TMA descriptor as these kernels build them: row-major
    2-D (or contiguous 3-D) with 16-byte aligned base and row stride."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
        if t.dim() == 3 and not t.is_contiguous():
            return False
    return True


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_mm_fprop(a_RK: Tensor, scale_a_R: Tensor, b_EOK: Tensor, scale_b_EO: Tensor, ends_E: Tensor,
                     block_m: Optional[int] = None, block_n: Optional[int] = None, block_k: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                     programs: Optional[int] = None,
                     out: Optional[Tensor] = None, warp_specialize: bool = False,
                     precise: bool = False) -> Tensor:
    """bf16 ``[R, O]``: ``(a[rows of e] @ b[e]^T) * scale_a[row] * scale_b[e, col]``; rows past
    the last group end are left unwritten (uninitialized unless ``out``, a bf16 ``[R, O]`` view
    with unit column stride, is given). Launch shape: the arguments given, the rest from
    `FPROP_TILES` (`FPROP_PRECISE_TILES` with ``precise``). ``programs``: persistent programs
    (default: the table's programs per multiprocessor). ``warp_specialize``: the compiler's
    automatic warp specialization of the tile loop instead of its flattening (a tuning option; the
    same sums either way). ``precise``: split accumulation (see the module's header), else fast."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = a_RK.shape
    experts, o, k_b = b_EOK.shape
    assert k == k_b and a_RK.dtype == b_EOK.dtype == torch.float8_e4m3fn
    if out is None:
        out = torch.empty(rows, o, dtype=torch.bfloat16, device=a_RK.device)
    assert out.shape == (rows, o) and out.dtype == torch.bfloat16 and out.stride(1) == 1
    if rows == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages, programs = _launch_shape(
        (block_m, block_n, block_k, num_warps, num_stages, programs),
        FPROP_PRECISE_TILES if precise else FPROP_TILES, out.element_size(), a_RK.device.index or 0, k)
    a_desc = TensorDescriptor(a_RK, [rows, k], [a_RK.stride(0), 1], [block_m, block_k])
    b_rows = b_EOK.reshape(experts * o, k)
    b_desc = TensorDescriptor(b_rows, [experts * o, k], [b_rows.stride(0), 1], [block_n, block_k])
    launch(_grouped_fprop_kernel, (programs,),
           a_desc, b_desc, out, scale_a_R, scale_b_EO, ends_E, experts, rows, o, out.stride(0),
           K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=next_power_of_2(experts),
           NUM_PROGRAMS=programs, NUM_STAGES=num_stages, FLATTEN=not warp_specialize,
           WARP_SPECIALIZE=warp_specialize, PRECISE=precise, num_warps=num_warps)
    return out



@triton.jit
def _old_tile(out_ptr, e, M, N, rows, cols, row_ok, col_ok):
    # expert e's tile [rows, cols] of the fp32 gradient the kernel adds into, zeros past its edges
    return tl.load(out_ptr + (e * M + rows[:, None]).to(tl.int64) * N + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _tile_origin(t, per_expert, m_tiles, n_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 COLUMNS_FIRST: tl.constexpr):
    """(expert, first row, first column) of tile ``t`` of the weight gradient's tiles."""
    e = t // per_expert
    local = t % per_expert
    if COLUMNS_FIRST:
        return e, (local // n_tiles) * BLOCK_M, (local % n_tiles) * BLOCK_N
    return e, (local % m_tiles) * BLOCK_M, (local // m_tiles) * BLOCK_N


@triton.jit
def _grouped_wgrad_kernel(a_desc, b_desc, out_ptr, scale_a_ptr, scale_b_ptr, ends_ptr, E, M, N,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr, TMA_STORE: tl.constexpr = False,
                          out_desc=None, FLATTEN: tl.constexpr = True, WARP_SPECIALIZE: tl.constexpr = False,
                          PRECISE: tl.constexpr = False, ACCUMULATE: tl.constexpr = False,
                          TMA_REDUCE: tl.constexpr = False, PREFETCH_OLD: tl.constexpr = False,
                          STORE_HALVES: tl.constexpr = True, COLUMNS_FIRST: tl.constexpr = False):
    """Tiles of every expert's ``[M, N]`` output dealt round-robin to the persistent programs,
    expert by expert (the tiles running together share the expert's operands in L2). The
    contraction runs over the expert's aligned columns; one loop over all tiles that the compiler
    flattens with the contraction, as in the forward kernel. An expert without tokens stores
    zeros. Columns past the operands' width read as zeros (the descriptors' bounds).
    ``ACCUMULATE`` (fp32 output): each tile is added to the output's values (beta = 1), the
    scaled fp32 product plus the old value, one fp32 add, as ``out += dw`` would after a plain
    store; an expert without tokens adds zeros. ``TMA_REDUCE`` (with ``TMA_STORE`` and
    ``ACCUMULATE``): the add is TMA's reduce-add into the output instead of a load and a store.
    ``STORE_HALVES`` (with ``TMA_STORE``): the tile leaves in two column halves through half a tile
    of staging, else whole (``out_desc``'s block is then the whole tile). ``COLUMNS_FIRST``: an
    expert's tiles are dealt along the output's rows first (neighbouring programs write
    neighbouring columns of the same rows) instead of down its columns."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_expert = m_tiles * n_tiles
    for t in tl.range(pid, E * per_expert, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        e, row0, col0 = _tile_origin(t, per_expert, m_tiles, n_tiles, BLOCK_M, BLOCK_N, COLUMNS_FIRST)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        add_old: tl.constexpr = ACCUMULATE and not (TMA_STORE and TMA_REDUCE)
        if add_old and PREFETCH_OLD:
            # the old values' loads issued before the contraction, in flight while it runs (their
            # registers held through it), instead of after it with the warps waiting
            old = _old_tile(out_ptr, e, M, N, rows, cols, row_ok, col_ok)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(start, end, BLOCK_K, num_stages=NUM_STAGES):
            a = a_desc.load([row0, k0])
            b = b_desc.load([col0, k0])
            acc = _accumulate(a, b, acc, BLOCK_K, PRECISE)
        sa = tl.load(scale_a_ptr + e * M + rows, mask=row_ok, other=0.0)
        sb = tl.load(scale_b_ptr + e * N + cols, mask=col_ok, other=0.0)
        out = acc * sa[:, None] * sb[None, :]
        if add_old:
            if not PREFETCH_OLD:
                old = _old_tile(out_ptr, e, M, N, rows, cols, row_ok, col_ok)
            out = old + out
        out = out.to(out_ptr.dtype.element_ty)
        if TMA_STORE and not STORE_HALVES:
            # the whole tile through one staging buffer, drained while the next tile's
            # contraction runs; the next tile's store waits only for this one's reads
            whole = tl.reshape(out, (1, BLOCK_M, BLOCK_N))
            if ACCUMULATE and TMA_REDUCE:
                out_desc.atomic_add([e, row0, col0], whole)
            else:
                out_desc.store([e, row0, col0], whole)
        elif TMA_STORE:
            # The tile leaves by TMA in two column halves (half the staging buffer): the copy
            # engine drains it while the next tile's contraction runs, where the plain store
            # holds the warps until its last byte is issued. The [E, M, N] descriptor clips
            # each half at the expert's and the output's bounds.
            halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            left = tl.reshape(left, (1, BLOCK_M, BLOCK_N // 2))
            right = tl.reshape(right, (1, BLOCK_M, BLOCK_N // 2))
            if ACCUMULATE and TMA_REDUCE:
                # TMA's reduce-add: the copy engine adds the tile into the output in memory (each
                # element old + product, one fp32 add, the bits of the load-add-store above)
                # instead of the warps reading the old values back first (`TMA_REDUCE`).
                out_desc.atomic_add([e, row0, col0], left)
                out_desc.atomic_add([e, row0, col0 + BLOCK_N // 2], right)
            else:
                out_desc.store([e, row0, col0], left)
                out_desc.store([e, row0, col0 + BLOCK_N // 2], right)
        else:
            ptrs = out_ptr + (e * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def grouped_mm_wgrad(a_MR: Tensor, scale_a_EM: Tensor, b_NR: Tensor, scale_b_EN: Tensor, aligned_ends_E: Tensor,
                     block_m: Optional[int] = None, block_n: Optional[int] = None, block_k: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                     programs: Optional[int] = None,
                     out_dtype: torch.dtype = torch.bfloat16, tma_store: bool = False,
                     warp_specialize: bool = False, precise: bool = False,
                     accumulate_into: Optional[Tensor] = None, prefetch_old: Optional[bool] = None,
                     store_halves: Optional[bool] = None, columns_first: Optional[bool] = None) -> Tensor:
    """``out_dtype`` (bf16 or fp32) ``[E, M, N]``: ``dw[e] = (a[:, cols of e] @ b[:, cols of e]^T) * scale_a[e, i] *
    scale_b[e, j]``.

    ``a`` float8 ``[M, R]`` and ``b`` float8 ``[N, R]``, the token dimension contiguous, in the
    aligned group layout: ``aligned_ends`` int32 ``[E]`` cumulative, each a multiple of
    `WGRAD_GROUP_ALIGN` (expert ``e``'s columns are ``[aligned_ends[e-1], aligned_ends[e])``, its
    tokens first and zeros after). An expert without tokens gets zeros. Scales fp32 ``[E, M]`` and
    ``[E, N]``. fp32 output is for fp32 master weights: their gradient is written once, not
    rounded to bf16 and widened by a second pass. ``tma_store``: the tiles leave by TMA (see the
    kernel; needs ``N`` times the element size a multiple of 16 bytes). ``programs`` and
    ``warp_specialize`` and ``precise`` as in `grouped_mm_fprop`. Launch shape: the arguments
    given, the rest from `WGRAD_TILES`, or `WGRAD_FP32_OR_PRECISE_TILES` for an fp32 output or
    ``precise``.

    ``accumulate_into``: a contiguous fp32 ``[E, M, N]`` tensor (a parameter's ``.grad``) that the
    kernel adds the gradient into and returns, instead of a new one (Megatron-Core's
    gradient-accumulation fusion): each element ``old + dw`` in fp32, the bits of ``out += dw``
    after an fp32 ``dw``. ``prefetch_old`` (default `WGRAD_PREFETCH_OLD`): its old values loaded
    before each tile's contraction instead of after. ``store_halves`` (default: False for fp32
    tiles under `WGRAD_FP32_STORE_WHOLE`, else True) and ``columns_first`` (default
    `WGRAD_COLUMNS_FIRST`): the kernel's ``STORE_HALVES`` and ``COLUMNS_FIRST``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, r = a_MR.shape
    n, r_b = b_NR.shape
    experts = aligned_ends_E.shape[0]
    assert r == r_b and a_MR.dtype == b_NR.dtype == torch.float8_e4m3fn
    wide = precise or out_dtype == torch.float32
    if store_halves is None:
        store_halves = not (WGRAD_FP32_STORE_WHOLE and out_dtype == torch.float32)
    columns_first = WGRAD_COLUMNS_FIRST if columns_first is None else columns_first
    block_m, block_n, block_k, num_warps, num_stages, programs = _launch_shape(
        (block_m, block_n, block_k, num_warps, num_stages, programs),
        WGRAD_FP32_OR_PRECISE_TILES if wide else WGRAD_TILES, out_dtype.itemsize, a_MR.device.index or 0,
        staged_fraction=0.5 if store_halves or not tma_store else 1.0)
    assert WGRAD_GROUP_ALIGN % block_k == 0, "a contraction block must not cross a group's aligned end"
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grouped_mm_wgrad writes bf16 or fp32, not {out_dtype}")
    if accumulate_into is None:
        out = torch.empty(experts, m, n, dtype=out_dtype, device=a_MR.device)
    else:
        out = accumulate_into
        if (out.dtype != torch.float32 or out_dtype != torch.float32 or tuple(out.shape) != (experts, m, n)
                or not out.is_contiguous()):
            raise ValueError(f"grouped_mm_wgrad(accumulate_into=...) takes a contiguous fp32 [{experts}, {m}, {n}] "
                             f"tensor with out_dtype fp32, got {out.dtype} {tuple(out.shape)} and {out_dtype}")
    if out.numel() == 0:
        return out
    a_desc = TensorDescriptor(a_MR, [m, r], [a_MR.stride(0), 1], [block_m, block_k])
    b_desc = TensorDescriptor(b_NR, [n, r], [b_NR.stride(0), 1], [block_n, block_k])
    out_desc = None
    if tma_store:
        if n * out.element_size() % 16:
            raise ValueError(f"grouped_mm_wgrad(tma_store=True): rows of {n} {out_dtype} are not a multiple of 16 "
                             "bytes, as TMA needs; use tma_store=False")
        out_desc = TensorDescriptor(out, [experts, m, n], [m * n, n, 1],
                                    [1, block_m, block_n // 2 if store_halves else block_n])
    launch(_grouped_wgrad_kernel, (programs,),
           a_desc, b_desc, out, scale_a_EM, scale_b_EN, aligned_ends_E, experts, m, n,
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_PROGRAMS=programs,
           NUM_STAGES=num_stages, TMA_STORE=tma_store, out_desc=out_desc, FLATTEN=not warp_specialize,
           WARP_SPECIALIZE=warp_specialize, PRECISE=precise, STORE_HALVES=store_halves,
           COLUMNS_FIRST=columns_first, num_warps=num_warps,
           # The epilogue's old + product must stay a multiply then an add, each rounded, as the
           # unfused store and add: no contraction into a fused multiply-add.
           **({"ACCUMULATE": True, "TMA_REDUCE": tma_store and _tma_reduce(), "enable_fp_fusion": False,
               "PREFETCH_OLD": prefetch_old if prefetch_old is not None else WGRAD_PREFETCH_OLD}
              if accumulate_into is not None else {}))
    return out
