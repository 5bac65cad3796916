"""Mean cross-entropy of a language-model head's logits, in fp32, for large vocabularies.

`cross_entropy_mean` is ``F.cross_entropy(logits.float(), labels, ignore_index, reduction="sum")``
divided by the number of kept labels (0, not NaN, when there are none). In training on a GPU with
Triton, two kernels (`kernels.cross_entropy_triton`) replace it: the forward reads the logits once
for each row's log-sum-exp and the loss, and keeps the logits (the tensor the caller passed, not a
copy), the labels, the ``[N]`` fp32 log-sum-exps and the kept count; the backward reads the logits
once more and writes their gradient, ``(softmax - onehot) * grad_loss / kept``, once, into a new
tensor in the logits' dtype, reading ``grad_loss`` on the device. No fp32 copy of the logits, no
saved log-softmax and no gradient buffer is held from the forward to the backward: what is held is
the logits themselves (a language-model head's logits, which nothing else keeps, then live until
the backward instead of a gradient of their size; where the caller keeps the logits anyway, that
gradient's memory is saved). Elsewhere (CPU, no gradient, tensor subclasses) the autograd
formulation runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.kernels import use_triton

# The fused kernel where it can run; benchmarks comparing it with the autograd formulation set this False.
FUSED_KERNEL = True


class _FusedCrossEntropyMean(torch.autograd.Function):
    """The loss from one read of the logits; the backward computes their gradient from the saved
    logits and log-sum-exps (it runs once: first order only)."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, labels_N: Tensor, ignore_index: int) -> Tensor:
        from lightning_moe.kernels.cross_entropy_triton import cross_entropy_forward

        loss, lse_N, kept = cross_entropy_forward(logits_NV, labels_N, ignore_index)
        ctx.save_for_backward(logits_NV, labels_N, lse_N, kept)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor) -> tuple[Optional[Tensor], None, None]:
        from lightning_moe.kernels.cross_entropy_triton import cross_entropy_backward

        logits_NV, labels_N, lse_N, kept = ctx.saved_tensors
        # grad_loss / kept in fp32 before the one rounding to the logits' dtype (a power-of-two
        # grad_loss, 1 / accumulation steps, gives the bits of scaling the rounded gradient)
        return cross_entropy_backward(logits_NV, labels_N, lse_N, kept, grad_loss, ctx.ignore_index), None, None


def _fused(logits_NV: Tensor) -> bool:
    return (FUSED_KERNEL and logits_NV.requires_grad and torch.is_grad_enabled() and type(logits_NV) is Tensor
            and logits_NV.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and logits_NV.stride(1) == 1 and use_triton(logits_NV))


def cross_entropy_mean(logits_NV: Tensor, labels_N: Tensor, ignore_index: int = -100) -> Tensor:
    """fp32 mean cross-entropy of ``logits_NV`` ``[N, V]`` against ``labels_N`` ``[N]`` over the rows
    whose label is not ``ignore_index``; 0 when every label is ignored. The kept count stays on the
    device (no host sync)."""
    if _fused(logits_NV):
        return _FusedCrossEntropyMean.apply(logits_NV, labels_N, ignore_index)
    total = F.cross_entropy(logits_NV.float(), labels_N, ignore_index=ignore_index, reduction="sum")
    return total / (labels_N != ignore_index).sum().clamp(min=1)
