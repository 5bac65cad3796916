"""The native FP8 backend's GEMMs: ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` and our Triton
grouped kernels, on operands already cast (`precision.native_casts`).

- ``_scaled_mm(a [M, K] row-major, b [K, N] column-major, scale_a, scale_b)``: tensorwise
  scales are fp32 scalars, rowwise ``[M, 1]`` and ``[1, N]``; the contraction must be a
  multiple of 16 (the token dimension is zero-padded for the weight gradient);
- ``_scaled_grouped_mm`` (rowwise only): 2-D x 3-D ``x [R, K]`` with ``w [E, K, N]``
  column-major per expert, scales ``[R]`` and ``[E, N]``; 2-D x 2-D for the weight
  gradient, groups along the contraction, scales ``[E * K]`` and ``[E * N]`` (group-major).
  The grouped kernels take E4M3 only.
- with at most `PER_EXPERT_MAX_EXPERTS` experts, one ``_scaled_mm`` per expert instead of
  the grouped kernel (faster for few large experts; costs one host sync per layer forward for
  the group sizes). Under CUDA-graph capture the grouped kernel is used.
- on Hopper with Triton, the grouped products (fast or split accumulation) run on our own kernels
  (``kernels.fp8_grouped_gemm_triton``: no host sync; `TRITON_GROUPED_GEMM`; split-accumulation
  forward and data-gradient products over large experts on torch's grouped kernel,
  `SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS`; an fp32 master weight's gradient is written in
  fp32, not rounded to bf16 as torch's grouped kernel's). The
  weight gradient's kernel reads its transposed operands in an aligned group layout
  (`native_casts.wgrad_aligned_ends`) so that no contraction block crosses into the next group.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.kernels import accumulate_widened_, widened
from lightning_moe.precision.native_casts import ALIGN, local_triton_operands, once_per_version


def pad_fp8(q: Tensor, multiple: int = ALIGN) -> Tensor:
    """Zero-pad the last dimension of a float8 tensor (zero bits are +0.0 in E4M3 / E5M2)."""
    pad = (-q.shape[-1]) % multiple
    return F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype) if pad else q


# A dense linear's float8 transposes (its backward's output gradient, input and weight) by the tiled
# byte transpose of ``kernels.transpose_triton`` (128 x 128 byte tiles, 16-byte loads and stores)
# instead of torch's elementwise copy, which moves one byte a thread and reads across rows. The same
# bytes (GPU and interpreter tests); the qwen3-shaped FP8 step measured 6.8% faster at accumulate 8
# (benchmarks/NOTES.md). Benchmarks patch it off (`train_step.py --tiled-fp8-transposes off`).
TILED_FP8_TRANSPOSES = True


def transposed_fp8(q: Tensor, multiple: int = 1) -> Tensor:
    """``q [R, C]`` float8 transposed into a contiguous ``[C, R]``, ``R`` padded to ``multiple`` with
    zero columns where the tiled kernel runs (`TILED_FP8_TRANSPOSES`, a local tensor on a GPU; a
    caller that pads afterwards, as `pad_fp8` does, gets the same bytes either way)."""
    # Not a DTensor (a tensor-parallel shard): a Triton kernel sees only a local tensor's memory.
    if TILED_FP8_TRANSPOSES and local_triton_operands(q):
        from lightning_moe.kernels.transpose_triton import transpose_bytes

        return transpose_bytes(q, multiple)
    return q.t().contiguous()


def column_major(q: Tensor) -> Tensor:
    """Same values, column-major storage (``_scaled_mm``'s second operand)."""
    return q.t().contiguous().t()


def scaled_mm_rows(a: Tensor, sa: Tensor, b_rows: Tensor, sb: Tensor, out_dtype: torch.dtype, fast: bool,
                   accumulate_into: Optional[Tensor] = None) -> Optional[Tensor]:
    """``a @ b_rows.T`` where both are laid out ``[other, contraction]`` (row-major).
    ``accumulate_into``: a contiguous fp32 tensor of the product's elements (a weight's ``.grad``)
    that the product is added into instead of returned (None returned). ``_scaled_mm`` has no
    beta, so the add is a pass of its own, in one read of a bf16 product (`accumulate_widened_`):
    the bits of returning the product in ``out_dtype`` fp32 and adding it."""
    rowwise = sa.numel() > 1 or sb.numel() > 1
    dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise kernels write bf16 only
    scale_a, scale_b = (sa.reshape(-1, 1), sb.reshape(1, -1)) if rowwise else (sa.reshape(()), sb.reshape(()))
    out = torch._scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                           out_dtype=dtype, use_fast_accum=fast)
    if accumulate_into is not None:
        accumulate_widened_(accumulate_into, out)
        return None
    return out.to(out_dtype)


# One ``_scaled_mm`` per expert beats ``_scaled_grouped_mm`` when experts are few and large
# (measured on H200: about 1.15x at 8 experts of Mixtral's shape, fprop and weight gradient) and
# loses badly when they are many and small (128 experts of Qwen3's shape: 0.15x): per-expert
# launches then dominate.
PER_EXPERT_MAX_EXPERTS = 32

# Our Triton grouped GEMMs (``kernels.fp8_grouped_gemm_triton``) for the grouped products on
# Hopper, with fast or split accumulation, without the per-expert products' host sync: forward and
# data gradient 1.2-1.5x torch's grouped kernel at 128 small experts and about even with the
# per-expert products at 8 large ones; weight gradient 1.07-1.29x torch's grouped kernel (fast
# accumulation; torch's grouped kernel with split accumulation is about 3x slower than with fast).
# Benchmarks comparing against torch's kernels set this False.
TRITON_GROUPED_GEMM = True

# Split accumulation (the default recipe's data gradient) on large experts, each expert's weight
# at least this many elements, runs on torch's grouped kernel even where ours is on: at Mixtral's
# experts (4096 x 14336, 59 M elements) its split-accumulation products ran 1.18-1.23x ours and at a
# DeepSeek-like 7168 x 4096 (29 M) 1.07x (H100, `fp8_grouped_tune.py --precise`), with the same sums
# (relative difference 0; the GPU test compares the data gradients' bits), where at Qwen3's small
# experts (2048 x 768 / 1536, 1.6-3.1 M) ours runs 2.5-3.7x torch's. Keyed on the expert's size,
# not the count of local experts, which expert parallelism divides. Ours keeps the weight gradient
# (it adds an unrounded fp32 gradient into ``.grad`` in its epilogue).
SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS = 1 << 24

# The Triton weight-gradient kernel stores its tiles by TMA where the rows allow it (a few percent
# faster than stores from registers, the same bits). Benchmarks comparing the two set this False.
WGRAD_TMA_STORE = True


def triton_grouped(t: Tensor) -> bool:
    """Whether the grouped products on ``t``'s device take the Triton kernels: a Hopper GPU (sm90:
    the FP8 tensor-core path they were built and measured on), a Triton with host-side TMA
    descriptors, and not switched off."""
    from lightning_moe.kernels import use_triton

    return (TRITON_GROUPED_GEMM and use_triton(t)
            and triton_grouped_device(t.device.index))  # a CUDA tensor's device always has an index


@functools.lru_cache(maxsize=None)
def triton_grouped_device(index: int) -> bool:
    """Whether CUDA device ``index`` can run the Triton grouped GEMM (checked once per device): sm90,
    and a Triton with host-side TMA descriptors (``triton.tools.tensor_descriptor``; the kernel
    was built and measured on 3.6; older ones keep torch's kernels)."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def host_group_ends(offsets_E: Tensor, experts: int) -> Optional[list[int]]:
    """Row ends per expert on the host when per-expert GEMMs pay off, else None (grouped kernel).

    The host list is kept on the offsets tensor (`once_per_version`) for the layer's other
    projection and the backward, which share that tensor.
    """
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if experts > PER_EXPERT_MAX_EXPERTS or capturing:
        return None
    # host sync (once per offsets): each expert's _scaled_mm call needs its row count
    return once_per_version(offsets_E, "_host_ends", offsets_E.tolist)


def group_gemm(qa_RK: Tensor, sa_R: Tensor, qb_EOK: Tensor, sb_EO: Tensor, offsets_E: Tensor,
               ends: Optional[list[int]], fast: bool, triton: bool) -> Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]^T`` (fprop / dgrad): ``a`` row-major ``[R, K]`` with
    per-row scales ``[R]``, ``b`` stored ``[E, O, K]`` with per-output scales ``[E, O]``.
    ``triton``: `triton_grouped` holds for this product (the kernel still declines operands a
    TMA descriptor cannot take, and split accumulation over experts of at least
    `SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS` goes to torch's grouped kernel). Returns bf16
    ``[R, O]``; rows past the last group are zero (per-expert) or unspecified."""
    if triton and (fast or qb_EOK.shape[1] * qb_EOK.shape[2] < SPLIT_ACCUMULATION_TORCH_MIN_EXPERT_ELEMENTS):
        from lightning_moe.kernels.fp8_grouped_gemm_triton import MAX_EXPERTS, grouped_mm_fprop, tma_operands

        if qb_EOK.shape[0] <= MAX_EXPERTS and tma_operands(qa_RK, qb_EOK):
            return grouped_mm_fprop(qa_RK, sa_R.contiguous(), qb_EOK, sb_EO.contiguous(), offsets_E, precise=not fast)
    return torch_group_gemm(qa_RK, sa_R, qb_EOK, sb_EO, offsets_E, ends, fast)


def torch_group_gemm(qa_RK: Tensor, sa_R: Tensor, qb_EOK: Tensor, sb_EO: Tensor, offsets_E: Tensor,
                     ends: Optional[list[int]], fast: bool) -> Tensor:
    """`group_gemm` on torch's kernels: one ``_scaled_mm`` per expert given the host list of group
    ends (rows past the last group zeroed), else ``_scaled_grouped_mm``."""
    if qa_RK.shape[0] == 0:  # no rows (an expert-parallel rank that received no tokens)
        return qa_RK.new_empty(0, qb_EOK.shape[1], dtype=torch.bfloat16)
    if ends is None:
        return torch._scaled_grouped_mm(qa_RK, qb_EOK.transpose(1, 2), sa_R, sb_EO, offs=offsets_E,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
    out = torch.empty(qa_RK.shape[0], qb_EOK.shape[1], dtype=torch.bfloat16, device=qa_RK.device)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch._scaled_mm(qa_RK[start:end], qb_EOK[e].t(), scale_a=sa_R[start:end, None],
                             scale_b=sb_EO[e][None], out_dtype=torch.bfloat16, use_fast_accum=fast,
                             out=out[start:end])
        start = end
    out[start:].zero_()
    return out


def group_weight_gradient(qa_KR: Tensor, sa_EK: Tensor, qb_NR: Tensor, sb_EN: Tensor, offsets_E: Tensor,
                          ends: Optional[list[int]], fast: bool, aligned_ends: Optional[Tensor] = None,
                          out_dtype: torch.dtype = torch.bfloat16,
                          accumulate_into: Optional[Tensor] = None) -> Optional[Tensor]:
    """``dw[e] = a[:, rows of e] @ b[:, rows of e]^T``: both operands ``[features, R]`` with
    per-(expert, feature) scales ``[E, features]``. Returns ``out_dtype`` ``[E, K, N]`` (the
    weight's dtype). Our Triton kernel writes an fp32 gradient for fp32 master weights directly.
    torch's grouped kernel writes bf16 only, and its row-scaled ``_scaled_mm`` writes fp32 only on
    sm90 with cuBLAS >= 12.9, so those paths write bf16, widened after (`kernels.widened`). So fp32
    master weights get an unrounded gradient from the Triton kernel and a bf16-rounded one
    otherwise (the Triton kernel switched off, the generic quantizers, off sm90). ``aligned_ends``:
    the operands are in the aligned group layout (`wgrad_aligned_ends`), for our Triton kernel.

    ``accumulate_into`` (with ``out_dtype`` fp32): a contiguous fp32 tensor of ``E * K * N``
    elements (the weight's ``.grad``, `nn.compute_weights.accumulation_grad`) that the gradient is
    added into instead of returned (None returned), Megatron-Core's gradient-accumulation fusion:
    our Triton kernel adds its fp32 tiles to the old values in its epilogue (no fp32 gradient
    written and read back); torch's kernels' bf16 output is added in one pass
    (`kernels.accumulate_widened_`). The bits of returning the gradient and ``.grad += dw``."""
    if accumulate_into is not None and out_dtype != torch.float32:
        raise ValueError(f"group_weight_gradient(accumulate_into=...) adds an fp32 gradient, not {out_dtype}")
    if aligned_ends is not None:
        from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

        kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        tma_store = WGRAD_TMA_STORE and qb_NR.shape[0] * kernel_dtype.itemsize % 16 == 0
        into = None
        if accumulate_into is not None:
            into = accumulate_into.view(sa_EK.shape[0], qa_KR.shape[0], qb_NR.shape[0])
        dw = grouped_mm_wgrad(qa_KR, sa_EK.contiguous(), qb_NR, sb_EN.contiguous(), aligned_ends,
                              out_dtype=kernel_dtype, tma_store=tma_store,
                              precise=not fast, accumulate_into=into)
        return None if into is not None else dw.to(out_dtype)
    experts = sa_EK.shape[0]
    if ends is None:
        # torch's FP8 grouped GEMM writes bf16 only
        return _widened_or_added(torch._scaled_grouped_mm(qa_KR, qb_NR.t(), sa_EK.reshape(-1), sb_EN.reshape(-1),
                                                          offs=offsets_E, out_dtype=torch.bfloat16,
                                                          use_fast_accum=fast),
                                 out_dtype, accumulate_into)
    out = torch.empty(experts, qa_KR.shape[0], qb_NR.shape[0], dtype=torch.bfloat16, device=qa_KR.device)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch._scaled_mm(qa_KR[:, start:end], qb_NR[:, start:end].t(), scale_a=sa_EK[e][:, None],
                             scale_b=sb_EN[e][None], out_dtype=torch.bfloat16, use_fast_accum=fast, out=out[e])
        else:
            out[e].zero_()  # an expert without tokens has no gradient
        start = end
    return _widened_or_added(out, out_dtype, accumulate_into)


def _widened_or_added(dw: Tensor, out_dtype: torch.dtype, accumulate_into: Optional[Tensor]) -> Optional[Tensor]:
    """``dw`` widened to ``out_dtype``, or added into ``accumulate_into`` (None returned)."""
    if accumulate_into is None:
        return widened(dw, out_dtype)
    accumulate_widened_(accumulate_into, dw)
    return None
