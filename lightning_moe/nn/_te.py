"""Transformer Engine glue, imported only when the "te" expert backend runs.

Our experts keep one 3-D weight per projection (``[E, K, N]``) whatever backend runs, so a
checkpoint never depends on the backend. Transformer Engine's ``GroupedLinear`` owns one
``[N, K]`` parameter per expert; we run its autograd function on views of our weight by
lending them to a parameter-less instance for the duration of one call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor


def _new_grouped_linear(num_experts: int, in_features: int, out_features: int):
    import transformer_engine.pytorch as te

    # On the meta device: TE skips allocating and initialising its own E weights (its
    # __init__ defers init for meta), which are never used since every call lends ours. With
    # bias=False the only other tensors are empty bias placeholders that TE replaces by its
    # own empty tensors before any GEMM (general_grouped_gemm: ``bias if use_bias else ...``).
    # use_grouped_tensor=False pins the split-quantize path, which takes host split sizes (the
    # native grouped-tensor path wants them on the GPU and is otherwise picked by an env var).
    return te.GroupedLinear(
        num_experts, in_features, out_features, bias=False, device="meta", use_grouped_tensor=False
    )


def _grouped_linear(cache: dict, key: str, num_experts: int, in_features: int, out_features: int):
    """The ``te.GroupedLinear`` of one projection of one experts module.

    One instance per projection, kept in its experts module's ``cache``: TE modules carry
    per-module FP8 state (delayed scaling's amax history and scales), which must not be shared
    between layers, and TE forbids calling a delayed-scaling module twice in one autocast.
    """
    shape = (num_experts, in_features, out_features)
    entry = cache.get(key)
    if entry is None or entry[0] != shape:
        entry = cache[key] = (shape, _new_grouped_linear(*shape))
    return entry[1]


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


def _check_alignment(split_sizes: list[int]) -> None:
    """Quantized grouped GEMMs need every group padded to TE's alignment (16, MXFP8 32, NVFP4
    128): checked on the host sizes we already have, instead of failing inside cuBLAS."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager, get_align_size_for_quantization

    if not FP8GlobalStateManager.is_fp8_enabled():
        return
    align = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
    if any(size % align for size in split_sizes):
        raise ValueError(
            f"Transformer Engine's quantized grouped GEMM needs every expert's token group padded to a "
            f"multiple of {align}; got {split_sizes}. Set MoEConfig(expert_alignment={align})."
        )


def te_grouped_linear(x_RK: Tensor, w_EKN: Tensor, split_sizes: list[int], cache: dict, key: str) -> Tensor:
    """``y = x @ w[e]`` per group through ``te.GroupedLinear`` (honours ``te.autocast`` recipes).

    ``split_sizes`` must sum to ``x_RK.shape[0]`` (TE splits the input with ``torch.split``).
    ``cache`` / ``key``: where the TE module of this projection lives (see `_grouped_linear`).
    """
    num_experts, k, n = w_EKN.shape
    _check_alignment(split_sizes)
    module = _grouped_linear(cache, key, num_experts, k, n)
    # Outside torch.autocast TE demands weights in the input's dtype (set_activation_dtype
    # raises otherwise), so cast them like the other backends do; under autocast TE casts
    # (or quantizes) the fp32 masters itself.
    dtype = w_EKN.dtype if torch.is_autocast_enabled(x_RK.device.type) else x_RK.dtype
    # TE wants [out, in] = [N, K] row-major per expert: one transposing copy, then unbind, whose
    # backward stacks the E gradients in one kernel (E separate ``w[e]`` selects would each
    # materialise a full-size [E, K, N] gradient).
    w_ENK = w_EKN.transpose(1, 2).to(dtype).contiguous()
    with _lent_weights(module, list(w_ENK.unbind(0))):
        return module(x_RK, split_sizes)
