"""Deterministic CUDA kernels for the GPU comparisons that check bits: by default the flash-attention
backward adds the query gradient's blocks with atomics, so two identical bf16 runs differ in the last
bits (measured on an H100: 21 of 39 gradients of a 4-layer model, up to 1.2e-4; none under
deterministic algorithms or with the math attention backend)."""

import contextlib
import os

import torch

# cuBLAS's deterministic workspace: read when an operation checks it under deterministic algorithms.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside, without filling fresh allocations (that
    fill would add kernels and change the peaks the memory tests compare)."""
    from torch.utils import deterministic

    fill = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        deterministic.fill_uninitialized_memory = fill
