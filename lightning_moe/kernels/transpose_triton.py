"""The transpose of a one-byte tensor (float8 values, as their bytes) in tiles.

A float8 GEMM on Hopper reads both operands with the contraction contiguous, so a dense linear's
weight gradient takes its output gradient and input transposed. torch copies a transposed float8
tensor with its generic elementwise kernel, one byte per thread and the reads strided across rows
(0.1-0.23 ms for the 8,192 x 2,048-4,096 copies of a qwen3-shaped layer on an H100, about 5x their
bytes' time). Here each program moves a 128 x 128 tile: loads along the source rows, the compiler
reshuffles the tile through shared memory, stores along the destination rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch

_TILE = 128


@triton.jit
def _transpose_bytes_kernel(src_ptr, dst_ptr, R, C, R_OUT, BR: tl.constexpr, BC: tl.constexpr):
    # dst [C, R_OUT] = src [R, C] transposed; columns [R, R_OUT) of dst get zeros.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    in_cols = (cols < C)[None, :]
    tile = tl.load(src_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=(rows < R)[:, None] & in_cols,
                   other=0)
    tl.store(dst_ptr + cols[None, :].to(tl.int64) * R_OUT + rows[:, None], tile, mask=(rows < R_OUT)[:, None] & in_cols)


def transpose_bytes(q_RC: Tensor, multiple: int = 1) -> Tensor:
    """``q [R, C]`` (one-byte elements, contiguous) transposed into a new contiguous ``[C, R']``,
    ``R'`` being ``R`` rounded up to ``multiple`` with zero bytes in the extra columns (+0.0 in
    float8): the same bytes as ``q.t().contiguous()`` padded so."""
    if multiple < 1:
        raise ValueError(f"transpose_bytes pads the rows to a multiple of at least 1, got {multiple}")
    if q_RC.element_size() != 1 or q_RC.dim() != 2:
        raise ValueError(f"transpose_bytes takes a 2-D tensor of one-byte elements, got {q_RC.dtype} "
                         f"{tuple(q_RC.shape)}")
    rows, cols = q_RC.shape
    rows_out = -(-rows // multiple) * multiple
    out = torch.empty(cols, rows_out, dtype=q_RC.dtype, device=q_RC.device)
    if out.numel():
        src = q_RC.contiguous().view(torch.uint8)
        launch(_transpose_bytes_kernel, (cdiv(rows_out, _TILE), cdiv(cols, _TILE)), src, out.view(torch.uint8),
               rows, cols, rows_out, BR=_TILE, BC=_TILE, num_warps=4)
    return out
