"""Transformer Engine glue, imported only when the "te" expert backend runs.

Our experts keep one 3-D weight per projection (``[E, K, N]``) whatever backend runs, so a
checkpoint never depends on the backend. Transformer Engine's ``GroupedLinear`` owns one
``[N, K]`` parameter per expert; we run its autograd function on views of our weight by
lending them to a parameter-less instance for the duration of one call.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import Tensor


@functools.lru_cache(maxsize=64)
def _grouped_linear(num_experts: int, in_features: int, out_features: int, dtype: torch.dtype, device: str):
    import transformer_engine.pytorch as te

    module = te.GroupedLinear(
        num_experts, in_features, out_features, bias=False, params_dtype=dtype, device=device
    )
    return module


@contextlib.contextmanager
def _lent_weights(module: torch.nn.Module, weights: list[Tensor]) -> Iterator[None]:
    saved = {f"weight{i}": module._parameters[f"weight{i}"] for i in range(len(weights))}
    try:
        for i, w in enumerate(weights):
            # Direct dict write: a view of our parameter stands in for TE's own (autograd then
            # flows to our 3-D weight). nn.Module.__setattr__ would demand a Parameter.
            module._parameters[f"weight{i}"] = w
        yield
    finally:
        module._parameters.update(saved)


def te_grouped_linear(x_RK: Tensor, w_EKN: Tensor, split_sizes: list[int]) -> Tensor:
    """``y = x @ w[e]`` per group through ``te.GroupedLinear`` (honours ``te.autocast`` recipes)."""
    num_experts, k, n = w_EKN.shape
    module = _grouped_linear(num_experts, k, n, x_RK.dtype, str(x_RK.device))
    # TE wants [out, in] = [N, K] per expert; contiguous copies (autograd flows back to our
    # [E, K, N] weight) since TE's GEMMs assume row-major weights.
    weights = [w_EKN[e].t().contiguous() for e in range(num_experts)]
    with _lent_weights(module, weights):
        return module(x_RK, split_sizes)
