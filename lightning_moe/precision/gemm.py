"""FP8 / NVFP4 GEMMs with autograd: `fp8_linear` and `fp8_grouped_mm`.

Each GEMM of forward and backward quantizes both operands along its contraction dimension
(see `operands`): ``y = x w^T`` (fprop), ``dx = dy w`` (dgrad) and ``dw = dy^T x`` (wgrad).
Gradients use the recipe's backward format (E5M2 under the "hybrid" format, TE's default
for tensorwise / delayed scaling). Backends:

- "emulated": every operand is quantized with the reference rounding and dequantized to
  fp32; the GEMM runs in fp32 on those values (on CUDA the grouped GEMM runs in bf16, the
  only dtype its kernel takes). Works on any device; differs from an FP8 tensor-core GEMM
  only by accumulation order (and, on CUDA grouped GEMMs, bf16 rounding of dequantized values).
- "torch": ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` (`scaled_mm`), CUDA only.
- "te" works at module level only (`FP8Precision` swaps ``nn.Linear`` for ``te.Linear``).

The saved activations are the high-precision inputs, as for ``nn.Linear`` (recipes that
tile per direction must re-quantize them along the other axis anyway); their quantization
is recomputed in backward.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_moe.precision.delayed import DelayedState
from lightning_moe.precision.operands import Layout, dequantized_operand, pad_contraction, symmetric_tiles
from lightning_moe.precision.quantize import NVFP4_BLOCK
from lightning_moe.precision.recipes import FP8Recipe, resolve_backend


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear layer returns here: autocast's when enabled, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def no_autocast(x: Tensor) -> AbstractContextManager:
    """Quantized GEMM internals pick their own dtypes."""
    return torch.autocast(x.device.type, enabled=False)


def _hadamard(recipe: FP8Recipe) -> bool:
    return recipe.is_fp4 and recipe.nvfp4_rht


def _grouped_gemm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """``torch._grouped_mm`` on dequantized fp32 operands (fp32 result)."""
    if a.is_cuda:  # the CUDA kernel takes bf16 operands
        return torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offsets, out_dtype=torch.float32)
    return torch._grouped_mm(a.contiguous(), b, offs=offsets)


class _EmulatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                state: Optional[DelayedState]) -> Tensor:
        out_dtype = compute_dtype(x)
        with no_autocast(x):
            x2 = x.reshape(-1, x.shape[-1])
            y = dequantized_operand(x2, recipe, "input", state=state) @ dequantized_operand(
                weight, recipe, "weight", state=state).t()
            if bias is not None:
                y = y + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.state, ctx.bias_dtype = recipe, state, None if bias is None else bias.dtype
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        recipe, state = ctx.recipe, ctx.state
        with no_autocast(dy):
            dy2 = dy.reshape(-1, dy.shape[-1]).float()
            dy_q = dequantized_operand(dy2, recipe, "grad", state=state)
            dx = dy_q @ dequantized_operand(weight.t(), recipe, "weight", state=state).t()
            # wgrad contracts over tokens: padding them with zeros changes nothing and lets
            # NVFP4's Hadamard transform work on whole 16-token blocks.
            multiple = NVFP4_BLOCK if _hadamard(recipe) else 1
            if symmetric_tiles(recipe, "grad"):
                dy_t = pad_contraction(dy_q.t(), multiple)
            else:
                dy_t = dequantized_operand(pad_contraction(dy2.t(), multiple), recipe, "grad", state=state,
                                           hadamard=_hadamard(recipe))
            x_t = dequantized_operand(pad_contraction(x.reshape(-1, x.shape[-1]).t(), multiple), recipe, "input",
                                      state=state, hadamard=_hadamard(recipe))
            dw = dy_t @ x_t.t()
            db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)
        return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), db, None, None


class _EmulatedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                state: Optional[DelayedState]) -> Tensor:
        out_dtype = compute_dtype(x)
        experts, k, n = w.shape
        with no_autocast(x):
            x_q = dequantized_operand(x, recipe, "input", Layout(row_offsets=offsets), state)
            w_q = dequantized_operand(w.transpose(1, 2).reshape(experts * n, k), recipe, "weight",
                                      Layout(batch=experts), state)
            y = _grouped_gemm(x_q, w_q.reshape(experts, n, k).transpose(1, 2), offsets)
        ctx.save_for_backward(x, w, offsets)
        ctx.recipe, ctx.state = recipe, state
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        x, w, offsets = ctx.saved_tensors
        recipe, state = ctx.recipe, ctx.state
        experts, k, n = w.shape
        hadamard = _hadamard(recipe)
        with no_autocast(dy):
            dy = dy.float().contiguous()
            dy_q = dequantized_operand(dy, recipe, "grad", Layout(row_offsets=offsets), state)
            w_q = dequantized_operand(w.reshape(experts * k, n), recipe, "weight", Layout(batch=experts), state)
            dx = _grouped_gemm(dy_q, w_q.reshape(experts, k, n).transpose(1, 2), offsets)
            multiple = 1
            if hadamard:  # Hadamard blocks of 16 tokens must not mix two experts' tokens
                torch._assert_async((offsets % NVFP4_BLOCK == 0).all(),
                                    "NVFP4 grouped GEMMs need expert groups padded to a multiple of 16 tokens")
                multiple = NVFP4_BLOCK
            cols = Layout(col_offsets=offsets)
            if symmetric_tiles(recipe, "grad"):
                dy_t = pad_contraction(dy_q.t(), multiple)
            else:
                dy_t = dequantized_operand(pad_contraction(dy.t(), multiple), recipe, "grad", cols, state, hadamard)
            x_t = dequantized_operand(pad_contraction(x.t(), multiple), recipe, "input", cols, state, hadamard)
            dw = _grouped_gemm(x_t, dy_t.t().contiguous(), offsets)
        return dx.to(x.dtype), dw.to(w.dtype), None, None, None


def _backend(recipe: FP8Recipe, backend: str, x: Tensor, grouped: bool) -> str:
    if backend == "te":
        raise ValueError(
            "backend='te' quantizes inside Transformer Engine modules: use FP8Precision(backend='te') "
            "(it swaps nn.Linear for te.Linear); the functional GEMMs take 'torch' or 'emulated'."
        )
    return resolve_backend(recipe, backend, device=x.device.type, grouped=grouped)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    recipe: Union[str, FP8Recipe] = "tensorwise",
    backend: str = "emulated",
    bias: Optional[Tensor] = None,
    state: Optional[DelayedState] = None,
) -> Tensor:
    """``x @ weight.T + bias`` with every GEMM of forward and backward quantized.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout, fp32 master weights);
            bias: ``[N]``.
        recipe: a recipe name or `FP8Recipe`.
        backend: "emulated", "torch" or "auto" (see `resolve_backend`).
        state: delayed-scaling buffers (required by the "delayed" recipe).
    Returns:
        ``[..., N]`` in the autocast dtype when autocast is on, else in ``x.dtype``.
    """
    recipe = FP8Recipe.of(recipe)
    if _backend(recipe, backend, x, grouped=False) == "torch":
        from lightning_moe.precision.scaled_mm import scaled_linear

        return scaled_linear(x, weight, bias, recipe, state)
    return _EmulatedLinear.apply(x, weight, bias, recipe, state)


def fp8_grouped_mm(
    x_RK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    recipe: Union[str, FP8Recipe] = "tensorwise",
    backend: str = "emulated",
    state: Optional[DelayedState] = None,
) -> Tensor:
    """Grouped GEMM ``y[rows of e] = x[rows of e] @ w[e]`` with quantized operands.

    Args:
        x_RK: tokens sorted by expert ``[R, K]``.
        w_EKN: expert weights ``[E, K, N]``.
        offsets_E: cumulative int32 row ends per expert ``[E]`` (``torch._grouped_mm``'s
            ``offs``); groups should be padded to ``recipe.alignment`` tokens.
        recipe / backend / state: as in `fp8_linear`. Tensorwise and delayed scales are
            per expert (one per token group, one per expert weight), as in TE's GroupedLinear.
    Returns:
        ``[R, N]``.
    """
    recipe = FP8Recipe.of(recipe)
    if _backend(recipe, backend, x_RK, grouped=True) == "torch":
        from lightning_moe.precision.scaled_mm import scaled_grouped_mm

        return scaled_grouped_mm(x_RK, w_EKN, offsets_E, recipe, state)
    return _EmulatedGroupedMM.apply(x_RK, w_EKN, offsets_E, recipe, state)
