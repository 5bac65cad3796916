"""A language-model head's projection and mean cross-entropy, chunked over tokens: no ``[T, V]`` logits.

``linear_cross_entropy_mean(h, w, labels)`` is ``cross_entropy_mean(h @ w.T, labels)`` (the mean
fp32 cross-entropy over the tokens whose label is not ``ignore_index``, 0 when there are none, the
kept count on the device), computed ``chunk_tokens`` rows at a time, as Liger-Kernel's
FusedLinearCrossEntropy and Megatron / NeMo's fused linear cross-entropy do: for each chunk of
tokens the forward computes the logits ``h_c @ w.T`` (``[C, V]``), each row's loss and the
gradient of the logits for a unit gradient of the mean loss, ``(softmax - onehot) / kept``, then at
once the chunk's input gradient ``dh_c = grad_c @ w`` and its share of the weight gradient ``dw +=
grad_c.T @ h_c`` (an fp32 accumulator), and drops the chunk's logits. The backward only scales
``dh`` and ``dw`` by the loss's gradient (a 0-dim device tensor: no host sync) and hands them on.

Memory, for T tokens, a vocabulary of V words and width D (bf16 activations): the unchunked head
keeps ``T x V`` logits from the forward to the backward and writes a gradient of that size in the
backward (2 x 2.5 GB for qwen3's 151,936 words at 8,192 tokens); here at most ``C x V`` logits
exist at a time (their gradient is written over them on a GPU), and what is held from the forward
to the backward is ``dh`` (``T x D``, the activations' dtype) and the fp32 ``dw`` (``V x D``: 1.2 GB
for qwen3's head; that of the unchunked head's bf16 weight gradient is made in the backward either
way). The GEMM FLOPs are the same (three products of the head's size).

Numerics: on a GPU the per-chunk loss and gradient come from the fused cross-entropy's kernels
(`kernels.cross_entropy_triton.cross_entropy_rows_and_grad_`: the same fp32 arithmetic and bits as
`cross_entropy_mean`'s); elsewhere from ``F.cross_entropy`` on the chunk's fp32 logits and its
autograd gradient, scaled as `cross_entropy_mean`'s autograd formulation scales it. The logits'
gradient is rounded to their dtype for a unit loss gradient and ``dh`` is rounded once per chunk;
the loss's gradient multiplies them afterwards (a power of two, ``1 / accumulation steps``, changes
no bit). ``dw`` sums the chunks' products in fp32 and is rounded once to the weight's dtype in the
backward, so it differs from the one-GEMM weight gradient by the order of the fp32 sums (and, on
CPU, by the products being computed in fp32).

The weight: pass the one the model multiplies with (`compute_weights.compute_weight` of the
parameter: the cached bf16 cast under bf16-mixed training, whose backward widens the gradient into
the fp32 ``.grad``, in place where `ComputeWeightCache(accumulate_grads_in_place=True)` says so).
An fp32 weight that is itself a parameter gets the same in-place accumulation here
(`compute_weights.in_place_accumulation_target`). A tied embedding's weight works as any other: the
gradient reaches the shared parameter.

Not for tensor subclasses (DTensor: a vocabulary-parallel head under tensor parallelism): the
caller keeps the unchunked path there (`MoEDecoder` does).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.kernels import use_triton
from lightning_moe.nn.compute_weights import accumulation_grad, in_place_accumulation_target

# An fp32 ``out_dtype`` for bf16 / fp16 GEMMs (CUDA): None until the first try tells.
_FP32_OUT_GEMM: Optional[bool] = None


def linear_cross_entropy_supported(h: Tensor, w: Tensor) -> bool:
    """Whether `linear_cross_entropy_mean` takes these operands: plain tensors (no DTensor or other
    subclass), 2-D, of one floating dtype after the caller's cast, on one device."""
    return (_plain(h) and _plain(w) and w.dim() == 2
            and h.shape[-1] == w.shape[1] and h.device == w.device
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _plain(t: Tensor) -> bool:
    return type(t) in (Tensor, torch.nn.Parameter) and type(t.data) is Tensor


def linear_cross_entropy_mean(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int = -100,
                              chunk_tokens: int = 2048, accumulate_in_place: bool = True) -> Tensor:
    """fp32 mean cross-entropy of ``h_TD @ w_VD.T`` against ``labels_T`` over the rows whose label is
    not ``ignore_index`` (0 when every label is ignored), ``chunk_tokens`` rows of logits at a time
    (module docstring). ``h_TD``: ``[T, D]`` (any leading shape is flattened), cast to ``w_VD``'s
    dtype as a linear under autocast casts it; ``w_VD``: the ``[V, D]`` weight the model multiplies
    with. Without gradients (evaluation) only the chunked loss is computed.

    ``accumulate_in_place``: an fp32 parameter ``w_VD`` may get its gradient added into its ``.grad``
    in the backward where `in_place_accumulation_target` allows it; pass False where the parameter
    also gets a gradient elsewhere in the same backward (a tied embedding: autograd sums the two
    gradients before adding them to ``.grad``, whose bits an in-place add of one of them first
    would not give)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    if not linear_cross_entropy_supported(h_TD, w_VD):
        raise ValueError("linear_cross_entropy_mean takes plain tensors h [T, D] and w [V, D] of a float dtype "
                         f"(got {type(h_TD).__name__} {tuple(h_TD.shape)}, {type(w_VD).__name__} "
                         f"{tuple(w_VD.shape)} {w_VD.dtype}); use cross_entropy_mean on the logits instead.")
    h_TD = h_TD.reshape(-1, h_TD.shape[-1]).to(w_VD.dtype)
    labels_T = labels_T.reshape(-1)
    if labels_T.shape[0] != h_TD.shape[0]:
        raise ValueError(f"labels {labels_T.shape[0]} do not match the hidden states' {h_TD.shape[0]} tokens.")
    if torch.is_grad_enabled() and (h_TD.requires_grad or w_VD.requires_grad):
        in_place = accumulate_in_place and w_VD.dtype == torch.float32
        target = in_place_accumulation_target(w_VD) if in_place else None
        return _LinearCrossEntropyMean.apply(h_TD, w_VD, labels_T, ignore_index, chunk_tokens, (target,))
    with torch.no_grad():
        loss, _, _ = _chunked(h_TD, w_VD, labels_T, ignore_index, chunk_tokens, False, False)
    return loss


class _LinearCrossEntropyMean(torch.autograd.Function):
    """The loss, ``dh`` and ``dw`` in the forward, chunk by chunk; the backward scales them (first
    order only)."""

    @staticmethod
    def forward(ctx, h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int, chunk_tokens: int,
                accumulate_into: tuple[Optional[Tensor]]) -> Tensor:
        ctx.set_materialize_grads(False)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh_TD, dw_VD = _chunked(h_TD, w_VD, labels_T, ignore_index, chunk_tokens, need_h, need_w)
        ctx.save_for_backward(dh_TD, dw_VD)
        # A reference in a tuple (not an input: no second edge to the parameter's AccumulateGrad).
        (ctx.accumulate_into,) = accumulate_into
        ctx.h_dtype, ctx.w_dtype = h_TD.dtype, w_VD.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Optional[Tensor]):
        none = (None, None, None, None)
        if grad_loss is None:
            return (None, None, *none)
        dh_TD, dw_VD = ctx.saved_tensors
        scale = grad_loss.detach().to(dtype=torch.float32).reshape(())  # read on the device
        grad_h = None
        if dh_TD is not None:
            grad_h = (dh_TD.float() * scale).to(ctx.h_dtype) if dh_TD.dtype != torch.float32 else dh_TD * scale
        grad_w = None
        if dw_VD is not None:
            main_grad = accumulation_grad(ctx.accumulate_into, dw_VD.numel())
            if main_grad is not None:  # autograd's bits: the scaled gradient, then .grad += it
                main_grad.add_(dw_VD.mul_(scale).view(main_grad.shape))
            else:  # scaled in fp32 and rounded to the weight's dtype in one pass
                grad_w = torch.mul(dw_VD, scale, out=torch.empty(dw_VD.shape, dtype=ctx.w_dtype, device=dw_VD.device))
        return (grad_h, grad_w, *none)


def _chunked(h_TD: Tensor, w_VD: Tensor, labels_T: Tensor, ignore_index: int, chunk_tokens: int,
             need_h: bool, need_w: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(mean loss, ``dh`` for a unit loss gradient or None, fp32 ``dw`` for it or None)."""
    tokens, vocab = h_TD.shape[0], w_VD.shape[0]
    device = h_TD.device
    kept_T = labels_T != ignore_index
    kept = kept_T.sum()  # on the device
    torch._assert_async(((labels_T >= 0) & (labels_T < vocab) | ~kept_T).all(),
                        "cross-entropy label outside the vocabulary")
    loss_T = torch.empty(tokens, dtype=torch.float32, device=device)
    grads = need_h or need_w
    dh_TD = torch.empty_like(h_TD, memory_format=torch.contiguous_format) if need_h else None
    dw_VD = None
    if need_w:  # the first chunk's product is written, not added (no fill, no read); no chunk: zeros
        dw_VD = (torch.empty if tokens else torch.zeros)(w_VD.shape, dtype=torch.float32, device=device)
    fused = use_triton(h_TD) and h_TD.dtype in (torch.bfloat16, torch.float16, torch.float32)
    inv_kept = 1.0 / kept.clamp(min=1).to(torch.float32)  # the unchunked mean's division, as its backward scales
    w_t = w_VD.t()
    with torch.autocast(device.type, enabled=False):  # the dtypes are the caller's (h cast to w's)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            h_c, labels_c = h_TD[start:end], labels_T[start:end]
            logits_c = torch.mm(h_c, w_t)
            if fused:
                from lightning_moe.kernels.cross_entropy_triton import cross_entropy_rows_and_grad_

                grad_c = cross_entropy_rows_and_grad_(logits_c, labels_c, loss_T[start:end], kept, ignore_index)
            else:
                grad_c = _eager_rows_and_grad(logits_c, labels_c, loss_T[start:end], inv_kept, ignore_index, grads)
            del logits_c
            if need_h:
                torch.mm(grad_c, w_VD, out=dh_TD[start:end])
            if need_w:
                _accumulate_fp32_(dw_VD, grad_c.t(), h_c, first=start == 0)
            del grad_c
    loss = loss_T.sum() / kept.clamp(min=1)
    return loss, dh_TD, dw_VD


def _eager_rows_and_grad(logits_CV: Tensor, labels_C: Tensor, loss_C: Tensor, inv_kept: Tensor, ignore_index: int,
                         grads: bool) -> Optional[Tensor]:
    """The rows' losses into ``loss_C`` and the logits' gradient for a unit gradient of the mean
    loss: ``F.cross_entropy`` on fp32 logits and its autograd, with the ``1 / kept`` factor that the
    unchunked mean's backward applies (the same bits as `cross_entropy_mean`'s autograd gradient for
    a unit loss gradient)."""
    with torch.enable_grad():
        x = logits_CV.detach().requires_grad_(grads)
        rows = F.cross_entropy(x.float(), labels_C, ignore_index=ignore_index, reduction="none")
        loss_C.copy_(rows.detach())
        if not grads:
            return None
        (grad,) = torch.autograd.grad(rows, x, grad_outputs=inv_kept.expand(rows.shape))
    return grad


def _accumulate_fp32_(acc: Tensor, a: Tensor, b: Tensor, first: bool = False) -> None:
    """``acc += a @ b`` with fp32 ``acc``: on CUDA a bf16 / fp16 GEMM with an fp32 output added into
    ``acc`` by cuBLAS (no rounding of the chunk's product to 16 bits; where this torch lacks the
    in-place form, an fp32-output product then an add), else the product of the fp32 operands.
    ``first``: ``acc = a @ b`` (its contents are not read)."""
    global _FP32_OUT_GEMM
    beta = 0 if first else 1
    if a.dtype == torch.float32:
        acc.addmm_(a, b, beta=beta)
        return
    if a.is_cuda:
        if _FP32_OUT_GEMM is not False:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, out=acc)
                _FP32_OUT_GEMM = True
                return
            except (RuntimeError, TypeError):
                if _FP32_OUT_GEMM:
                    raise
                _FP32_OUT_GEMM = False
        try:
            product = torch.mm(a, b, out_dtype=torch.float32)
            acc.copy_(product) if first else acc.add_(product)
            return
        except (RuntimeError, TypeError):
            pass
    acc.addmm_(a.float(), b.float(), beta=beta)
