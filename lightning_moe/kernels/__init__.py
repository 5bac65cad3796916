"""Own GPU kernels (Triton) for the memory-bound parts of the MoE block.

Each kernel has a plain-torch twin that runs on CPU and serves as its reference; callers go
through the dispatching functions, which pick Triton for CUDA tensors when Triton imports.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and a CUDA device exists (checked once)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()
