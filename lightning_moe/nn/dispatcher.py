"""Token dispatchers: move routed tokens to their experts and the results back.

Every dispatcher derives from `TokenDispatcher`, which declares everything ``MoELayer`` may
call: the two required methods, with explicit state passed from ``dispatch`` to ``combine`` (no
hidden member state, so a layer can have several micro-batches in flight):

    expert_input_RD, group_sizes_E, state = dispatcher.dispatch(x_TD, routing)
    expert_output_RD = experts(expert_input_RD, group_sizes_E)
    y_TD = dispatcher.combine(expert_output_RD, state)

and the optional capabilities, each a class flag (False in the base) with the member it
enables: ``prefetches`` (``prefetch``), ``can_leave_tail_unwritten`` / ``can_defer_permute``
(``dispatch``'s ``tail_unwritten`` / ``defer_permute`` options), ``can_defer_combine``
(``deferred_combine``), ``runs_experts`` (``run``), and ``syncs_host``. The layer reads the flags
and calls the members directly (no probing), so a dispatcher declares a capability by setting
its flag and implementing its member. ``group_sizes_E`` (int64, device) are the row counts of
this rank's local experts in ``expert_input_RD``. The local dispatcher below serves one rank;
expert-parallel dispatchers (all-to-all, all-gather) live in ``lightning_moe.parallel`` and
are installed by the strategy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

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


class TokenDispatcher(ABC):
    """What ``MoELayer`` needs from a dispatcher: every member it calls, with its default.

    Required: `dispatch`, `combine`. Optional capabilities, each off unless a subclass sets its
    flag (and then implements the member the flag names); the layer asks only what the flags
    announce, so a dispatcher that declares nothing is driven by `dispatch` and `combine` alone:

    - ``prefetches``: `prefetch` starts moving the tokens before the router runs; the layer
      passes its result to ``dispatch(..., prefetched=...)``.
    - ``can_leave_tail_unwritten``: ``dispatch`` takes ``tail_unwritten=True`` (its buffer has
      rows after the last group, sized for the worst case, which it may leave unwritten when the
      experts never read them: ``experts.reads_only_grouped_rows``).
    - ``can_defer_permute``: ``dispatch`` takes ``defer_permute=True`` and then returns a
      `DeferredPermutation` (the tokens and the plan) instead of the permuted rows, for experts
      that read the permutation inside their first GEMM's input cast
      (``experts.takes_deferred_permutation``).
    - ``can_defer_combine``: `deferred_combine` returns the combine as a `DeferredCombine` (the
      plan and the probabilities), for experts that end in the combine themselves
      (``experts.takes_deferred_combine``; then ``y_TD = experts(..., combine=deferred)``).
    - ``runs_experts``: `run` pipelines dispatch, experts and combine itself; the layer then calls
      it instead of `dispatch` / `combine`.
    - ``syncs_host``: `dispatch` reads device values on the host, so it cannot run under CUDA-graph
      capture (a property where it depends on the configuration).

    The keyword options of `dispatch` (``prefetched``, ``tail_unwritten``, ``defer_permute``)
    are passed only to a dispatcher whose flag announces them.
    """

    prefetches: bool = False
    can_leave_tail_unwritten: bool = False
    can_defer_permute: bool = False
    can_defer_combine: bool = False
    runs_experts: bool = False
    syncs_host: bool = False

    # Every capability flag, with the member a subclass setting it must implement (None: an
    # option of `dispatch`, or a fact about it).
    CAPABILITIES: ClassVar[dict[str, str | None]] = {
        "prefetches": "prefetch",
        "can_leave_tail_unwritten": None,
        "can_defer_permute": None,
        "can_defer_combine": "deferred_combine",
        "runs_experts": "run",
        "syncs_host": None,
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for flag, member in TokenDispatcher.CAPABILITIES.items():
            if member is not None and getattr(cls, flag) is True and getattr(cls, member) is getattr(TokenDispatcher, member):
                raise TypeError(f"{cls.__name__} sets {flag} = True but does not implement {member}")

    @abstractmethod
    def dispatch(self, x_TD: Tensor, routing: RoutingResult, **options: Any) -> tuple[Tensor | DeferredPermutation,
                                                                                       Tensor, Any]:
        """(expert input: permuted rows, or a `DeferredPermutation` when asked with
        ``defer_permute=True``; the local experts' group sizes; the state `combine` takes).
        ``options``: only those the capability flags announce (see the class docstring)."""

    @abstractmethod
    def combine(self, expert_output_RD: Tensor, state: Any) -> Tensor:
        """The tokens' outputs ``[T, D]`` from the experts' output rows and `dispatch`'s state."""

    def describe(self) -> str:
        """One line for logs and run summaries."""
        return type(self).__name__

    def prefetch(self, x_TD: Tensor) -> Any | None:
        """(``prefetches``) Start moving ``x_TD`` before it is routed; the result goes to
        ``dispatch(..., prefetched=...)``. Default: nothing started (None)."""
        return None

    def deferred_combine(self, state: Any) -> DeferredCombine:
        """(``can_defer_combine``) `combine` not yet carried out, for experts that end in it."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its combine (can_defer_combine=False)")

    def run(self, x_TD: Tensor, routing: RoutingResult, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """(``runs_experts``) dispatch -> ``experts(expert_input_RD, group_sizes_E)`` -> combine,
        in one call (pipelined as the dispatcher likes)."""
        raise NotImplementedError(f"{type(self).__name__} does not run the experts itself (runs_experts=False)")


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


class LocalDispatcher(TokenDispatcher):
    """Single-rank dispatch: sort assignments by expert (sync-free), run, and combine."""

    can_defer_permute = True  # `MoELayer` may pass ``defer_permute=True`` to `dispatch`
    can_defer_combine = True

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
