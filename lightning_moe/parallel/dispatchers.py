"""Expert-parallel token dispatchers: all-to-all and all-gather, with optional expert TP.

Both derive from `TokenDispatcher` of ``lightning_moe.nn.dispatcher`` and follow Megatron-Core's
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

The all-to-all dispatcher sends each token once per EP rank that holds any of its experts
(not once per (token, expert) assignment, which would move ``K`` copies): with top-8 routing
over 2 EP ranks that is ~2 rows per token instead of 8. The receiving rank expands the rows to
its local experts, and sends back one partial sum per row (its experts' probability-weighted
outputs), which the source adds up. Under ``pad_expert_input_to_capacity`` it sends one row per
assignment instead, so that every split size is static.

Host syncs: the all-to-all needs its split sizes on the host, read once per dispatch (a single
``tolist``; none at all under ``pad_expert_input_to_capacity``, whose splits are static);
combine and both backward passes reuse those sizes. The all-gather dispatcher never syncs.

A dropless all-to-all inside a CUDA graph (`AllToAllDispatcher.static_budget`, which the
``CUDAGraphs`` callback sets for its capture): every size is fixed by the number of tokens, as
Megatron-Core's ``--moe-expert-rank-capacity-factor`` fixes its receive budget. Each rank sends a
slot of ``S = min(T, ceil(f * T * K / EP))`` token rows to every EP rank (equal splits: nothing
read on the host; every token fits where ``f * K >= EP``) and each rank's experts get a buffer
of ``ceil(f * T * K * ETP)`` assignment rows (plus alignment), ``f`` the budget factor: about ``f``
times the rows of a balanced eager dispatch.
Where a slot or the buffer would overflow, that exchange keeps no assignment at all (no memory is
touched out of bounds) and a device flag (``overflow``) records it; the caller reads the flag once
per optimizer step and runs the step again eagerly (dropless, host-synced sizes), so no token is
ever dropped. All ranks must route the same number of tokens.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.nn.aux_losses import tokens_per_expert
from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import TokenDispatcher, expert_input
from lightning_moe.nn.permutation import (
    DeferredPermutation,
    PermutationPlan,
    permute,
    plan_permutation,
    round_up,
    unpermute,
)
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


def _describe(kind: str, ep_size: int, etp_size: int, transport: str = "nccl") -> str:
    sizes = f"EP={ep_size}" if etp_size == 1 else f"EP={ep_size}, ETP={etp_size}"
    return f"{kind} ({sizes})" if transport == "nccl" else f"{kind} ({sizes}, {transport.replace('_', ' ')})"


def _check_copy_engine_groups(groups: list) -> None:
    """The copy-engine transport needs groups with an NCCL backend for CUDA (symmetric memory is
    CUDA-only; a mapping such as "cpu:gloo,cuda:nccl" qualifies). That the ranks share one host
    is left to the symmetric-memory rendezvous, which fails on its own otherwise."""
    for group in groups:
        backend = str(dist.get_backend(group))
        if "nccl" not in backend or not torch.cuda.is_available():
            raise ValueError(
                f"MoEConfig.dispatch_transport='copy_engine' needs CUDA GPUs of one host on an NCCL "
                f"process group (this group's backend is {backend!r}): use dispatch_transport='nccl'."
            )


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


@dataclass
class TokenAllToAllState:
    """What combine needs from a token-level (deduplicated) dispatch.

    send_plan: this rank's tokens grouped by destination EP rank (one row per (token, rank)
        pair holding at least one kept assignment); its unpermute with weight 1 sums the partial
        outputs that come back.
    expert_plan: the received rows (all ETP peers', padded per peer to ``peer_stride``) expanded
        to this rank's local experts.
    combine_probs_NK: routing weights of the received rows' assignments (ones under
        ``apply_probs_on_input``); entries of other ranks' experts are never read.
    input_splits / output_splits: token rows sent to / received from each EP rank (host ints).
    num_received, peer_stride: rows this rank received, and the per-peer block of the ETP gather.
    """

    send_plan: PermutationPlan
    expert_plan: PermutationPlan
    combine_probs_NK: Tensor
    input_splits: list[int]
    output_splits: list[int]
    num_received: int
    peer_stride: int


@dataclass
class _TokenSplits:
    """Host split sizes of one token-level dispatch (see `AllToAllDispatcher._exchange_counts_tokens`)."""

    input_splits: list[int]
    output_splits: list[int]
    num_received: int
    peer_stride: int
    num_expert_rows: int


def _pads_to_capacity(cfg: MoEConfig, routing: RoutingResult) -> bool:
    """Whether this dispatch sends ``capacity`` rows per expert (static splits, no sync)."""
    return cfg.pad_expert_input_to_capacity and routing.capacity is not None


def _kept_experts(routing: RoutingResult) -> Tensor:
    """``experts_TK`` with capacity-dropped assignments set to -1 (no destination)."""
    if routing.keep_TK is None:
        return routing.experts_TK
    return torch.where(routing.keep_TK, routing.experts_TK, -1)


def _routing_rows(routing: RoutingResult, start: int, end: int) -> RoutingResult:
    """The routing of tokens ``start:end`` (its per-expert counts recomputed on the device)."""
    keep = None if routing.keep_TK is None else routing.keep_TK[start:end]
    experts = routing.experts_TK[start:end]
    return RoutingResult(
        routing.probs_TK[start:end], experts, keep, tokens_per_expert(experts, routing.num_experts, keep),
        routing.num_experts, routing.capacity,
    )


_STREAMS: dict[tuple[int, str, int], torch.cuda.Stream] = {}


def _side_streams(device: torch.device, count: int, purpose: str = "chunks") -> list:
    """``count`` CUDA side streams of ``device`` for ``purpose`` (created once, reused by every
    layer); none on CPU."""
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = []
    for i in range(count):
        key = (index, purpose, i)
        if key not in _STREAMS:
            _STREAMS[key] = torch.cuda.Stream(device=index)
        streams.append(_STREAMS[key])
    return streams


@contextlib.contextmanager
def _on_stream(streams: list, index: int, wait_for, inputs: tuple):
    """Run the block on ``streams[index]`` (after ``wait_for``'s queued work; ``inputs`` made on
    another stream are marked as used there, so the allocator does not hand out their memory
    while this stream still reads it). Without streams (CPU): just run it."""
    if not streams:
        yield
        return
    stream = streams[index]
    if wait_for is not None:
        stream.wait_stream(wait_for)
    for t in inputs:
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


def _init_groups(
    dispatcher: Any, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: dist.ProcessGroup | None
) -> None:
    """The group attributes both dispatchers share: EP/ETP groups and sizes, local experts."""
    dispatcher.cfg = cfg
    dispatcher.ep_group = ep_group
    dispatcher.ep_size = group_size(ep_group)
    dispatcher.etp_group = etp_group if group_size(etp_group) > 1 else None
    dispatcher.etp_size = group_size(dispatcher.etp_group)
    _check_experts_divide(cfg, dispatcher.ep_size)
    dispatcher.num_local_experts = cfg.num_experts // dispatcher.ep_size


class AllToAllDispatcher(TokenDispatcher):
    """Dispatch by an uneven all-to-all over the EP group (Megatron's "alltoall" dispatcher).

    dispatch: exchange per-rank row counts with a small all-to-all and read the split sizes on
    the host once; group this rank's tokens by destination EP rank (one row per token and rank
    that holds any of its kept experts; sync-free), all-to-all the rows with their routing
    metadata, all-gather them within the ETP group, then expand them to the local experts with
    one gather (each expert's group padded to ``cfg.expert_alignment``). combine reduces each
    received row over this rank's experts with the routing weights, sums over the ETP group,
    sends the partial sums back, and each token adds up its ranks' partial sums.

    Under ``pad_expert_input_to_capacity`` every source sends exactly ``capacity`` rows per
    expert (zero rows where it has fewer tokens; one row per assignment), so every local expert
    gets ``capacity * EP * ETP`` rows, as in Megatron; the splits are then static and nothing
    syncs. All ranks must then route the same number of tokens (capacity depends on it).

    Args:
        cfg: the layer configuration.
        ep_group: the expert-parallel group (ranks holding different experts).
        etp_group: the expert tensor-parallel group (ranks splitting the same experts), or None.
    """

    runs_experts = True  # `MoELayer` calls `run` (chunked and pipelined under ``cfg.dispatch_chunks``)

    def __init__(
        self, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: dist.ProcessGroup | None = None
    ) -> None:
        if cfg.dispatch_transport != "nccl":
            raise ValueError(
                f"MoEConfig.dispatch_transport={cfg.dispatch_transport!r} is implemented by the all-gather "
                "dispatcher only: set token_dispatcher_type='allgather' (or the strategy's "
                "token_dispatcher='allgather'), or dispatch_transport='nccl'."
            )
        _init_groups(self, cfg, ep_group, etp_group)
        self.etp_rank = group_rank(self.etp_group)
        # The budget factor of the static (capturable) dropless path, None: host-synced sizes
        # (module docstring). Set by the CUDAGraphs callback around its capture.
        self.static_budget: float | None = None
        # int32 0-dim device flag, nonzero once a static dispatch overflowed its slots or buffer
        # (made at the first static dispatch; cleared by whoever reads it).
        self.overflow: Tensor | None = None

    takes_static_budget = True  # the CUDAGraphs callback may capture its dropless path (`static_budget`)

    def describe(self) -> str:
        return _describe("all-to-all", self.ep_size, self.etp_size)

    @property
    def syncs_host(self) -> bool:
        """Whether dispatch reads device values on the host (the dropless path's split sizes), so
        that it cannot run under CUDA-graph capture as it is (`static_budget` makes it static)."""
        cfg = self.cfg
        return not (cfg.pad_expert_input_to_capacity and cfg.expert_capacity_factor is not None)

    def dispatch(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor, Tensor, Any]:
        if _pads_to_capacity(self.cfg, routing):
            return self._dispatch_assignments(x_TD, routing)
        if self.static_budget is not None:
            return self._dispatch_tokens_static(x_TD, routing, self.static_budget)
        return self._dispatch_tokens(x_TD, routing)

    def static_sizes(self, num_tokens: int, budget: float) -> tuple[int, int]:
        """(token rows of each EP rank's slot, expert rows) of the static path for ``num_tokens``
        tokens per rank: the slot is ``min(T, ceil(f * T * K / EP))``; the expert buffer
        ``ceil(f * T * K * ETP)`` rows plus every local expert's alignment padding (at most the
        rows that the slots can bring)."""
        if not budget > 0:
            raise ValueError(f"the all-to-all budget factor must be > 0, got {budget!r}")
        topk, align, el = self.cfg.router_topk, self.cfg.expert_alignment, self.num_local_experts
        slot = min(num_tokens, math.ceil(budget * num_tokens * topk / self.ep_size))
        worst = self.etp_size * self.ep_size * slot * min(topk, el)
        rows = min(math.ceil(budget * num_tokens * topk * self.etp_size), worst)
        return slot, round_up(rows + el * (align - 1), align)

    def _dispatch_tokens_static(
        self, x_TD: Tensor, routing: RoutingResult, budget: float
    ) -> tuple[Tensor, Tensor, TokenAllToAllState]:
        """The token-level dispatch with sizes fixed by the token count (module docstring): equal
        slots of ``S`` rows per EP rank, a ``static_sizes`` expert buffer, no host read. An
        exchange whose slot or buffer would overflow keeps no assignment and sets ``overflow``."""
        cfg = self.cfg
        ep, el = self.ep_size, self.num_local_experts
        experts_TK, needs_TR, _ = self._token_counts(routing)
        num_tokens, topk = experts_TK.shape
        slot, expert_rows = self.static_sizes(num_tokens, budget)
        send_over = (needs_TR.sum(0) > slot).any()
        keep_TR = needs_TR & ~send_over
        ranks_TR = torch.arange(ep, device=x_TD.device).expand(num_tokens, ep)
        send_plan = plan_permutation(ranks_TR, ep, keep_TK=keep_TR, capacity=slot, pad_to_capacity=True)
        x_ND = permute(x_TD, send_plan)
        meta_NK2 = self._sent_rows_metadata(experts_TK, routing.probs_TK, send_plan)
        splits = [slot] * ep
        recv_x_ND = all_to_all_rows(x_ND, splits, splits, self.ep_group)
        recv_meta = all_to_all_rows(meta_NK2, splits, splits, self.ep_group)
        if self.etp_group is not None:  # every peer's block has EP x S rows already
            recv_x_ND = all_gather_rows(recv_x_ND, self.etp_group)
            recv_meta = all_gather_rows(recv_meta, self.etp_group)
        probs_NK, local_NK = recv_meta[:, :topk], recv_meta[:, topk:].detach().long()
        mine_NK = local_NK >= 0
        experts_NK = local_NK.clamp(min=0)
        received_E = torch.zeros(el, dtype=torch.long, device=x_TD.device).scatter_add_(
            0, experts_NK.reshape(-1), mine_NK.reshape(-1).long())
        recv_over = round_up(received_E, cfg.expert_alignment).sum() > expert_rows
        mine_NK = mine_NK & ~recv_over
        self._record_overflow(send_over | recv_over)
        expert_plan = plan_permutation(experts_NK, el, keep_TK=mine_NK, alignment=cfg.expert_alignment,
                                       num_rows=expert_rows, spare_rows=True)
        expert_input_RD, combine_probs_NK = expert_input(recv_x_ND, probs_NK, expert_plan, cfg)
        received = ep * slot
        state = TokenAllToAllState(send_plan, expert_plan, combine_probs_NK, splits, splits, received, received)
        return expert_input_RD, expert_plan.group_sizes_E, state

    def _sent_rows_metadata(self, experts_TK: Tensor, probs_TK: Tensor, send_plan: PermutationPlan) -> Tensor:
        """``[N, 2K]`` per sent row: its token's K probabilities, then its K assignments as the
        destination's local expert ids (-1 for other ranks' or dropped ones). The ids travel as
        exact floats beside the probabilities, so the metadata takes one all-to-all. A padding row
        of the plan (a static slot's empty row: token T) reads probability 0 and expert -1."""
        ep, el = self.ep_size, self.num_local_experts
        if send_plan.padding_rows:
            experts_TK = torch.cat([experts_TK, experts_TK.new_full((1, experts_TK.shape[1]), -1)])
            probs_TK = torch.cat([probs_TK, probs_TK.new_zeros(1, probs_TK.shape[1])])
        row_token_N = send_plan.row_token_R
        local_NK = experts_TK.index_select(0, row_token_N) - (send_plan.row_assignment_R % ep).unsqueeze(1) * el
        local_NK = torch.where((local_NK >= 0) & (local_NK < el), local_NK, -1)
        return torch.cat([probs_TK.index_select(0, row_token_N), local_NK.to(probs_TK.dtype)], 1)

    def _record_overflow(self, overflowed: Tensor) -> None:
        if self.overflow is None or self.overflow.device != overflowed.device:
            self.overflow = torch.zeros((), dtype=torch.int32, device=overflowed.device)
        self.overflow.bitwise_or_(overflowed.to(torch.int32))

    def combine(self, expert_output_RD: Tensor, state: Any) -> Tensor:
        if isinstance(state, TokenAllToAllState):
            return self._combine_tokens(expert_output_RD, state)
        return self._combine_assignments(expert_output_RD, state)

    # Token-level path (default): one row per (token, destination rank).

    def _dispatch_tokens(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor, Tensor, TokenAllToAllState]:
        experts_TK, needs_TR, send_RC = self._token_counts(routing)
        (splits,) = self._exchange_counts_tokens([send_RC])
        return self._dispatch_tokens_with(x_TD, routing, experts_TK, needs_TR, splits)

    def _token_counts(self, routing: RoutingResult) -> tuple[Tensor, Tensor, Tensor]:
        """``experts_TK`` with dropped assignments as -1, ``needs_TR`` (bool ``[T, EP]``: token t
        has a kept assignment on EP rank r) and the counts to send each rank,
        ``[EP, E_local + 1]``: its local experts' assignments, then the token rows. Device-side,
        no sync."""
        ep, el = self.ep_size, self.num_local_experts
        experts_TK = _kept_experts(routing)
        dest_rank_TK = torch.where(experts_TK >= 0, experts_TK // el, ep)  # column ep absorbs drops
        needs_TR = torch.zeros(experts_TK.shape[0], ep + 1, dtype=torch.bool, device=experts_TK.device)
        needs_TR.scatter_(1, dest_rank_TK, True)
        needs_TR = needs_TR[:, :ep]
        send_RC = torch.cat(
            [routing.tokens_per_expert_E.view(ep, el), needs_TR.sum(0, dtype=torch.long).view(ep, 1)], 1
        )
        return experts_TK, needs_TR, send_RC

    def _exchange_counts_tokens(self, sends_RC: list[Tensor]) -> list[_TokenSplits]:
        """Exchange the counts of ``C`` chunks in one all-to-all and read every split on the host
        with a single sync."""
        ep, el, num_chunks = self.ep_size, self.num_local_experts, len(sends_RC)
        send_RXC = torch.stack(sends_RC, 1)  # [EP, chunks, E_local + 1]: rank-major for the all-to-all
        received = torch.empty_like(send_RXC)
        dist.all_to_all_single(received, send_RXC, group=self.ep_group)
        if self.etp_group is not None:
            received = all_gather_plain(received, self.etp_group)
        received_PSXC = received.view(self.etp_size, ep, num_chunks, el + 1)
        align = self.cfg.expert_alignment
        aligned_rows_X = round_up(received_PSXC[..., :el].sum((0, 1)), align).sum(1)
        # Host sync (the only one per micro-batch): all_to_all_single takes its split sizes as
        # Python ints; each expert buffer's exact (aligned) size comes along, so no GEMM sees
        # spare rows.
        if send_RXC.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the dropless all-to-all dispatch reads its split sizes on the host, which CUDA-graph capture "
                "cannot record: set MoEConfig(expert_capacity_factor=..., pad_expert_input_to_capacity=True) "
                "or use the all-gather dispatcher"
            )
        sizes = torch.cat(
            [send_RXC[..., el].t().reshape(-1), received_PSXC[..., el].permute(2, 0, 1).reshape(-1), aligned_rows_X]
        ).tolist()
        peers = self.etp_size
        chunks = []
        for c in range(num_chunks):
            input_splits = sizes[c * ep : (c + 1) * ep]
            base = num_chunks * ep + c * peers * ep
            rows_PS = [sizes[base + p * ep : base + (p + 1) * ep] for p in range(peers)]
            output_splits = rows_PS[self.etp_rank]
            chunks.append(_TokenSplits(
                input_splits=input_splits,
                output_splits=output_splits,
                num_received=sum(output_splits),
                peer_stride=max(sum(rows) for rows in rows_PS),
                num_expert_rows=sizes[num_chunks * ep * (1 + peers) + c],
            ))
        return chunks

    def _dispatch_tokens_with(
        self, x_TD: Tensor, routing: RoutingResult, experts_TK: Tensor, needs_TR: Tensor, splits: _TokenSplits
    ) -> tuple[Tensor, Tensor, TokenAllToAllState]:
        cfg = self.cfg
        ep, el = self.ep_size, self.num_local_experts
        num_tokens, topk = experts_TK.shape
        input_splits, output_splits = splits.input_splits, splits.output_splits
        num_received, peer_stride = splits.num_received, splits.peer_stride

        # Rows to send, grouped by destination rank, in token order within each.
        ranks_TR = torch.arange(ep, device=x_TD.device).expand(num_tokens, ep)
        send_plan = plan_permutation(ranks_TR, ep, keep_TK=needs_TR, num_rows=sum(input_splits))
        x_ND = permute(x_TD, send_plan)
        meta_NK2 = self._sent_rows_metadata(experts_TK, routing.probs_TK, send_plan)

        recv_x_ND = all_to_all_rows(x_ND, output_splits, input_splits, self.ep_group)
        recv_meta = all_to_all_rows(meta_NK2, output_splits, input_splits, self.ep_group)
        if self.etp_group is not None:
            # Equal-sized blocks for the all-gather: pad each peer's rows to the largest count
            # (padding rows carry expert id -1: they reach no expert).
            pad = peer_stride - num_received
            recv_x_ND = all_gather_rows(F.pad(recv_x_ND, (0, 0, 0, pad)), self.etp_group)
            filler = torch.cat([recv_meta.new_zeros(pad, topk), recv_meta.new_full((pad, topk), -1.0)], 1)
            recv_meta = all_gather_rows(torch.cat([recv_meta, filler]), self.etp_group)
        probs_NK, local_NK = recv_meta[:, :topk], recv_meta[:, topk:].detach().long()
        mine_NK = local_NK >= 0
        expert_plan = plan_permutation(
            local_NK.clamp(min=0), el, keep_TK=mine_NK, alignment=cfg.expert_alignment,
            num_rows=splits.num_expert_rows,
        )
        expert_input_RD, combine_probs_NK = expert_input(recv_x_ND, probs_NK, expert_plan, cfg)
        state = TokenAllToAllState(
            send_plan, expert_plan, combine_probs_NK, input_splits, output_splits, num_received, peer_stride
        )
        return expert_input_RD, expert_plan.group_sizes_E, state

    # Pipelined dispatch: chunks of tokens on separate CUDA streams.

    def run(self, x_TD: Tensor, routing: RoutingResult, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """dispatch -> ``experts(expert_input_RD, group_sizes_E)`` -> combine, pipelined.

        With ``cfg.dispatch_chunks = C > 1`` the tokens are split into ``C`` contiguous chunks;
        every chunk's all-to-alls are issued before any chunk's GEMMs, and each chunk runs on its
        own CUDA stream, so the all-to-all of one chunk overlaps the expert GEMMs of another
        (forward, and backward too: autograd runs each backward op on its forward op's stream).
        The counts of all chunks are exchanged together: still one host sync per micro-batch.
        Results equal the unchunked dispatch up to the order of floating-point sums.
        """
        num_chunks = min(self.cfg.dispatch_chunks, x_TD.shape[0])
        # the static path exchanges the micro-batch at once (inside a graph no host waits on it)
        if num_chunks <= 1 or _pads_to_capacity(self.cfg, routing) or self.static_budget is not None:
            expert_input_RD, group_sizes_E, state = self.dispatch(x_TD, routing)
            return self.combine(experts(expert_input_RD, group_sizes_E), state)
        bounds = [(c * x_TD.shape[0] // num_chunks, (c + 1) * x_TD.shape[0] // num_chunks) for c in range(num_chunks)]
        routings = [_routing_rows(routing, a, b) for a, b in bounds]
        counts = [self._token_counts(r) for r in routings]
        splits = self._exchange_counts_tokens([send_RC for _, _, send_RC in counts])
        streams = _side_streams(x_TD.device, num_chunks)
        main = torch.cuda.current_stream(x_TD.device) if streams else None
        dispatched = []
        for c, (a, b) in enumerate(bounds):  # every chunk's dispatch first: its all-to-alls queue up
            experts_TK, needs_TR, _ = counts[c]
            with _on_stream(streams, c, main, inputs=(x_TD, routing.probs_TK, experts_TK, needs_TR)):
                dispatched.append(self._dispatch_tokens_with(x_TD[a:b], routings[c], experts_TK, needs_TR, splits[c]))
        outputs = []
        for c, (expert_input_RD, group_sizes_E, state) in enumerate(dispatched):
            with _on_stream(streams, c, None, inputs=()):
                outputs.append(self._combine_tokens(experts(expert_input_RD, group_sizes_E), state))
        if streams:
            for stream, y_TD in zip(streams, outputs):
                main.wait_stream(stream)
                y_TD.record_stream(main)  # made on a side stream, consumed (and freed) on the main one
        return torch.cat(outputs)

    def _combine_tokens(self, expert_output_RD: Tensor, state: TokenAllToAllState) -> Tensor:
        # Each received row's partial output: the weighted sum over this rank's experts.
        partial_ND = unpermute(expert_output_RD, state.combine_probs_NK, state.expert_plan)
        if self.etp_group is not None:
            # Each ETP rank holds partial sums (its FFN slice); sum them, keep this rank's rows.
            partial_ND = reduce_scatter_rows(partial_ND, self.etp_group)[: state.num_received]
        returned_ND = all_to_all_rows(partial_ND, state.input_splits, state.output_splits, self.ep_group)
        send_plan = state.send_plan
        ones_TR = torch.ones(send_plan.dest_TK.shape, dtype=torch.float32, device=returned_ND.device)
        return unpermute(returned_ND, ones_TR, send_plan)

    # Assignment-level path (``pad_expert_input_to_capacity``): static splits, no host sync.

    def _dispatch_assignments(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor, Tensor, AllToAllDispatchState]:
        cfg = self.cfg
        plan = plan_permutation(
            routing.experts_TK,
            routing.num_experts,
            keep_TK=routing.keep_TK,
            alignment=cfg.expert_alignment,
            capacity=routing.capacity,
            pad_to_capacity=True,
        )
        x_RD, combine_probs_TK = expert_input(x_TD, routing.probs_TK, plan, cfg)

        # Each (source, expert) block is the capacity rounded up to the alignment, as in the plan.
        counts_PSE, input_splits, rows_PS = self._static_counts(
            round_up(routing.capacity, cfg.expert_alignment), x_TD.device
        )
        output_splits = rows_PS[self.etp_rank]
        rows_per_peer = [sum(rows) for rows in rows_PS]
        num_received = rows_per_peer[self.etp_rank]
        peer_stride = max(rows_per_peer)

        received_ND = all_to_all_rows(x_RD, output_splits, input_splits, self.ep_group)
        if self.etp_group is not None:
            # Equal-sized blocks for the all-gather: pad each peer's rows to the largest count.
            received_ND = all_gather_rows(F.pad(received_ND, (0, 0, 0, peer_stride - num_received)), self.etp_group)
        group_sizes_E, regroup_index, restore_index = self._regroup_maps(counts_PSE, rows_per_peer, peer_stride)
        expert_input_RD = gather_rows(received_ND, regroup_index, restore_index)
        state = AllToAllDispatchState(
            plan, combine_probs_TK, input_splits, output_splits, num_received, regroup_index, restore_index
        )
        return expert_input_RD, group_sizes_E, state

    def _combine_assignments(self, expert_output_RD: Tensor, state: AllToAllDispatchState) -> Tensor:
        received_ND = gather_rows(expert_output_RD, state.restore_index, state.regroup_index)
        if self.etp_group is not None:
            # Each ETP rank holds partial sums (its FFN slice); sum them, keep this rank's rows.
            received_ND = reduce_scatter_rows(received_ND, self.etp_group)[: state.num_received]
        # Every one of the E x aligned-capacity rows was sent (padding rows are zero), so the returned
        # rows are the whole permuted buffer.
        sent_RD = all_to_all_rows(received_ND, state.input_splits, state.output_splits, self.ep_group)
        return unpermute(sent_RD, state.combine_probs_TK, state.plan)

    def _static_counts(self, capacity: int, device: torch.device) -> tuple[Tensor, list[int], list[list[int]]]:
        """Row counts and host splits under ``pad_expert_input_to_capacity``: ``capacity`` rows per
        (source, expert) block, so nothing is read from the device.

        Returns ``counts_PSE`` (``[ETP, EP, E_local]``: rows source EP rank ``s`` sends to local
        expert ``e`` of ETP peer ``p``), the rows this rank sends to each EP rank, and
        ``rows_PS[p][s]`` on the host.
        """
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
        group_sizes_E = round_up(counts_BE.sum(0), align)
        # The last group's end (the buffer size) stays aligned too.
        num_dst = round_up(sum(rows_per_peer) + el * (align - 1), align)
        dst_start_BE = exclusive_cumsum(group_sizes_E, 0) + exclusive_cumsum(counts_BE, 0)
        peer_base = torch.arange(peers, device=counts_PSE.device).unsqueeze(1) * peer_stride
        src_start_PB = exclusive_cumsum(counts_PSE.reshape(peers, sources * el), 1) + peer_base
        regroup_index, restore_index = block_regroup_index(
            counts_PSE.reshape(-1), src_start_PB.reshape(-1), dst_start_BE.reshape(-1), peers * peer_stride, num_dst
        )
        return group_sizes_E, regroup_index, restore_index


@dataclass
class PrefetchedTokens:
    """Tokens of the whole EP x ETP block gathered ahead of routing (see `AllGatherDispatcher.prefetch`).

    x_all: ``[G*T, D]``, made on ``stream`` (None on CPU).
    """

    x_all: Tensor
    stream: Any | None

    def wait(self) -> Tensor:
        """``x_all``, safe to use on the current stream."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.x_all.device)
            current.wait_stream(self.stream)
            self.x_all.record_stream(current)  # made on the side stream, consumed (and freed) here
        return self.x_all


@dataclass
class AllGatherDispatchState:
    """plan: permutation of the gathered assignments onto this rank's local experts.
    combine_probs_TK: gathered combine weights ``[G*T, K]`` (ones under ``apply_probs_on_input``).
    """

    plan: PermutationPlan
    combine_probs_TK: Tensor


class AllGatherDispatcher(TokenDispatcher):
    """Dispatch by all-gathering every token of the EP x ETP block (Megatron's "allgather").

    Tokens, combine weights and expert choices of all ``G = EP * ETP`` ranks are all-gathered
    (the gradient of the tokens and weights is a reduce-scatter); each rank permutes the
    assignments that hit its own experts (the others are treated as dropped), runs them,
    un-permutes into a partial output for all ``G * T`` tokens, and a reduce-scatter sums the
    partial outputs (other experts, other FFN slices) back to the tokens' owners. Nothing syncs.
    All ranks must pass the same number of tokens. Under ``pad_expert_input_to_capacity`` each
    local expert gets exactly ``capacity * G`` rows, as with Megatron's padded routing map.

    The token gather does not depend on the routing, so `MoELayer` starts it before the router
    (:meth:`prefetch`, on a side stream). The expert buffer is sized for the worst case, ``G*T*K``
    rows, about ``(G-1)/G`` of it padding after the last group; the "grouped_mm" expert backend
    leaves that padding out of its GEMMs. Rows move over NCCL or, with
    ``cfg.dispatch_transport="copy_engine"``, as peer copies through symmetric memory.

    Args: as `AllToAllDispatcher`.
    """

    # `MoELayer` calls `prefetch` and may pass ``tail_unwritten=True`` and ``defer_permute=True`` to
    # `dispatch`.
    prefetches = True
    can_leave_tail_unwritten = True
    can_defer_permute = True

    def __init__(
        self, cfg: MoEConfig, ep_group: dist.ProcessGroup, etp_group: dist.ProcessGroup | None = None
    ) -> None:
        _init_groups(self, cfg, ep_group, etp_group)
        self.first_local_expert = group_rank(ep_group) * self.num_local_experts
        self._tables: dict = {}
        # Gather within the ETP group first, then across EP: the gathered rows are ordered
        # (EP rank, ETP rank, token); the reduce-scatter undoes it in reverse.
        self._gather_groups = [g for g in (self.etp_group, ep_group) if group_size(g) > 1]
        self.transport = cfg.dispatch_transport
        if self.transport == "copy_engine":
            _check_copy_engine_groups(self._gather_groups)

    def describe(self) -> str:
        return _describe("all-gather", self.ep_size, self.etp_size, self.transport)

    def _local_expert_table(self, device: torch.device) -> Tensor:
        """int32 [E + 1]: entry ``e`` is global expert ``e``'s local index on this rank, or
        ``num_local_experts`` (the plan's sentinel) when another rank holds it; the last entry,
        which index -1 (a dropped assignment) reads, is the sentinel too. Built once per device."""
        table = self._tables.get(device)
        if table is None:
            first, count = self.first_local_expert, self.num_local_experts
            table = torch.full((self.cfg.num_experts + 1,), count, dtype=torch.int32, device=device)
            table[first:first + count] = torch.arange(count, dtype=torch.int32, device=device)
            self._tables[device] = table
        return table

    def _gather(self, x: Tensor) -> Tensor:
        for group in self._gather_groups:
            x = all_gather_rows(x, group, self.transport)
        return x

    def prefetch(self, x_TD: Tensor) -> PrefetchedTokens:
        """Start gathering the tokens before the router runs: they do not depend on the routing.

        On CUDA the gather runs on a side stream, so the transfer overlaps the router's kernels;
        autograd runs its backward (the reduce-scatter of the token gradient) on that stream
        too, beside the router's backward. Pass the result to :meth:`dispatch` as ``prefetched``.
        On CPU the gather simply runs here.
        """
        streams = _side_streams(x_TD.device, 1, purpose="prefetch")
        if not streams:
            return PrefetchedTokens(self._gather(x_TD), None)
        (side,) = streams
        with _on_stream(streams, 0, torch.cuda.current_stream(x_TD.device), inputs=(x_TD,)):
            x_all = self._gather(x_TD)
        return PrefetchedTokens(x_all, side)

    def dispatch(
        self, x_TD: Tensor, routing: RoutingResult, prefetched: PrefetchedTokens | None = None,
        tail_unwritten: bool = False, defer_permute: bool = False,
    ) -> tuple[Tensor | DeferredPermutation, Tensor, AllGatherDispatchState]:
        """``tail_unwritten``: the experts read only the rows their groups cover, so the rows
        after the last group (about ``(G-1)/G`` of the buffer) are not written on CUDA, neither
        by the permutation nor by the combine's backward (see ``PermutationPlan.rows_end``).
        ``defer_permute``: return the gathered tokens and the plan as a `DeferredPermutation`
        instead of the permuted rows (not under ``apply_probs_on_input``)."""
        cfg = self.cfg
        x_all = self._gather(x_TD) if prefetched is None else prefetched.wait()
        # One metadata gather: the routing weights with the expert ids beside them as exact
        # floats (dropped assignments marked -1); only the weights carry a gradient back.
        probs_TK = routing.probs_TK
        topk, meta_dtype = probs_TK.shape[1], torch.promote_types(probs_TK.dtype, torch.float32)
        meta_all = self._gather(torch.cat([probs_TK.to(meta_dtype), _kept_experts(routing).to(meta_dtype)], 1))
        probs_all = meta_all[:, :topk].to(probs_TK.dtype)
        # Each gathered expert id as this rank's local expert, or the sentinel (the local expert
        # count) for other ranks' and dropped (-1) assignments: one table lookup.
        local_TK = self._local_expert_table(meta_all.device)[meta_all[:, topk:].detach().long()]
        pad_to_capacity = _pads_to_capacity(cfg, routing)
        group_ranks = self.ep_size * self.etp_size
        plan = plan_permutation(
            local_TK,
            self.num_local_experts,
            dropped_marked=True,
            alignment=cfg.expert_alignment,
            capacity=routing.capacity * group_ranks if pad_to_capacity else None,
            pad_to_capacity=pad_to_capacity,
        )
        if tail_unwritten and not cfg.apply_probs_on_input:  # input-side probabilities multiply every row
            plan.rows_end = plan.group_sizes_E.sum()
        x_RD, combine_probs_all = expert_input(x_all, probs_all, plan, cfg, defer_permute)
        return x_RD, plan.group_sizes_E, AllGatherDispatchState(plan, combine_probs_all)

    def combine(self, expert_output_RD: Tensor, state: AllGatherDispatchState) -> Tensor:
        y_all = unpermute(expert_output_RD, state.combine_probs_TK, state.plan)
        for group in reversed(self._gather_groups):
            y_all = reduce_scatter_rows(y_all, group, self.transport)
        return y_all
