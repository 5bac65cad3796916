"""Grouped GEMM backends: ``y[rows of group e] = x[rows of group e] @ w[e]`` for every expert.

All backends take the same operands, so the experts module keeps one set of weights whichever
runs:

- ``x_RK``: [R, K] rows grouped by expert (contiguous groups, in expert order);
- ``w_EKN``: [E, K, N] one matrix per expert;
- ``group_sizes_E``: int64 [E] rows per group on the device; the groups cover rows
  ``0 .. sum-1``; any rows after them are zero padding (a sync-free buffer sized for the worst
  case) and their outputs are zero. "grouped_mm" and "te" leave them out of the GEMMs (a
  buffer of the all-gather dispatcher is about half padding); "loop" lets them join the last
  group.

Backends: "grouped_mm" (``torch._grouped_mm``; one kernel on CUDA and on CPU, no host sync; K
and N of any size, through zero-padded copies where the rows are not 16 bytes wide), "loop"
(one matmul per expert; the readable reference) and "te" (Transformer Engine's grouped GEMM,
imported lazily).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.kernels import use_triton
from lightning_moe.nn.compute_weights import compute_weight
from lightning_moe.nn.permutation import PermutationPlan, gather_token_rows, permute_backward


def group_offsets(group_sizes_E: Tensor, num_rows: int) -> Tensor:
    """Cumulative int32 group ends for ``torch._grouped_mm``; the last one is ``num_rows``.

    Padding rows beyond ``sum(group_sizes_E)`` are zero and join the last group: zero rows give
    zero outputs and zero weight gradients, and no output row is left unwritten.
    """
    ends = torch.cumsum(group_sizes_E, 0, dtype=torch.int32)
    ends[-1:].fill_(num_rows)
    return ends


def zero_rows_from(y_RC: Tensor, end: Tensor) -> None:
    """In place ``y_RC[end:] = 0`` for a 0-dim device index ``end``; no host sync."""
    if use_triton(y_RC) and y_RC.stride(1) == 1:
        from lightning_moe.kernels.tail_triton import zero_rows_from_triton

        zero_rows_from_triton(y_RC, end)
    else:
        zero_rows_from_torch(y_RC, end)


def zero_rows_from_torch(y_RC: Tensor, end: Tensor) -> None:
    """The plain-torch twin of ``kernels.tail_triton.zero_rows_from_triton`` (any device, no
    Triton needed): one masked pass over the whole buffer."""
    rows = torch.arange(y_RC.shape[0], device=y_RC.device)
    y_RC.masked_fill_((rows >= end).unsqueeze(1), 0)


class _GroupedMMCoveredRows(torch.autograd.Function):  # first-order only (in-place zeroing in backward)
    """``torch._grouped_mm`` over the rows the groups cover (ends ``offsets_E``, the last one
    ``sum(group_sizes)``), with zeros in every later row of the output and of the input
    gradient: the padding rows cost neither GEMM nor gradient work."""

    @staticmethod
    def forward(ctx, x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor, zero_output: bool, zero_grad_input: bool):
        ctx.save_for_backward(x_RK, w_EKN, offsets_E)
        ctx.zero_grad_input = zero_grad_input
        y_RN = torch._grouped_mm(x_RK, w_EKN, offs=offsets_E)
        if zero_output:
            zero_rows_from(y_RN, offsets_E[-1])
        return y_RN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RN: Tensor):
        x_RK, w_EKN, offsets_E = ctx.saved_tensors
        grad_RN = grad_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_RN, w_EKN.transpose(-2, -1), offs=offsets_E)
            # Autograd's anomaly mode checks every gradient for NaN, the unwritten rows included.
            if ctx.zero_grad_input or torch.is_anomaly_enabled():
                zero_rows_from(grad_x, offsets_E[-1])
        if ctx.needs_input_grad[1]:
            # Groups along the reduction dim: rows after the last end take no part.
            grad_w = torch._grouped_mm(x_RK.transpose(-2, -1), grad_RN, offs=offsets_E)
        return grad_x, grad_w, None, None, None


def grouped_mm(
    x_RK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor, zero_output: bool = True, zero_grad_input: bool = True
) -> Tensor:
    """``torch._grouped_mm`` with sizes turned into offsets; no host sync.

    Rows after ``sum(group_sizes_E)`` are left out of the GEMMs and come out zero (see
    `_GroupedMMCoveredRows`). A caller whose next operation never reads those rows may skip
    zeroing them in the output (``zero_output=False``) or in the input gradient
    (``zero_grad_input=False``): they then hold whatever the allocator handed out.
    ``torch._grouped_mm`` takes fp32/bf16/fp16 with 16-byte rows; other sizes run on padded
    copies (see `grouped_mm_covered`), float64 (numerical checks) one matmul per group.
    """
    offsets_E = covered_offsets(group_sizes_E, x_RK.shape[0])
    return grouped_mm_covered(x_RK, w_EKN, offsets_E, zero_output, zero_grad_input)


def covered_offsets(group_sizes_E: Tensor, num_rows: int) -> Tensor:
    """Cumulative int32 group ends, the last one the covered row count (rows after it are
    padding). Clamped to the buffer: groups summing past it (a caller's bug) must not send the
    kernel past the end of the operand."""
    return torch.cumsum(group_sizes_E, 0, dtype=torch.int32).clamp_(max=num_rows)


def grouped_mm_covered(
    x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor, zero_output: bool = True, zero_grad_input: bool = True
) -> Tensor:
    """`grouped_mm` from offsets already made by `covered_offsets` (callers running several
    GEMMs over the same groups make them once).

    ``torch._grouped_mm`` needs the rows of both operands 16 bytes wide (K and N multiples of 8
    in bf16 / fp16, of 4 in fp32), which `MoEConfig` does not ask of D and F (nor expert tensor
    parallelism of its shards of F). Other sizes run on copies zero-padded to the next multiple:
    zero columns of ``x`` meet zero rows of ``w`` (the contraction is unchanged) and the zero
    columns of ``w`` give output columns that are sliced off; autograd slices the gradients back.
    Aligned operands reach the kernel as they are. float64, which the kernel does not take,
    runs `loop_covered_rows` (same rows, same zeros after them; it syncs).
    """
    w_EKN = compute_weight(w_EKN, x_RK.dtype)
    if x_RK.dtype == torch.float64:
        return loop_covered_rows(x_RK, w_EKN, offsets_E)
    n = w_EKN.shape[-1]
    x_RK, w_EKN = padded_to_16_byte_rows(x_RK, w_EKN)
    y_RN = _GroupedMMCoveredRows.apply(x_RK, w_EKN, offsets_E, zero_output, zero_grad_input)
    return y_RN[:, :n] if y_RN.shape[1] != n else y_RN


def gathered_grouped_mm_covered(x_TD: Tensor, plan: PermutationPlan, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``grouped_mm_covered(permute(x_TD, plan), w_EKN, offsets_E, zero_output=False)`` keeping
    only the unpermuted tokens ``x_TD`` for backward, not the ``[R, D]`` permuted rows: the
    backward gathers them again for the weight gradient (one more read of ``x_TD`` and write of
    the rows per layer, K times fewer bytes kept: 32 KB a token and layer fewer at qwen3's top-8
    and width 2048). Same values and gradients, bit for bit, as the permutation followed by the
    GEMM. ``x_TD`` and ``w_EKN`` of one dtype with 16-byte rows (`gathers_in_backward`); rows
    after the last offset are left unwritten in the output, as ``zero_output=False`` leaves them."""
    return _GatheredGroupedMMCoveredRows.apply(x_TD, w_EKN, offsets_E, plan)


def gathers_in_backward(dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether `gathered_grouped_mm_covered` takes ``[T, k] @ [E, k, n]`` operands of ``dtype``:
    a floating dtype other than float64, rows 16 bytes wide in both (no zero-padded copies)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    multiple = 16 // (torch.finfo(dtype).bits // 8)
    return k % multiple == 0 and n % multiple == 0


class _GatheredGroupedMMCoveredRows(torch.autograd.Function):  # first-order only
    """The permutation and the first expert GEMM as one node that saves the tokens, not the rows."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_EKN: Tensor, offsets_E: Tensor, plan: PermutationPlan) -> Tensor:
        ctx.save_for_backward(x_TD, w_EKN, offsets_E)
        ctx.plan = plan
        x_RK = gather_token_rows(x_TD, plan)
        return torch._grouped_mm(x_RK, w_EKN, offs=offsets_E)  # x_RK is freed here

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_RN: Tensor):
        x_TD, w_EKN, offsets_E = ctx.saved_tensors
        plan = ctx.plan
        grad_RN = grad_RN.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # Rows after the last offset stay unwritten: the permutation's backward reads only the
            # rows that hold tokens, all inside the groups.
            grad_RK = torch._grouped_mm(grad_RN, w_EKN.transpose(-2, -1), offs=offsets_E)
            grad_x = permute_backward(grad_RK, plan)
        if ctx.needs_input_grad[1]:
            x_RK = gather_token_rows(x_TD, plan)  # the forward's rows again, the same bits
            grad_w = torch._grouped_mm(x_RK.transpose(-2, -1), grad_RN, offs=offsets_E)
        return grad_x, grad_w, None, None


def padded_to_16_byte_rows(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Operands of ``torch._grouped_mm`` with rows 16 bytes wide: ``a [M, K] @ b [E, K, N]`` gets K
    and N zero-padded, ``a [K, T] @ b [T, N]`` (groups along the contraction) N. Zero columns of
    ``a`` meet zero rows of ``b``; the output's extra columns are zeros to slice off. Operands that
    need nothing are returned as they are (no copy)."""
    multiple = 16 // a.element_size()
    pad_n = -b.shape[-1] % multiple
    pad_k = -a.shape[1] % multiple if b.dim() == 3 else 0
    if pad_k:
        a = F.pad(a, (0, pad_k))
    if pad_k or pad_n:
        b = F.pad(b, (0, pad_n, 0, pad_k) if b.dim() == 3 else (0, pad_n))
    return a, b


def loop_covered_rows(x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """`grouped_mm_covered` as one matmul per group (any dtype; the float64 path): the rows after
    the last end are left out, zero in the output and in the input gradient. Host sync (the
    ends are read on the host), as `loop_mm`."""
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    outs = [x_RK[start:end] @ w_EKN[e].to(x_RK.dtype) for e, (start, end) in enumerate(zip(starts, ends))]
    y_UN = torch.cat(outs)
    return F.pad(y_UN, (0, 0, 0, x_RK.shape[0] - y_UN.shape[0]))


def loop_mm(x_RK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """Reference backend: one matmul per expert."""
    num_experts = w_EKN.shape[0]
    # Host sync: Python slicing needs the group sizes on the host (reference backend only).
    sizes = group_sizes_E.tolist()
    sizes[-1] += x_RK.shape[0] - sum(sizes)
    chunks = torch.split(x_RK, sizes)
    outs = [chunks[e] @ w_EKN[e].to(x_RK.dtype) for e in range(num_experts)]
    return torch.cat(outs)


def te_grouped_mm(
    x_RK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor, cache: Optional[dict] = None, key: str = "gemm"
) -> Tensor:
    """Transformer Engine's grouped GEMM (cuBLAS grouped kernels, FP8-aware under ``te.autocast``)."""
    from lightning_moe.nn._te import te_grouped_linear

    # Host sync: Transformer Engine takes the split sizes as a Python list.
    sizes = group_sizes_E.tolist()
    used, num_rows = sum(sizes), x_RK.shape[0]
    if cache is None:  # callers outside an experts module (benchmarks, tests): one module per shape
        cache, key = _SHARED_TE_MODULES, f"{key}{tuple(w_EKN.shape)}"
    if used == num_rows:
        return te_grouped_linear(x_RK, w_EKN, sizes, cache, key)
    if used == 0:  # only padding rows: zero outputs, and no zero-row TE call
        return x_RK @ w_EKN[-1].to(x_RK.dtype)
    # The zero padding rows stay out of TE's groups rather than joining the last one: under FP8
    # every group must stay a multiple of the quantization alignment. Their outputs are zero.
    y = te_grouped_linear(x_RK[:used], w_EKN, sizes, cache, key)
    return torch.nn.functional.pad(y, (0, 0, 0, num_rows - used))


_SHARED_TE_MODULES: dict = {}

BACKENDS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "grouped_mm": grouped_mm,
    "loop": loop_mm,
    "te": te_grouped_mm,
}


@functools.lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # any import failure (missing, ABI mismatch) means "not available"
        return False
    return True


def resolve_backend(requested: str, device: torch.device | None = None) -> str:
    """Pick the grouped-GEMM backend: "auto" -> "grouped_mm" (TE only when asked explicitly).

    ``torch._grouped_mm`` runs on CPU and CUDA; it is the default because it needs no host
    sync. "te" is chosen only on request since it syncs to read the split sizes; benchmarks
    report both.
    """
    if requested == "auto":
        return "grouped_mm"
    if requested == "te" and not transformer_engine_available():
        raise ValueError(
            "expert_backend='te' needs Transformer Engine and a CUDA GPU: "
            "`pip install lightning-moe[te]`, or use expert_backend='grouped_mm'."
        )
    if requested not in BACKENDS:
        raise ValueError(f"unknown expert backend {requested!r}; choose one of {sorted(BACKENDS)} or 'auto'.")
    return requested
