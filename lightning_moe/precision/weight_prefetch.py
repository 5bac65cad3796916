"""The expert weights' FP8 copies started before routing: the weights do not depend on the
tokens, so `MoELayer` starts their casts (through ``GroupedExperts.prefetch``) on a side stream
while the router, the permutation and the first projection run; each GEMM waits only for its own
weight's copies (`PrefetchedWeight.take`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_moe.precision.delayed import DelayedState
from lightning_moe.precision.native_casts import (
    FusedGroupedOperands,
    both_weight_layouts_now,
    fused_rowwise,
    local_triton_operands,
)
from lightning_moe.precision.recipes import FP8Recipe
from lightning_moe.precision.weight_cache import training_cache


def weight_signature(w: Tensor) -> tuple:
    """What identifies a weight's values: memory, layout and version (a new view of the same
    parameter, as each forward makes, has the same signature; an in-place update changes it)."""
    return w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w._version


_PREFETCH_STREAMS: dict[int, torch.cuda.Stream] = {}


def prefetch_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device`` that weight casts started early run on (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PREFETCH_STREAMS:
        _PREFETCH_STREAMS[index] = torch.cuda.Stream(device=index)
    return _PREFETCH_STREAMS[index]


@dataclass
class PrefetchedWeight:
    """Both FP8 layouts of an expert weight, being cast on a side stream (`prefetch_weight_layouts`).

    signature: the weight's `weight_signature` when the cast started.
    layouts: ``(fprop [E, N, K], scales [E, N], dgrad [E * K, N], scales [E * K])``, as
        ``FusedGroupedOperands.weight_both`` returns them; allocated on the stream that
        started the cast, written on the side stream.
    done: recorded on the side stream after the cast.
    device: the weight's device.
    """

    signature: tuple
    layouts: tuple[Tensor, Tensor, Tensor, Tensor]
    done: torch.cuda.Event
    device: torch.device

    def release(self) -> None:
        """Make the current stream wait for the cast: nothing issued after this (an optimizer
        step, the delayed-scaling update) may touch the weight or the amax the cast records
        while the side stream may still be at it."""
        torch.cuda.current_stream(self.device).wait_event(self.done)

    def take(self, w: Tensor) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """The layouts, ready on the current stream, if they are of ``w`` as it is now (an
        in-place update through ``.data`` is not seen: it bypasses the version counter), else
        None; `release` either way."""
        self.release()
        if self.signature != weight_signature(w):
            return None
        current = torch.cuda.current_stream(self.device)
        for t in self.layouts:
            # No-op on the stream that allocated them; on another one (a pipelined dispatcher's
            # chunk stream), their memory must not be handed out before that stream is done.
            t.record_stream(current)
        return self.layouts


def can_prefetch_weight_layouts(w_EKN: Tensor, recipe: FP8Recipe) -> bool:
    """Whether the training forward of `scaled_grouped_mm` would cast both layouts of ``w`` itself
    with the fused casts, so that `prefetch_weight_layouts` may start them early: CUDA, the
    rowwise or delayed recipe (E4M3, no power-of-2 scales for rowwise),
    ``FP8Recipe.quantize_weights_once``, no weight cache, gradients on. Under CUDA-graph capture
    too: the side stream forks from the capturing stream and joins it again at the GEMM's event
    wait (or at `PrefetchedWeight.release`), so the graph keeps the casts beside the routing.
    Reads no delayed-scaling state."""
    needs_backward = torch.is_grad_enabled() and w_EKN.requires_grad
    if not (w_EKN.is_cuda and needs_backward and both_weight_layouts_now(recipe, needs_backward)):
        return False
    if training_cache(w_EKN) is not None:
        return False
    if recipe.name == "delayed":
        return local_triton_operands(w_EKN)
    return fused_rowwise(recipe, None, w_EKN)


def prefetch_weight_layouts(w_EKN: Tensor, recipe: FP8Recipe,
                            state: Optional[DelayedState]) -> PrefetchedWeight:
    """Start casting both FP8 layouts of ``w [E, K, N]`` on a side stream, where
    `can_prefetch_weight_layouts` holds (``state``: the projection's delayed-scaling state, or
    None for rowwise). Pass the result to `scaled_grouped_mm` (``prefetched=``): its forward
    waits for it there, and casts again if the weight changed since. The layouts are allocated
    on the current stream, so their memory returns to its pool when the backward frees them."""
    side = prefetch_stream(w_EKN.device)
    layouts = FusedGroupedOperands(recipe, state).weight_both(w_EKN.detach(), launch_stream=side)
    done = torch.cuda.Event()
    done.record(side)
    # Read there: if the weight's memory were freed before the current stream waits for
    # `done`, the allocator must not hand it out until then (the casts mark their own operands).
    w_EKN.record_stream(side)
    return PrefetchedWeight(weight_signature(w_EKN), layouts, done, w_EKN.device)
