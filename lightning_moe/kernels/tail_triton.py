"""Zero the rows of a buffer from a row index held on the device (no host sync).

The expert GEMMs compute only the rows their token groups cover; the rows after the last
group (padding of a sync-free buffer sized for the worst case) must still read as zero. This
kernel writes zeros there and nothing else: a program whose row block lies wholly before the
end returns after one scalar load, so the cost is the tail's bytes, not the buffer's.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch


@triton.jit
def _zero_tail_kernel(y_ptr, end_ptr, R, C, stride_r, BR: tl.constexpr, BC: tl.constexpr):
    end = tl.load(end_ptr).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * BR
    if row0 + BR > end:
        rows = row0 + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = (rows[:, None] >= end) & (rows[:, None] < R) & (cols[None, :] < C)
        zeros = tl.zeros((BR, BC), dtype=y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_r + cols[None, :], zeros, mask=mask)


_BR, _BC = 32, 256


def zero_rows_from_triton(y_RC: Tensor, end: Tensor) -> None:
    """In place: ``y_RC[end:] = 0`` for a 0-dim integer ``end`` on ``y_RC``'s device.

    ``y_RC`` must have unit column stride (rows may be strided)."""
    r, c = y_RC.shape
    if r == 0 or c == 0:
        return
    if y_RC.stride(1) != 1:
        raise ValueError("zero_rows_from_triton needs unit column stride")
    launch(
        _zero_tail_kernel, (cdiv(r, _BR), cdiv(c, _BC)),
        y_RC, end, r, c, y_RC.stride(0), BR=_BR, BC=_BC, num_warps=4
    )
