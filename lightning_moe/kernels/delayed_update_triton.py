"""Delayed scaling's once-per-step update in one kernel: the new scales from the amax history and the
history rolled by one step, for a ``[H, 3, G]`` block of histories (`precision.delayed`).

The torch formulation (`precision.delayed.update_delayed_scaling` on CPU) takes about twenty small
kernels per block (the format maxima, the reduction over the history, the division, clamp, masks,
the roll and zeroing); on the H200 they ran 0.05 ms of GPU time plus a launch gap each after every
FP8 step. Here one program per block of columns
reads its columns' whole history (in chunks of rows), computes their scales with the same IEEE
operations, and writes the history rolled into a new tensor (the caller copies it back in place:
the casts write into row 0 by address, so the buffers must stay where they are). The same bits as
the torch formulation: the GPU test and the interpreter test compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch

_FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # torch.finfo(torch.float32).max


@triton.jit
def _delayed_update_kernel(history_ptr, scale_ptr, new_scale_ptr, rolled_ptr, H, S, FMT0: tl.constexpr,
                           FMT1: tl.constexpr, FMT2: tl.constexpr, MARGIN_SCALE: tl.constexpr,
                           MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # Columns c of the history viewed as [H, 3S] (slot c // S, group c % S): amax over the rows
    # ("max") or row 0 ("most_recent") with torch's NaN propagation, then scale =
    # fmt_max / amax, clamped to FLT_MAX, divided by 2**margin, kept only where the amax is
    # positive and finite; rolled[h] = history[h - 1], rolled[0] = 0.
    width = 3 * S
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    amax = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], dtype=tl.int32)
    rows_read = 1 if MOST_RECENT else H
    for h0 in range(0, rows_read, CHUNK):
        rows = h0 + tl.arange(0, CHUNK)
        m = (rows < rows_read)[:, None] & live[None, :]
        v = tl.load(history_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], mask=m, other=float("-inf"))
        amax = tl.maximum(amax, tl.max(v, 0))
        nan = tl.maximum(nan, tl.max((v != v).to(tl.int32), 0))
    amax = tl.where(nan > 0, float("nan"), amax)
    slot = cols // S
    fmt_max = tl.where(slot == 0, FMT0, tl.where(slot == 1, FMT1, FMT2))
    new = tl.minimum(tl.math.div_rn(fmt_max, amax), _FLT_MAX)
    new = tl.math.div_rn(new, MARGIN_SCALE + tl.zeros_like(new))
    usable = (amax > 0.0) & (amax < float("inf"))
    old = tl.load(scale_ptr + cols, mask=live, other=0.0)
    tl.store(new_scale_ptr + cols, tl.where(usable, new, old), mask=live)
    for h0 in range(0, H, CHUNK):
        rows = h0 + tl.arange(0, CHUNK)
        m = (rows < H)[:, None] & live[None, :]
        v = tl.load(history_ptr + (rows[:, None].to(tl.int64) - 1) * width + cols[None, :],
                    mask=m & (rows >= 1)[:, None], other=0.0)
        tl.store(rolled_ptr + rows[:, None].to(tl.int64) * width + cols[None, :], v, mask=m)


def delayed_update(history_H3S: Tensor, scale_3S: Tensor, fmt_max: tuple[float, float, float], margin: int,
                   most_recent: bool) -> tuple[Tensor, Tensor]:
    """(new scales ``[3, S]``, the history rolled by one step ``[H, 3, S]`` with a zero row 0) for fp32
    contiguous ``history_H3S`` and ``scale_3S``; ``fmt_max``: the largest value of each slot's format
    (input, weight, gradient); ``margin``: scales are divided by ``2**margin``; ``most_recent``: the
    amax is row 0's instead of the maximum over the history. Neither input is written."""
    if history_H3S.dtype != torch.float32 or scale_3S.dtype != torch.float32:
        raise ValueError("delayed_update: the history and the scales must be fp32")
    history_H3S, scale_3S = history_H3S.contiguous(), scale_3S.contiguous()
    rows, _, groups = history_H3S.shape
    new_scale = torch.empty_like(scale_3S)
    rolled = torch.empty_like(history_H3S)
    block = 128
    launch(_delayed_update_kernel, (cdiv(3 * groups, block),), history_H3S, scale_3S, new_scale, rolled, rows, groups,
           FMT0=float(fmt_max[0]), FMT1=float(fmt_max[1]), FMT2=float(fmt_max[2]), MARGIN_SCALE=float(2.0**margin),
           MOST_RECENT=most_recent, BLOCK=block, CHUNK=32, num_warps=4)
    return new_scale, rolled
