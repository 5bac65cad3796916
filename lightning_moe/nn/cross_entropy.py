"""Mean cross-entropy of a language-model head's logits, in fp32, for large vocabularies.

`cross_entropy_mean` is ``F.cross_entropy(logits.float(), labels, ignore_index, reduction="sum")``
divided by the number of kept labels (0, not NaN, when there are none). In training on a GPU with
Triton, one kernel computes the loss and its gradient together
(`kernels.cross_entropy_triton`): no fp32 copy of the logits, no saved log-softmax, and the
backward only scales the stored gradient. Elsewhere (CPU, no gradient, tensor subclasses) the
autograd formulation runs.
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
    """The loss and its gradient from one kernel; the backward scales the gradient in place (it
    runs once: first order only)."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, labels_N: Tensor, ignore_index: int) -> Tensor:
        from lightning_moe.kernels.cross_entropy_triton import cross_entropy_mean_and_grad

        loss, grad_NV = cross_entropy_mean_and_grad(logits_NV, labels_N, ignore_index)
        ctx.save_for_backward(grad_NV)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor) -> tuple[Optional[Tensor], None, None]:
        (grad_NV,) = ctx.saved_tensors
        # In the logits' dtype: a power-of-two factor (1 / accumulation steps) scales exactly.
        return grad_NV.mul_(grad_loss), None, None


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
