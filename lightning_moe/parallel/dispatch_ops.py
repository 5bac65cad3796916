"""Building blocks of the expert-parallel dispatchers: row regrouping and autograd collectives.

Everything here is sync-free: index arithmetic runs on the device from sizes the caller
already holds on the host, and the collectives take Python split sizes. The collectives are
small autograd functions over the c10d ops, or over ``torch.ops.symm_mem``'s copy-engine
collectives (waited for at once), so their outputs are plain tensors that custom kernels can
read directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.nn.aux_losses import group_size
from lightning_moe.nn.permutation import _with_zero_row

# torch >= 2.13 names the tensor-form collectives "*_single"; older releases only have the old names.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


class _GatherRows(torch.autograd.Function):
    """``out[i] = x[index[i]]`` for a partial bijection of rows; index ``N`` (= ``len(x)``) reads zero.

    The backward is the inverse gather ``grad_x[j] = grad_out[inverse[j]]`` (``inverse[j] =
    len(out)`` for rows of ``x`` that no output row reads), so neither direction scatter-adds.
    """

    @staticmethod
    def forward(ctx, x_ND: Tensor, index_M: Tensor, inverse_N: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_N)
        return _with_zero_row(x_ND).index_select(0, index_M)

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        (inverse_N,) = ctx.saved_tensors
        return _with_zero_row(grad_MD.contiguous()).index_select(0, inverse_N), None, None


def gather_rows(x_ND: Tensor, index_M: Tensor, inverse_N: Tensor) -> Tensor:
    """Reorder rows by a gather whose gradient is the inverse gather (see `_GatherRows`)."""
    return _GatherRows.apply(x_ND, index_M, inverse_N)


def block_regroup_index(
    counts_B: Tensor, src_start_B: Tensor, dst_start_B: Tensor, num_src: int, num_dst: int
) -> tuple[Tensor, Tensor]:
    """Row maps that move ``B`` contiguous blocks of rows from one buffer layout to another.

    Block ``b`` holds ``counts_B[b]`` rows starting at ``src_start_B[b]`` in the source buffer
    (``num_src`` rows) and at ``dst_start_B[b]`` in the destination buffer (``num_dst`` rows).
    ``src_start_B`` must be non-decreasing; rows of either buffer that no block covers (gaps,
    alignment padding) map to the other buffer's sentinel (its length).

    Returns:
        ``(src_of_dst [num_dst], dst_of_src [num_src])``: the forward gather index of
        :func:`gather_rows` and its inverse. Computed on the device without host syncs.
    """
    device = counts_B.device
    rows_N = torch.arange(num_src, device=device)
    block_N = (torch.searchsorted(src_start_B, rows_N, right=True) - 1).clamp_(min=0)
    within_N = rows_N - src_start_B[block_N]
    valid_N = within_N < counts_B[block_N]
    dst_of_src = torch.where(valid_N, dst_start_B[block_N] + within_N, num_dst)
    # Slot num_dst absorbs the writes of uncovered source rows and is cut off.
    src_of_dst = torch.full((num_dst + 1,), num_src, dtype=torch.long, device=device)
    src_of_dst.scatter_(0, dst_of_src, rows_N)
    return src_of_dst[:num_dst], dst_of_src


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return torch.cumsum(x, dim) - x


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x_ND.new_empty((sum(output_splits), *x_ND.shape[1:]))
        dist.all_to_all_single(out, x_ND.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        input_splits, output_splits = ctx.splits
        grad_x = grad_MD.new_empty((sum(input_splits), *grad_MD.shape[1:]))
        dist.all_to_all_single(grad_x, grad_MD.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_x, None, None, None


def _gather_into(x: Tensor, group) -> Tensor:
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_into(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: Tensor, group) -> Tensor:
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    _reduce_scatter_into(out, x.contiguous(), group=group)
    return out


def _symm_mem_ops():
    """``torch.ops.symm_mem`` (importing the module registers the ops; CUDA builds only)."""
    import torch.distributed._symmetric_memory  # noqa: F401

    return torch.ops.symm_mem


def _on_current_stream(out: Tensor) -> Tensor:
    """Wait for a symmetric-memory op's result on the current stream. The op runs on a private
    stream: waiting here, while its input is still referenced, orders every later use (and any
    reuse of the input's memory) after it; the result may have been allocated on that private
    stream, so its use here is recorded, or the allocator could hand its memory to the next op
    there while this stream still reads it."""
    out = torch.ops._c10d_functional.wait_tensor(out)
    out.record_stream(torch.cuda.current_stream(out.device))
    return out


def _gather_copy_engine(x: Tensor, group) -> Tensor:
    """All-gather by peer copies through the group's symmetric-memory workspace (copy engines,
    no NCCL kernel)."""
    return _on_current_stream(_symm_mem_ops()._low_contention_all_gather(x.contiguous(), group.group_name))


def _reduce_scatter_copy_engine(x: Tensor, group) -> Tensor:
    """Reduce-scatter by peer copies into the workspace, then a local sum over the group's
    blocks (fp32 accumulation for bf16/fp16, rounded once: equal to an fp32 reduction cast back)."""
    return _on_current_stream(
        _symm_mem_ops()._low_contention_reduce_scatter(x.contiguous(), "sum", group.group_name)
    )


_GATHER = {"nccl": _gather_into, "copy_engine": _gather_copy_engine}
_SCATTER = {"nccl": _reduce_scatter, "copy_engine": _reduce_scatter_copy_engine}


def _sum_scatter(x: Tensor, group, transport: str) -> Tensor:
    """Reduce-scatter (sum) with low-precision rows summed in fp32 and rounded once.

    Where the transport's own arithmetic already does that, the rows travel in their own dtype:
    the copy-engine path sums locally with fp32 accumulation, and NCCL's sum over two ranks is
    one rounded addition, ``round(a + b)``, which equals the fp32 sum cast back. Otherwise (NCCL
    over more ranks, whose ring rounds at every hop) they travel as fp32.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    if transport == "nccl" and group_size(group) > 2 and wide != x.dtype:
        return _SCATTER[transport](x.to(wide), group).to(x.dtype)
    return _SCATTER[transport](x, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: Tensor, group, transport: str) -> Tensor:
        ctx.group, ctx.transport = group, transport
        return _GATHER[transport](x_ND, group)

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        return _sum_scatter(grad_MD, ctx.group, ctx.transport), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: Tensor, group, transport: str) -> Tensor:
        ctx.group, ctx.transport = group, transport
        return _sum_scatter(x_ND, group, transport)

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        return _GATHER[ctx.transport](grad_MD, ctx.group), None, None


def all_to_all_rows(
    x_ND: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Uneven all-to-all of rows; its backward is the all-to-all with the splits swapped."""
    return _AllToAll.apply(x_ND, output_splits, input_splits, group)


def all_gather_rows(x_ND: Tensor, group: dist.ProcessGroup, transport: str = "nccl") -> Tensor:
    """Concatenate every rank's equal-sized rows in group-rank order; backward: reduce-scatter
    (sum, low-precision gradients summed as in `reduce_scatter_rows`).

    transport: "nccl" (the process group's collectives) or "copy_engine" (peer copies through
    symmetric memory; CUDA GPUs of one host).
    """
    return _AllGather.apply(x_ND, group, transport)


def reduce_scatter_rows(x_ND: Tensor, group: dist.ProcessGroup, transport: str = "nccl") -> Tensor:
    """Sum over the group, keep this rank's block of rows; backward: all-gather.

    Low-precision inputs are summed in fp32 and rounded once, as Megatron does for expert
    outputs (see `_sum_scatter` for when the rows travel in their own dtype).
    """
    return _ReduceScatter.apply(x_ND, group, transport)


def all_gather_plain(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Non-differentiable all-gather along dim 0 (routing metadata, token counts)."""
    return _gather_into(x, group)
