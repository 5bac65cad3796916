"""What every CUDA-graph capture of ours runs under."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_held_off() -> Iterator[None]:
    """Collect Python's garbage now and keep the cyclic collector off until the block ends.

    A collection inside a capture may destroy CUDA graphs that became garbage (a module whose
    forward was replaced by a graphed one is a reference cycle), which CUDA refuses without an
    error of its own: the capture is invalidated and fails later, at an unrelated launch. torch
    no longer collects before a capture (only with ``torch.compiler.config.force_cudagraph_gc``).
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
