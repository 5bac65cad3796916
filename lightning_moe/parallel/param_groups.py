"""Optimizer steps that torch's ``foreach`` kernels can run when a param group mixes DTensors
and plain tensors.

Under :class:`~lightning_moe.strategies.MegatronMoEStrategy` some parameters are DTensors
(FSDP-sharded dense layers, expert-parallel experts, tensor-parallel layers) and some stay plain
tensors (the routers and shared experts, which the strategy reduces itself, or a layer FSDP
skips). Which ones depends on the layout, so param groups are built by role (decay / no decay)
and mix the two kinds. torch's ``foreach`` kernels (the default optimizer implementation on
CUDA) refuse a list holding both.

`GroupsByTensorKind` makes one optimizer step run each mixed group as two groups, one per kind,
with the same hyperparameters; its ``param_groups``, ``state_dict()``, LR schedulers and
checkpoints keep the groups as built, so a checkpoint still resumes in another layout.
:func:`split_by_tensor_kind` splits groups for good, for code that builds its own optimizer
step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer


def is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def mixes_tensor_kinds(group: dict[str, Any]) -> bool:
    """Whether a param group holds both DTensor and plain parameters."""
    return len({is_dtensor(p) for p in group["params"]}) > 1


def split_by_tensor_kind(param_groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split into its plain and its DTensor parameters (same hyperparameters, new dicts).

    A group of one kind comes back as a copy; an empty part is dropped (never an empty group).
    """
    out: list[dict[str, Any]] = []
    for group in param_groups:
        params = list(group["params"])
        plain = [p for p in params if not is_dtensor(p)]
        sharded = [p for p in params if is_dtensor(p)]
        out.extend({**group, "params": part} for part in (plain, sharded) if part)
        if not params:
            out.append({**group, "params": []})
    return out


class GroupsByTensorKind:
    """Steps an optimizer with each param group that mixes DTensors and plain tensors run as two
    groups, one per kind (same hyperparameters), so that ``foreach`` kernels can run them, without
    touching the optimizer's class or instance.

    Used around one ``optimizer.step(closure)``: `split` (called at the end of the closure, which
    runs first against the optimizer's own groups: Lightning's hooks and gradient clipping run
    inside it and may change a group's hyperparameters) swaps in the split groups, and leaving the
    ``with`` block restores the groups and copies back what the step changed in a split group's
    hyperparameters. Anything else, ``param_groups`` included, is as before: the same update as a
    step without foreach, only the kernels differ.

        with GroupsByTensorKind(optimizer) as groups:
            optimizer.step(lambda: (loss := closure(), groups.split())[0])
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._groups: Optional[list[dict[str, Any]]] = None
        self._parts: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def __enter__(self) -> GroupsByTensorKind:
        return self

    def split(self) -> None:
        """Swap in the split groups (once; nothing where no group mixes the kinds)."""
        groups = self.optimizer.param_groups
        if self._groups is not None or not any(mixes_tensor_kinds(group) for group in groups):
            return
        self._parts = [(part, group) for group in groups for part in split_by_tensor_kind([group])]
        self._groups = groups
        self.optimizer.param_groups = [part for part, _ in self._parts]

    def __exit__(self, *exc: Any) -> None:
        if self._groups is None:
            return
        self.optimizer.param_groups = self._groups
        for part, owner in self._parts:
            owner.update({key: value for key, value in part.items() if key != "params"})
        self._groups, self._parts = None, []


def step_by_tensor_kind(optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    """``optimizer.step(closure)`` with `GroupsByTensorKind`: the closure (if any) against the
    optimizer's own groups, the step on the split ones."""
    with GroupsByTensorKind(optimizer) as groups:
        def split_after(inner: Optional[Callable[[], Any]] = closure) -> Any:
            result = inner() if inner is not None else None
            groups.split()
            return result

        return optimizer.step(split_after)



def init_state_by_tensor_kind(optimizer: Optimizer) -> None:
    """Create an optimizer's state as ``torch.distributed.checkpoint`` does before loading into it
    (one step on zero gradients at learning rate 0, gradients cleared after), with the step run
    kind by kind (`step_by_tensor_kind`). Nothing where the state exists or a gradient is set."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups if "lr" in group]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    step_by_tensor_kind(optimizer)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = lrs.pop(0)
    optimizer.zero_grad(set_to_none=True)
