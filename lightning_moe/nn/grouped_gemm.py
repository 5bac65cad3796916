"""Grouped GEMM backends: ``y[rows of group e] = x[rows of group e] @ w[e]`` for every expert.

All backends take the same operands, so the experts module keeps one set of weights whichever
runs:

- ``x_RK``: [R, K] rows grouped by expert (contiguous groups, in expert order);
- ``w_EKN``: [E, K, N] one matrix per expert;
- ``group_sizes_E``: int64 [E] rows per group on the device; the groups cover rows
  ``0 .. sum-1`` and any rows after them (zero padding) are assigned to the last group.

Backends: "grouped_mm" (``torch._grouped_mm``; one kernel on CUDA and on CPU, no host sync),
"loop" (one matmul per expert; the readable reference) and "te" (Transformer Engine's
grouped GEMM, imported lazily).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor


def group_offsets(group_sizes_E: Tensor, num_rows: int) -> Tensor:
    """Cumulative int32 group ends for ``torch._grouped_mm``; the last one is ``num_rows``.

    Padding rows beyond ``sum(group_sizes_E)`` are zero and join the last group: zero rows give
    zero outputs and zero weight gradients, and no output row is left unwritten.
    """
    ends = torch.cumsum(group_sizes_E, 0)
    ends = torch.cat([ends[:-1], ends.new_full((1,), num_rows)])
    return ends.to(torch.int32)


def grouped_mm(x_RK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor) -> Tensor:
    """``torch._grouped_mm`` with sizes turned into offsets; no host sync.

    ``torch._grouped_mm`` takes fp32/bf16/fp16; float64 (numerical checks) runs the loop.
    """
    if x_RK.dtype == torch.float64:
        return loop_mm(x_RK, w_EKN, group_sizes_E)
    offsets = group_offsets(group_sizes_E, x_RK.shape[0])
    return torch._grouped_mm(x_RK, w_EKN.to(x_RK.dtype), offs=offsets)


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
