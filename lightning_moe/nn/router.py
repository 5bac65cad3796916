"""Top-k token router: the functional core :func:`route` and the :class:`TopKRouter` module.

Routing semantics equal Megatron-Core's ``TopKRouter`` (score functions, pre-softmax, group-limited
top-k, scaling factor, expert bias, capacity with both drop policies, aux/seq-aux/global-aux and
z losses, input jitter), but the result stays sparse: ``[T, K]`` probabilities and expert ids
instead of Megatron's dense ``[T, E]`` maps. Dense maps are built only where the loss math needs
scores over all experts, and nothing here reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.nn.aux_losses import (
    AuxLossAutoScaler,
    all_reduce_counts,
    compute_routing_scores_for_aux_loss,
    global_load_balancing_loss,
    group_size,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    tokens_per_expert,
    tokens_per_sequence_expert,
    z_loss,
)
from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.router_logits import router_logits
from lightning_moe.nn.saved_tensors import recomputing

if TYPE_CHECKING:
    from lightning_moe.nn.router_replay import ReplayedRouting

_LOW_PRECISION_FLOATS = (torch.float16, torch.bfloat16)


@dataclass
class RoutingResult:
    """Sparse routing decision for ``T`` tokens.

    Attributes:
        probs_TK: fp32 ``[T, K]`` combine weights after scaling; 0 where capacity dropped the
            assignment. Carries gradient to the router weight (and the aux-loss hooks).
        experts_TK: int64 ``[T, K]`` chosen experts, in descending score order per token.
        keep_TK: bool ``[T, K]`` capacity keep-mask; ``None`` when routing is dropless.
        tokens_per_expert_E: int64 ``[E]`` kept assignments per expert, on device.
        num_experts: ``E``.
        capacity: tokens per expert under token dropping (``cfg.expert_capacity(T)``), else None.
    """

    probs_TK: Tensor
    experts_TK: Tensor
    keep_TK: Tensor | None
    tokens_per_expert_E: Tensor
    num_experts: int
    capacity: int | None

    def dense(self) -> tuple[Tensor, Tensor]:
        """Megatron's dense layout: ``(probs_TE fp32, routing_map_TE bool)``, both ``[T, E]``.

        Equal to Megatron's ``(probs, routing_map)`` after ``apply_router_token_dropping``, with
        one deliberate difference under ``pad_expert_input_to_capacity``: Megatron marks extra
        (token, expert) pairs with probability 0 so that every expert receives exactly
        ``capacity`` rows; here the map holds only the real kept assignments, and the layer pads
        each expert's input with zero rows instead. A zero-weighted token and a zero row give the
        same outputs and gradients (the expert output is multiplied by 0 either way), so only the
        map differs. ``probs_TE`` is identical in both cases and keeps its gradient.
        """
        num_tokens = self.experts_TK.shape[0]
        device = self.experts_TK.device
        probs_TE = torch.zeros(num_tokens, self.num_experts, dtype=self.probs_TK.dtype, device=device)
        probs_TE = probs_TE.scatter(1, self.experts_TK, self.probs_TK)
        keep_TK = self.keep_TK if self.keep_TK is not None else torch.ones_like(self.experts_TK, dtype=torch.bool)
        routing_map_TE = torch.zeros(num_tokens, self.num_experts, dtype=torch.bool, device=device)
        routing_map_TE = routing_map_TE.scatter(1, self.experts_TK, keep_TK)
        return probs_TE, routing_map_TE

    @property
    def num_dropped(self) -> Tensor:
        """0-dim int64 count of assignments dropped by capacity, on device (no host sync)."""
        if self.keep_TK is None:
            return torch.zeros((), dtype=torch.int64, device=self.experts_TK.device)
        return self.keep_TK.numel() - self.keep_TK.sum()


def route(
    logits_TE: Tensor, cfg: MoEConfig, expert_bias: Tensor | None = None, replayed: ReplayedRouting | None = None
) -> RoutingResult:
    """Choose ``K`` experts per token from router logits; Megatron-Core's routing math in fp32.

    Steps, as in Megatron's ``topk_routing_with_score_function`` and
    ``apply_router_token_dropping``: score function and top-k (group-limited if configured,
    expert bias for selection only), normalisation and scaling of the top-k probabilities, then
    expert capacity. Losses are not computed here (see :class:`TopKRouter`).

    Args:
        logits_TE: router logits ``[T, E]``; computed in fp32 (cast if given lower precision).
        cfg: the layer configuration.
        expert_bias: fp32 ``[E]`` selection bias (sigmoid routing only), or None.
        replayed: an earlier forward's experts and keep-mask to use instead of choosing
            (`lightning_moe.nn.router_replay`); the probabilities are computed at those experts.

    Returns:
        The sparse :class:`RoutingResult`; ``probs_TK`` carries gradient to ``logits_TE``.
    """
    logits_TE = logits_TE.float()
    if expert_bias is not None and cfg.router_score_function != "sigmoid":
        raise ValueError("expert_bias is used only with router_score_function='sigmoid' (as in Megatron-Core).")
    select = _select_topk if replayed is None else replayed.select
    probs_TK, experts_TK = _topk_probs(logits_TE, cfg, expert_bias, select)
    num_experts = cfg.num_experts
    capacity = cfg.expert_capacity(logits_TE.shape[0])
    if capacity is None:
        counts_E = tokens_per_expert(experts_TK, num_experts)
        return RoutingResult(probs_TK, experts_TK, None, counts_E, num_experts, None)
    if replayed is None:
        keep_TK = capacity_keep_mask(probs_TK, experts_TK, num_experts, capacity, cfg.token_drop_policy)
    else:
        keep_TK = replayed.keep_TK.to(experts_TK.device)
    probs_TK = probs_TK * keep_TK
    counts_E = tokens_per_expert(experts_TK, num_experts, keep_TK)
    return RoutingResult(probs_TK, experts_TK, keep_TK, counts_E, num_experts, capacity)


def _topk_probs(
    logits_TE: Tensor, cfg: MoEConfig, expert_bias: Tensor | None, select: Callable[..., tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """Top-k combine weights ``[T, K]`` and expert ids ``[T, K]`` for the configured score function.

    softmax: over all experts before top-k (``router_pre_softmax``) or over the top-k logits.
    sigmoid: per-expert sigmoid; the bias shifts only which experts win. The chosen weights are
    then divided by their sum where ``cfg.renormalizes_topk`` (Megatron: sigmoid with K > 1).
    ``select``: the top-k (`_select_topk`, or a replay's).
    """
    if cfg.router_score_function == "softmax":
        if cfg.router_pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
            probs_TK, experts_TK = select(scores_TE, cfg)
        else:
            top_logits_TK, experts_TK = select(logits_TE, cfg)
            probs_TK = torch.softmax(top_logits_TK, dim=-1, dtype=torch.float32)
    else:
        scores_TE = torch.sigmoid(logits_TE)
        if expert_bias is not None:
            _, experts_TK = select(scores_TE + expert_bias, cfg)
            probs_TK = torch.gather(scores_TE, dim=1, index=experts_TK)
        else:
            probs_TK, experts_TK = select(scores_TE, cfg)
    if cfg.renormalizes_topk:
        probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.router_topk_scaling_factor:
        probs_TK = probs_TK * cfg.router_topk_scaling_factor
    return probs_TK, experts_TK


def _select_topk(scores_TE: Tensor, cfg: MoEConfig) -> tuple[Tensor, Tensor]:
    """``(values_TK, experts_TK)`` of the top-k scores, group-limited when configured."""
    if cfg.router_group_topk:
        per_group_score = cfg.router_group_score_topk or cfg.router_topk // cfg.router_group_topk
        return _group_limited_topk(
            scores_TE, cfg.router_topk, cfg.router_num_groups, cfg.router_group_topk, per_group_score
        )
    values_TK, experts_TK = torch.topk(scores_TE, k=cfg.router_topk, dim=1)
    return values_TK, experts_TK


def _group_limited_topk(
    scores_TE: Tensor, k: int, num_groups: int, group_topk: int, per_group_score: int
) -> tuple[Tensor, Tensor]:
    """Top-k restricted to the ``group_topk`` best expert groups (DeepSeek-V2/V3 device/node limit).

    A group's score is the sum of its best ``per_group_score`` expert scores (Megatron:
    ``k // group_topk``; DeepSeek-V3: 2, see ``MoEConfig.router_group_score_topk``).
    """
    num_tokens, num_experts = scores_TE.shape
    per_group = num_experts // num_groups
    group_scores_TG = scores_TE.view(num_tokens, num_groups, per_group).topk(per_group_score, dim=-1)[0].sum(dim=-1)
    groups_TG = torch.topk(group_scores_TG, k=group_topk, dim=-1, sorted=False)[1]
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, groups_TG, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
    masked_TE = scores_TE.masked_fill(~expert_mask_TE, float("-inf"))
    values_TK, experts_TK = torch.topk(masked_TE, k=k, dim=-1)
    return values_TK, experts_TK


def capacity_keep_mask(
    probs_TK: Tensor, experts_TK: Tensor, num_experts: int, capacity: int, drop_policy: str
) -> Tensor:
    """Bool ``[T, K]``: which assignments fit in their expert's ``capacity``.

    "probs" keeps each expert's ``capacity`` highest-probability assignments, "position" its
    earliest ones (token order). Megatron takes a dense column-wise top-k over ``[T, E]``; here the
    ``T*K`` assignments are sorted by expert (stably, after an ordering by probability for
    "probs") and each one's rank inside its expert is compared to the capacity.
    """
    experts_N = experts_TK.reshape(-1)
    if drop_policy == "probs":
        order_N = torch.argsort(probs_TK.detach().reshape(-1), descending=True, stable=True)
    elif drop_policy == "position":
        order_N = torch.arange(experts_N.numel(), device=experts_N.device)
    else:
        raise ValueError(f"token_drop_policy must be 'probs' or 'position', got {drop_policy!r}.")
    order_N = order_N[torch.argsort(experts_N[order_N], stable=True)]
    counts_E = tokens_per_expert(experts_TK, num_experts)
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    sorted_experts_N = experts_N[order_N]
    rank_N = torch.arange(experts_N.numel(), device=experts_N.device) - starts_E[sorted_experts_N]
    keep_N = torch.empty_like(experts_N, dtype=torch.bool).scatter_(0, order_N, rank_N < capacity)
    return keep_N.view_as(experts_TK)


@dataclass(frozen=True)
class UnevenShares:
    """Where a rank's tokens come from when the ranks hold uneven shares of the micro-batches
    (dynamic context parallelism; every DP replica's micro-batch is ``[B, S]``).

    Attributes:
        replica_T: int64 ``[T]``, the DP replica of each local token.
        row_T: int64 ``[T]``, the row of each local token among all replicas' rows
            (``replica * B + row``).
        num_replicas: DP. rows_per_replica: B. row_tokens: S.
        group: the ranks sharing all replicas' tokens (DP x CP); None: one rank.
    """

    replica_T: Tensor
    row_T: Tensor
    num_replicas: int
    rows_per_replica: int
    row_tokens: int
    group: dist.ProcessGroup | None

    @property
    def replica_tokens(self) -> int:
        """Tokens of one DP replica's micro-batch: what the static CP group shares."""
        return self.rows_per_replica * self.row_tokens

    def balancing_loss(self, name: str, scores_TE: Tensor, experts_TK: Tensor, topk: int, coeff: float) -> Tensor:
        """This rank's share of the static layout's ``aux_loss`` (one per replica) or ``seq_aux_loss``
        (one per row, averaged over a replica's rows): each local token's scores weighted by the
        expert counts of its replica (row), the counts summed over ``group`` (one all-reduce of
        ``[units, E]``). The shares summed over the ranks give the static losses summed over the
        replicas, and so the same gradients once averaged over DP x CP."""
        num_experts = scores_TE.shape[1]
        if name == "aux_loss":
            unit_T, units, unit_tokens, per_replica = self.replica_T, self.num_replicas, self.replica_tokens, 1
        else:
            unit_T, units = self.row_T, self.num_replicas * self.rows_per_replica
            unit_tokens, per_replica = self.row_tokens, self.rows_per_replica
        unit_T = unit_T.to(experts_TK.device)
        offsets_TK = unit_T.unsqueeze(1) * num_experts
        counts_UE = all_reduce_counts(tokens_per_expert(experts_TK + offsets_TK, units * num_experts), self.group)
        counts_TE = counts_UE.view(units, num_experts)[unit_T]
        scale = num_experts * coeff / (topk * unit_tokens * unit_tokens * per_replica)
        return torch.sum(scores_TE * counts_TE) * scale


class TopKRouter(nn.Module):
    """Linear gate plus :func:`route`, with Megatron's auxiliary losses and aux-loss-free balancing.

    Attributes:
        cfg: the (frozen) `MoEConfig`; inside a `MoELayer` the layer's own ``config`` object,
            which ``MoELayer.set_config`` replaces here together with the layer's and the
            dispatcher's (never assign it directly there).
        weight: fp32 ``[E, D]`` gate (Megatron's ``router.weight``).
        expert_bias: fp32 ``[E]`` selection bias (persistent), only with
            ``cfg.router_enable_expert_bias``; else None.
        local_tokens_per_expert: fp32 ``[E]`` kept assignments accumulated over the micro-batches
            of the current step, for :meth:`update_expert_bias` (persistent; bias only). Under
            ``pad_expert_input_to_capacity`` every expert counts ``min(capacity, T)``, as Megatron.
        global_tokens_per_expert / global_aux_num_microbatches: fp32 ``[E]`` and 0-dim
            accumulators for the global aux loss (persistent; only when that loss is active).
        aux_loss_scale: gradient the aux and z losses receive per unit of loss weight; the
            training strategy sets it to its main-loss scale (e.g. ``1 / grad_accumulation``).
        latest_losses: detached fp32 loss values of the last forward without their coefficients
            (keys among "aux_loss", "seq_aux_loss", "global_aux_loss", "z_loss"), the values
            Megatron logs. When counts are reduced over a group, each rank's load-balancing value
            is its share (the shares sum to the batch's loss); "z_loss" is the mean over the
            local tokens. Empty after a forward in eval mode or under ``no_grad``.
        replayed_routing: the recorded routing the next forward uses instead of choosing (set and
            cleared around each forward by `lightning_moe.nn.router_replay.RouterReplay`); None.
        sequence_parallel_group: ranks that hold slices of the same sequences (Megatron's TP x CP
            group); token counts of the aux and seq-aux losses are summed over it and the z-loss
            coefficient is divided by its size. None: nothing is reduced.
        global_aux_loss_group: ranks whose tokens form the global batch (TP x DP x CP); counts of
            the global aux loss are summed over it. None: nothing is reduced.
        uneven_shares: :class:`UnevenShares` when the ranks hold uneven shares of the micro-batches
            (set per micro-batch by `lightning_moe.callbacks.DynamicContextParallel`): the losses
            then count and normalise per DP replica (aux, global aux, z) or row (seq aux) from it,
            so that the ranks' shares add up to the static layout's losses. None (static layouts):
            local tokens x group size.

    All router state stays fp32 under ``module.to(torch.bfloat16)`` / ``.half()``: routing choices
    and bias updates are made from it, and low precision would flip them.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        num_experts = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, cfg.hidden_size, dtype=torch.float32))
        with_bias = cfg.router_enable_expert_bias
        with_global = "global_aux_loss" in cfg.active_aux_losses
        self.register_buffer("expert_bias", _zeros_or_none(with_bias, num_experts))
        self.register_buffer("local_tokens_per_expert", _zeros_or_none(with_bias, num_experts))
        self.register_buffer("global_tokens_per_expert", _zeros_or_none(with_global, num_experts))
        self.register_buffer("global_aux_num_microbatches", _zeros_or_none(with_global))
        self.aux_loss_scale: float = 1.0
        self.latest_losses: dict[str, Tensor] = {}
        self.sequence_parallel_group: dist.ProcessGroup | None = None
        self.global_aux_loss_group: dist.ProcessGroup | None = None
        self.uneven_shares: UnevenShares | None = None
        self.replayed_routing: ReplayedRouting | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, ``cfg.init_method_std``) gate weight; zero bias and counters.

        Also the way to initialise a router created on the meta device, after ``to_empty``.
        """
        with torch.no_grad():
            self.weight.normal_(mean=0.0, std=self.cfg.init_method_std)
        for buf in self._state_buffers():
            buf.zero_()

    def forward(self, x: Tensor) -> RoutingResult:
        """Route ``x``: ``[T, D]`` (one sequence) or ``[B, S, D]`` (B sequences, batch-first).

        Tokens are flattened batch-major (``t = b * S + s``). Logits are computed in fp32 whatever
        the input dtype. In training mode the input is jittered; in training mode with gradients
        enabled the active aux losses and the z-loss are attached to the routing graph (they
        reach ``weight.grad`` in backward with no change to the user's loss), and with gradients
        enabled the expert-bias counters accumulate.
        """
        x_TD, num_seqs = _flatten_tokens(x, self.cfg.hidden_size)
        track_losses = self.training and torch.is_grad_enabled()
        if self.training and self.cfg.input_jitter_eps:
            eps = self.cfg.input_jitter_eps
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
        # fp32 logits even inside a bf16 autocast region (with router_logits_gemm="bf16x3", bf16 CUDA
        # tokens take exact bf16 splits of the weight on the tensor cores: `router_logits`).
        logits_TE = router_logits(x_TD, self.weight.to(torch.float32), split=self.cfg.router_logits_gemm == "bf16x3")
        losses: dict[str, Tensor] = {}
        if track_losses and self.cfg.z_loss_coeff:
            logits_TE = self._attach_z_loss(logits_TE, losses)
        result = route(logits_TE, self.cfg, self.expert_bias, self.replayed_routing)
        if track_losses and self.cfg.active_aux_losses:
            result.probs_TK = self._attach_aux_losses(result.probs_TK, logits_TE, num_seqs, losses)
        if self.expert_bias is not None and torch.is_grad_enabled() and not recomputing():
            # Megatron counts whenever gradients are on (evaluation runs under no_grad); a
            # recomputation in backward routes the same tokens again and does not count them twice.
            with torch.no_grad():
                self.local_tokens_per_expert += self._counts_for_bias(result)
        self.latest_losses = losses
        return result

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert_E: Tensor | None = None) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean(count) - count)``.

        Args:
            tokens_per_expert_E: ``[E]`` counts already summed over the ranks that routed distinct
                tokens (the strategy reduces them); None uses this rank's accumulated counts.
        The local counts are reset afterwards, as Megatron does once per optimizer step.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs MoEConfig(router_enable_expert_bias=True).")
        counts_E = self.local_tokens_per_expert if tokens_per_expert_E is None else tokens_per_expert_E
        counts_E = counts_E.to(torch.float32)
        mean_count = counts_E.sum(dim=-1, keepdim=True) / counts_E.shape[-1]
        self.expert_bias.add_(torch.sign(mean_count - counts_E) * self.cfg.router_bias_update_rate)
        self.local_tokens_per_expert.zero_()

    def communicates(self) -> bool:
        """Whether a training forward issues collectives: a load-balancing loss whose token
        counts are summed over a group of more than one rank."""
        for name in self.cfg.active_aux_losses:
            group = self.global_aux_loss_group if name == "global_aux_loss" else self.sequence_parallel_group
            if group_size(group) > 1:
                return True
        return False

    def reset_step_state(self) -> None:
        """Zero the per-step accumulators (bias counts, global aux-loss counts and micro-batches)."""
        for buf in (self.local_tokens_per_expert, self.global_tokens_per_expert, self.global_aux_num_microbatches):
            if buf is not None:
                buf.zero_()

    def _attach_z_loss(self, logits_TE: Tensor, losses: dict[str, Tensor]) -> Tensor:
        """Tie the z-loss to the logits; its coefficient is shared over the sequence-splitting ranks."""
        coeff = self.cfg.z_loss_coeff / group_size(self.sequence_parallel_group)
        if self.uneven_shares is None:
            loss = z_loss(logits_TE, coeff)
        else:  # the local sum over one replica's tokens (mean x T / N_replica x group size)
            share = logits_TE.shape[0] * group_size(self.sequence_parallel_group) / self.uneven_shares.replica_tokens
            loss = z_loss(logits_TE, coeff * share)
        losses["z_loss"] = (loss / coeff).detach()
        return AuxLossAutoScaler.apply(logits_TE, loss, self.aux_loss_scale)

    def _attach_aux_losses(
        self, probs_TK: Tensor, logits_TE: Tensor, num_seqs: int, losses: dict[str, Tensor]
    ) -> Tensor:
        """Tie every active load-balancing loss to the combine weights, as Megatron does."""
        experts_TK, scores_TE = compute_routing_scores_for_aux_loss(
            logits_TE, self.cfg.router_topk, self.cfg.router_score_function
        )
        for name, coeff in self.cfg.active_aux_losses.items():
            loss = self._load_balancing_loss(name, coeff, scores_TE, experts_TK, num_seqs)
            losses[name] = (loss / coeff).detach()
            probs_TK = AuxLossAutoScaler.apply(probs_TK, loss, self.aux_loss_scale)
        return probs_TK

    def _load_balancing_loss(
        self, name: str, coeff: float, scores_TE: Tensor, experts_TK: Tensor, num_seqs: int
    ) -> Tensor:
        """One load-balancing loss from the aux scores ``[T, E]`` and their top-k ``[T, K]``."""
        num_tokens, num_experts = scores_TE.shape
        k = self.cfg.router_topk
        shares = self.uneven_shares
        if shares is not None and name != "global_aux_loss":
            return shares.balancing_loss(name, scores_TE, experts_TK, k, coeff)
        if name == "aux_loss":
            group = self.sequence_parallel_group
            counts_E = all_reduce_counts(tokens_per_expert(experts_TK, num_experts), group)
            total_tokens = num_tokens * group_size(group)
            return switch_load_balancing_loss(scores_TE, counts_E, total_tokens, k, num_experts, coeff)
        if name == "seq_aux_loss":
            group = self.sequence_parallel_group
            seq_len = num_tokens // num_seqs
            experts_BSK = experts_TK.view(num_seqs, seq_len, k)
            counts_BE = all_reduce_counts(tokens_per_sequence_expert(experts_BSK, num_experts), group)
            scores_BSE = scores_TE.view(num_seqs, seq_len, num_experts)
            return sequence_load_balancing_loss(scores_BSE, counts_BE, seq_len * group_size(group), k, coeff)
        group = self.global_aux_loss_group
        counts_E = all_reduce_counts(tokens_per_expert(experts_TK, num_experts), group)
        if not recomputing():  # the recomputation sees the counts its forward saw (already added)
            with torch.no_grad():
                self.global_tokens_per_expert += counts_E
                self.global_aux_num_microbatches += 1
        return global_load_balancing_loss(
            scores_TE,
            self.global_tokens_per_expert,
            self.global_aux_num_microbatches,
            num_tokens * group_size(group) if shares is None else shares.replica_tokens * shares.num_replicas,
            k,
            num_experts,
            coeff,
        )

    def _counts_for_bias(self, result: RoutingResult) -> Tensor:
        """Counts the bias update sees: Megatron sums its final routing map.

        Under ``pad_expert_input_to_capacity`` that map is padded, so every expert counts
        ``min(capacity, T)`` and the bias does not move; this reproduces it.
        """
        if self.cfg.pad_expert_input_to_capacity and result.capacity is not None:
            padded = min(result.capacity, result.experts_TK.shape[0])
            return torch.full_like(self.local_tokens_per_expert, padded)
        return result.tokens_per_expert_E

    def _state_buffers(self) -> list[Tensor]:
        return [b for b in self._buffers.values() if b is not None]

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """Move/cast like any module, then put low-precision router state back to fp32."""
        super()._apply(fn, recurse)
        for param in self._parameters.values():
            if param is not None and param.dtype in _LOW_PRECISION_FLOATS:
                param.data = param.data.float()
        for name, buf in self._buffers.items():
            if buf is not None and buf.dtype in _LOW_PRECISION_FLOATS:
                self._buffers[name] = buf.float()
        return self


def _zeros_or_none(enabled: bool, *shape: int) -> Tensor | None:
    return torch.zeros(shape, dtype=torch.float32) if enabled else None


def _flatten_tokens(x: Tensor, hidden_size: int) -> tuple[Tensor, int]:
    """``x`` as ``[T, D]`` plus its number of sequences (1 for a 2-D input)."""
    if x.dim() not in (2, 3) or x.shape[-1] != hidden_size:
        raise ValueError(f"router input must be [T, {hidden_size}] or [B, S, {hidden_size}], got {tuple(x.shape)}.")
    num_seqs = x.shape[0] if x.dim() == 3 else 1
    return x.reshape(-1, hidden_size), num_seqs
