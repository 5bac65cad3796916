"""lightning_moe: Megatron-Core-class Mixture-of-Experts training for PyTorch Lightning.

`lightning_moe.nn` (the MoE layer) imports without Lightning. The Lightning side loads on first
use: ``from lightning_moe import MegatronMoEStrategy`` (or ``import lightning_moe.strategies``)
imports it and registers the ``"megatron_moe"`` strategy name; so does ``import lightning_moe``
when Lightning is already imported.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_moe.layout import ParallelLayout
from lightning_moe.nn import MoEConfig, MoELayer

__version__ = "0.1.0"

# name -> the module that defines it, imported on first access (Lightning, CUDA graphs)
_LAZY = {"MegatronMoEStrategy": "lightning_moe.strategies", "capture_moe_layer": "lightning_moe.cuda_graphs"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if "lightning.pytorch" in sys.modules:  # a Lightning user's script: make strategy="megatron_moe" resolve now
    importlib.import_module("lightning_moe.strategies")

__all__ = ["MegatronMoEStrategy", "MoEConfig", "MoELayer", "ParallelLayout", "__version__", "capture_moe_layer"]
