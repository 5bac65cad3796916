"""`MoELayer`: router -> dispatcher -> grouped experts -> combine (+ shared experts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import LocalDispatcher, TokenDispatcher
from lightning_moe.nn.experts import GroupedExperts, SharedExperts
from lightning_moe.nn.router import RoutingResult, TopKRouter
from lightning_moe.nn.saved_tensors import checkpoint


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


# MoEConfig fields a layer's parameters, buffers and submodules are built from (`set_config`
# cannot change them).
_BUILT_FROM = (
    "hidden_size", "ffn_hidden_size", "num_experts", "activation", "expert_backend", "init_method_std",
    "shared_expert_intermediate_size", "shared_expert_gate", "router_enable_expert_bias",
)


def _has_global_aux_loss(cfg: MoEConfig) -> bool:
    """Whether the router holds the global aux loss's buffers for ``cfg``."""
    return "global_aux_loss" in cfg.active_aux_losses


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward block, plain PyTorch.

    ``forward(x)`` takes ``x`` of shape [..., D] ([B, S, D] is treated as B sequences for the
    sequence-level aux loss) and returns the same shape. Load-balancing and z losses are
    attached to the routing probabilities and reach the router's gradient without any user
    code; their latest values are in ``layer.router.latest_losses``.

    Submodules: ``router`` (`TopKRouter`, fp32 ``weight`` [E, D]), ``experts``
    (`GroupedExperts`), ``shared_experts`` (optional). The dispatcher defaults to the local
    one; a parallel strategy installs an expert-parallel one with ``set_dispatcher``.

    Configuration: ``layer.config`` is the one (frozen) `MoEConfig` of the layer, and its router
    (``router.cfg``) and dispatcher (``dispatcher.cfg``) hold that same object. A derived setting
    replaces it as a whole: `set_config` (also what assigning ``layer.config`` does) hands the
    new config to the layer, the router and the dispatcher together, and `set_dispatcher` gives an
    installed dispatcher the layer's. The expert group alignment lives there only
    (``config.expert_alignment``, raised by the FP8 configuration through `set_expert_alignment`):
    the dispatcher pads each expert's group to it, and the experts get the group sizes from the
    dispatcher, so router, dispatcher and experts cannot disagree on it, whichever of
    expert-parallel setup and FP8 configuration runs first.

    ``recompute_shared_experts``: the shared experts keep only their input for backward and are
    recomputed there (Megatron's ``shared_experts`` recompute).
    """

    def __init__(self, cfg: MoEConfig, output_init_std: Optional[float] = None) -> None:
        super().__init__()
        self._config = cfg
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
        self.recompute_shared_experts = False
        self.last_stats: Optional[RoutingStats] = None

    @property
    def config(self) -> MoEConfig:
        """The layer's configuration, the object its router and dispatcher hold too. Assigning it
        calls `set_config`."""
        return self._config

    @config.setter
    def config(self, cfg: MoEConfig) -> None:
        self.set_config(cfg)

    @property
    def expert_alignment(self) -> int:
        """The multiple each expert's token group is padded to (``config.expert_alignment``)."""
        return self._config.expert_alignment

    def set_config(self, cfg: MoEConfig) -> None:
        """Replace the layer's configuration by ``cfg`` (e.g. ``dataclasses.replace(layer.config,
        ...)``) in the layer, its router and its dispatcher at once. The fields the parameters,
        buffers and submodules were built from must stay as they are (`ValueError` otherwise):
        build a new layer to change them."""
        if not isinstance(cfg, MoEConfig):
            raise TypeError(f"MoELayer.set_config takes a MoEConfig, got {type(cfg).__name__}.")
        changed = [name for name in _BUILT_FROM if getattr(cfg, name) != getattr(self._config, name)]
        if _has_global_aux_loss(cfg) != _has_global_aux_loss(self._config):
            changed.append("global_aux_loss in router_load_balancing_type / aux_loss_coeff")
        if changed:
            raise ValueError(
                f"MoELayer.set_config cannot change {', '.join(changed)}: the layer's parameters, buffers or "
                "submodules were built from them; build a new MoELayer instead."
            )
        self._config = cfg
        self.router.cfg = cfg
        if getattr(self.dispatcher, "cfg", None) is not None:
            self.dispatcher.cfg = cfg

    def set_expert_alignment(self, alignment: int) -> None:
        """Pad each expert's token group to a multiple of ``alignment`` from now on (a new config,
        `set_config`; ``MoEConfig`` checks the value). The FP8 configuration calls this with its
        recipe's need (``precision.modules.pad_expert_groups``)."""
        if alignment != self._config.expert_alignment:
            self.set_config(dataclasses.replace(self._config, expert_alignment=alignment))

    def set_dispatcher(self, dispatcher: TokenDispatcher) -> None:
        """Install a token dispatcher (the strategy does this for expert parallelism). One built
        from a config equal to the layer's is given the layer's object (so a later `set_config`
        reaches it); one built from a different config is refused."""
        cfg = getattr(dispatcher, "cfg", None)
        if cfg is not None and cfg is not self._config:
            if cfg != self._config:
                raise ValueError(
                    "MoELayer.set_dispatcher: the dispatcher was built from a config other than the layer's; "
                    "build it from layer.config (after layer.set_config for a changed setting)."
                )
            dispatcher.cfg = self._config
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
        dispatcher = self.dispatcher
        prefetched = dispatcher.prefetch(x_TD) if dispatcher.prefetches and not self.router.communicates() else None
        # Likewise the experts' own token-independent work (FP8 copies of their weights).
        self.experts.prefetch()
        try:
            return self._route_and_combine(x, x_TD, prefetched)
        finally:
            self.experts.release_prefetched()

    def _route_and_combine(self, x: Tensor, x_TD: Tensor, prefetched: Any | None) -> Tensor:
        """The rest of `forward`: ``prefetched`` is the dispatcher's early token gather (or None).
        The dispatcher's optional members are called as its `TokenDispatcher` capability flags
        announce; the experts' as `lightning_moe.nn.experts.RoutedExperts` declares them (a
        replacement experts module provides every member listed there)."""
        routing: RoutingResult = self.router(x if x.dim() == 3 else x_TD)
        dispatcher, experts = self.dispatcher, self.experts
        if dispatcher.runs_experts:  # dispatchers that pipeline dispatch, experts and combine themselves
            y_TD = dispatcher.run(x_TD, routing, experts)
        else:
            extra = {} if prefetched is None else {"prefetched": prefetched}
            # A dispatcher whose buffer has rows after the last group (sized for the worst case)
            # may leave them unwritten when the experts never read them; its combine and its
            # permutation's backward never read them back either.
            tail_unwritten = dispatcher.can_leave_tail_unwritten and experts.reads_only_grouped_rows(x_TD.dtype)
            tail = {"tail_unwritten": True} if tail_unwritten else {}  # only then: other experts lack it
            # Experts that read the permutation themselves (inside their first quantized cast, or
            # in fc1's node on the unquantized path) get the tokens and the plan: the permuted rows
            # are then never written in the tokens' dtype, or never kept for the backward.
            if dispatcher.can_defer_permute and experts.takes_deferred_permutation(x_TD):
                extra["defer_permute"] = True
            expert_input_RD, group_sizes_E, state = dispatcher.dispatch(x_TD, routing, **extra, **tail)
            # Experts that end in the combine themselves (their FP8 path weights the SwiGLU's rows
            # and gathers the tokens' gradient inside its cast) get it deferred.
            if dispatcher.can_defer_combine and not tail_unwritten and experts.takes_deferred_combine(x_TD):
                y_TD = experts(expert_input_RD, group_sizes_E, combine=dispatcher.deferred_combine(state))
            else:
                y_TD = dispatcher.combine(experts(expert_input_RD, group_sizes_E, **tail), state)
        if self.shared_experts is not None:
            if self.recompute_shared_experts and torch.is_grad_enabled():
                y_TD = y_TD + checkpoint(self.shared_experts, x_TD)
            else:
                y_TD = y_TD + self.shared_experts(x_TD)
        self.last_stats = RoutingStats(
            tokens_per_expert_E=routing.tokens_per_expert_E.detach(),
            num_dropped=routing.num_dropped.detach(),
            num_assignments=routing.experts_TK.numel(),
        )
        return y_TD.view(x.shape)
