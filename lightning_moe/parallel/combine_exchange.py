"""The all-gather dispatcher's combine with its reduce-scatter fused in (``dispatch_transport="nvlink"``).

Without fusion the combine writes a partial output for all ``G*T`` gathered tokens and a
reduce-scatter then moves ``(G-1)*T`` rows to their owners and sums them; its backward
all-gathers the output gradient before the combine's backward can start. Both collectives sit
on the critical path of the block, with nothing to hide behind.

Here each rank's symmetric-memory buffer (``[G, T, D]``, mapped into every peer of the group)
receives the partial sums of its tokens directly from the combine kernels of its peers, which
store them over the peer link (NVLink) as they compute them; the backward loads the peers'
output-gradient rows from their buffers inside the combine-backward kernel. Host-side
symmetric-memory barriers (one small kernel each, release/acquire at system scope) order the
remote stores and loads:

- forward: barrier (every peer has finished reading the buffer's previous contents), the
  peers' blocks stored remotely, barrier (every peer's stores into this rank have landed), this
  rank's own block combined and summed with the received partials;
- backward: barrier, this rank's output gradient copied into its buffer, barrier, the combine
  backward reading every rank's rows.

Numerics equal the reduce-scatter path's over two ranks (each partial rounded to the row dtype,
summed in fp32, rounded once), so outputs and gradients are bit-identical to the NCCL transport
at G=2. Over more ranks the partials still travel in the row dtype (NCCL's path widens them to
fp32 first), and are summed in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.nn.aux_losses import group_size
from lightning_moe.nn.permutation import PermutationPlan

_BUFFERS: dict[tuple[str, int], "SymmetricBuffer"] = {}


def buffer_for_group(group: dist.ProcessGroup) -> "SymmetricBuffer":
    """The buffer shared by every layer on ``group`` (their uses are ordered on one stream)."""
    key = (group.group_name, torch.cuda.current_device())
    if key not in _BUFFERS:
        _BUFFERS[key] = SymmetricBuffer(group)
    return _BUFFERS[key]


class SymmetricBuffer:
    """A grow-only symmetric-memory buffer of a process group, with every rank's base address.

    ``view(rows, width, dtype)``: this rank's buffer as ``[rows, width]``; ``peer_ptrs``: int64
    [G] device tensor of every rank's buffer address (the same bytes seen from the peers).
    Growing allocates a new buffer (a collective: every rank grows at the same call, since the
    all-gather dispatcher's shapes agree across ranks); the old one stays referenced, because
    kernels already queued may still address it.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = group_size(group)
        self._buffer: Tensor | None = None
        self._handle = None
        self.peer_ptrs: Tensor | None = None
        self._retired: list[tuple[Tensor, object]] = []

    def ensure(self, nbytes: int, device: torch.device) -> None:
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return
        import torch.distributed._symmetric_memory as symm_mem

        if self._buffer is not None:
            self._retired.append((self._buffer, self._handle))
        self._buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, self.group)
        addresses = [self._handle.get_buffer(r, (nbytes,), torch.uint8).data_ptr() for r in range(self.size)]
        self.peer_ptrs = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.barrier()  # loads the barrier kernel now, before any exchange relies on it

    def view(self, rows: int, width: int, dtype: torch.dtype) -> Tensor:
        count = rows * width
        return self._buffer[: count * dtype.itemsize].view(dtype).view(rows, width)

    def barrier(self) -> None:
        """Every rank's work queued on the current stream before this point is complete and its
        stores visible to every other rank's work queued after it (a kernel, no host sync)."""
        self._handle.barrier(channel=0)


class _FusedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan, buffer: SymmetricBuffer) -> Tensor:
        from lightning_moe.kernels.combine_triton import combine_own, combine_to_peers

        ctx.plan, ctx.buffer, ctx.probs_dtype = plan, buffer, probs_TK.dtype
        ctx.save_for_backward(y_RD, probs_TK)
        num_ranks, width = buffer.size, y_RD.shape[1]
        per_rank = plan.num_tokens // num_ranks
        buffer.ensure(num_ranks * per_rank * width * y_RD.element_size(), y_RD.device)
        slots = buffer.view(num_ranks * per_rank, width, y_RD.dtype).view(num_ranks, per_rank, width)
        args = (y_RD, plan.dest_TK, probs_TK)
        # Kernels are compiled and loaded before the first barrier: loading a module while a
        # barrier kernel spins for a peer can deadlock (measured: a rank hung loading a kernel
        # compiled for a new shape after its barrier).
        combine_to_peers(*args, buffer.peer_ptrs, buffer.rank, load_only=True)
        combine_own(*args, slots, buffer.rank, load_only=True)
        buffer.barrier()  # the peers are done reading what this buffer held before
        combine_to_peers(*args, buffer.peer_ptrs, buffer.rank)
        buffer.barrier()  # every peer's partials for this rank's tokens have landed here
        return combine_own(*args, slots, buffer.rank)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        from lightning_moe.kernels.combine_triton import combine_backward

        plan: PermutationPlan = ctx.plan
        buffer: SymmetricBuffer = ctx.buffer
        y_RD, probs_TK = ctx.saved_tensors
        per_rank, width = grad_TD.shape
        own = buffer.view(per_rank, width, grad_TD.dtype)

        def run(load_only: bool):
            return combine_backward(
                y_RD, plan.dest_TK, probs_TK, own, plan.num_rows,
                row_token_R=plan.row_token_R if plan.padding_rows else None, need_grad_w=ctx.needs_input_grad[1],
                # anomaly mode checks every gradient for NaN, so no row is left unwritten then
                rows_end=None if torch.is_anomaly_enabled() else plan.rows_end,
                g_ptrs_G=buffer.peer_ptrs, load_only=load_only,
            )

        run(load_only=True)  # compiled and loaded before the barriers, as in forward
        buffer.barrier()  # the peers are done reading what this buffer held before
        own.copy_(grad_TD)
        buffer.barrier()  # every rank's output gradient is in its buffer
        grad_y, grad_w = run(load_only=False)
        # The peers read this buffer until their combine backward ends; the next use of the
        # buffer starts with a barrier, so nothing overwrites it before then.
        return grad_y, (grad_w.to(ctx.probs_dtype) if grad_w is not None else None), None, None


def fused_combine_reduce_scatter(
    y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan, buffer: SymmetricBuffer
) -> Tensor:
    """``reduce_scatter(unpermute(y_RD, probs_TK, plan))`` over ``buffer``'s group in two kernels.

    ``plan`` permutes ``G*T`` gathered tokens ordered by owning rank; returns this rank's ``[T, D]``
    in ``y``'s dtype. CUDA only (Triton kernels, symmetric memory).
    """
    if plan.num_tokens % buffer.size:
        raise ValueError(f"{plan.num_tokens} gathered tokens do not split evenly over {buffer.size} ranks.")
    return _FusedCombine.apply(y_RD, probs_TK, plan, buffer)
