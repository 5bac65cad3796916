"""Optimizer steps that torch's ``foreach`` kernels can run when a param group mixes DTensors
and plain tensors.

Under :class:`~lightning_moe.strategies.MegatronMoEStrategy` some parameters are DTensors
(FSDP-sharded dense layers, expert-parallel experts, tensor-parallel layers) and some stay plain
tensors (the routers and shared experts, which the strategy reduces itself, or a layer FSDP
skips). Which ones depends on the layout, so param groups are built by role (decay / no decay)
and mix the two kinds. torch's ``foreach`` kernels (the default optimizer implementation on
CUDA) refuse a list holding both.

:func:`step_by_tensor_kind` makes an optimizer step each mixed group as two groups, one per
kind, with the same hyperparameters; its ``param_groups``, ``state_dict()``, LR schedulers and
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


def step_by_tensor_kind(optimizer: Optimizer) -> None:
    """Make ``optimizer.step`` run each param group that mixes DTensors and plain tensors as two
    groups, one per kind (same hyperparameters), so that ``foreach`` kernels can run them.

    The closure, if any, runs first against the optimizer's own groups (Lightning's hooks and
    gradient clipping run inside it and may change a group's hyperparameters); then the step runs
    on the split groups, and what it changed in a split group's hyperparameters is copied back.
    Anything else, ``param_groups`` included, is unchanged. Installing it twice does nothing more.
    The step is the same update as a step without foreach: only the kernels differ.
    """
    if getattr(optimizer, "_steps_by_tensor_kind", False):
        return
    inner: Callable[..., Any] = optimizer.step

    def step(closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = optimizer.param_groups
        if not any(mixes_tensor_kinds(group) for group in groups):
            inner()
            return loss
        parts, owners = [], []
        for group in groups:
            for part in split_by_tensor_kind([group]):
                parts.append(part)
                owners.append(group)
        optimizer.param_groups = parts
        try:
            inner()
        finally:
            optimizer.param_groups = groups
            for part, owner in zip(parts, owners):
                owner.update({key: value for key, value in part.items() if key != "params"})
        return loss

    optimizer.step = step  # type: ignore[method-assign]
    optimizer._steps_by_tensor_kind = True  # type: ignore[attr-defined]


__all__ = ["is_dtensor", "mixes_tensor_kinds", "split_by_tensor_kind", "step_by_tensor_kind"]
