"""How the quantized GEMMs meet autocast: they return autocast's dtype and pick their own inside."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear layer returns here: autocast's when enabled, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def no_autocast(x: Tensor) -> AbstractContextManager:
    """Quantized GEMM internals pick their own dtypes."""
    return torch.autocast(x.device.type, enabled=False)
