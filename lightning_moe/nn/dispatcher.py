"""Token dispatchers: move routed tokens to their experts and the results back.

A dispatcher is a small protocol with explicit state passed from ``dispatch`` to ``combine``
(no hidden member state, so a layer can have several micro-batches in flight):

    expert_input_RD, group_sizes_E, state = dispatcher.dispatch(x_TD, routing)
    expert_output_RD = experts(expert_input_RD, group_sizes_E)
    y_TD = dispatcher.combine(expert_output_RD, state)

``group_sizes_E`` (int64, device) are the row counts of this rank's local experts in
``expert_input_RD``. A dispatcher may also offer ``prefetch(x_TD)``, which starts moving the
tokens before the router runs; the layer then passes its result to
``dispatch(x_TD, routing, prefetched=...)``. A dispatcher with ``can_defer_permute = True``
takes ``dispatch(..., defer_permute=True)`` and then returns a `DeferredPermutation` (the tokens and
the plan) instead of the permuted rows, for experts that read the permutation inside their
first GEMM's input cast (``experts.takes_deferred_permutation``). A dispatcher with
``deferred_combine(state)`` returns its combine as a `DeferredCombine` (the plan and the
probabilities), for experts that end in the combine themselves
(``experts.takes_deferred_combine``; then ``y_TD = experts(..., combine=deferred)``). The local
dispatcher below serves one rank;
expert-parallel dispatchers (all-to-all, all-gather) live in ``lightning_moe.parallel`` and
are installed by the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.permutation import (
    DeferredCombine,
    DeferredPermutation,
    PermutationPlan,
    permute,
    plan_permutation,
    row_probs,
    unpermute,
)
from lightning_moe.nn.router import RoutingResult


class TokenDispatcher(Protocol):
    """What ``MoELayer`` needs from a dispatcher."""

    def dispatch(self, x_TD: Tensor, routing: RoutingResult) -> tuple[Tensor | DeferredPermutation, Tensor, Any]:
        """(expert input: permuted rows, or a `DeferredPermutation` when asked with
        ``defer_permute=True`` by a dispatcher with ``can_defer_permute``; group sizes; state)."""
        ...

    def combine(self, expert_output_RD: Tensor, state: Any) -> Tensor: ...

    def describe(self) -> str: ...


@dataclass
class LocalDispatchState:
    plan: PermutationPlan
    combine_probs_TK: Tensor


def plan_for(routing: RoutingResult, cfg: MoEConfig) -> PermutationPlan:
    """The permutation of ``routing`` under ``cfg``'s alignment and capacity padding."""
    return plan_permutation(
        routing.experts_TK,
        routing.num_experts,
        keep_TK=routing.keep_TK,
        alignment=cfg.expert_alignment,
        capacity=routing.capacity,
        pad_to_capacity=cfg.pad_expert_input_to_capacity,
    )


def input_side_probs(x_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan) -> Tensor:
    """``apply_probs_on_input``: scale each permuted row by its routing probability."""
    return x_RD * row_probs(probs_TK, plan).to(x_RD.dtype).unsqueeze(1)


def expert_input(x_TD: Tensor, probs_TK: Tensor, plan: PermutationPlan, cfg: MoEConfig,
                 defer: bool = False) -> tuple[Tensor | DeferredPermutation, Tensor]:
    """The experts' input and the probabilities the combine applies: the permuted rows ``[R, D]``
    with ``probs``; under ``apply_probs_on_input`` the rows scaled by their probabilities and ones
    for the combine (dropped rows read the zero row). ``defer`` (ignored under
    ``apply_probs_on_input``, which scales the rows here): the tokens and the plan as a
    `DeferredPermutation` instead of the permuted rows."""
    if defer and not cfg.apply_probs_on_input:
        return DeferredPermutation(x_TD, plan), probs_TK
    x_RD = permute(x_TD, plan)
    if cfg.apply_probs_on_input:
        return input_side_probs(x_RD, probs_TK, plan), torch.ones_like(probs_TK)
    return x_RD, probs_TK


class LocalDispatcher:
    """Single-rank dispatch: sort assignments by expert (sync-free), run, and combine."""

    # `MoELayer` may pass ``defer_permute=True`` to `dispatch`.
    can_defer_permute = True

    def __init__(self, cfg: MoEConfig) -> None:
        self.cfg = cfg

    def dispatch(self, x_TD: Tensor, routing: RoutingResult,
                 defer_permute: bool = False) -> tuple[Tensor | DeferredPermutation, Tensor, LocalDispatchState]:
        """``defer_permute``: return the tokens and the plan as a `DeferredPermutation` instead of
        the permuted rows (not under ``apply_probs_on_input``, which scales the rows here)."""
        plan = plan_for(routing, self.cfg)
        x_RD, combine_probs_TK = expert_input(x_TD, routing.probs_TK, plan, self.cfg, defer_permute)
        return x_RD, plan.group_sizes_E, LocalDispatchState(plan, combine_probs_TK)

    def combine(self, expert_output_RD: Tensor, state: LocalDispatchState) -> Tensor:
        return unpermute(expert_output_RD, state.combine_probs_TK, state.plan)

    def deferred_combine(self, state: LocalDispatchState) -> DeferredCombine:
        """`combine` as a `DeferredCombine`, for experts that carry it out themselves."""
        return DeferredCombine(state.plan, state.combine_probs_TK)

    def describe(self) -> str:
        return "local (sort-based permutation)"
