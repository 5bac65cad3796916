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

The emulated backend saves the fp32 dequantized operands for backward when their tiles are
transpose-symmetric (tensorwise, delayed, 2-D weight tiles), else the high-precision inputs,
which backward re-quantizes along the other axis (the weight-gradient GEMM contracts over
tokens).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

from lightning_moe.kernels import accumulate_widened_
from lightning_moe.nn.compute_weights import accumulation_grad, in_place_accumulation_target
from lightning_moe.nn.grouped_gemm import padded_to_16_byte_rows
from lightning_moe.precision.autocast import compute_dtype, no_autocast
from lightning_moe.precision import scaled_mm
from lightning_moe.precision.delayed import DelayedState
from lightning_moe.precision.native_casts import native_delayed_casts
from lightning_moe.precision.operands import Layout, dequantized_operand, pad_contraction, symmetric_tiles
from lightning_moe.precision.quantize import NVFP4_BLOCK
from lightning_moe.precision.recipes import FP8Recipe, resolve_backend

if TYPE_CHECKING:
    from lightning_moe.nn.permutation import DeferredCombine
    from lightning_moe.precision.weight_prefetch import PrefetchedWeight


def _hadamard(recipe: FP8Recipe) -> bool:
    return recipe.is_fp4 and recipe.nvfp4_rht


def _grouped_gemm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """``torch._grouped_mm`` on dequantized fp32 operands (fp32 result): ``a [M, K] @ b [E, K, N]``
    with groups of rows, or ``a [K, T] @ b [T, N]`` with groups of the contraction (``[E, K, N]``).
    Any K and N: where rows are not 16 bytes wide, zeros pad them and the output is sliced."""
    if b.dim() == 2 and a.shape[1] == 0:  # weight gradient of a rank that received no tokens
        return a.new_zeros(offsets.numel(), a.shape[0], b.shape[1])
    if a.is_cuda:  # the CUDA kernel takes bf16 operands (and returns bf16)
        a, b = a.bfloat16(), b.bfloat16()
    else:
        a = a.contiguous()
    n = b.shape[-1]
    y = torch._grouped_mm(*padded_to_16_byte_rows(a, b), offs=offsets)
    return (y[..., :n] if y.shape[-1] != n else y).float()


class _EmulatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                state: Optional[DelayedState], accumulate_into: tuple[Optional[Tensor]] = (None,)) -> Tensor:
        out_dtype = compute_dtype(x)
        with no_autocast(x):
            x2 = x.reshape(-1, x.shape[-1])
            x_q = dequantized_operand(x2, recipe, "input", state=state)
            w_q = dequantized_operand(weight, recipe, "weight", state=state)
            y = x_q @ w_q.t()
            if bias is not None:
                y = y + bias.float()
        ctx.reuse_x, ctx.reuse_w = symmetric_tiles(recipe, "input"), symmetric_tiles(recipe, "weight")
        ctx.save_for_backward(x_q if ctx.reuse_x else x2, w_q if ctx.reuse_w else weight)
        ctx.recipe, ctx.state, ctx.bias_dtype = recipe, state, None if bias is None else bias.dtype
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        (ctx.accumulate_into,) = accumulate_into  # a reference, not an input (see _weight_gradient)
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        x_saved, w_saved = ctx.saved_tensors
        recipe, state, hadamard = ctx.recipe, ctx.state, _hadamard(ctx.recipe)
        with no_autocast(dy):
            dy2 = dy.reshape(-1, dy.shape[-1]).float()
            dy_q = dequantized_operand(dy2, recipe, "grad", state=state)
            w_t = w_saved.t() if ctx.reuse_w else dequantized_operand(w_saved.t(), recipe, "weight", state=state)
            dx = dy_q @ w_t.t()
            # wgrad contracts over tokens: padding them with zeros changes nothing and lets
            # NVFP4's Hadamard transform work on whole 16-token blocks.
            multiple = NVFP4_BLOCK if hadamard else 1
            if symmetric_tiles(recipe, "grad"):
                dy_t = dy_q.t()
            else:
                dy_t = dequantized_operand(pad_contraction(dy2.t(), multiple), recipe, "grad", state=state,
                                           hadamard=hadamard)
            if ctx.reuse_x:
                x_t = x_saved.t()
            else:
                x_t = dequantized_operand(pad_contraction(x_saved.t(), multiple), recipe, "input", state=state,
                                          hadamard=hadamard)
            dw = dy_t @ x_t.t()
            db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)
        return dx.to(ctx.x_dtype).reshape(ctx.x_shape), _weight_gradient(ctx, dw), db, None, None, None


class _EmulatedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                state: Optional[DelayedState], accumulate_into: tuple[Optional[Tensor]] = (None,)) -> Tensor:
        out_dtype = compute_dtype(x)
        experts, k, n = w.shape
        with no_autocast(x):
            x_q = dequantized_operand(x, recipe, "input", Layout(row_offsets=offsets), state)
            w_q = dequantized_operand(w.transpose(1, 2).reshape(experts * n, k), recipe, "weight",
                                      Layout(batch=experts), state).reshape(experts, n, k).transpose(1, 2)
            y = _grouped_gemm(x_q, w_q, offsets)
        ctx.reuse_x, ctx.reuse_w = symmetric_tiles(recipe, "input"), symmetric_tiles(recipe, "weight")
        ctx.save_for_backward(x_q if ctx.reuse_x else x, w_q if ctx.reuse_w else w, offsets)
        ctx.recipe, ctx.state, ctx.x_dtype, ctx.w_dtype = recipe, state, x.dtype, w.dtype
        (ctx.accumulate_into,) = accumulate_into
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        x_saved, w_saved, offsets = ctx.saved_tensors
        recipe, state, hadamard = ctx.recipe, ctx.state, _hadamard(ctx.recipe)
        experts, k, n = w_saved.shape
        with no_autocast(dy):
            dy = dy.float().contiguous()
            dy_q = dequantized_operand(dy, recipe, "grad", Layout(row_offsets=offsets), state)
            if ctx.reuse_w:
                w_q = w_saved
            else:
                w_q = dequantized_operand(w_saved.reshape(experts * k, n), recipe, "weight", Layout(batch=experts),
                                          state).reshape(experts, k, n)
            dx = _grouped_gemm(dy_q, w_q.transpose(1, 2), offsets)
            if hadamard:  # Hadamard blocks of 16 tokens must not mix two experts' tokens
                torch._assert_async((offsets % NVFP4_BLOCK == 0).all(),
                                    "NVFP4 grouped GEMMs need expert groups padded to a multiple of 16 tokens")
            # Tokens are the wgrad contraction: zero columns past the last group change nothing,
            # give whole 16-token Hadamard blocks and the 16-byte strides _grouped_mm needs.
            multiple = 16
            cols = Layout(col_offsets=offsets)
            if symmetric_tiles(recipe, "grad"):
                dy_t = dy_q.t()
            else:
                dy_t = dequantized_operand(pad_contraction(dy.t(), multiple), recipe, "grad", cols, state, hadamard)
            if ctx.reuse_x:
                x_t = x_saved.t()
            else:
                x_t = dequantized_operand(pad_contraction(x_saved.t(), multiple), recipe, "input", cols, state,
                                          hadamard)
            x_t, dy_t = pad_contraction(x_t, multiple), pad_contraction(dy_t, multiple)
            dw = _grouped_gemm(x_t.contiguous(), dy_t.t().contiguous(), offsets)
        return dx.to(ctx.x_dtype), _weight_gradient(ctx, dw), None, None, None, None


def _weight_gradient(ctx: Any, dw: Tensor) -> Optional[Tensor]:
    """The emulated weight gradient in the weight's dtype for autograd, or None after adding it into
    the weight's fp32 ``.grad`` (`accumulation_grad`, where the forward's
    `in_place_accumulation_target` chose the weight: the strategy's ``accumulate_grads_in_place``),
    the bits of autograd's ``.grad += dw``. The parameter rides on ctx in a tuple, not as an input
    of the Function, so that autograd has no second edge to its AccumulateGrad."""
    dw = dw.to(ctx.w_dtype)
    main_grad = accumulation_grad(ctx.accumulate_into, dw.numel())
    if main_grad is None:
        return dw
    accumulate_widened_(main_grad, dw)
    return None


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
    weight_key: Optional[Hashable] = None,
) -> Tensor:
    """``x @ weight.T + bias`` with every GEMM of forward and backward quantized.

    Args:
        x: ``[..., K]``; weight: ``[N, K]`` (``nn.Linear`` layout, fp32 master weights);
            bias: ``[N]``.
        recipe: a recipe name or `FP8Recipe`.
        backend: "emulated", "torch" or "auto" (see `resolve_backend`).
        state: delayed-scaling buffers (required by the "delayed" recipe).
        weight_key: a name for ``weight`` that lives as long as it does (e.g. ``(id(module),
            "weight")``): in training passes inside `caching_fp8_weights` the "torch" backend
            then quantizes it once per weight state instead of every call (evaluation, no-grad
            and inference-mode calls never use the cache). None: no caching.
    Returns:
        ``[..., N]`` in the autocast dtype when autocast is on, else in ``x.dtype``.
    """
    recipe = FP8Recipe.of(recipe)
    if _backend(recipe, backend, x, grouped=False) == "torch":
        return scaled_mm.scaled_linear(x, weight, bias, recipe, state, weight_key)
    return _EmulatedLinear.apply(x, weight, bias, recipe, state, (in_place_accumulation_target(weight),))


def fp8_grouped_mm(
    x_RK: Tensor,
    w_EKN: Tensor,
    offsets_E: Tensor,
    recipe: Union[str, FP8Recipe] = "tensorwise",
    backend: str = "emulated",
    state: Optional[DelayedState] = None,
    weight_key: Optional[Hashable] = None,
    prefetched: Optional[PrefetchedWeight] = None,
) -> Tensor:
    """Grouped GEMM ``y[rows of e] = x[rows of e] @ w[e]`` with quantized operands.

    Args:
        x_RK: tokens sorted by expert ``[R, K]``.
        w_EKN: expert weights ``[E, K, N]``.
        offsets_E: cumulative int32 row ends per expert ``[E]`` (``torch._grouped_mm``'s
            ``offs``); groups should be padded to ``recipe.alignment`` tokens.
        recipe / backend / state: as in `fp8_linear`. Tensorwise and delayed scales are
            per expert (one per token group, one per expert weight), as in TE's GroupedLinear.
        weight_key: as in `fp8_linear`.
        prefetched: ``w``'s FP8 layouts started early (``weight_prefetch.prefetch_weight_layouts``;
            the "torch" backend makes them, the others never get any).
    Returns:
        ``[R, N]``; on the "torch" backend rows past the last group end are unspecified unless
        the products run per expert (as with ``torch._scaled_grouped_mm``).
    """
    recipe = FP8Recipe.of(recipe)
    if _backend(recipe, backend, x_RK, grouped=True) == "torch":
        return scaled_mm.scaled_grouped_mm(x_RK, w_EKN, offsets_E, recipe, state, weight_key, prefetched)
    return _EmulatedGroupedMM.apply(x_RK, w_EKN, offsets_E, recipe, state, (in_place_accumulation_target(w_EKN),))


def _native_delayed(recipe: FP8Recipe, backend: str, state: Optional[DelayedState], x: Tensor) -> bool:
    """Delayed scaling with its state, on the native ("torch") grouped backend for ``x``."""
    return recipe.name == "delayed" and state is not None and _backend(recipe, backend, x, grouped=True) == "torch"


def gathered_cast_runs(recipe: FP8Recipe, backend: str, *operands: Tensor) -> bool:
    """Whether `fp8_grouped_mm_gathered` (given a delayed-scaling state) runs on ``operands``
    (the tokens first, then any weights): the native delayed-scaling casts (recipe "delayed",
    Triton on CUDA, no DTensors) on the "torch" grouped backend. The one test for both the GEMM
    and the experts that decide whether to hand it the tokens unpermuted."""
    return native_delayed_casts(recipe, *operands) and _backend(recipe, backend, operands[0], grouped=True) == "torch"


def fp8_grouped_mm_gathered(
    tokens_TK: Tensor,
    plan: Any,
    w_EKN: Tensor,
    offsets_E: Tensor,
    recipe: Union[str, FP8Recipe] = "delayed",
    backend: str = "torch",
    state: Optional[DelayedState] = None,
    weight_key: Optional[Hashable] = None,
    prefetched: Optional[PrefetchedWeight] = None,
) -> Optional[Tensor]:
    """``permute(tokens, plan) @ w`` per group with the permutation's gather read straight into
    the FP8 cast of the GEMM's input, so the permuted rows are never written in ``tokens``'
    dtype and read back (``scaled_mm.scaled_grouped_mm_gathered`` says which path's bits it
    matches). Runs where the native delayed-scaling casts run (the "torch" backend on CUDA);
    returns None elsewhere, and the caller permutes the tokens itself.

    Args:
        tokens_TK: the tokens ``[T, K]`` before the permutation.
        plan: the `PermutationPlan` whose rows (``R = plan.num_rows``) the GEMM takes.
        w_EKN / offsets_E / recipe / backend / state / weight_key / prefetched: as in
            `fp8_grouped_mm`.
    """
    recipe = FP8Recipe.of(recipe)
    if state is None or not gathered_cast_runs(recipe, backend, tokens_TK, w_EKN):
        return None
    return scaled_mm.scaled_grouped_mm_gathered(tokens_TK, plan, w_EKN, offsets_E, recipe, state, weight_key, prefetched)


def fp8_grouped_mm_swiglu(
    h_RF2: Tensor,
    w_EFN: Tensor,
    offsets_E: Tensor,
    recipe: Union[str, FP8Recipe] = "delayed",
    backend: str = "torch",
    state: Optional[DelayedState] = None,
    weight_key: Optional[Hashable] = None,
    prefetched: Optional[PrefetchedWeight] = None,
    combine: Optional["DeferredCombine"] = None,
) -> Optional[Tensor]:
    """``swiglu(h) @ w`` per group with the SwiGLU computed inside the FP8 cast of the GEMM's
    input, so ``silu(gate) * up`` is never written in bf16 and read back; the same bits as
    ``fp8_grouped_mm(swiglu(h), w, ...)``. Runs where the native delayed-scaling casts run (the
    "torch" backend on CUDA, a training pass); returns None elsewhere, and the caller applies
    the SwiGLU itself.

    Args:
        h_RF2: the first projection's output ``[R, 2F]`` (``[gate | up]``).
        w_EFN: the second projection's weights ``[E, F, N]``.
        offsets_E / recipe / backend / state / weight_key / prefetched: as in `fp8_grouped_mm`.
        combine: a `DeferredCombine`: return its combine of the products, ``[T, N]``, computed
            with the probabilities applied to the SwiGLU's rows (see
            ``scaled_mm.scaled_grouped_mm_swiglu``).
    """
    recipe = FP8Recipe.of(recipe)
    if not _native_delayed(recipe, backend, state, h_RF2):
        return None
    if not scaled_mm.swiglu_fusable(h_RF2, w_EFN, recipe, state):
        return None
    return scaled_mm.scaled_grouped_mm_swiglu(h_RF2, w_EFN, offsets_E, recipe, state, weight_key, prefetched, combine)
