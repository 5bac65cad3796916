"""fp32 router logits ``x @ W^T`` from bf16 tokens, on the tensor cores
(``MoEConfig(router_logits_gemm="bf16x3")``).

The router keeps its gate weight in fp32 and computes its logits in fp32 (routing decisions flip
under low precision). With bf16 tokens the plain way is ``F.linear(x.float(), W)``: an fp32 copy of
the tokens, then fp32 products on the CUDA cores (no tensor cores; TF32 is off by default and would
round the weight to 10 mantissa bits). At qwen3's block (16,384 tokens of 2,048, 128 experts) that
forward and its two backward products took 0.76 ms on an H200, ~9% of the bf16 block.

Here the products run as bf16 GEMMs with fp32 accumulation, on operands split exactly:

- a bf16 token is exact in fp32, so ``x`` is used as it is;
- the fp32 weight is the exact sum of three bf16 parts, ``W = W_hi + W_mid + W_lo`` (8 + 8 + 8
  significand bits cover fp32's 24; bf16 has fp32's exponent range). A bf16 x bf16 product is exact
  in fp32, so ``x @ W^T = x @ W_hi^T + x @ W_mid^T + x @ W_lo^T`` up to fp32 accumulation;
- the backward splits the fp32 logits' gradient ``g`` the same way. ``dx = g @ W`` keeps the six
  part products whose magnitude is at least 2^-16 of the whole (hi.hi, hi.mid, mid.hi, hi.lo,
  lo.hi, mid.mid) as one GEMM over the concatenated parts; the three dropped ones are below fp32's
  rounding. ``dW = g^T @ x`` takes g's three parts.

Every product is exact; the error is the accumulation's. The H200's tensor cores accumulate in fp32
with less care than the CUDA cores' fused multiply-adds: at 4,096 tokens of 2,048 x 128 experts the
logits were 7.3e-6 from fp64 at worst where ``F.linear`` in fp32 was 1.3e-6 (~2^-17 against ~2^-20
of the logits' scale; bf16 logits would be ~2^-8), and the top-8 of 128 experts agreed with
``F.linear``'s for all but near-tied tokens (GPU tests). Not bit for bit, so not the default. It
applies to CUDA tensors: bf16 tokens, an fp32 weight, plain tensors (not DTensors). Everything else
takes ``F.linear(x.float(), W)``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# (a, b) -> a @ b for bf16 a [M, K] and b [K, N], accumulated in fp32: on CUDA torch's bf16 GEMM with an
# fp32 output (`_cuda_mm_fp32`) or a bf16 one (`_cuda_mm_bf16`).
MatMul = Callable[[Tensor, Tensor], Tensor]


def _cuda_mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


def _cuda_mm_bf16(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b)


def split_bf16x3(t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``t`` as three bf16 tensors whose fp32 sum is ``t`` exactly (round to nearest at each
    step; each remainder is exact in fp32), for magnitudes between 2^-100 (below, the low parts
    underflow) and bf16's largest finite value (above, the high part overflows): a router's gate
    weights lie far inside."""
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def _sum_thirds(t: Tensor, dim: int) -> Tensor:
    """The three equal blocks of ``t`` along ``dim`` (the hi, mid and lo parts' products) summed in
    that order."""
    hi, mid, lo = t.chunk(3, dim=dim)
    return (hi + mid) + lo


class _SplitRouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD: Tensor, w_ED: Tensor, mm_fp32: MatMul, mm_bf16: MatMul) -> Tensor:
        w_parts = split_bf16x3(w_ED)
        logits_T3E = mm_fp32(x_TD, torch.cat(w_parts, 0).t())
        ctx.save_for_backward(x_TD, *w_parts)
        ctx.mm_fp32, ctx.mm_bf16 = mm_fp32, mm_bf16
        return _sum_thirds(logits_T3E, 1)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_TE: Tensor) -> tuple[Tensor | None, ...]:
        x_TD, w_hi, w_mid, w_lo = ctx.saved_tensors
        g_hi, g_mid, g_lo = split_bf16x3(g_TE.float().contiguous())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # the six part products of g @ W down to 2^-16 of the whole, as one contraction over 6E
            g_T6E = torch.cat([g_hi, g_hi, g_mid, g_hi, g_lo, g_mid], 1)
            w_6ED = torch.cat([w_hi, w_mid, w_hi, w_lo, w_hi, w_mid], 0)
            # fp32 accumulation rounded to x's dtype (cuBLAS may reduce split-K partials in bf16 where
            # torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction allows it)
            dx = ctx.mm_bf16(g_T6E, w_6ED)
        if ctx.needs_input_grad[1]:
            dw = _sum_thirds(ctx.mm_fp32(torch.cat([g_hi, g_mid, g_lo], 1).t(), x_TD), 0)
        return dx, dw, None, None


def split_applies(x_TD: Tensor, w_ED: Tensor) -> bool:
    """Whether `router_logits` takes the split bf16 products for these operands: bf16 tokens and an
    fp32 weight, plain 2-D CUDA tensors (not DTensors), on NVIDIA's CUDA (ROCm's bf16 GEMMs with
    fp32 outputs are not available everywhere)."""
    return (x_TD.is_cuda and w_ED.is_cuda and torch.version.hip is None and x_TD.dtype == torch.bfloat16
            and w_ED.dtype == torch.float32 and x_TD.dim() == 2 and type(x_TD) is Tensor
            and type(w_ED) in (Tensor, torch.nn.Parameter))


_WARNED: set[tuple] = set()


def _warn_fallback(x_TD: Tensor, w_ED: Tensor) -> None:
    """Say once per kind of operands that ``router_logits_gemm="bf16x3"`` falls back to fp32 products."""
    key = (x_TD.dtype, x_TD.device.type, w_ED.dtype, type(x_TD).__name__, type(w_ED).__name__)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"router_logits_gemm='bf16x3' needs bf16 tokens and an fp32 gate weight as plain CUDA tensors; the "
            f"router got {x_TD.dtype} {type(x_TD).__name__} tokens on {x_TD.device.type} and a {w_ED.dtype} "
            f"{type(w_ED).__name__} weight, so its logits are fp32 products (as router_logits_gemm='fp32'). Run "
            "the model's activations in bf16 (e.g. precision='bf16-true') to use it, or set "
            "router_logits_gemm='fp32'.", stacklevel=3)


def router_logits(x_TD: Tensor, w_ED: Tensor, split: bool = False) -> Tensor:
    """fp32 logits ``[T, E]`` = ``x [T, D] @ w [E, D]^T``, whatever autocast says: with ``split``, by
    the split bf16 products (module docstring) for bf16 CUDA tokens and an fp32 weight; else (and for
    other operands) ``F.linear`` in fp32."""
    with torch.autocast(device_type=x_TD.device.type, enabled=False):
        if split:
            if split_applies(x_TD, w_ED):
                return _SplitRouterLogits.apply(x_TD.contiguous(), w_ED, _cuda_mm_fp32, _cuda_mm_bf16)
            _warn_fallback(x_TD, w_ED)
        if x_TD.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and w_ED.dtype == torch.float32:
            return _WidenedRouterLogits.apply(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED.to(torch.float32))


class _WidenedRouterLogits(torch.autograd.Function):
    """``F.linear(x.float(), W)`` that keeps ``x`` in its own dtype for the backward and widens it
    again there, instead of keeping the fp32 copy that autograd would save (4 bytes a token and
    dimension against 2; in a block the bf16 tokens are the experts' saved input too, so they cost
    nothing more). The backward's products are those autograd's ``mm`` formulas take for this
    layout (``dx = g @ W`` rounded to x's dtype, ``dW = g^T @ x``), on the same fp32 operands: the
    same bits."""

    @staticmethod
    def forward(ctx: Any, x_TD: Tensor, w_ED: Tensor) -> Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_TE: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x_TD, w_ED = ctx.saved_tensors
        dx = dw = None
        with torch.autocast(device_type=g_TE.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = g_TE.mm(w_ED).to(x_TD.dtype)
            if ctx.needs_input_grad[1]:
                dw = g_TE.t().mm(x_TD.float())
        return dx, dw


def split_router_logits(x_TD: Tensor, w_ED: Tensor, mm_fp32: MatMul, mm_bf16: MatMul) -> Tensor:
    """The split path with given GEMMs (tests run it on CPU, where torch has no bf16 GEMM with an
    fp32 output, through fp32 products of the bf16 parts)."""
    return _SplitRouterLogits.apply(x_TD, w_ED, mm_fp32, mm_bf16)
