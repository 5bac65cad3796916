"""The all-gather dispatcher's combine with its exchange overlapped, token block by token block.

The all-gather dispatcher combines its experts' outputs into a partial output for every
gathered token ``[G*T, D]`` and reduce-scatters it back to the tokens' owners; in the backward
it all-gathers the output gradient before the combine's backward can start. Done whole, both
collectives sit on the critical path: nothing else in the layer runs beside them.

Here the combine runs one group rank's ``T`` tokens at a time. Forward: the peers' blocks
first, each sent to its owner as soon as it is ready, this rank's own block last while they
travel; the partials received for this rank's tokens are summed in fp32 in group-rank order
and rounded once (so over two ranks the bits are those of NCCL's bf16 reduce-scatter, and of
the copy-engine transport's). Backward: this rank's output gradient goes to every peer at
once, the own block's combine backward runs meanwhile, the peers' blocks as their gradients
arrive. The rows move as point-to-point sends and receives of the process group (NCCL on GPUs,
gloo on CPU); nothing syncs with the host.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_moe.nn.aux_losses import group_size
from lightning_moe.nn.permutation import BlockwiseCombine, PermutationPlan
from lightning_moe.parallel.dispatch_ops import group_rank


def _exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], group) -> list:
    """Start sends and receives (``(tensor, group rank)``) as one batch; returns the works.
    On NCCL, waiting for a work makes the current stream wait, not the host."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _sum_in_rank_order(blocks: dict[int, Tensor]) -> Tensor:
    """Sum of the partials by source rank, in fp32 (for low-precision rows), rounded once."""
    ordered = [blocks[rank] for rank in sorted(blocks)]
    dtype = ordered[0].dtype
    total = ordered[0].to(torch.promote_types(dtype, torch.float32), copy=True)
    for block in ordered[1:]:
        total += block
    return total.to(dtype)


class _CombineExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan, group) -> Tensor:
        ctx.plan, ctx.group, ctx.probs_dtype = plan, group, probs_TK.dtype
        ctx.save_for_backward(y_RD, probs_TK)
        size, rank = group_size(group), group_rank(group)
        tokens = plan.num_tokens // size
        blocks = BlockwiseCombine(y_RD, plan)
        works, sent, received = [], [], {}
        for step in range(1, size):
            owner, source = (rank + step) % size, (rank - step) % size
            block = slice(owner * tokens, (owner + 1) * tokens)
            partial = blocks.forward(block, probs_TK[block])
            received[source] = torch.empty_like(partial)
            works += _exchange([(partial, owner)], [(received[source], source)], group)
            sent.append(partial)  # referenced until the sends are waited for
        own = slice(rank * tokens, (rank + 1) * tokens)
        received[rank] = blocks.forward(own, probs_TK[own])
        for work in works:
            work.wait()
        return _sum_in_rank_order(received)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        y_RD, probs_TK = ctx.saved_tensors
        plan: PermutationPlan = ctx.plan
        size, rank = group_size(ctx.group), group_rank(ctx.group)
        tokens = plan.num_tokens // size
        grad_TD = grad_TD.contiguous()
        peers = [(rank - step) % size for step in range(1, size)]
        inbox = {peer: torch.empty_like(grad_TD) for peer in peers}
        works = _exchange([(grad_TD, (rank + step) % size) for step in range(1, size)],
                          [(inbox[peer], peer) for peer in peers], ctx.group)
        blocks = BlockwiseCombine(y_RD, plan)
        # anomaly mode checks every gradient for NaN, so no row is left unwritten then
        rows_end = None if torch.is_anomaly_enabled() else plan.rows_end
        grad_y, grad_w = blocks.grad_buffers(grad_TD, ctx.needs_input_grad[1], rows_end)
        own = slice(rank * tokens, (rank + 1) * tokens)
        blocks.backward_into(own, probs_TK[own], grad_TD, grad_y, grad_w)
        for work in works:
            work.wait()
        for peer in sorted(peers):
            block = slice(peer * tokens, (peer + 1) * tokens)
            blocks.backward_into(block, probs_TK[block], inbox[peer], grad_y, grad_w)
        grad_probs = grad_w.to(ctx.probs_dtype) if grad_w is not None else None
        return blocks.finish_grad(grad_y), grad_probs, None, None


def combine_and_exchange(y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan, group) -> Tensor:
    """``reduce_scatter_rows(unpermute(y_RD, probs_TK, plan), group)`` with the exchange
    overlapping the combine (see the module docstring): [R, D] -> this rank's [T, D].

    ``plan`` covers the ``G*T`` tokens gathered over ``group`` in group-rank order (``T`` per
    rank); ``probs_TK`` [G*T, K] are their combine weights. Its backward is the all-gather of
    the output gradient overlapping the combine's backward.
    """
    size = group_size(group)
    if plan.num_tokens % size:
        raise ValueError(f"combine_and_exchange: {plan.num_tokens} gathered tokens do not split over {size} ranks")
    return _CombineExchange.apply(y_RD, probs_TK, plan, group)


def exchange_applies(transport: str, gather_groups: list) -> Optional[str]:
    """None when `combine_and_exchange` can serve the all-gather dispatcher, else why not."""
    if transport != "nccl":
        return f"dispatch_transport={transport!r} moves rows through symmetric memory, not point-to-point sends"
    if len(gather_groups) > 1:
        return "the tokens are gathered over two groups (expert tensor and expert parallelism both > 1)"
    return None
