"""SwiGLU experts in native FP8 with delayed scaling: ``fc2(swiglu(fc1(x)))`` in one autograd function.

Run as two FP8 grouped GEMMs with the SwiGLU between them, a training step writes the SwiGLU's
output ``a [R, F]`` in bf16 for fc2's input cast to read back, and in the backward the SwiGLU's
input gradient ``dh [R, 2F]`` in bf16 for fc1's gradient cast to read back. Here the casts
compute those values themselves (``delayed_cast(swiglu=True)`` from ``h``, ``delayed_cast
(swiglu_grad=da)`` from ``h`` and ``da``), so neither is ever written in bf16 (at mixtral's
shape about 0.5 GB and 0.9 GB per step, each written once and read once).

The numbers are those of the two-function path bit for bit (GPU test): the same casts of the
same values (the SwiGLU arithmetic and rounding of ``kernels.swiglu_triton``), the same GEMMs.
fc1 and fc2 keep their own delayed-scaling states, weight cache entries and data-gradient weight
copies (`_forward_weight`). Only where `fusable`: delayed recipe, CUDA, Triton, a backward to
come (evaluation casts the row copy alone and takes the two-function path).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_moe.precision.delayed import DelayedState
from lightning_moe.precision.gemm import compute_dtype, no_autocast
from lightning_moe.precision.recipes import FP8Recipe
from lightning_moe.precision.scaled_mm import (
    _ALIGN,
    _backward_weight,
    _forward_weight,
    _fused_delayed,
    _FusedGroupedOperands,
    _group_gemm,
    _group_weight_gradient,
    _host_group_ends,
    _needs_backward,
)
from lightning_moe.precision.weight_cache import FP8WeightCache, training_cache


class _ScaledSwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, w2: Tensor, offsets: Tensor, recipe: FP8Recipe,
                states: tuple[DelayedState, DelayedState], keys: tuple[Optional[Hashable], Optional[Hashable]],
                cache: Optional[FP8WeightCache]) -> Tensor:
        out_dtype = compute_dtype(x)
        experts = w1.shape[0]
        fc1, fc2 = (_FusedGroupedOperands(recipe, state) for state in states)
        with no_autocast(x):
            qx, sx_R, qx_t, sx_t = fc1.activation(x, offsets, "input", True)
            qw1, sw1, saved1, ctx.on_ctx1 = _forward_weight(fc1, w1, recipe, cache, keys[0], True)
            qw2, sw2, saved2, ctx.on_ctx2 = _forward_weight(fc2, w2, recipe, cache, keys[1], True)
            ends = _host_group_ends(offsets, experts)
            h = _group_gemm(qx, sx_R, qw1, sw1, offsets, ends, fast=recipe.fast("fprop")).to(out_dtype)  # [R, 2F]
            qa, sa_R, qa_t, sa_t = fc2.activation(h, offsets, "input", True, swiglu=True)  # silu(gate) * up
            y = _group_gemm(qa, sa_R, qw2, sw2, offsets, ends, fast=recipe.fast("fprop"))
        ctx.save_for_backward(qx_t, sx_t, qa_t, sa_t, h, offsets, w1, w2, *saved1, *saved2)
        ctx.recipe, ctx.states, ctx.ends = recipe, states, ends
        ctx.x_dtype, ctx.w_dtypes, ctx.h_dtype = x.dtype, (w1.dtype, w2.dtype), h.dtype
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        recipe, ends = ctx.recipe, ctx.ends
        # Unpacked once: activation checkpointing refuses a second unpack of a saved tensor.
        qx_t, sx_t, qa_t, sa_t, h, offsets, w1, w2, *saved = ctx.saved_tensors
        experts, d, f2 = w1.shape
        f = w2.shape[1]
        torch._assert_async((offsets % _ALIGN == 0).all(),
                            "torch._scaled_grouped_mm needs expert groups padded to a multiple of 16 tokens")
        fc1, fc2 = (_FusedGroupedOperands(recipe, state) for state in ctx.states)
        with no_autocast(dy):
            dy = dy.contiguous()
            qdy, sdy_R, qdy_t, sdy_t = fc2.activation(dy, offsets, "grad", True)
            qw2, sw2 = _backward_weight(fc2, w2, (saved[2], saved[3]), ctx.on_ctx2)
            # da as the two-function path hands it to the SwiGLU: fc2's data gradient in h's dtype
            da = _group_gemm(qdy, sdy_R, qw2.view(experts, f, -1), sw2.view(experts, f), offsets, ends,
                             fast=recipe.fast("dgrad")).to(ctx.h_dtype)
            dw2 = _group_weight_gradient(qa_t, sa_t.view(experts, f), qdy_t, sdy_t.view(experts, -1), offsets, ends,
                                         fast=recipe.fast("wgrad"))
            # the SwiGLU's input gradient [d_gate | d_up], cast straight from h and da
            qdh, sdh_R, qdh_t, sdh_t = fc1.activation(h, offsets, "grad", True, swiglu_grad=da)
            qw1, sw1 = _backward_weight(fc1, w1, (saved[0], saved[1]), ctx.on_ctx1)
            dx = _group_gemm(qdh, sdh_R, qw1.view(experts, d, f2), sw1.view(experts, d), offsets, ends,
                             fast=recipe.fast("dgrad"))
            dw1 = _group_weight_gradient(qx_t, sx_t.view(experts, d), qdh_t, sdh_t.view(experts, f2), offsets, ends,
                                         fast=recipe.fast("wgrad"))
        return (dx.to(ctx.x_dtype), dw1.to(ctx.w_dtypes[0]), dw2.to(ctx.w_dtypes[1]),
                None, None, None, None, None)


def fusable(x: Tensor, w1: Tensor, w2: Tensor, recipe: FP8Recipe, states: tuple[Optional[DelayedState], ...]) -> bool:
    """Whether `swiglu_experts` runs here: the delayed recipe's one-read casts on CUDA in a
    training pass (evaluation casts the row copies alone)."""
    return (all(state is not None for state in states) and _fused_delayed(recipe, states[0], x, w1, w2)
            and (_needs_backward(x, w1) or w2.requires_grad))


def swiglu_experts(x: Tensor, w1: Tensor, w2: Tensor, offsets: Tensor, recipe: FP8Recipe,
                   states: tuple[DelayedState, DelayedState],
                   keys: tuple[Optional[Hashable], Optional[Hashable]] = (None, None)) -> Tensor:
    """``swiglu(x @ w1) @ w2`` per expert group in FP8, where `fusable`.

    Args:
        x: ``[R, D]`` rows grouped by expert; w1: ``[E, D, 2F]`` (``[gate | up]``); w2: ``[E, F, D]``.
        offsets: int32 cumulative group ends ``[E]`` (padded to 16 rows).
        states: fc1's and fc2's delayed-scaling states; keys: their weight-cache names.
    """
    return _ScaledSwiGLUExperts.apply(x, w1, w2, offsets, recipe, tuple(states), tuple(keys), training_cache(w1))
