"""The rows of a padded permutation plan in two kernels instead of ~15 torch ops.

``nn.permutation.plan_permutation`` sorts the (token, expert) assignments by expert; when the
expert groups are padded (to an alignment, or to the capacity) or the buffer has more rows than
assignments, every kept assignment's row is ``start[e] + (its sorted position - bounds[e])``,
where ``start`` is the exclusive scan of the padded group sizes. In torch that is a rounding, a
scan, gathers, a scatter into the row table and one back into assignment order: each a kernel
launch, and the plan is built for every MoE layer and micro-batch. Here:

- `_group_starts_kernel` (one program): padded group sizes ``[E]`` and their exclusive scan;
- `_plan_rows_kernel` (one program per block of sorted assignments): each assignment's row
  (``num_rows`` when dropped), written in assignment order, and the row table entry of every
  kept one.

Integer arithmetic only, so the plan is the torch path's exactly (GPU test against the CPU plan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import cdiv, launch, next_power_of_2


@triton.jit
def _group_starts_kernel(bounds_ptr, sizes_ptr, starts_ptr, E, alignment, rows_per_expert,
                         PAD_TO_CAPACITY: tl.constexpr, BE: tl.constexpr):
    e = tl.arange(0, BE)
    m = e < E
    first = tl.load(bounds_ptr + e, mask=m, other=0)
    count = tl.load(bounds_ptr + e + 1, mask=m, other=0) - first
    if PAD_TO_CAPACITY:
        size = tl.where(m, rows_per_expert, 0).to(tl.int64)
    else:
        size = tl.where(m, (count + alignment - 1) // alignment * alignment, 0).to(tl.int64)
    tl.store(sizes_ptr + e, size, mask=m)
    tl.store(starts_ptr + e, tl.cumsum(size, 0) - size, mask=m)


@triton.jit
def _plan_rows_kernel(sorted_expert_ptr, order_ptr, bounds_ptr, starts_ptr, dest_ptr, row_assignment_ptr, N, E,
                      num_rows, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < N
    expert = tl.load(sorted_expert_ptr + j, mask=m, other=0).to(tl.int64)
    order = tl.load(order_ptr + j, mask=m, other=0)
    kept = expert < E  # dropped assignments carry the sentinel expert E and sort last
    e = tl.minimum(expert, E - 1)
    start = tl.load(starts_ptr + e, mask=m, other=0)
    first = tl.load(bounds_ptr + e, mask=m, other=0)
    dest = tl.where(kept, start + j - first, num_rows)
    tl.store(dest_ptr + order, dest, mask=m)
    # A row past the buffer (a caller's num_rows below the groups' total, against the contract)
    # is never written: no write outside the table.
    tl.store(row_assignment_ptr + dest, order, mask=m & kept & (dest < num_rows))


def plan_rows(sorted_expert_N: Tensor, order_N: Tensor, bounds: Tensor, num_experts: int, alignment: int,
              rows_per_expert: int | None, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The padded plan's ``(dest_N, row_assignment_R, group_sizes_E)``.

    Args:
        sorted_expert_N: int32 ``[N]`` expert of each sorted assignment (``num_experts`` for a
            dropped one); ``order_N``: int64 ``[N]`` the assignment at each sorted position.
        bounds: int64 ``[E + 1]`` sorted position of each expert's first assignment (entry E:
            of the first dropped one).
        alignment: groups are rounded up to a multiple of it (1: not padded).
        rows_per_expert: every group's size when padding to capacity (already aligned), else None.
        num_rows: rows of the buffer, at least the padded groups' total (not checked, since
            that would read the device; assignments past it get no row-table entry).
    Returns:
        int64 ``dest_N`` (row of each assignment in assignment order, ``num_rows`` when
        dropped), int64 ``row_assignment_R`` (the assignment each row holds, ``N`` for a
        padding row) and int64 ``group_sizes_E`` (padded rows per expert).
    """
    device = sorted_expert_N.device
    n = sorted_expert_N.numel()
    sizes_E = torch.empty(num_experts, dtype=torch.long, device=device)
    starts_E = torch.empty(num_experts, dtype=torch.long, device=device)
    launch(_group_starts_kernel, (1,), bounds, sizes_E, starts_E, num_experts, alignment, rows_per_expert or 0,
           PAD_TO_CAPACITY=rows_per_expert is not None, BE=next_power_of_2(max(num_experts, 1)), num_warps=4)
    dest_N = torch.empty(n, dtype=torch.long, device=device)
    row_assignment_R = torch.full((num_rows,), n, dtype=torch.long, device=device)
    if n:
        block = 1024
        launch(_plan_rows_kernel, (cdiv(n, block),), sorted_expert_N, order_N, bounds, starts_E, dest_N,
               row_assignment_R, n, num_experts, num_rows, BLOCK=block, num_warps=4)
    return dest_N, row_assignment_R, sizes_E
