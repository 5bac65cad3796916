"""`MoELayer`: router -> dispatcher -> grouped experts -> combine (+ shared experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import LocalDispatcher, TokenDispatcher
from lightning_moe.nn.experts import GroupedExperts, SharedExperts
from lightning_moe.nn.router import RoutingResult, TopKRouter


@dataclass
class RoutingStats:
    """Routing statistics of the last forward, kept on the device (reading them syncs).

    tokens_per_expert_E: int64 [E] kept (token, expert) assignments per expert on this rank.
    num_dropped: 0-dim int64, assignments dropped by the capacity limit.
    num_assignments: T*K of this rank.
    """

    tokens_per_expert_E: Tensor
    num_dropped: Tensor
    num_assignments: int


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward block, plain PyTorch.

    ``forward(x)`` takes ``x`` of shape [..., D] ([B, S, D] is treated as B sequences for the
    sequence-level aux loss) and returns the same shape. Load-balancing and z losses are
    attached to the routing probabilities and reach the router's gradient without any user
    code; their latest values are in ``layer.router.latest_losses``.

    Submodules: ``router`` (`TopKRouter`, fp32 ``weight`` [E, D]), ``experts``
    (`GroupedExperts`), ``shared_experts`` (optional). The dispatcher defaults to the local
    one; a parallel strategy installs an expert-parallel one with ``set_dispatcher``.
    """

    def __init__(self, cfg: MoEConfig, output_init_std: Optional[float] = None) -> None:
        super().__init__()
        self.config = cfg
        self.router = TopKRouter(cfg)
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            activation=cfg.activation,
            backend=cfg.expert_backend,
            init_std=cfg.init_method_std,
            output_init_std=output_init_std,
        )
        self.shared_experts: Optional[SharedExperts] = None
        if cfg.shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExperts(
                cfg.hidden_size,
                cfg.shared_expert_intermediate_size,
                activation=cfg.activation,
                gate=cfg.shared_expert_gate,
                init_std=cfg.init_method_std,
                output_init_std=output_init_std,
            )
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg)
        self.last_stats: Optional[RoutingStats] = None

    def set_dispatcher(self, dispatcher: TokenDispatcher) -> None:
        """Install a token dispatcher (the strategy does this for expert parallelism)."""
        self.dispatcher = dispatcher

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.config.hidden_size
        if x.shape[-1] != hidden:
            raise ValueError(f"MoELayer expects inputs [..., {hidden}], got {tuple(x.shape)}")
        x_TD = x.reshape(-1, hidden)
        # Dispatchers that can move the tokens before they are routed start here, so the
        # transfer overlaps the router (the all-gather dispatcher). Not when the router has
        # collectives of its own: the two would run NCCL kernels of different communicators
        # side by side, which NCCL does not promise to be free of deadlock.
        prefetch = getattr(self.dispatcher, "prefetch", None)
        prefetched = prefetch(x_TD) if prefetch is not None and not self.router.communicates() else None
        # Likewise the experts' own token-independent work (FP8 copies of their weights).
        prefetch_experts = getattr(self.experts, "prefetch", None)
        if prefetch_experts is not None:
            prefetch_experts()
        try:
            return self._route_and_combine(x, x_TD, prefetched)
        finally:
            release = getattr(self.experts, "release_prefetched", None)
            if release is not None:
                release()

    def _route_and_combine(self, x: Tensor, x_TD: Tensor, prefetched: Optional[Any]) -> Tensor:
        """The rest of `forward`: ``prefetched`` is the dispatcher's early token gather (or None)."""
        routing: RoutingResult = self.router(x if x.dim() == 3 else x_TD)
        run = getattr(self.dispatcher, "run", None)
        if run is not None:  # dispatchers that pipeline dispatch, experts and combine themselves
            y_TD = run(x_TD, routing, self.experts)
        else:
            extra = {} if prefetched is None else {"prefetched": prefetched}
            # A dispatcher whose buffer has rows after the last group (sized for the worst case)
            # may leave them unwritten when the experts never read them; its combine and its
            # permutation's backward never read them back either.
            reads_grouped = getattr(self.experts, "reads_only_grouped_rows", None)
            tail_unwritten = (getattr(self.dispatcher, "can_leave_tail_unwritten", False)
                              and reads_grouped is not None and reads_grouped(x_TD.dtype))
            tail = {"tail_unwritten": True} if tail_unwritten else {}  # only then: other experts lack it
            # Experts that read the permutation inside their first quantized cast get the tokens
            # and the plan, so the permuted rows are never written in the tokens' dtype.
            takes_deferred = getattr(self.experts, "takes_deferred_permutation", None)
            if (getattr(self.dispatcher, "can_defer_permute", False) and takes_deferred is not None
                    and not tail_unwritten and takes_deferred(x_TD)):
                extra["defer_permute"] = True
            expert_input_RD, group_sizes_E, state = self.dispatcher.dispatch(x_TD, routing, **extra, **tail)
            # Experts that end in the combine themselves (their FP8 path weights the SwiGLU's rows
            # and gathers the tokens' gradient inside its cast) get it deferred.
            deferred_combine = getattr(self.dispatcher, "deferred_combine", None)
            takes_combine = getattr(self.experts, "takes_deferred_combine", None)
            if (deferred_combine is not None and takes_combine is not None and not tail_unwritten
                    and takes_combine(x_TD)):
                y_TD = self.experts(expert_input_RD, group_sizes_E, combine=deferred_combine(state))
            else:
                y_TD = self.dispatcher.combine(self.experts(expert_input_RD, group_sizes_E, **tail), state)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        self.last_stats = RoutingStats(
            tokens_per_expert_E=routing.tokens_per_expert_E.detach(),
            num_dropped=routing.num_dropped.detach(),
            num_assignments=routing.experts_TK.numel(),
        )
        return y_TD.view(x.shape)
