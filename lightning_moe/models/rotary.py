"""Queries' or keys' per-head RMSNorm (optional) and rotary embedding: `norm_rotary`.

The eager formulation is ``apply_rotary(norm(x), cos, sin)`` (`layers.RMSNorm` in fp32 returning
``x.dtype``, then `layers.apply_rotary` in fp32): about ten fp32 full-size temporaries of each
of q and k forward and more kernels in backward. On a GPU with Triton one kernel each way does
it, with or without gradients (`kernels.rotary_triton`): the same rounding points (the normed value rounded
to the activation dtype before the rotation), within one unit in the last place of eager.
Elsewhere (CPU, tensor subclasses such as a tensor-parallel DTensor weight, a norm
module with hooks, which the fused path would not call) the eager formulation runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_moe.kernels import use_triton
from lightning_moe.models.layers import RMSNorm, apply_rotary

# The fused kernel where it can run; benchmarks comparing it with the eager formulation set this False.
FUSED_KERNEL = True

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _FusedNormRotary(torch.autograd.Function):
    """`kernels.rotary_triton` forward and backward; saves only ``x`` (in its dtype), the weight and
    the tables, and recomputes the norm's statistic in backward (first order only)."""

    @staticmethod
    def forward(ctx, x_BSHd: Tensor, weight: Optional[Tensor], cos: Tensor, sin: Tensor, eps: float) -> Tensor:
        from lightning_moe.kernels.rotary_triton import norm_rotary_forward

        ctx.save_for_backward(x_BSHd, weight, cos, sin)
        ctx.eps = eps
        return norm_rotary_forward(x_BSHd, weight, cos, sin, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy_BSHd: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None, None, None]:
        from lightning_moe.kernels.rotary_triton import norm_rotary_backward

        x_BSHd, weight, cos, sin = ctx.saved_tensors
        dx, dw = norm_rotary_backward(dy_BSHd, x_BSHd, weight, cos, sin, ctx.eps)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None, None)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` would run hooks besides its forward (its own or global ones)."""
    from torch.nn.modules import module as module_state

    return bool(module._forward_hooks or module._forward_pre_hooks or module_state._global_forward_hooks
                or module_state._global_forward_pre_hooks)


def _plain_norm(norm: Optional[nn.Module], hd: int) -> bool:
    if norm is None:
        return True
    return (type(norm) is RMSNorm and type(norm.weight) in (Tensor, nn.Parameter)
            and norm.weight.shape == (hd,) and norm.weight.dtype in _DTYPES and not _hooked(norm))


def _fused(x_BSHd: Tensor, cos: Tensor, sin: Tensor, norm: Optional[nn.Module]) -> bool:
    # Not conditioned on grad mode: a recomputed block (activation checkpointing) must give the
    # bits its first forward gave, and that forward may run without gradients.
    if not (FUSED_KERNEL and type(x_BSHd) is Tensor and x_BSHd.dim() == 4):
        return False
    hd = x_BSHd.shape[-1]
    return (x_BSHd.dtype in _DTYPES and hd % 2 == 0 and _plain_norm(norm, hd)
            and all(type(t) is Tensor and t.dtype == torch.float32 and not t.requires_grad
                    and t.shape[-2:] == (x_BSHd.shape[1], hd)
                    and (t.dim() == 2 or (t.dim() == 3 and t.shape[0] in (1, x_BSHd.shape[0])))
                    for t in (cos, sin))
            and use_triton(x_BSHd))


def norm_rotary(x_BSHd: Tensor, cos: Tensor, sin: Tensor, norm: Optional[nn.Module] = None) -> Tensor:
    """``apply_rotary(norm(x), cos, sin)`` (without ``norm``: ``apply_rotary(x, cos, sin)``) of
    ``x`` ``[B, S, H, hd]`` with fp32 ``cos``/``sin`` ``[S, hd]`` or ``[B, S, hd]``; ``norm`` an
    `RMSNorm` over one head. Fused on a GPU with Triton (see the module docstring)."""
    if _fused(x_BSHd, cos, sin, norm):
        weight = None if norm is None else norm.weight
        return _FusedNormRotary.apply(x_BSHd, weight, cos, sin, 0.0 if norm is None else float(norm.eps))
    if norm is not None:
        x_BSHd = norm(x_BSHd)
    return apply_rotary(x_BSHd, cos, sin)
