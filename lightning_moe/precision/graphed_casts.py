"""CUDA graphs of the expert weights' FP8 casts that `FP8GroupedGemm.prefetch_weights` starts.

A training forward of native FP8 grouped experts casts both weights (fc1, fc2) into both FP8
layouts before routing, on a side stream (`weight_prefetch.prefetch_weight_layouts`). On the GPU these
are two memory-bound kernels; on the host, with their allocations, stream switches and launches,
they cost about a millisecond per layer (about a quarter of the qwen3-shaped FP8 layer's forward
on the host), and a forward whose host side is slower than its GPU
side leaves the GPU waiting for launches.

With ``FP8Recipe(graph_weight_casts=True)`` one layer's casts are captured into a CUDA graph once
and replayed at each forward: one launch. A graph writes the same buffers at every replay, so:

- memory: both FP8 layouts of the local expert weights (2 bytes per parameter) stay allocated
  for good. The eager casts free the forward layout after the layer's forward and keep the
  data-gradient one until its backward, so the peak grows by about one byte per local expert
  parameter of every graphed layer (the qwen3-shaped block: about 10% more),
  and by two under activation checkpointing, where the eager copies live only while a layer runs.
- a replay waits until nothing references the previous replay's outputs (each forward gets new
  views of them; any view, saved tensor or view of a view keeps their storage's use count up).
  While something does (a second forward before the first one's backward, a graph kept with
  ``retain_graph=True``), the casts run eagerly into new memory, exactly as without the option:
  results never depend on it.
- the graph reads the weights and the delayed-scaling buffers at fixed addresses, so it is keyed
  on each one's address, shape, strides and dtype and captured again when any changes (a new
  parameter tensor, ``.to()``, a resized state); in-place updates (the optimizer step, the amax
  history update) are what the next replay reads.
- a key is captured at its second forward: the first runs eagerly (compiling the kernels); a
  delayed-scaling state without scales yet (`DelayedState.fresh`) casts with a pre-pass the graph
  would not repeat, and casts eagerly until its first update. Capture synchronizes the device
  once per key.

Readers of the outputs on other streams must be joined into the forward's stream before its next
forward (autograd's backward and the dispatchers' chunk streams are), since a replay is ordered
after that stream's work only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_moe._capture import collector_held_off
from lightning_moe.nn.saved_tensors import recomputing
from lightning_moe.precision.delayed import DelayedState, recording_amax
from lightning_moe.precision.recipes import FP8Recipe

# (projection, its weight ``[E, K, N]``, its delayed-scaling state or None): one cast each
CastJob = tuple[str, Tensor, Optional[DelayedState]]


def _storage_uses(t: Tensor) -> int:
    """References to ``t``'s storage (tensors over it; the call's own storage object counts one)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _operand_key(t: Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class GraphedWeightCasts:
    """One FP8 grouped GEMM's prefetched weight casts as a CUDA graph (see the module docstring).

    ``captures``, ``replays`` and ``busy`` (replays declined because the previous outputs were
    still referenced) count what `start` did, for tests and diagnostics.
    """

    def __init__(self) -> None:
        self._key: Optional[tuple] = None  # of the captured graph
        self._seen_key: Optional[tuple] = None  # cast eagerly once, ready to capture
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        # projection -> (fprop [E, N, K], scales [E, N], dgrad [E * K, N], scales [E * K]), the
        # graph's outputs; never handed out themselves, so that views count as uses
        self._layouts: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._idle_uses: list[int] = []  # storage use counts of the outputs with no view out
        self.captures = self.replays = self.busy = 0

    # A graph is tied to its device memory: a copied module starts without one.
    def __deepcopy__(self, memo: dict) -> GraphedWeightCasts:
        return GraphedWeightCasts()

    def __reduce__(self) -> tuple:
        return GraphedWeightCasts, ()

    def start(self, jobs: list[CastJob], recipe: FP8Recipe) -> Optional[dict]:
        """Replay (capturing first where due) the casts of ``jobs``; returns ``{projection:
        PrefetchedWeight}`` as `weight_prefetch.prefetch_weight_layouts` would, or None where the
        caller must cast eagerly (see the module docstring for when)."""
        if not jobs or torch.cuda.is_current_stream_capturing() or not recording_amax() or recomputing():
            return None
        if any(state is not None and state.fresh for _, _, state in jobs):
            return None
        device = jobs[0][1].device
        if any(w.device != device for _, w, _ in jobs):
            return None
        key = (device, recipe.name, recipe.fmt, tuple(
            (projection, _operand_key(w)) + (() if state is None else
                                             (_operand_key(state.amax_history), _operand_key(state.scale)))
            for projection, w, state in jobs))
        if key != self._key:
            self._drop()
            if key != self._seen_key:
                self._seen_key = key
                return None  # eagerly this once: compiles and loads the kernels the graph captures
            self._capture(jobs, recipe, key)
        elif self._in_use():
            self.busy += 1
            return None
        return self._replay(jobs, device)

    def _drop(self) -> None:
        self._key, self._graph, self._layouts, self._idle_uses = None, None, {}, []

    def _outputs(self) -> list[Tensor]:
        return [t for layouts in self._layouts.values() for t in layouts]

    def _in_use(self) -> bool:
        return any(_storage_uses(t) > idle for t, idle in zip(self._outputs(), self._idle_uses))

    def _capture(self, jobs: list[CastJob], recipe: FP8Recipe, key: tuple) -> None:
        from lightning_moe.precision.native_casts import FusedGroupedOperands
        from lightning_moe.precision.weight_prefetch import prefetch_stream

        graph = torch.cuda.CUDAGraph()
        # Captured on the prefetch stream, where the eager casts run. Entering synchronizes the
        # device (host sync, once per key) and frees the allocator's cached blocks.
        # "thread_local": other threads' CUDA calls (a pin-memory thread) do not break the capture.
        with collector_held_off(), torch.cuda.graph(graph, stream=prefetch_stream(jobs[0][1].device),
                                                    capture_error_mode="thread_local"):
            layouts = {projection: FusedGroupedOperands(recipe, state).weight_both(w.detach())
                       for projection, w, state in jobs}
        self._key, self._graph, self._layouts = key, graph, layouts
        self._idle_uses = [_storage_uses(t) for t in self._outputs()]
        self.captures += 1

    def _replay(self, jobs: list[CastJob], device: torch.device) -> dict:
        from lightning_moe.precision.weight_prefetch import PrefetchedWeight, prefetch_stream, weight_signature

        side = prefetch_stream(device)
        # After everything issued so far on this stream: the last readers of the outputs (the
        # previous backward), the optimizer step and the amax update.
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._graph.replay()
        done = torch.cuda.Event()
        done.record(side)
        started = {}
        for projection, w, _ in jobs:
            w.record_stream(side)  # read there (as the eager prefetch marks it)
            views = tuple(t.view(t.shape) for t in self._layouts[projection])
            started[projection] = PrefetchedWeight(weight_signature(w), views, done, device)
        self.replays += 1
        return started
