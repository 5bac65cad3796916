"""Expert-parallel token dispatchers: all-to-all and all-gather, with optional expert TP.

Both follow the `TokenDispatcher` protocol of ``lightning_moe.nn.dispatcher`` and Megatron-Core's
semantics (``MoEAlltoAllTokenDispatcher`` / ``MoEAllGatherTokenDispatcher``):

* Experts are contiguous per EP rank: EP rank ``r`` owns global experts
  ``[r * E/EP, (r+1) * E/EP)``. Under expert tensor parallelism (ETP) every rank of an ETP group
  holds the same experts, split along the FFN dimension (see ``expert_parallel.py``).
* Every rank routes its own tokens; the ranks of an ETP group hold *different* tokens (they are
  the sequence-parallel ranks of the dense grid), so the expert input of an ETP group is the
  union of its ranks' tokens, and the partial expert outputs are summed back
  (all-gather before the experts, reduce-scatter after, as Megatron does with its expert TP group).
* The outputs and gradients on every rank equal those of one process running the whole layer
  on that rank's tokens. Expert weight gradients already hold the contributions of every token of
  the EP x ETP block (the collectives' backward brings them), so the training strategy must reduce
  expert gradients over the expert data-parallel group (EDP) only.

Host syncs: the all-to-all needs its split sizes on the host, read once per dispatch (a single
``tolist``; none at all under ``pad_expert_input_to_capacity``, whose splits are static);
combine and both backward passes reuse those sizes. The all-gather dispatcher never syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import input_side_probs
from lightning_moe.nn.permutation import PermutationPlan, permute, plan_permutation, unpermute
from lightning_moe.nn.router import RoutingResult
from lightning_moe.parallel.dispatch_ops import (
    all_gather_plain,
    all_gather_rows,
    all_to_all_rows,
    block_regroup_index,
    exclusive_cumsum,
    gather_rows,
    group_rank,
    group_size,
    reduce_scatter_rows,
)


def _check_experts_divide(cfg: MoEConfig, ep_size: int) -> None:
    if cfg.num_experts % ep_size:
        raise ValueError(
            f"num_experts={cfg.num_experts} is not divisible by the expert-parallel size {ep_size}: "
            "choose expert_parallel_size dividing num_experts."
        )


def _describe(kind: str, ep_size: int, etp_size: int) -> str:
    return f"{kind} (EP={ep_size})" if etp_size == 1 else f"{kind} (EP={ep_size}, ETP={etp_size})"


@dataclass
class AllToAllDispatchState:
    """What combine needs from dispatch (no member state: several micro-batches may be in flight).

    plan: this rank's permutation of its (token, expert) assignments, by global expert.
    combine_probs_TK: weights of the final unpermute (ones under ``apply_probs_on_input``).
    input_splits / output_splits: rows sent to / received from each EP rank (host ints).
    num_received: rows this rank received (``sum(output_splits)``).
    regroup_index / restore_index: gather maps between the received layout (ETP peer, source
        rank, local expert) and the expert layout (local expert, ETP peer, source rank).
    """

    plan: PermutationPlan
    combine_probs_TK: Tensor
    input_splits: list[int]
    output_splits: list[int]
    num_received: int
    regroup_index: Tensor
    restore_index: Tensor


def _init_groups(
    dispatcher: Any, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: Optional[dist.ProcessGroup]
) -> None:
    """The group attributes both dispatchers share: EP/ETP groups and sizes, local experts."""
    dispatcher.cfg = cfg
    dispatcher.ep_group = ep_group
    dispatcher.ep_size = group_size(ep_group)
    dispatcher.etp_group = etp_group if group_size(etp_group) > 1 else None
    dispatcher.etp_size = group_size(dispatcher.etp_group)
    _check_experts_divide(cfg, dispatcher.ep_size)
    dispatcher.num_local_experts = cfg.num_experts // dispatcher.ep_size


class AllToAllDispatcher:
    """Dispatch by an uneven all-to-all over the EP group (Megatron's "alltoall" dispatcher).

    dispatch: sort assignments by global expert (sync-free), exchange per-expert row counts with
    a small all-to-all, read the split sizes on the host once, all-to-all the rows, all-gather
    them within the ETP group, then regroup them by local expert with one gather (padding each
    expert's group to ``cfg.expert_alignment``). combine is the exact reverse, ending with the
    probability-weighted unpermute.

    Under ``pad_expert_input_to_capacity`` every source sends exactly ``capacity`` rows per
    expert (zero rows where it has fewer tokens), so every local expert gets
    ``capacity * EP * ETP`` rows, as in Megatron; the splits are then static and nothing syncs.
    All ranks must then route the same number of tokens (capacity depends on it).

    Args:
        cfg: the layer configuration.
        ep_group: the expert-parallel group (ranks holding different experts).
        etp_group: the expert tensor-parallel group (ranks splitting the same experts), or None.
    """

    def __init__(
        self, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        _init_groups(self, cfg, ep_group, etp_group)
        self.etp_rank = group_rank(self.etp_group)

    def describe(self) -> str:
        return _describe("all-to-all", self.ep_size, self.etp_size)

    def dispatch(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor, Tensor, AllToAllDispatchState]:
        cfg = self.cfg
        pad_to_capacity = cfg.pad_expert_input_to_capacity and routing.capacity is not None
        plan = plan_permutation(
            routing.experts_TK,
            routing.num_experts,
            keep_TK=routing.keep_TK,
            capacity=routing.capacity,
            pad_to_capacity=pad_to_capacity,
        )
        x_RD = permute(x_TD, plan)
        combine_probs_TK = routing.probs_TK
        if cfg.apply_probs_on_input:
            x_RD = input_side_probs(x_RD, routing.probs_TK, plan)
            combine_probs_TK = torch.ones_like(routing.probs_TK)

        if pad_to_capacity:
            counts_PSE, input_splits, rows_PS = self._static_counts(routing.capacity, x_TD.device)
        else:
            counts_PSE, input_splits, rows_PS = self._exchange_counts(plan.tokens_per_expert_E)
        output_splits = rows_PS[self.etp_rank]
        rows_per_peer = [sum(rows) for rows in rows_PS]
        num_sent, num_received = sum(input_splits), rows_per_peer[self.etp_rank]
        peer_stride = max(rows_per_peer)

        received_ND = all_to_all_rows(x_RD[:num_sent], output_splits, input_splits, self.ep_group)
        if self.etp_group is not None:
            # Equal-sized blocks for the all-gather: pad each peer's rows to the largest count.
            received_ND = all_gather_rows(F.pad(received_ND, (0, 0, 0, peer_stride - num_received)), self.etp_group)
        group_sizes_E, regroup_index, restore_index = self._regroup_maps(counts_PSE, rows_per_peer, peer_stride)
        expert_input_RD = gather_rows(received_ND, regroup_index, restore_index)
        state = AllToAllDispatchState(
            plan, combine_probs_TK, input_splits, output_splits, num_received, regroup_index, restore_index
        )
        return expert_input_RD, group_sizes_E, state

    def combine(self, expert_output_RD: Tensor, state: AllToAllDispatchState) -> Tensor:
        received_ND = gather_rows(expert_output_RD, state.restore_index, state.regroup_index)
        if self.etp_group is not None:
            # Each ETP rank holds partial sums (its FFN slice); sum them, keep this rank's rows.
            received_ND = reduce_scatter_rows(received_ND, self.etp_group)[: state.num_received]
        sent_RD = all_to_all_rows(received_ND, state.input_splits, state.output_splits, self.ep_group)
        missing = state.plan.num_rows - sent_RD.shape[0]  # dropped assignments: zero rows
        if missing:
            sent_RD = F.pad(sent_RD, (0, 0, 0, missing))
        return unpermute(sent_RD, state.combine_probs_TK, state.plan)

    def _exchange_counts(self, tokens_per_expert_E: Tensor) -> tuple[Tensor, list[int], list[list[int]]]:
        """Row counts of this ETP group's local experts, and the host split sizes.

        Returns ``counts_PSE`` (device, ``[ETP, EP, E_local]``: rows that source EP rank ``s``
        sends to local expert ``e`` of ETP peer ``p``; this rank is peer ``etp_rank``), the rows
        this rank sends to each EP rank, and ``rows_PS[p][s]`` = ``counts_PSE[p, s].sum()`` on
        the host.
        """
        ep, el = self.ep_size, self.num_local_experts
        send_E = tokens_per_expert_E.contiguous()
        received_SE = torch.empty_like(send_E)
        dist.all_to_all_single(received_SE, send_E, group=self.ep_group)
        if self.etp_group is not None:
            received_SE = all_gather_plain(received_SE, self.etp_group)
        counts_PSE = received_SE.view(self.etp_size, ep, el)
        # Host sync (the only one): all_to_all_single takes its split sizes as Python ints.
        sizes = torch.cat([send_E.view(ep, el).sum(1), counts_PSE.sum(2).reshape(-1)]).tolist()
        rows_PS = [sizes[ep + p * ep : ep + (p + 1) * ep] for p in range(self.etp_size)]
        return counts_PSE, sizes[:ep], rows_PS

    def _static_counts(self, capacity: int, device: torch.device) -> tuple[Tensor, list[int], list[list[int]]]:
        """`_exchange_counts` under ``pad_expert_input_to_capacity``: ``capacity`` rows per block."""
        ep, el = self.ep_size, self.num_local_experts
        counts_PSE = torch.full((self.etp_size, ep, el), capacity, dtype=torch.long, device=device)
        return counts_PSE, [el * capacity] * ep, [[el * capacity] * ep for _ in range(self.etp_size)]

    def _regroup_maps(
        self, counts_PSE: Tensor, rows_per_peer: list[int], peer_stride: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Group sizes of the local experts and the gather maps received layout <-> expert layout.

        Received layout: ETP peer ``p`` owns rows ``[p * stride, p * stride + rows_per_peer[p])``,
        ordered by (source EP rank, local expert). Expert layout: groups by local expert, each
        ordered by (peer, source), padded to a multiple of ``cfg.expert_alignment``; the buffer
        reserves ``alignment - 1`` spare rows per expert (an upper bound, so no further sync),
        unused rows are zero.
        """
        peers, sources, el = counts_PSE.shape
        align = self.cfg.expert_alignment
        counts_BE = counts_PSE.reshape(peers * sources, el)
        group_sizes_E = (counts_BE.sum(0) + align - 1) // align * align
        num_dst = sum(rows_per_peer) + (el * (align - 1) if align > 1 else 0)
        dst_start_BE = exclusive_cumsum(group_sizes_E, 0) + exclusive_cumsum(counts_BE, 0)
        peer_base = torch.arange(peers, device=counts_PSE.device).unsqueeze(1) * peer_stride
        src_start_PB = exclusive_cumsum(counts_PSE.reshape(peers, sources * el), 1) + peer_base
        regroup_index, restore_index = block_regroup_index(
            counts_PSE.reshape(-1), src_start_PB.reshape(-1), dst_start_BE.reshape(-1), peers * peer_stride, num_dst
        )
        return group_sizes_E, regroup_index, restore_index


@dataclass
class AllGatherDispatchState:
    """plan: permutation of the gathered assignments onto this rank's local experts.
    combine_probs_TK: gathered combine weights ``[G*T, K]`` (ones under ``apply_probs_on_input``).
    """

    plan: PermutationPlan
    combine_probs_TK: Tensor


class AllGatherDispatcher:
    """Dispatch by all-gathering every token of the EP x ETP block (Megatron's "allgather").

    Tokens, combine weights and expert choices of all ``G = EP * ETP`` ranks are all-gathered
    (the gradient of the tokens and weights is a reduce-scatter); each rank permutes the
    assignments that hit its own experts (the others are treated as dropped), runs them,
    un-permutes into a partial output for all ``G * T`` tokens, and a reduce-scatter sums the
    partial outputs (other experts, other FFN slices) back to the tokens' owners. Nothing syncs.
    All ranks must pass the same number of tokens. Under ``pad_expert_input_to_capacity`` each
    local expert gets exactly ``capacity * G`` rows, as with Megatron's padded routing map.

    Args: as `AllToAllDispatcher`.
    """

    def __init__(
        self, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        _init_groups(self, cfg, ep_group, etp_group)
        self.first_local_expert = group_rank(ep_group) * self.num_local_experts
        # Gather within the ETP group first, then across EP: the gathered rows are ordered
        # (EP rank, ETP rank, token); the reduce-scatter undoes it in reverse.
        self._gather_groups = [g for g in (self.etp_group, ep_group) if group_size(g) > 1]

    def describe(self) -> str:
        return _describe("all-gather", self.ep_size, self.etp_size)

    def _gather(self, x: Tensor) -> Tensor:
        for group in self._gather_groups:
            x = all_gather_rows(x, group)
        return x

    def dispatch(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor, Tensor, AllGatherDispatchState]:
        cfg = self.cfg
        x_all = self._gather(x_TD)
        probs_all = self._gather(routing.probs_TK)
        # One metadata gather: dropped assignments are marked with expert -1.
        experts_TK = routing.experts_TK
        if routing.keep_TK is not None:
            experts_TK = torch.where(routing.keep_TK, experts_TK, -1)
        for group in self._gather_groups:
            experts_TK = all_gather_plain(experts_TK, group)
        local_TK = experts_TK - self.first_local_expert
        mine_TK = (local_TK >= 0) & (local_TK < self.num_local_experts)
        pad_to_capacity = cfg.pad_expert_input_to_capacity and routing.capacity is not None
        group_ranks = self.ep_size * self.etp_size
        plan = plan_permutation(
            torch.where(mine_TK, local_TK, 0),
            self.num_local_experts,
            keep_TK=mine_TK,
            alignment=cfg.expert_alignment,
            capacity=routing.capacity * group_ranks if pad_to_capacity else None,
            pad_to_capacity=pad_to_capacity,
        )
        x_RD = permute(x_all, plan)
        if cfg.apply_probs_on_input:
            x_RD = input_side_probs(x_RD, probs_all, plan)
            probs_all = torch.ones_like(probs_all)
        return x_RD, plan.group_sizes_E, AllGatherDispatchState(plan, probs_all)

    def combine(self, expert_output_RD: Tensor, state: AllGatherDispatchState) -> Tensor:
        y_all = unpermute(expert_output_RD, state.combine_probs_TK, state.plan)
        for group in reversed(self._gather_groups):
            y_all = reduce_scatter_rows(y_all, group)
        return y_all
