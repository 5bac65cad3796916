"""The weight-gradient kernel's aligned group ends and the 16-row check of the group ends, in one
launch.

The FP8 grouped GEMM's forward needs, once per offsets tensor, (a) a device-side check that every
group end is a multiple of 16 (``offsets % 16 == 0``, ``.all()``, ``torch._assert_async``: four
launches) and (b) the cumulative ends of `grouped_mm_wgrad`'s aligned layout, each group's size
rounded up to ``WGRAD_GROUP_ALIGN`` (``diff``, rounding, ``cumsum``, a cast: about eight
launches). Those twelve small launches cost about 0.45 ms of host time in the FP8 block's forward
on the H200 machine (``launch_overhead.py --phases``), while their GPU work is a few
microseconds. Here one program computes both; the caller asserts on its flag (one more launch).
Integer arithmetic only: the same ends as the torch ops (GPU test).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import launch, next_power_of_2


@triton.jit
def _aligned_ends_kernel(offsets_ptr, aligned_ptr, ok_ptr, E, ALIGN: tl.constexpr, CHECK: tl.constexpr,
                         BE: tl.constexpr):
    e = tl.arange(0, BE)
    m = e < E
    ends = tl.load(offsets_ptr + e, mask=m, other=0).to(tl.int64)
    starts = tl.load(offsets_ptr + e - 1, mask=m & (e > 0), other=0).to(tl.int64)
    sizes = tl.where(m, (ends - starts + ALIGN - 1) // ALIGN * ALIGN, 0)
    tl.store(aligned_ptr + e, tl.cumsum(sizes, 0).to(tl.int32), mask=m)
    misaligned = tl.sum((m & (ends % CHECK != 0)).to(tl.int32), 0)
    tl.store(ok_ptr, (misaligned == 0).to(tl.int32))


def aligned_group_ends(offsets_E: Tensor, align: int, check: int) -> tuple[Tensor, Tensor]:
    """``(aligned ends, ok)`` for cumulative group ends ``offsets [E]`` (int32 or int64, CUDA):

    - int32 ``[E]``: the cumulative sums of each group's size rounded up to ``align``;
    - int32 ``[1]``: 1 when every end is a multiple of ``check``, else 0 (for
      ``torch._assert_async``).
    """
    experts = offsets_E.numel()
    aligned = torch.empty(experts, dtype=torch.int32, device=offsets_E.device)
    ok = torch.empty(1, dtype=torch.int32, device=offsets_E.device)
    if experts == 0:
        ok.fill_(1)
        return aligned, ok
    launch(_aligned_ends_kernel, (1,), offsets_E.contiguous(), aligned, ok, experts, ALIGN=align, CHECK=check,
           BE=next_power_of_2(experts), num_warps=4)
    return aligned, ok
