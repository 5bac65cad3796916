"""Delayed scaling: per-module amax histories and their once-per-step update.

Each FP8 module owning delayed-scaling state has two non-persistent buffers (kept out of
checkpoints so that FP8 on/off does not change the state dict), allocated at its first call:

- ``fp8_amax_history [H, 3, G]``: row 0 accumulates this step's amax (max over micro-batches)
  of the GEMM inputs, weights and output gradients (slots 0, 1, 2) per token group G
  (G = 1 for a linear; 2E for grouped experts: fc1's E experts, then fc2's); rows 1.. hold
  the previous steps;
- ``fp8_scale [3, G]``: quantization scales used this step; 0 means "no history yet", in
  which case the operand is scaled from its current amax (first step, or after a resume).

A state without scales yet (its first optimizer step, also after a resume: the buffers are not
checkpointed) scales each operand from its current amax, max-reduced first over the module's
amax reduction group (``fp8_amax_group``, set by `FP8Precision`) during training: the ranks that
hold the same tensor then quantize it alike, so the first step does not depend on how tokens
are spread over data- or expert-parallel ranks.

`update_delayed_scaling` runs once per optimizer step: one MAX all-reduce of every module's
row 0 over the given process group, then TE's update: ``amax = max(history)`` (or the most
recent), ``scale = fmt_max / amax / 2**margin`` (old scale kept when amax is 0 or inf), and
the history rolls by one step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe.kernels import use_triton
from lightning_moe.nn.saved_tensors import recomputing
from lightning_moe.precision.quantize import FLT_MAX
from lightning_moe.precision.recipes import ROLES, FP8Recipe

SLOTS = {role: i for i, role in enumerate(ROLES)}


class DelayedState(NamedTuple):
    """Views of one module's delayed-scaling buffers handed to the GEMM functions.

    ``fresh``: the buffers have not been through `update_delayed_scaling` since they were
    allocated, so no scale exists yet. Only a speed hint (the values do not depend on it): the
    native casts then find every group's current amax by a pre-pass, where otherwise a group
    without a scale finds it inside the cast (cheap for the few such groups of later steps).
    """

    amax_history: torch.Tensor  # [H, 3, G]
    scale: torch.Tensor  # [3, G]
    fresh: bool = False
    group: Optional[dist.ProcessGroup] = None  # the module's amax reduction group (None: none)


_FRESH = "_fp8_delayed_fresh"  # module attribute: its buffers have had no update yet
AMAX_GROUP = "fp8_amax_group"  # module attribute: the ranks its amaxes are reduced over


def set_amax_group(module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Record the ranks ``module``'s amaxes are reduced over (a plain attribute, not state)."""
    module.__dict__[AMAX_GROUP] = group


def _group_of(module: nn.Module) -> Optional[dist.ProcessGroup]:
    return module.__dict__.get(AMAX_GROUP)


def register_delayed_buffers(module: nn.Module) -> None:
    """Declare ``module``'s (non-persistent) delayed-scaling buffers; `ensure_delayed_state`
    allocates them at the first call, on the weights' device and with the local number of
    groups (meta-device initialization, ``to_empty`` and expert sharding happen before that)."""
    module.register_buffer("fp8_amax_history", None, persistent=False)
    module.register_buffer("fp8_scale", None, persistent=False)


def ensure_delayed_state(module: nn.Module, recipe: FP8Recipe, groups: int, device: torch.device) -> DelayedState:
    """``module``'s delayed-scaling state for ``groups`` token groups, allocated (zeros: no
    history yet) when missing or sized for another group count."""
    if module.fp8_scale is None or module.fp8_scale.shape[1] != groups:
        module.fp8_amax_history = torch.zeros(recipe.amax_history_len, len(ROLES), groups, device=device)
        module.fp8_scale = torch.zeros(len(ROLES), groups, device=device)
        module.__dict__[_FRESH] = True
    return DelayedState(module.fp8_amax_history, module.fp8_scale, module.__dict__.get(_FRESH, False),
                        _group_of(module))


def delayed_state(module: nn.Module) -> Optional[DelayedState]:
    """``module``'s allocated delayed-scaling state, if any."""
    history = getattr(module, "fp8_amax_history", None)
    if history is None:
        return None
    return DelayedState(history, module.fp8_scale, module.__dict__.get(_FRESH, False), _group_of(module))


_AMAX_RECORDING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_moe_amax_recording", default=True)


@contextlib.contextmanager
def amax_recording_paused() -> Iterator[None]:
    """Evaluation forwards inside this context leave the amax histories alone (the scales
    follow training statistics only); `FP8Precision` wraps its val/test/predict steps in it."""
    token = _AMAX_RECORDING.set(False)
    try:
        yield
    finally:
        _AMAX_RECORDING.reset(token)


def recording_amax() -> bool:
    """Whether forwards and backwards now record amaxes (False inside `amax_recording_paused`)."""
    return _AMAX_RECORDING.get()


def amax_record_row(state: DelayedState, role: str) -> Optional[torch.Tensor]:
    """The ``[G]`` row that ``role``'s amax of this step is max-folded into (by a kernel, in
    place), or None while recording is paused or while the backward recomputes a checkpointed
    forward (`lightning_moe.nn.saved_tensors.recomputing`): that forward recorded its amaxes once
    already. Its casts still use this step's scales, as the original forward did."""
    return state.amax_history[0, SLOTS[role]] if recording_amax() and not recomputing() else None


def history_scales(state: DelayedState, role: str, history_fmt_max: float, fmt_max: float) -> torch.Tensor:
    """``role``'s per-group scales ``[G]`` for a cast to a format whose largest value is
    ``fmt_max``. The history's scales target the recipe's format for the role
    (``history_fmt_max``); a kernel that casts to another one (the grouped FP8 kernels take E4M3
    gradients even under the hybrid recipe) needs them rescaled, else it would saturate
    everything above ``amax * fmt_max / history_fmt_max``. E4M3 / E5M2 maxima differ by 2^7, so
    the rescaling is exact (except for scales the update clamped to FLT_MAX, amax < ~1.7e-34)."""
    scale = state.scale[SLOTS[role]]
    return scale if fmt_max == history_fmt_max else scale * (fmt_max / history_fmt_max)


def fresh_amax_reduction(state: Optional[DelayedState]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """`reduce_current_amax` over the state's `fresh_amax_group`, or None where there is none."""
    group = fresh_amax_group(state)
    return None if group is None else functools.partial(reduce_current_amax, group=group)


def fresh_amax_group(state: Optional[DelayedState]) -> Optional[dist.ProcessGroup]:
    """The group to max-reduce a fresh state's current amaxes over before casting (see the module
    doc), or None: the state has scales, no group of several ranks is set, or recording is
    paused (evaluation may run on some ranks only, and its scales change no state)."""
    if state is None or not state.fresh or state.group is None or not recording_amax():
        return None
    return state.group if dist.get_world_size(state.group) > 1 else None


@torch.no_grad()
def reduce_current_amax(amax: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``amax`` max-reduced over ``group`` (returned as is for None). Every rank of the group
    must call this for the same operands in the same order, empty ones included."""
    if group is None:
        return amax
    amax = amax.contiguous().clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@torch.no_grad()
def record_amax(state: DelayedState, role: str, amax_G: torch.Tensor) -> None:
    """Fold this micro-batch's per-group amax into the current step's row."""
    row = amax_record_row(state, role)
    if row is not None:
        torch.maximum(row, amax_G.to(row.dtype), out=row)


def _fmt_max(recipe: FP8Recipe, like: torch.Tensor) -> torch.Tensor:
    """``[3, 1]`` largest values of the roles' formats, on ``like``'s device. Built by fills, not
    from a host list: copying a pageable host tensor to the GPU synchronizes the stream, which
    would stall the host once per optimizer step until the GPU drained its queue."""
    return torch.stack([like.new_full((1,), recipe.format(role).max) for role in ROLES])


def _updated(history_H3G: torch.Tensor, scale_3G: torch.Tensor, recipe: FP8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(new scales ``[3, G]``, the history rolled by one step with a zero row 0): TE's update, in torch
    (the reference of `kernels.delayed_update_triton`, which CUDA tensors take)."""
    fmt_max = _fmt_max(recipe, history_H3G)
    amax = history_H3G.amax(0) if recipe.amax_compute_algo == "max" else history_H3G[0]
    new = (fmt_max / amax).clamp(max=FLT_MAX) / 2.0**recipe.margin
    usable = (amax > 0) & torch.isfinite(amax)
    rolled = torch.roll(history_H3G, 1, 0)
    rolled[0].zero_()
    return torch.where(usable, new, scale_3G), rolled


# The scale update as one Triton kernel on GPUs (the same bits as the torch formulation, about twenty
# launches fewer per step). Benchmarks comparing the two set this False.
FUSED_SCALE_UPDATE = True


@torch.no_grad()
def update_delayed_scaling(
    modules: Iterable[nn.Module], recipe: FP8Recipe, group: Optional[dist.ProcessGroup] = None
) -> None:
    """Reduce and apply this step's amaxes of every module with delayed-scaling buffers.

    Call once per optimizer step, after backward (the gradient amaxes are recorded there).
    ``group``: ranks whose amaxes are reduced (None: the default group when
    ``torch.distributed`` is initialized, else no reduction).
    """
    owners = [(m, s) for m, s in ((m, delayed_state(m)) for m in modules) if s is not None]
    if not owners:
        return
    states = [s for _, s in owners]
    # All modules' states as one [H, 3, sum G] block per (device, history length), so that the
    # update is a few batched kernels instead of about ten per module (a model has hundreds of
    # FP8 modules, and the next forward waits for these launches): on a GPU with Triton, the
    # concatenations, one update kernel and two copies back (`FUSED_SCALE_UPDATE` False: the torch
    # formulation there too, for benchmarks).
    blocks: dict[tuple, list[DelayedState]] = {}
    for state in states:
        blocks.setdefault((state.amax_history.device, state.amax_history.shape[0]), []).append(state)
    # (one module alone needs no concatenation: its own buffers are read, and written back below)
    merged = [(members, members[0].amax_history, members[0].scale) if len(members) == 1 else
              (members, torch.cat([s.amax_history for s in members], 2), torch.cat([s.scale for s in members], 1))
              for members in blocks.values()]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        current = torch.cat([history[0].reshape(-1) for _, history, _ in merged])
        dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)  # one collective per step
        for (_, history, _), reduced in zip(merged, current.split([h[0].numel() for _, h, _ in merged])):
            history[0].copy_(reduced.view_as(history[0]))
    for members, history, scale in merged:
        if FUSED_SCALE_UPDATE and use_triton(history) and history.dtype == scale.dtype == torch.float32:
            # one kernel, the same bits (kernels.delayed_update_triton): about twenty fewer launches
            from lightning_moe.kernels.delayed_update_triton import delayed_update

            with torch.cuda.device(history.device):  # Triton launches on the current device
                scale, history = delayed_update(history, scale, tuple(recipe.format(role).max for role in ROLES),
                                                recipe.margin, recipe.amax_compute_algo == "most_recent")
        else:
            scale, history = _updated(history, scale, recipe)
        sizes = [s.scale.shape[1] for s in members]
        torch._foreach_copy_([s.amax_history for s in members], list(history.split(sizes, 2)))
        torch._foreach_copy_([s.scale for s in members], list(scale.split(sizes, 1)))
    for module, _ in owners:
        module.__dict__[_FRESH] = False  # scales exist now (for every group that has seen a value)
