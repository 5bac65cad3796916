"""Gather token rows into the permuted expert buffer, stopping at a row index held on the device.

``out[r] = x[row_token[r]]`` for ``r < end``, zeros where ``row_token[r] == T`` (a padding row
inside the groups), and nothing at all from ``end`` on: the rows after the last expert group
of a sync-free buffer sized for the worst case are left unwritten, for experts that never read
them. A program past the end returns after one scalar load, so the cost follows the rows the
groups cover, not the buffer's size; no zero row is appended to ``x`` either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import launch, next_power_of_2


@triton.jit
def _gather_rows_kernel(x_ptr, row_token_ptr, out_ptr, end_ptr, T, D, BD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    if r < tl.load(end_ptr):
        t = tl.load(row_token_ptr + r)
        held = t < T  # the sentinel token T marks a padding row: zeros
        for d0 in range(0, D, BD):
            offs = d0 + tl.arange(0, BD)
            mask = offs < D
            vals = tl.load(x_ptr + t * D + offs, mask=mask & held, other=0.0)
            tl.store(out_ptr + r * D + offs, vals, mask=mask)


def gather_rows_until(x_TD: Tensor, row_token_R: Tensor, end: Tensor) -> Tensor:
    """``[R, D]``: rows ``r < end`` are ``x[row_token[r]]`` (zero for the sentinel ``T``); rows
    from ``end`` on are unwritten. ``end``: 0-dim integer tensor on ``x``'s device."""
    x_TD = x_TD.contiguous()
    num_rows, d = row_token_R.shape[0], x_TD.shape[1]
    out = torch.empty(num_rows, d, dtype=x_TD.dtype, device=x_TD.device)
    if num_rows and d:
        block = min(next_power_of_2(d), 2048)
        launch(_gather_rows_kernel, (num_rows,), x_TD, row_token_R.contiguous(), out, end, x_TD.shape[0], d, BD=block,
               num_warps=4)
    return out
