"""The delayed-scaling float8 cast's tile kernel in CUDA C (``cuda/fp8_delayed_cast.cu``) for the
operands it covers: bf16, plain or gathered through a permutation, with a transposed copy (the
activations of the grouped GEMMs and the expert weights). `fp8_delayed_triton.delayed_cast` takes it
where `applies` says so and `CUDA_CASTS` is on; everything else (the SwiGLU kinds, fp32 operands,
the row copy alone, E5M2) stays on the Triton kernels. The same bytes either way (the GPU test compares
every output).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

# On by default where NVRTC compiles the kernel: it runs the bf16 plain and gathered casts faster than the
# Triton kernel, which casts every other operand kind (the SwiGLU's, fp32 and fp16 operands) and takes these
# where NVRTC or torch's private loader of it is unavailable. Escape hatch: ``LIGHTNING_MOE_CAST_CUDA=0``
# casts with the Triton kernel everywhere; ``=1`` fails instead of falling back where the kernel cannot be
# compiled. Benchmarks comparing the two set `CUDA_CASTS`.
_SETTING = os.environ.get("LIGHTNING_MOE_CAST_CUDA", "auto")
if _SETTING not in ("0", "1", "auto"):
    raise ValueError(f"LIGHTNING_MOE_CAST_CUDA={_SETTING!r}: use 0 (Triton casts), 1 (the CUDA cast, failing where it "
                     "cannot compile) or auto (the default: the CUDA cast where it compiles)")
CUDA_CASTS: bool = _SETTING != "0"

_THREADS = 128
# A block's 4 warps side by side in columns: 1 (a block 128 rows x 64 columns per pass), 2 or 4 (32 x 256).
WARPS_ACROSS = 1
# Blocks per multiprocessor the kernel's registers are capped for (``__launch_bounds__``): 4 -> 128 registers
# per thread, 6 -> 80, both without spills (offline sm90). 4 was the fastest in every case of
# `benchmarks/cast_backends.py` (about 6% ahead of 6 on qwen3's gathered operand, 4% on the plain one).
MIN_BLOCKS = 4
_SIGNATURE = "ppppppppppqiiiqq"


def applies(x_RC: Tensor, cols: int, offsets_G: Tensor, swiglu: bool, out_col: Optional[Tensor], e5m2: bool,
            gather_rows: Optional[Tensor]) -> bool:
    """Whether the CUDA kernel casts this operand: bf16 ``x`` on a CUDA device with 16-byte aligned rows
    (``cols`` a multiple of 8) and fewer than 2^31 of them (the kernel's int32 token index), int32 group
    ends, not the SwiGLU kind, a transposed copy asked for (the tile kernel's case), E4M3, int64 gather
    indices; and `CUDA_CASTS` on. Not while ``torch.compile`` traces: it traces user Triton kernels, not a
    driver launch through ctypes."""
    return (CUDA_CASTS and not torch.compiler.is_compiling() and x_RC.is_cuda and x_RC.dtype == torch.bfloat16
            and x_RC.shape[0] < 2**31 and cols % 8 == 0 and x_RC.data_ptr() % 16 == 0 and not swiglu
            and out_col is not None and not e5m2 and offsets_G.dtype == torch.int32
            and (gather_rows is None or gather_rows.dtype == torch.int64) and _available(x_RC.device.index))


@functools.lru_cache(maxsize=None)
def _available(device: int) -> bool:
    """Whether the kernel compiles on ``device`` (tried once per device); warns once and falls back to
    the Triton kernel where it does not, unless ``LIGHTNING_MOE_CAST_CUDA=1`` asked for it."""
    try:
        _kernel(device, True, True, True, 128)
    except Exception as error:  # NVRTC missing or refusing the source: the Triton kernel casts instead
        if _SETTING == "1":
            raise RuntimeError(f"LIGHTNING_MOE_CAST_CUDA=1, but the CUDA cast kernel does not compile: {error}. "
                               "Unset it to fall back to the Triton kernel.") from error
        warnings.warn(f"The CUDA float8 cast kernel is unavailable ({error}); the Triton kernel casts instead.",
                      stacklevel=3)
        return False
    return True


def _kernel(device: int, gather: bool, write_row: bool, record: bool, align: int):
    from lightning_moe.kernels.cuda_launch import compiled

    macros = (("GATHER", int(gather)), ("WRITE_ROW", int(write_row)), ("RECORD", int(record)), ("ALIGN", align),
              ("MIN_BLOCKS", MIN_BLOCKS), ("WARPS_ACROSS", WARPS_ACROSS))
    return compiled("fp8_delayed_cast.cu", "fp8_delayed_cast", _SIGNATURE, macros, device)


def launch_delayed_cast(x_RC: Tensor, rows: int, cols: int, offsets_G: Tensor, scale_G: Tensor,
                        record_G: Optional[Tensor], q_row: Optional[Tensor], s_row: Optional[Tensor],
                        out_col: Tensor, s_col: Tensor, stride_out_col: int, stride_out_group: int,
                        gather_rows: Optional[Tensor], aligned_ends: Optional[Tensor]) -> None:
    """`fp8_delayed_triton._launch_delayed_cast`'s tile case on the CUDA kernel (arguments as there;
    ``scale_G`` already filled where a pre-pass ran)."""
    from lightning_moe.kernels import WGRAD_GROUP_ALIGN

    groups = offsets_G.numel()
    write_row = q_row is not None
    kernel = _kernel(x_RC.device.index, gather_rows is not None, write_row, record_G is not None,
                     0 if aligned_ends is None else WGRAD_GROUP_ALIGN)
    grid = (-(-cols // (64 * WARPS_ACROSS)), groups + 1 if write_row else groups, 1)
    kernel.launch(grid, (_THREADS, 1, 1), [
        x_RC, gather_rows, offsets_G, scale_G, q_row, s_row, out_col, s_col, record_G,
        None if aligned_ends is None else aligned_ends.contiguous(), rows, cols, groups, x_RC.shape[0],
        stride_out_col, stride_out_group])
