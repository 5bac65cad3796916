"""For the ``_interpreted_*`` scripts: the library's Triton paths on CPU tensors, whose kernels
Triton's interpreter then runs (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import sys

import torch


def force_triton_paths() -> None:
    """Make `use_triton` accept CPU float tensors in every ``lightning_moe`` module loaded so far
    (each module binds its own name: import the modules under test first)."""
    import lightning_moe

    assert lightning_moe
    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_moe") and hasattr(module, "use_triton"):
            module.use_triton = lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16)
