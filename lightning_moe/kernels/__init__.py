"""Own GPU kernels (Triton) for the memory-bound parts of the MoE block.

Each kernel has a plain-torch twin that runs on CPU and serves as its reference; callers go
through the dispatching functions, which pick Triton for CUDA tensors when Triton imports.
"""

from __future__ import annotations

import functools

import torch

# The FP8 weight-gradient kernel's token groups start at multiples of this many columns of its
# operands, the gaps zero (``fp8_grouped_gemm_triton.grouped_mm_wgrad``): a tile's contraction
# then never reads the next group's tokens, so every block comes in by TMA and goes to the tensor
# cores untouched (masking the next group's tokens in registers ran at 0.43-0.88x torch's kernel).
# Here, without Triton, for the layout's host-side helpers.
WGRAD_GROUP_ALIGN = 128


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and a CUDA device exists (checked once)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def accumulate_widened_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst += src`` (``src`` in a narrower float dtype, ``dst`` the same number of elements,
    both contiguous): bf16 into fp32 on a GPU with Triton in one pass
    (``widen_triton.accumulate_widened_``), else torch's in-place add, which computes in ``dst``'s
    dtype. The same bits either way."""
    if dst.dtype == torch.float32 and src.dtype == torch.bfloat16 and use_triton(dst):
        from lightning_moe.kernels.widen_triton import accumulate_widened_ as triton_accumulate

        return triton_accumulate(dst, src.contiguous())
    return dst.add_(src.view(dst.shape))


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``; bf16 to fp32 on a GPU with Triton through ``widen_triton.widen_to_fp32``
    (one vectorized pass, where torch's copy runs its per-element casting loop at about half the
    bandwidth). The same values either way."""
    if t.dtype == torch.bfloat16 and dtype == torch.float32 and use_triton(t):
        from lightning_moe.kernels.widen_triton import widen_to_fp32

        return widen_to_fp32(t.contiguous())
    return t.to(dtype)
