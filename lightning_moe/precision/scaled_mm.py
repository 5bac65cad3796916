"""The "torch" backend: FP8 GEMMs on ``torch._scaled_mm`` / ``torch._scaled_grouped_mm``.

CUDA only (tensorwise sm89+, rowwise and grouped sm90+; `resolve_backend` checks). Operands
are quantized exactly as in the emulated backend (same tiles and scales; torch's saturating
float8 cast instead of the reference rounding, bit-identical), then:

- ``_scaled_mm(a [M, K] row-major, b [K, N] column-major, scale_a, scale_b)``: tensorwise
  scales are fp32 scalars, rowwise ``[M, 1]`` and ``[1, N]``; the contraction must be a
  multiple of 16 (the token dimension is zero-padded for the weight gradient);
- ``_scaled_grouped_mm`` (rowwise only): 2-D x 3-D ``x [R, K]`` with ``w [E, K, N]``
  column-major per expert, scales ``[R]`` and ``[E, N]``; 2-D x 2-D for the weight
  gradient, groups along the contraction, scales ``[E * K]`` and ``[E * N]`` (group-major).
  Tensorwise / delayed per-expert scales are expanded to rows. The grouped kernels take
  E4M3 only, so gradients are E4M3 here whatever the recipe's format.
- with at most ``PER_EXPERT_MAX_EXPERTS`` experts, one ``_scaled_mm`` per expert instead of
  the grouped kernel (faster for few large experts; costs one host sync per layer forward for
  the group sizes, none in the backward unless activation checkpointing recomputes the
  forward). Under CUDA-graph capture the grouped kernel is used.
- on Hopper with Triton, the grouped forward and data-gradient products with fast accumulation
  run on our own kernel instead (``kernels.fp8_grouped_gemm_triton``: torch's bits, faster than
  both torch paths at the benchmark shapes, no host sync; `TRITON_GROUPED_GEMM`). When it takes
  both, no host list of group ends is made. The weight gradient with fast accumulation runs on
  its kernel too (``grouped_mm_wgrad``): its transposed operands are then cast into an aligned
  group layout (`_wgrad_aligned_ends`) so that no contraction block crosses into the next group.

Accumulation per GEMM follows ``recipe.fast_accumulation`` (default: fast fprop, split dgrad /
wgrad, as Transformer Engine).

Rowwise operands on CUDA go through the fused Triton quantizers (`_fused_rowwise`): each
activation is quantized once for both of its GEMMs (rowwise for fprop / dgrad, per expert group
and transposed for the weight gradient), and the backward keeps that FP8 copy instead of the
bf16 input. A training forward quantizes each expert weight for both of its GEMMs with one
quantizer (``FP8Recipe.quantize_weights_once``; see `_both_weight_layouts_now`), or takes both
from the weight cache. Delayed-scaling operands on CUDA
(`_fused_delayed`) take the same copies from one read each with their history scales
(``kernels.fp8_delayed_triton``): grouped operands through `_FusedGroupedOperands`, dense ones
through `_dense_operand`. Both fused paths give the generic quantizers' bits. Under delayed
scaling a SwiGLU expert's second projection can take ``h = [gate | up]`` itself
(`scaled_grouped_mm_swiglu`): its input cast computes ``silu(gate) * up`` on the fly, so the
SwiGLU output is never written in bf16 and read back.

The expert weights do not depend on the tokens, so `MoELayer` starts their FP8 copies before
it routes (`prefetch_weight_layouts`, through ``GroupedExperts.prefetch``): both layouts of
each projection's weight are cast on a side stream while the router, the permutation and the
first projection run; each GEMM waits only for its own weight's copies.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_moe.kernels import WGRAD_GROUP_ALIGN, widened
from lightning_moe.precision.delayed import DelayedState, fresh_amax_group, fresh_amax_reduction
from lightning_moe.precision.formats import E4M3, E5M2
from lightning_moe.precision.gemm import compute_dtype, no_autocast
from lightning_moe.precision.operands import Layout, quantize_operand
from lightning_moe.precision.quantize import Axis
from lightning_moe.precision.recipes import FP8Recipe
from lightning_moe.precision.weight_cache import FP8WeightCache, cached, training_cache

_ALIGN = 16


def _pad_fp8(q: Tensor, multiple: int = _ALIGN) -> Tensor:
    """Zero-pad the last dimension of a float8 tensor (zero bits are +0.0 in E4M3 / E5M2)."""
    pad = (-q.shape[-1]) % multiple
    return F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype) if pad else q


def _column_major(q: Tensor) -> Tensor:
    """Same values, column-major storage (``_scaled_mm``'s second operand)."""
    return q.t().contiguous().t()


def _mm(a: Tensor, sa: Tensor, b_rows: Tensor, sb: Tensor, out_dtype: torch.dtype, fast: bool) -> Tensor:
    """``a @ b_rows.T`` where both are laid out ``[other, contraction]`` (row-major)."""
    rowwise = sa.numel() > 1 or sb.numel() > 1
    dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise kernels write bf16 only
    scale_a, scale_b = (sa.reshape(-1, 1), sb.reshape(1, -1)) if rowwise else (sa.reshape(()), sb.reshape(()))
    out = torch._scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                           out_dtype=dtype, use_fast_accum=fast)
    return out.to(out_dtype)


class _ScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                state: Optional[DelayedState], weight_key: Optional[Hashable],
                cache: Optional[FP8WeightCache], needs_backward: bool) -> Tensor:
        out_dtype = compute_dtype(x)
        with no_autocast(x):
            x2 = x.reshape(-1, x.shape[-1])
            fused = _fused_rowwise(recipe, state, x2)
            if fused:
                from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

                # Both copies of the input made now: the forward's, and the transposed one the
                # backward needs (kept in FP8 instead of the bf16 input).
                qx, sx, qx_t, sx_t = _fused_input(x2, _whole(x2), needs_backward)
                if _caching(cache, weight_key):
                    qw, sw, qw_t, sw_t = cached(cache, weight_key, weight, "dense_fused",
                                                lambda: _fused_both(weight, _whole(weight)))
                    weight_dgrad: Optional[tuple[Tensor, Tensor]] = (qw_t, sw_t)
                else:
                    # A dense weight's two layouts take two single quantizers either way (see
                    # `_fused_both`), so making both now would only hold memory longer.
                    qw, sw = rowwise_quantize(weight)
                    weight_dgrad = None  # quantized again in the backward
            else:
                delayed = _fused_delayed(recipe, state, x2, weight)
                qx, sx = _dense_operand(x2, recipe, state, "input", delayed)
                qw, sw = cached(cache, weight_key, weight, "dense_fprop",
                                lambda: _dense_operand(weight, recipe, state, "weight", delayed))
            y = _mm(qx, sx, qw, sw, out_dtype, fast=recipe.fast("fprop"))
            if bias is not None:
                y = y + bias.to(out_dtype)
        tensorwise = recipe.tile("input") == (None, None)
        # Tensorwise quantization does not depend on direction: keep the FP8 copies.
        if fused:
            # The same tensors whether or not the cache holds the weight's other layout: an
            # activation-checkpointing recompute runs outside the cache context and must save
            # what the first forward saved. The cached layout rides on ctx (the cache keeps it).
            ctx.save_for_backward(qx_t, sx_t, weight)
            ctx.weight_dgrad = weight_dgrad
        else:
            ctx.save_for_backward(*((qx, sx, qw, sw) if tensorwise else (x2, weight)))
        ctx.fused, ctx.delayed = fused, not fused and _fused_delayed(recipe, state, x2, weight)
        ctx.tensorwise, ctx.recipe, ctx.state, ctx.cache, ctx.weight_key = tensorwise, recipe, state, cache, weight_key
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        recipe, state = ctx.recipe, ctx.state
        with no_autocast(dy):
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ctx.tensorwise:
                qdy, sdy = _dense_operand(dy2, recipe, state, "grad", ctx.delayed)
                qx, sx, qw, sw = ctx.saved_tensors
                qw_t, sw_t = qw.t().contiguous(), sw
                qdy_t, sdy_t, qx_t, sx_t = qdy.t().contiguous(), sdy, qx.t().contiguous(), sx
            elif ctx.fused:
                qx_t, sx_t, weight = ctx.saved_tensors
                if ctx.weight_dgrad is not None:
                    qw_t, sw_t = ctx.weight_dgrad
                else:
                    qw_t, sw_t = _fused_columns(weight, _whole(weight))
                qdy, sdy, qdy_t, sdy_t = _fused_both(dy2, _whole(dy2))
            else:
                x2, weight = ctx.saved_tensors
                qdy, sdy, _, _ = quantize_operand(dy2, recipe, "grad", state=state, native=True)
                qw_t, sw_t, _, _ = cached(ctx.cache, ctx.weight_key, weight, "dense_dgrad", lambda: quantize_operand(
                    weight.t(), recipe, "weight", state=state, native=True))
                qdy_t, sdy_t, _, _ = quantize_operand(dy2.t(), recipe, "grad", state=state, native=True)
                qx_t, sx_t, _, _ = quantize_operand(x2.t(), recipe, "input", state=state, native=True)
            dx = _mm(qdy, sdy, qw_t, sw_t, ctx.x_dtype, fast=recipe.fast("dgrad"))
            dw = _mm(_pad_fp8(qdy_t), sdy_t, _pad_fp8(qx_t), sx_t, ctx.w_dtype, fast=recipe.fast("wgrad"))
            db = None if ctx.bias_dtype is None else dy2.float().sum(0).to(ctx.bias_dtype)
        return dx.reshape(ctx.x_shape), dw, db, None, None, None, None, None


def _dense_operand(t: Tensor, recipe: FP8Recipe, state: Optional[DelayedState], role: str,
                   delayed: bool) -> tuple[Tensor, Tensor]:
    """A dense GEMM operand quantized per tensor (tensorwise / delayed): float8 values and the
    scalar ``scale_inv``. ``delayed``: one read with the history scale (``delayed_cast``, the
    recipe's format for the role, E5M2 gradients under hybrid), else the generic quantizer."""
    if not (delayed and t.numel()):
        q, scale_inv, _, _ = quantize_operand(t, recipe, role, state=state, native=True)
        return q, scale_inv
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.precision.delayed import SLOTS, amax_record_row

    assert state is not None
    q, scale_inv_R, _ = delayed_cast(t, _whole(t), state.scale[SLOTS[role]], amax_record_row(state, role),
                                     e5m2=recipe.format(role) is E5M2)
    return q, scale_inv_R[:1]  # every row has the tensor's scale


def scaled_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                  state: Optional[DelayedState], weight_key: Optional[Hashable] = None) -> Tensor:
    """FP8 ``x @ weight.T (+ bias)``; ``weight_key`` names the weight for an active `FP8WeightCache`."""
    return _ScaledLinear.apply(x, weight, bias, recipe, state, weight_key, training_cache(weight),
                               _needs_backward(x, weight))


def _fused_rowwise(recipe: FP8Recipe, state: Optional[DelayedState], t: Tensor) -> bool:
    """The rowwise recipe's operands can take the fused Triton quantizers (same numbers, one
    kernel per operand; see ``kernels.fp8_quant_triton``). Not for DTensors (tensor-parallel
    shards): a Triton kernel sees only a local tensor's memory."""
    from torch.distributed.tensor import DTensor

    from lightning_moe.kernels import use_triton

    e4m3 = all(recipe.format(role) is E4M3 for role in ("input", "weight", "grad"))
    return (recipe.name == "rowwise" and e4m3 and state is None and not recipe.power_2_scales
            and not isinstance(t, DTensor) and use_triton(t))


def native_delayed_casts(recipe: FP8Recipe, *operands: Tensor) -> bool:
    """The recipe is delayed scaling and Triton can take the operands: the one-read delayed casts
    of ``kernels.fp8_delayed_triton`` (same numbers as the generic path) run."""
    return recipe.name == "delayed" and _local_triton_operands(*operands)


def _fused_delayed(recipe: FP8Recipe, state: Optional[DelayedState], *operands: Tensor) -> bool:
    """The delayed recipe's operands take the one-read delayed casts (`native_delayed_casts`)."""
    return state is not None and native_delayed_casts(recipe, *operands)


def _local_triton_operands(*operands: Tensor) -> bool:
    """Triton kernels can take the operands. Not DTensors: a tensor-parallel shard's amax is
    reduced over its shards by the generic path."""
    from torch.distributed.tensor import DTensor

    from lightning_moe.kernels import use_triton

    return all(not isinstance(t, DTensor) and use_triton(t) for t in operands)


def _caching(cache: Optional[FP8WeightCache], weight_key: Optional[Hashable]) -> bool:
    """Whether this weight's FP8 operands come from the weight cache.

    With the cache both layouts are made at once (one fused quantizer) and kept until the
    optimizer step. Without it see `_both_weight_layouts_now`.
    """
    return cache is not None and weight_key is not None


def _both_weight_layouts_now(recipe: FP8Recipe, needs_backward: bool) -> bool:
    """Whether a grouped forward without the weight cache makes the expert weight's
    data-gradient layout too (one quantizer for both), saving it for the backward: 1 byte per
    parameter held from the forward to the backward (``FP8Recipe.quantize_weights_once``, on
    unless set False). Otherwise the backward quantizes the weight again."""
    return needs_backward and recipe.quantize_weights_once is not False


def _transposed_width(rows: int, aligned_groups: int = 0) -> int:
    """Columns of `_transposed_out`'s buffer for ``rows`` rows: ``rows`` padded to 16, plus, in the
    aligned group layout of ``aligned_groups`` groups of whole 16-row runs, the most each group
    can grow (``WGRAD_GROUP_ALIGN - 16``): a bound without the group sizes on the host."""
    return -(-rows // _ALIGN) * _ALIGN + aligned_groups * (WGRAD_GROUP_ALIGN - _ALIGN)


def _transposed_out(t_RC: Tensor, cols: Optional[int] = None, rows: Optional[int] = None,
                    aligned_groups: int = 0) -> Tensor:
    """Float8 ``[C, R]`` for ``t^T`` (``C`` = ``cols``, ``R`` = ``rows``, default ``t``'s) with
    ``R`` padded to 16 by zero columns (the padding is the contraction the dense weight-gradient
    GEMM reads; the rest is written by a quantizer).

    ``aligned_groups`` > 0: room for that many groups in the aligned group layout of the Triton
    weight-gradient kernel (`_wgrad_aligned_ends`), which the quantizer writes whole (gaps
    included); what lies past the last aligned end is never read and stays unwritten. The bound
    holds for groups of whole 16-row runs only (`_assert_groups_aligned` first): up to
    ``aligned_groups * 112`` columns more than the plain copy (11% at 128 experts of ~1,000
    tokens, about half of it written)."""
    rows = t_RC.shape[0] if rows is None else rows
    cols = t_RC.shape[1] if cols is None else cols
    q_CR = torch.empty(cols, _transposed_width(rows, aligned_groups), dtype=torch.float8_e4m3fn, device=t_RC.device)
    if not aligned_groups:
        q_CR[:, rows:].zero_()
    return q_CR


def _wgrad_aligned_ends(offsets_E: Tensor) -> Tensor:
    """int32 ``[E]`` cumulative ends of the aligned group layout that `grouped_mm_wgrad` reads:
    each group's size rounded up to ``WGRAD_GROUP_ALIGN``. Made once per offsets tensor and
    version (the layer's two projections and their backwards share it); under CUDA-graph
    capture made afresh each call, so that the graph computes it from the offsets it replays
    with and no graph-pool tensor is kept on an eager one (as `_expert_row_ends`).

    With Triton on CUDA one kernel (``kernels.aligned_ends_triton``) makes the ends and the flag
    of `_assert_groups_aligned`'s check, which is then issued from it (and so done for this
    offsets version): two launches instead of about twelve in the forward."""
    from lightning_moe.kernels import use_triton
    from lightning_moe.nn.permutation import round_up

    def make() -> Tensor:
        if use_triton(offsets_E):
            from lightning_moe.kernels.aligned_ends_triton import aligned_group_ends

            ends, aligned_ok = aligned_group_ends(offsets_E, WGRAD_GROUP_ALIGN, _ALIGN)
            _once_per_version(offsets_E, "_aligned_checked", lambda: torch._assert_async(aligned_ok, _ALIGNED_MESSAGE))
            return ends
        sizes = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
        return round_up(sizes, WGRAD_GROUP_ALIGN).cumsum(0).to(torch.int32)

    if offsets_E.is_cuda and torch.cuda.is_current_stream_capturing():
        return make()
    return _once_per_version(offsets_E, "_wgrad_aligned_ends", make)


def _fused_columns(t_RC: Tensor, offsets_G: Tensor) -> tuple[Tensor, Tensor]:
    """The transposed half of `_fused_both` alone (its own quantizer: two reads of ``t``)."""
    from lightning_moe.kernels.fp8_quant_triton import group_column_quantize

    q_CR = _transposed_out(t_RC)
    scale_inv_GC = group_column_quantize(t_RC, offsets_G, q_CR, stride_out_col=q_CR.shape[1], stride_out_group=0)
    return q_CR, scale_inv_GC.reshape(-1)


def _needs_backward(x: Tensor, weight: Tensor) -> bool:
    """Whether this call will be differentiated: decided where the GEMM is called (inside an
    autograd Function's forward grad mode is off and ``needs_input_grad`` ignores it)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def _fused_input(
    t_RC: Tensor, offsets_G: Tensor, needs_backward: bool, aligned_ends: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The forward's rowwise copy of an activation, and its transposed copy only when a backward
    will use it (evaluation and inference make one copy, not two)."""
    if needs_backward:
        return _fused_both(t_RC, offsets_G, aligned_ends)
    from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

    return (*rowwise_quantize(t_RC), None, None)


def _whole(t_RC: Tensor) -> Tensor:
    """One row group spanning every row of ``t`` (dense operands)."""
    return torch.full((1,), t_RC.shape[0], dtype=torch.int32, device=t_RC.device)


def _fused_both(t_RC: Tensor, offsets_G: Tensor, aligned_ends: Optional[Tensor] = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``t [R, C]`` quantized twice by one fused quantizer (two reads of ``t``):

    - rowwise: (float8 ``[R, C]``, fp32 ``[R]``), the fprop / dgrad operand;
    - ``t^T`` per (column, row group): (float8 ``[C, R]`` with ``R`` padded to 16 by zero
      columns, group-major fp32 ``[G * C]``), the weight-gradient operand (dense: one group).

    Tokens past the last group get no transposed copy: no GEMM reads them (the grouped kernels
    stop at the last offset, the dense one's single group covers every token).

    A single group (dense operands) takes the two single quantizers instead: the dual kernels
    run one program per (group, 64 columns), which with one group leaves most SMs idle, while
    the rowwise kernel runs one program per row. ``aligned_ends``: the transposed copy in the
    weight-gradient kernel's aligned group layout (`_wgrad_aligned_ends`), by the dual kernels.
    """
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize, rowwise_quantize

    if offsets_G.numel() == 1 and aligned_ends is None:
        return (*rowwise_quantize(t_RC), *_fused_columns(t_RC, offsets_G))
    q_CR = _transposed_out(t_RC, aligned_groups=0 if aligned_ends is None else offsets_G.numel())
    q_RC, s_R, s_GC = dual_quantize(t_RC, offsets_G, q_CR, stride_out_col=q_CR.shape[1], stride_out_group=0,
                                    aligned_ends=aligned_ends)
    return q_RC, s_R, q_CR, s_GC.reshape(-1)


_ROW_ENDS: dict[tuple, Tensor] = {}


def _expert_row_ends(w_EKN: Tensor) -> Tensor:
    """int32 ``[E]`` cumulative row ends of ``w [E, K, N]`` viewed as ``[E * K, N]`` rows.

    They depend on the shape alone, so they are made once per (device, E, K) and shared (two
    launches fewer per weight cast); read-only, like every offsets tensor the casts take. Not
    kept when made under CUDA-graph capture, whose memory pool could outlive it wrongly."""
    experts, k, _ = w_EKN.shape
    key = (w_EKN.device, experts, k)
    ends = _ROW_ENDS.get(key)
    if ends is None:
        ends = torch.arange(1, experts + 1, device=w_EKN.device, dtype=torch.int32) * k
        if not w_EKN.is_cuda:
            _ROW_ENDS[key] = ends
        elif not torch.cuda.is_current_stream_capturing():
            # Host sync, once per shape: other streams (a pipelined dispatcher's chunks) will
            # read the shared tensor without waiting for the stream that wrote it.
            torch.cuda.current_stream(w_EKN.device).synchronize()
            _ROW_ENDS[key] = ends
    return ends


def _once_per_version(offsets: Tensor, name: str, make: Callable[[], Any]) -> Any:
    """``make()``, run once per offsets tensor and version and kept on the tensor as ``name``:
    a layer's two projections and their backwards share one offsets tensor, and an in-place
    update bumps the version. Inference tensors (Lightning's evaluation loops) have none."""
    version = None if offsets.is_inference() else offsets._version
    kept = getattr(offsets, name, None)
    if kept is not None and kept[0] == version:
        return kept[1]
    value = make()
    setattr(offsets, name, (version, value))
    return value


_ALIGNED_MESSAGE = "torch._scaled_grouped_mm needs expert groups padded to a multiple of 16 tokens"


def _assert_groups_aligned(offsets: Tensor) -> None:
    """Device-side check that every group end is a multiple of 16 (the grouped FP8 kernels'
    requirement), once per offsets tensor and version (4 launches each time, none when
    `_wgrad_aligned_ends` already checked this version)."""
    _once_per_version(offsets, "_aligned_checked",
                      lambda: torch._assert_async((offsets % _ALIGN == 0).all(), _ALIGNED_MESSAGE))


def _weight_as_groups(w_EKN: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """``w [E, K, N]`` as a group-column quantizer sees it: rows ``[E * K, N]`` grouped by
    expert, and the float8 ``[E, N, K]`` fprop output with its (column, group) strides."""
    experts, k, n = w_EKN.shape
    q_ENK = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device=w_EKN.device)
    ends = _expert_row_ends(w_EKN)
    # Row e*K + k, column n -> q[e, n, k] = e*N*K + n*K + k = (e*K + k) + n*K + e*K*(N-1).
    return w_EKN.reshape(experts * k, n), ends, q_ENK, k, k * (n - 1)


def _fused_weight_fprop(w_EKN: Tensor) -> tuple[Tensor, Tensor]:
    """The fprop half of `_fused_weight_both` alone: ``[E, N, K]`` per (expert, output column)."""
    from lightning_moe.kernels.fp8_quant_triton import group_column_quantize

    rows, ends, q_ENK, stride_col, stride_group = _weight_as_groups(w_EKN)
    return q_ENK, group_column_quantize(rows, ends, q_ENK, stride_col, stride_group)


def _fused_weight_both(w_EKN: Tensor, launch_stream: Optional[torch.cuda.Stream] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``w [E, K, N]`` quantized for both grouped GEMMs from two reads (one fused quantizer):

    - fprop: per (expert, output column) over K, stored ``[E, N, K]``, scales ``[E, N]``;
    - dgrad: per (expert, row k) over N, stored ``[E * K, N]``, scales ``[E * K]``.

    ``launch_stream``: run the kernels there (the outputs are allocated on the current stream).
    """
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize

    rows, ends, q_ENK, stride_col, stride_group = _weight_as_groups(w_EKN)
    q_dgrad, s_dgrad, s_EN = dual_quantize(rows, ends, q_ENK, stride_col, stride_group, launch_stream)
    return q_ENK, s_EN, q_dgrad, s_dgrad


class _FusedGroupedOperands:
    """The fused Triton quantizers of a grouped GEMM's operands, for the rowwise recipe
    (current scaling, two reads per operand) or the delayed one (history scales, one read:
    ``kernels.fp8_delayed_triton``). Either way the same copies come back: the row copy with
    per-row scales and the per-group transposed copy with per-(group, column) scales.

    Delayed: the input's and the weight's amaxes are recorded by the forward's casts only (the
    generic path records them again in the backward, from the same values). The two differ only
    if a forward ran with recording paused and its backward did not, which `FP8Precision`
    never does (it pauses recording for evaluation, which has no backward)."""

    def __init__(self, recipe: FP8Recipe, state: Optional[DelayedState]) -> None:
        self.recipe, self.state = recipe, state if recipe.name == "delayed" else None

    def _delayed(self, role: str) -> tuple[Tensor, Optional[Tensor]]:
        """``role``'s E4M3 scales ``[G]`` and the amax row to record into (None when paused)."""
        from lightning_moe.precision.delayed import amax_record_row, history_scales

        assert self.state is not None
        scale = history_scales(self.state, role, self.recipe.format(role).max, E4M3.max)
        return scale, amax_record_row(self.state, role)

    def activation(self, t_RC: Tensor, offsets_G: Tensor, role: str, transposed: bool,
                   swiglu: bool = False, gather_rows: Optional[Tensor] = None,
                   aligned_ends: Optional[Tensor] = None, row_probs: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
        """(row copy, ``[R]`` scales, transposed copy, ``[G * C]`` scales); the transposed pair
        only when ``transposed`` (a backward will run). ``swiglu`` (delayed, ``transposed``):
        ``t`` is ``h = [gate | up]`` and the copies are of ``silu(gate) * up``. ``gather_rows``
        (delayed): ``t`` is ``[T, C]`` and the operand is ``t[gather_rows]`` (a permutation's
        rows, zeros for the padding sentinel ``T``). ``aligned_ends``: the transposed copy in the
        Triton weight-gradient kernel's aligned group layout (`_wgrad_aligned_ends`). ``row_probs``
        (with ``swiglu``): fp32 ``[R]`` weights of the SwiGLU's rows."""
        if self.state is None:
            assert not swiglu and gather_rows is None and row_probs is None, \
                "the SwiGLU and gather casts are delayed-scaling casts"
            return _fused_input(t_RC, offsets_G, transposed, aligned_ends if transposed else None)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows = t_RC.shape[0] if gather_rows is None else gather_rows.shape[0]
        aligned_groups = 0 if aligned_ends is None else offsets_G.numel()
        q_CR = (_transposed_out(t_RC, t_RC.shape[1] // 2 if swiglu else None, rows=rows, aligned_groups=aligned_groups)
                if transposed else None)
        q_RC, s_R, s_GC = delayed_cast(t_RC, offsets_G, *self._delayed(role), out_col=q_CR,
                                       stride_out_col=0 if q_CR is None else q_CR.shape[1], swiglu=swiglu,
                                       gather_rows=gather_rows, aligned_ends=aligned_ends if transposed else None,
                                       row_probs=row_probs, amax_prepass=self.state.fresh,
                                  reduce_amax=fresh_amax_reduction(self.state))
        return q_RC, s_R, q_CR, None if s_GC is None else s_GC.reshape(-1)

    def weight_fprop(self, w_EKN: Tensor) -> tuple[Tensor, Tensor]:
        """``[E, N, K]`` with ``[E, N]`` scales."""
        if self.state is None:
            return _fused_weight_fprop(w_EKN)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows, ends, q_ENK, stride_col, stride_group = _weight_as_groups(w_EKN)
        _, _, s_EN = delayed_cast(rows, ends, *self._delayed("weight"), write_row=False, out_col=q_ENK,
                                  stride_out_col=stride_col, stride_out_group=stride_group,
                                  amax_prepass=self.state.fresh,
                                  reduce_amax=fresh_amax_reduction(self.state))
        return q_ENK, s_EN

    def weight_dgrad(self, w_EKN: Tensor) -> tuple[Tensor, Tensor]:
        """``[E * K, N]`` with ``[E * K]`` scales (the amax was recorded by the forward's cast)."""
        experts, k, n = w_EKN.shape
        rows = w_EKN.reshape(experts * k, n)
        if self.state is None:
            from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

            return rowwise_quantize(rows)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        q, s_EK, _ = delayed_cast(rows, _expert_row_ends(w_EKN), self._delayed("weight")[0], None,
                                  reduce_amax=fresh_amax_reduction(self.state))
        return q, s_EK

    def weight_both(self, w_EKN: Tensor, launch_stream: Optional[torch.cuda.Stream] = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`weight_fprop` and `weight_dgrad` from one kernel (the weight cache keeps both).
        ``launch_stream``: run the kernels there; the outputs are allocated on the current
        stream, which must wait for ``launch_stream`` before reading them."""
        if self.state is None:
            return _fused_weight_both(w_EKN, launch_stream)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows, ends, q_ENK, stride_col, stride_group = _weight_as_groups(w_EKN)
        scale, record = self._delayed("weight")
        q_dgrad, s_dgrad, s_EN = delayed_cast(rows, ends, scale, record, out_col=q_ENK, stride_out_col=stride_col,
                                              stride_out_group=stride_group, launch_stream=launch_stream,
                                              amax_prepass=self.state.fresh,
                                  reduce_amax=fresh_amax_reduction(self.state))
        return q_ENK, s_EN, q_dgrad, s_dgrad


def _per_row(scale_inv: Tensor, rows: Axis) -> Tensor:
    """Per-row scales of an operand quantized with whole-row tiles (rowwise or per group)."""
    return scale_inv[:, 0].index_select(0, rows.ids).contiguous()


def _per_group_rows(scale_inv: Tensor, rows: Axis, groups: int) -> Tensor:
    """``[groups * P]`` group-major scales of an operand tiled per (row, group of columns)."""
    per_row = scale_inv.index_select(0, rows.ids)  # [P, groups + 1 (tail)]
    return per_row[:, :groups].t().contiguous().reshape(-1)


# One ``_scaled_mm`` per expert beats ``_scaled_grouped_mm`` when experts are few and large
# (fp8_gemm_ceiling.json, H200: mixtral fprop 1465 vs 1271 TFLOP/s, weight gradient 1276 vs
# 870; deepseek_v3_slice 1261 vs 1098 and 1184 vs 842) and loses badly when they are many and
# small (qwen3, 128 experts: 143 vs 939): per-expert launches then dominate.
PER_EXPERT_MAX_EXPERTS = 32

# Our Triton grouped GEMMs (``kernels.fp8_grouped_gemm_triton``) for the products with fast
# accumulation on Hopper, without the per-expert products' host sync. Forward and data gradient:
# fp8_grouped_tune_s19d.json, qwen3 1.18-1.51x torch's grouped kernel; mixtral fc2 and deepseek
# fc2 1.10x / 1.23x the per-expert products; mixtral fc1 0.98x them (s19b, an earlier variant).
# Weight gradient: fp8_grouped_tune_s20a_wgrad.json, 1.07-1.29x torch's grouped kernel. Off with
# ``LIGHTNING_MOE_TRITON_GROUPED_GEMM=0`` (read at each call) or by setting this False.
TRITON_GROUPED_GEMM = True


def _triton_grouped(t: Tensor, fast: bool) -> bool:
    """Whether a grouped product on ``t``'s device takes the Triton kernel: fast accumulation (the
    kernel's only mode), a Hopper GPU (sm90: the FP8 tensor-core path it was built and measured
    on), a Triton with host-side TMA descriptors, and not switched off."""
    from lightning_moe.kernels import use_triton

    return (fast and TRITON_GROUPED_GEMM and use_triton(t)
            and os.environ.get("LIGHTNING_MOE_TRITON_GROUPED_GEMM", "1") != "0"
            and _triton_grouped_device(t.device.index))  # a CUDA tensor's device always has an index


@functools.lru_cache(maxsize=None)
def _triton_grouped_device(index: int) -> bool:
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


def _host_group_ends(offsets_E: Tensor, experts: int) -> Optional[list[int]]:
    """Row ends per expert on the host when per-expert GEMMs pay off, else None (grouped kernel).

    The host list is kept on the offsets tensor (`_once_per_version`) for the layer's other
    projection and the backward, which share that tensor.
    """
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if experts > PER_EXPERT_MAX_EXPERTS or capturing:
        return None
    # host sync (once per offsets): each expert's _scaled_mm call needs its row count
    return _once_per_version(offsets_E, "_host_ends", offsets_E.tolist)


def _group_gemm(qa_RK: Tensor, sa_R: Tensor, qb_EOK: Tensor, sb_EO: Tensor, offsets_E: Tensor,
                ends: Optional[list[int]], fast: bool, triton: bool) -> Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]^T`` (fprop / dgrad): ``a`` row-major ``[R, K]`` with
    per-row scales ``[R]``, ``b`` stored ``[E, O, K]`` with per-output scales ``[E, O]``.
    ``triton``: `_triton_grouped` holds for this product (the kernel still declines operands a
    TMA descriptor cannot take). Returns bf16 ``[R, O]``; rows past the last group are zero
    (per-expert) or unspecified."""
    if triton:
        from lightning_moe.kernels.fp8_grouped_gemm_triton import MAX_EXPERTS, grouped_mm_fprop, tma_operands

        if qb_EOK.shape[0] <= MAX_EXPERTS and tma_operands(qa_RK, qb_EOK):
            return grouped_mm_fprop(qa_RK, sa_R.contiguous(), qb_EOK, sb_EO.contiguous(), offsets_E)
    return _torch_group_gemm(qa_RK, sa_R, qb_EOK, sb_EO, offsets_E, ends, fast)


def _torch_group_gemm(qa_RK: Tensor, sa_R: Tensor, qb_EOK: Tensor, sb_EO: Tensor, offsets_E: Tensor,
                      ends: Optional[list[int]], fast: bool) -> Tensor:
    """`_group_gemm` on torch's kernels: one ``_scaled_mm`` per expert given the host list of group
    ends (rows past the last group zeroed), else ``_scaled_grouped_mm``."""
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


def _group_weight_gradient(qa_KR: Tensor, sa_EK: Tensor, qb_NR: Tensor, sb_EN: Tensor, offsets_E: Tensor,
                           ends: Optional[list[int]], fast: bool, aligned_ends: Optional[Tensor] = None,
                           out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``dw[e] = a[:, rows of e] @ b[:, rows of e]^T``: both operands ``[features, R]`` with
    per-(expert, feature) scales ``[E, features]``. Returns ``out_dtype`` ``[E, K, N]`` (the
    weight's dtype). Our Triton kernel writes an fp32 gradient for fp32 master weights directly.
    torch's grouped kernel writes bf16 only, and its row-scaled ``_scaled_mm`` writes fp32 only on
    sm90 with cuBLAS >= 12.9, so those paths write bf16, widened after (`kernels.widened`). So fp32
    master weights get an unrounded gradient from the Triton kernel and a bf16-rounded one
    otherwise (the Triton kernel switched off, split accumulation, the generic quantizers, off
    sm90). ``aligned_ends``: the
    operands are in the aligned group layout (`_wgrad_aligned_ends`), for our Triton kernel (fast
    accumulation only)."""
    if aligned_ends is not None:
        from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad

        assert fast, "the Triton weight-gradient kernel accumulates fast only"
        kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        # The tiles stored by TMA where the rows allow it: 2.5-3.9% faster in isolation at qwen3 with 4
        # stages (fp8_grouped_tune_s27_wgrad_tma.json, the same bits), 0.02-0.03 ms of the graphed
        # block (moe_block_s28_*.json); LIGHTNING_MOE_WGRAD_TMA_STORE=0 (an A/B switch for benchmarks)
        # stores them from registers. fp32 tiles take 3 stages, as 4 and their staging buffer exceed
        # shared memory.
        tma_store = (os.environ.get("LIGHTNING_MOE_WGRAD_TMA_STORE", "1") != "0"
                     and qb_NR.shape[0] * kernel_dtype.itemsize % 16 == 0)
        stages = 3 if tma_store and kernel_dtype == torch.float32 else 4
        return grouped_mm_wgrad(qa_KR, sa_EK.contiguous(), qb_NR, sb_EN.contiguous(), aligned_ends,
                                out_dtype=kernel_dtype, tma_store=tma_store, num_stages=stages).to(out_dtype)
    experts = sa_EK.shape[0]
    if ends is None:
        # torch's FP8 grouped GEMM writes bf16 only
        return widened(torch._scaled_grouped_mm(qa_KR, qb_NR.t(), sa_EK.reshape(-1), sb_EN.reshape(-1),
                                                offs=offsets_E, out_dtype=torch.bfloat16, use_fast_accum=fast),
                       out_dtype)
    out = torch.empty(experts, qa_KR.shape[0], qb_NR.shape[0], dtype=torch.bfloat16, device=qa_KR.device)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            torch._scaled_mm(qa_KR[:, start:end], qb_NR[:, start:end].t(), scale_a=sa_EK[e][:, None],
                             scale_b=sb_EN[e][None], out_dtype=torch.bfloat16, use_fast_accum=fast, out=out[e])
        else:
            out[e].zero_()  # an expert without tokens has no gradient
        start = end
    return widened(out, out_dtype)


def _weight_signature(w: Tensor) -> tuple:
    """What identifies a weight's values: memory, layout and version (a new view of the same
    parameter, as each forward makes, has the same signature; an in-place update changes it)."""
    return w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w._version


_PREFETCH_STREAMS: dict[int, torch.cuda.Stream] = {}


def _prefetch_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PREFETCH_STREAMS:
        _PREFETCH_STREAMS[index] = torch.cuda.Stream(device=index)
    return _PREFETCH_STREAMS[index]


@dataclass
class PrefetchedWeight:
    """Both FP8 layouts of an expert weight, being cast on a side stream (`prefetch_weight_layouts`).

    signature: the weight's `_weight_signature` when the cast started.
    layouts: ``(fprop [E, N, K], scales [E, N], dgrad [E * K, N], scales [E * K])``, as
        ``_FusedGroupedOperands.weight_both`` returns them; allocated on the stream that
        started the cast, written on the side stream.
    done: recorded on the side stream after the cast.
    device: the weight's device.
    """

    signature: tuple
    layouts: tuple[Tensor, Tensor, Tensor, Tensor]
    done: torch.cuda.Event
    device: torch.device

    def release(self) -> None:
        """Make the current stream wait for the cast: nothing issued after this (an optimizer
        step, the delayed-scaling update) may touch the weight or the amax the cast records
        while the side stream may still be at it."""
        torch.cuda.current_stream(self.device).wait_event(self.done)

    def take(self, w: Tensor) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """The layouts, ready on the current stream, if they are of ``w`` as it is now (an
        in-place update through ``.data`` is not seen: it bypasses the version counter), else
        None; `release` either way."""
        self.release()
        if self.signature != _weight_signature(w):
            return None
        current = torch.cuda.current_stream(self.device)
        for t in self.layouts:
            # No-op on the stream that allocated them; on another one (a pipelined dispatcher's
            # chunk stream), their memory must not be handed out before that stream is done.
            t.record_stream(current)
        return self.layouts


def can_prefetch_weight_layouts(w_EKN: Tensor, recipe: FP8Recipe) -> bool:
    """Whether the training forward of `scaled_grouped_mm` would cast both layouts of ``w`` itself
    with the fused casts, so that `prefetch_weight_layouts` may start them early: CUDA, the
    rowwise or delayed recipe (E4M3, no power-of-2 scales for rowwise),
    ``FP8Recipe.quantize_weights_once``, no weight cache, gradients on. Under CUDA-graph capture
    too: the side stream forks from the capturing stream and joins it again at the GEMM's event
    wait (or at `PrefetchedWeight.release`), so the graph keeps the casts beside the routing.
    Reads no delayed-scaling state."""
    needs_backward = torch.is_grad_enabled() and w_EKN.requires_grad
    if not (w_EKN.is_cuda and needs_backward and _both_weight_layouts_now(recipe, needs_backward)):
        return False
    if training_cache(w_EKN) is not None:
        return False
    if recipe.name == "delayed":
        return _local_triton_operands(w_EKN)
    return _fused_rowwise(recipe, None, w_EKN)


def prefetch_weight_layouts(w_EKN: Tensor, recipe: FP8Recipe,
                            state: Optional[DelayedState]) -> PrefetchedWeight:
    """Start casting both FP8 layouts of ``w [E, K, N]`` on a side stream, where
    `can_prefetch_weight_layouts` holds (``state``: the projection's delayed-scaling state, or
    None for rowwise). Pass the result to `scaled_grouped_mm` (``prefetched=``): its forward
    waits for it there, and casts again if the weight changed since. The layouts are allocated
    on the current stream, so their memory returns to its pool when the backward frees them."""
    side = _prefetch_stream(w_EKN.device)
    layouts = _FusedGroupedOperands(recipe, state).weight_both(w_EKN.detach(), launch_stream=side)
    done = torch.cuda.Event()
    done.record(side)
    # Read there: if the weight's memory were freed before the current stream waits for
    # `done`, the allocator must not hand it out until then (the casts mark their own operands).
    w_EKN.record_stream(side)
    return PrefetchedWeight(_weight_signature(w_EKN), layouts, done, w_EKN.device)


# fc1's output gradient cast inside fc2's backward, straight from the SwiGLU's input and fc2's data
# gradient (`_SwiGLUGradHandoff`); off with ``LIGHTNING_MOE_FUSED_SWIGLU_GRAD=0`` (read at each
# forward) or by setting this False.
FUSED_SWIGLU_GRAD = True

# The attribute of fc1's output that carries its `_SwiGLUGradHandoff` to fc2's call.
_HANDOFF_ATTR = "_lightning_moe_swiglu_grad_handoff"


class _SwiGLUGradHandoff:
    """fc1's output gradient handed from fc2's backward to fc1's as the FP8 copies fc1's backward
    casts it into, instead of as a bf16 tensor through autograd.

    fc2's backward holds the SwiGLU's input ``h`` (fc1's output) and its output's gradient (fc2's
    data gradient); fc1's backward needs ``grad_h`` only as its delayed FP8 row and transposed
    copies. With the handoff, fc2's backward casts ``grad_h`` computed on the fly
    (``kernels.swiglu_grad_cast_triton``: one read of ``h`` and the gradient, no bf16 ``grad_h``
    written and read back) with fc1's scales, amax record and weight-gradient layout, leaves the
    copies here and returns no gradient for ``h``; fc1's backward (its grads not materialized)
    takes them. The same bytes as the unfused path (GPU tests).

    fc1's forward arms it (a delayed-scaling fused cast in a training pass) and the wrapper
    attaches it to fc1's output; the first fc2 call on that output claims it, so it applies only
    where fc1's output goes straight into fc2's fused SwiGLU cast. If ``h`` also reached another
    consumer (a second fc2 call included, which gets no handoff), fc1's backward would receive that
    gradient beside the handoff, and raises.

    So no gradient of ``h`` passes through autograd: hooks and ``retain_grad`` on fc1's output see
    none, and ``torch.autograd.grad(..., inputs=[h])`` finds ``h`` unused. Switch it off
    (``LIGHTNING_MOE_FUSED_SWIGLU_GRAD=0``) to inspect that gradient."""

    def __init__(self) -> None:
        self.quantizer: Optional[_FusedGroupedOperands] = None  # fc1's, set by fc1's forward
        self.aligned = False  # fc1's transposed copies in the weight-gradient kernel's aligned layout
        self.claimed = False  # by the fc2 call that will cast into it
        self.operands: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None

    @staticmethod
    def enabled() -> bool:
        return FUSED_SWIGLU_GRAD and os.environ.get("LIGHTNING_MOE_FUSED_SWIGLU_GRAD", "1") != "0"

    def arm(self, quantizer: _FusedGroupedOperands, aligned: bool) -> None:
        self.quantizer, self.aligned = quantizer, aligned

    @property
    def armed(self) -> bool:
        return self.quantizer is not None

    def claim(self) -> bool:
        """Whether the calling fc2 is the first to take this armed handoff (and now holds it)."""
        if not self.armed or self.claimed:
            return False
        self.claimed = True
        return True

    def cast(self, h_RF2: Tensor, g_RF: Tensor, row_probs: Optional[Tensor], offsets: Tensor) -> Optional[Tensor]:
        """Cast ``grad_h`` of ``p * silu(gate) * up`` (``p`` = ``row_probs``, or 1) into fc1's
        copies, kept for fc1's backward; returns ``grad_p`` fp32 ``[R]`` with ``row_probs``. Copies
        that fc1's backward never took (a backward over a subset of the inputs that stopped at
        fc2, then another over the retained graph) are replaced by the same values."""
        from lightning_moe.kernels.swiglu_grad_cast_triton import delayed_swiglu_grad_cast

        assert self.quantizer is not None, "cast into a handoff that fc1's forward did not arm"
        rows, f2 = h_RF2.shape
        aligned_ends = _wgrad_aligned_ends(offsets) if self.aligned else None
        q_CR = _transposed_out(h_RF2, f2, rows=rows, aligned_groups=offsets.numel() if self.aligned else 0)
        scale, record = self.quantizer._delayed("grad")
        q_RC, s_R, s_GC, grad_p = delayed_swiglu_grad_cast(h_RF2, g_RF, row_probs, offsets, scale, record, q_CR,
                                                           q_CR.shape[1], aligned_ends)
        self.operands = (q_RC, s_R, q_CR, s_GC.reshape(-1))
        return grad_p

    def take(self) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
        operands, self.operands = self.operands, None
        return operands


class _ScaledGroupedMM(torch.autograd.Function):
    """``x @ w`` per group; with ``input_swiglu`` ``x`` is ``h = [gate | up]`` and the GEMM's
    input is ``silu(gate) * up``, quantized straight from ``h`` (see `scaled_grouped_mm_swiglu`);
    with ``gather`` (a `PermutationPlan`) ``x`` is the tokens ``[T, K]`` and the GEMM's input is
    ``permute(x, gather)``, gathered inside the cast (see `scaled_grouped_mm_gathered`). With
    ``combine`` (a `PermutationPlan`, under ``input_swiglu``) the SwiGLU's rows are weighted by
    their probabilities in ``probs`` ``[T, K]`` and the output rows are summed per token (an
    unweighted combine, ``[T, N]``), so the backward's gradient cast gathers the token gradients
    itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                state: Optional[DelayedState], weight_key: Optional[Hashable],
                cache: Optional[FP8WeightCache], needs_backward: bool, input_swiglu: bool = False,
                prefetched: Optional[PrefetchedWeight] = None, gather: Any = None, combine: Any = None,
                probs: Optional[Tensor] = None, handoff: Optional[_SwiGLUGradHandoff] = None) -> Tensor:
        out_dtype = compute_dtype(x)
        experts, k, n = w.shape
        with no_autocast(x):
            fused = _fused_rowwise(recipe, state, x) or _fused_delayed(recipe, state, x, w)
            assert fused or not input_swiglu, "scaled_grouped_mm_swiglu checks swiglu_fusable first"
            assert gather is None or (fused and state is not None and not input_swiglu), \
                "scaled_grouped_mm_gathered needs the native delayed casts"
            assert combine is None or (input_swiglu and probs is not None), "combine weights a SwiGLU's rows"
            row_probs = None
            if combine is not None:
                from lightning_moe.nn.permutation import row_probs as gather_row_probs

                # [R] fp32, 0 for padding rows; the backward maps the rows' gradient back by gathers
                row_probs = gather_row_probs(probs, combine).float()
            if prefetched is not None and not fused:
                prefetched.release()
            # Whether our Triton grouped GEMMs can run here; each product also needs fast accumulation.
            triton_here = _triton_grouped(x, True)
            if fused:
                # Both copies of the input and of the weight from one fused quantizer each: the
                # backward keeps FP8 operands (input^T for wgrad, weight for dgrad), not bf16.
                quantizer = _FusedGroupedOperands(recipe, state)
                # The gathered cast reads the tokens in the GEMM's dtype, as the unfused path casts
                # its permuted rows (autocast over an fp32 residual stream): the tokens are rounded
                # here, one row per token instead of one per assignment.
                source = x if gather is None or x.dtype == out_dtype else x.to(out_dtype)
                # Our weight-gradient kernel where it runs: the transposed copies (this input's now,
                # the gradient's in the backward) are then cast into its aligned group layout.
                wgrad_aligned_ends = None
                if needs_backward and triton_here and recipe.fast("wgrad"):
                    # The aligned layout's buffer bound holds for 16-row groups only: checked on the
                    # device before the first cast writes it (once per offsets tensor and version;
                    # with Triton the ends' kernel makes the check's flag, so it comes first).
                    wgrad_aligned_ends = _wgrad_aligned_ends(offsets)
                    _assert_groups_aligned(offsets)
                qx, sx_R, qx_t, sx_t = quantizer.activation(
                    source, offsets, "input", needs_backward, swiglu=input_swiglu,
                    gather_rows=None if gather is None else gather.row_token_R, aligned_ends=wgrad_aligned_ends,
                    row_probs=row_probs)
                # Waited for only now, so the input's cast above overlaps the weight's.
                prefetched_layouts = prefetched.take(w) if prefetched is not None else None
                if _caching(cache, weight_key):
                    qw_ENK, sw_EN, qw_dgrad, sw_EK = cached(cache, weight_key, w, f"grouped_fused_{recipe.name}",
                                                            lambda: quantizer.weight_both(w))
                    weight_dgrad: Optional[tuple[Tensor, Tensor]] = (qw_dgrad, sw_EK)
                elif _both_weight_layouts_now(recipe, needs_backward):
                    qw_ENK, sw_EN, qw_dgrad, sw_EK = (prefetched_layouts if prefetched_layouts is not None
                                                      else quantizer.weight_both(w))
                    weight_dgrad = (qw_dgrad, sw_EK)
                else:
                    qw_ENK, sw_EN = quantizer.weight_fprop(w)
                    weight_dgrad = None  # quantized again in the backward
                # The weight's data-gradient copy is a saved tensor when the recipe makes it in
                # every training forward, so activation checkpointing drops it after the forward
                # and its recompute (outside any cache) makes it again, with the same metadata.
                # Otherwise empty placeholders keep the saved count fixed, and a cached copy rides
                # on ctx (the cache keeps it anyway).
                save_dgrad = weight_dgrad is not None and _both_weight_layouts_now(recipe, needs_backward)
                if not save_dgrad:
                    placeholder = torch.empty(0, device=w.device)
                    saved_dgrad: tuple[Tensor, Tensor] = (placeholder, placeholder)
                else:
                    assert weight_dgrad is not None
                    saved_dgrad, weight_dgrad = weight_dgrad, None
            else:
                wgrad_aligned_ends = None  # the generic quantizers' copies: torch's kernels
                qx, sx, rx, _ = quantize_operand(x, recipe, "input", Layout(row_offsets=offsets), state, True, E4M3)

                def weight_fprop() -> tuple[Tensor, Tensor]:
                    qw, sw, rw, _ = quantize_operand(w.transpose(1, 2).reshape(experts * n, k), recipe, "weight",
                                                     Layout(batch=experts), state, True, E4M3)
                    return qw.view(experts, n, k), _per_row(sw, rw).view(experts, n)

                sx_R = _per_row(sx, rx)
                qw_ENK, sw_EN = cached(cache, weight_key, w, "grouped_fprop", weight_fprop)
            triton_fprop = triton_here and recipe.fast("fprop")
            triton_dgrad = needs_backward and triton_here and recipe.fast("dgrad")
            # The host list of group ends only where a product will run per expert: none when the
            # Triton kernels take the forward and, in training, the data gradient (the weight
            # gradient then takes ours or torch's grouped kernel, with no host sync at all).
            per_expert_products = not (triton_fprop and (triton_dgrad or not needs_backward))
            ends = _host_group_ends(offsets, experts) if per_expert_products else None
            y = _group_gemm(qx, sx_R, qw_ENK, sw_EN, offsets, ends, fast=recipe.fast("fprop"), triton=triton_fprop)
        if fused:
            # Same tensors with and without the cache (see _ScaledLinear.forward). Under
            # input_swiglu h is kept for the SwiGLU's backward (the unfused SwiGLU keeps it too).
            ctx.save_for_backward(qx_t, sx_t, offsets, w, *saved_dgrad, *((x,) if input_swiglu else ()),
                                  *((row_probs,) if combine is not None else ()))
            ctx.weight_dgrad = weight_dgrad
        else:
            ctx.save_for_backward(x, w, offsets)
        ctx.input_swiglu, ctx.gather, ctx.combine, ctx.triton_dgrad = input_swiglu, gather, combine, triton_dgrad
        # fc1 (a fused delayed cast in training): its output gradient may come through ``handoff``
        # (armed here), with no gradient from autograd; fc2: hands its input's gradient over.
        ctx.handoff = None
        # (not for a fresh state reduced over a group: the handoff's fused cast finds missing
        # scales by itself, rank-locally; the plain gradient cast reduces them first)
        if handoff is not None and fused and state is not None and needs_backward and fresh_amax_group(state) is None:
            if not input_swiglu:
                handoff.arm(quantizer, wgrad_aligned_ends is not None)
                ctx.set_materialize_grads(False)
                ctx.handoff = handoff
            elif handoff.claim():
                ctx.handoff = handoff
        # Whether the transposed copies are in the aligned layout. The backward takes the ends from
        # the saved offsets, as the saved input copy (which activation checkpointing recomputes).
        ctx.wgrad_aligned = wgrad_aligned_ends is not None
        ctx.recipe, ctx.state, ctx.ends, ctx.cache, ctx.weight_key = recipe, state, ends, cache, weight_key
        ctx.fused, ctx.x_dtype, ctx.w_dtype, ctx.w_shape = fused, x.dtype, w.dtype, w.shape
        ctx.probs_dtype = None if probs is None else probs.dtype
        y = y.to(out_dtype)
        if combine is not None:
            from lightning_moe.kernels.combine_triton import combine as combine_rows

            # The probabilities were applied before this GEMM: each token's rows are summed as they are.
            y = combine_rows(y, combine.dest_TK)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        recipe, state, ends = ctx.recipe, ctx.state, ctx.ends
        experts, k, n = ctx.w_shape
        # fc1's output gradient as fc2's backward cast it (see `_SwiGLUGradHandoff`), or None
        handed = ctx.handoff.take() if ctx.handoff is not None and not ctx.input_swiglu else None
        if handed is None and dy is None:  # fc1 armed a handoff that nothing filled: no gradient
            return (None,) * 14
        if handed is not None and dy is not None:
            raise RuntimeError(
                "FP8 grouped GEMM: fc1's output received a gradient from a consumer besides fc2's fused SwiGLU cast, "
                "which hands fc1 its gradient already cast. Feed fc1's output to fc2 alone, or set "
                "LIGHTNING_MOE_FUSED_SWIGLU_GRAD=0.")
        # Unpacked once: activation checkpointing refuses a second unpack of a saved tensor.
        saved = ctx.saved_tensors
        offsets = saved[2]
        _assert_groups_aligned(offsets)
        with no_autocast(offsets):
            dy = None if dy is None else dy.contiguous()
            if ctx.fused:  # (a handoff is armed on the fused path only)
                qx_t, sx_t, _, w, qw_saved, sw_saved = saved[:6]
                qw, sw_EK = _saved_weight_dgrad(ctx, qw_saved, sw_saved, w)
                # Under combine ``dy`` is the tokens' gradient [T, N]: row r's is dy[row_token[r]],
                # gathered by the cast (zeros for padding rows), as the combine's backward would.
                token_rows = None if ctx.combine is None else ctx.combine.row_token_R
                source = handed[0] if handed is not None else dy if token_rows is None else token_rows
                wgrad_aligned_ends = _saved_wgrad_layout(qx_t, offsets, source.shape[0], ctx.wgrad_aligned)
                if handed is not None:
                    qdy, sdy_R, qdy_t, sdy_t = handed
                else:
                    qdy, sdy_R, qdy_t, sdy_t = _FusedGroupedOperands(recipe, state).activation(
                        dy, offsets, "grad", True, gather_rows=token_rows, aligned_ends=wgrad_aligned_ends)
            else:
                x, w, _ = saved
                wgrad_aligned_ends = None
                qdy, sdy, rdy, _ = quantize_operand(dy, recipe, "grad", Layout(row_offsets=offsets), state, True, E4M3)

                def weight_dgrad() -> tuple[Tensor, Tensor]:
                    qw, sw, rw, _ = quantize_operand(w.reshape(experts * k, n), recipe, "weight", Layout(batch=experts),
                                                     state, True, E4M3)
                    return qw, _per_row(sw, rw)

                qw, sw_EK = cached(ctx.cache, ctx.weight_key, w, "grouped_dgrad", weight_dgrad)
                cols = Layout(col_offsets=offsets)
                qx_t, sx_t, rx_t, _ = quantize_operand(x.t(), recipe, "input", cols, state, True, E4M3)
                qdy_t, sdy_t, rdy_t, _ = quantize_operand(dy.t(), recipe, "grad", cols, state, True, E4M3)
                # zero tokens past the last group keep the 16-byte strides the kernel needs
                qx_t, qdy_t = _pad_fp8(qx_t), _pad_fp8(qdy_t)
                sdy_R = _per_row(sdy, rdy)
                sx_t, sdy_t = _per_group_rows(sx_t, rx_t, experts), _per_group_rows(sdy_t, rdy_t, experts)
            dx = _group_gemm(qdy, sdy_R, qw.view(experts, k, n), sw_EK.view(experts, k), offsets, ends,
                             fast=recipe.fast("dgrad"), triton=ctx.triton_dgrad)
            dw = _group_weight_gradient(qx_t, sx_t.view(experts, k), qdy_t, sdy_t.view(experts, n), offsets, ends,
                                        fast=recipe.fast("wgrad"), aligned_ends=wgrad_aligned_ends,
                                        out_dtype=ctx.w_dtype)
            dx = dx.to(ctx.x_dtype)
            grad_probs = None
            if ctx.handoff is not None and ctx.input_swiglu and ctx.needs_input_grad[0]:
                # fc1's output gradient goes to fc1's backward already cast (see `_SwiGLUGradHandoff`)
                grad_rows = ctx.handoff.cast(saved[6], dx, saved[7] if ctx.combine is not None else None, offsets)
                dx = None
            elif ctx.combine is not None:
                from lightning_moe.kernels.swiglu_triton import weighted_swiglu_backward

                # dx is the gradient of row_probs * silu(gate) * up
                dx, grad_rows = weighted_swiglu_backward(saved[6], dx, saved[7])
            elif ctx.input_swiglu:
                from lightning_moe.kernels.swiglu_triton import swiglu_backward

                # dx is the gradient of silu(gate) * up, as the unfused SwiGLU would receive it
                dx = swiglu_backward(saved[6], dx)
            if ctx.combine is not None:
                # Each kept assignment (t, k) holds one row, dest[t, k]; dropped ones (dest == R) get 0.
                grad_probs = torch.cat([grad_rows, grad_rows.new_zeros(1)])[ctx.combine.dest_TK]
                grad_probs = grad_probs.to(ctx.probs_dtype)
        if ctx.gather is not None:
            from lightning_moe.nn.permutation import permute_backward

            dx = permute_backward(dx, ctx.gather)  # the gradient of the permutation the cast read
        return dx, dw, *(None,) * 10, grad_probs, None


def _saved_weight_dgrad(ctx: Any, qw_saved: Tensor, sw_saved: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """The weight's data-gradient copy and scales: saved by the forward, kept on ``ctx`` (a cached
    copy), or quantized now."""
    if qw_saved.numel():
        return qw_saved, sw_saved
    if ctx.weight_dgrad is not None:
        return ctx.weight_dgrad
    return _FusedGroupedOperands(ctx.recipe, ctx.state).weight_dgrad(w)


def _saved_wgrad_layout(qx_t: Tensor, offsets: Tensor, rows: int, aligned: bool) -> Optional[Tensor]:
    """The aligned ends when the forward cast its input's transposed copy ``qx_t`` into the
    aligned layout (``aligned``), else None, after checking that the saved copy (recomputed under
    activation checkpointing) has the width of that layout: a recompute that decided otherwise
    (the Triton switch flipped in between) would give a wrong weight gradient silently."""
    if qx_t.shape[1] != _transposed_width(rows, offsets.numel() if aligned else 0):
        raise RuntimeError("FP8 grouped GEMM: the saved input copy is not in the layout its forward chose for the "
                           "weight gradient (was LIGHTNING_MOE_TRITON_GROUPED_GEMM or scaled_mm.TRITON_GROUPED_GEMM "
                           "changed between a forward and its recompute?); keep it fixed during a step")
    return _wgrad_aligned_ends(offsets) if aligned else None


def scaled_grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                      state: Optional[DelayedState], weight_key: Optional[Hashable] = None,
                      prefetched: Optional[PrefetchedWeight] = None) -> Tensor:
    """FP8 grouped GEMM; ``weight_key`` names ``w`` for an active `FP8WeightCache`;
    ``prefetched``: ``w``'s layouts from `prefetch_weight_layouts`. The output may carry a
    `_SwiGLUGradHandoff` for `scaled_grouped_mm_swiglu`."""
    return _apply_with_handoff(x, w, offsets, recipe, state, weight_key, training_cache(w), _needs_backward(x, w),
                               False, prefetched, None)


def _apply_with_handoff(*args: Any) -> Tensor:
    """``_ScaledGroupedMM.apply(*args)`` for a first projection (no SwiGLU input, no combine), given a
    fresh `_SwiGLUGradHandoff` that its output carries where the forward armed it."""
    handoff = _SwiGLUGradHandoff() if _SwiGLUGradHandoff.enabled() else None
    h = _ScaledGroupedMM.apply(*args, None, None, handoff)
    if handoff is not None and handoff.armed:
        setattr(h, _HANDOFF_ATTR, handoff)
    return h


def scaled_grouped_mm_gathered(tokens: Tensor, plan: Any, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                               state: DelayedState, weight_key: Optional[Hashable] = None,
                               prefetched: Optional[PrefetchedWeight] = None) -> Tensor:
    """``permute(tokens, plan) @ w`` per group, the permutation's gather read straight into the
    FP8 cast of the GEMM's input: the permuted rows are never written in ``tokens``' dtype and
    read back. The gradient flows to ``tokens`` through the permutation's backward. Under
    autocast the tokens are first rounded to its dtype, as ``GroupedExperts`` rounds permuted
    rows before a quantized GEMM: the same bits as that path (GPU test); without autocast the
    same bits as ``scaled_grouped_mm(permute(tokens, plan), w, ...)``. Only with a delayed state where
    `native_delayed_casts` (training or evaluation: both cast kernels read through the row index)."""
    return _apply_with_handoff(tokens, w, offsets, recipe, state, weight_key, training_cache(w),
                               _needs_backward(tokens, w), False, prefetched, plan)


def swiglu_fusable(h: Tensor, w: Tensor, recipe: FP8Recipe, state: Optional[DelayedState]) -> bool:
    """Whether `scaled_grouped_mm_swiglu` can take ``h``: the delayed recipe's one-read casts on
    CUDA, in a training pass (evaluation casts the row copy alone, whose kernel reads whole
    rows of a materialized input)."""
    return _fused_delayed(recipe, state, h, w) and _needs_backward(h, w)


def scaled_grouped_mm_swiglu(h: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                             state: DelayedState, weight_key: Optional[Hashable] = None,
                             prefetched: Optional[PrefetchedWeight] = None, combine: Any = None) -> Tensor:
    """``swiglu(h) @ w`` per group, the SwiGLU computed inside the FP8 cast of the GEMM's input:
    ``silu(gate) * up`` is never written in bf16 and read back. Same bits as
    ``scaled_grouped_mm(swiglu(h), w, ...)`` with the Triton SwiGLU (GPU test); only where
    `swiglu_fusable`.

    ``combine`` (a `DeferredCombine`): return ``combine.apply(swiglu(h) @ w)`` ``[T, N]`` instead,
    computed as Megatron-Core's experts do, with the routing probabilities applied to the SwiGLU's
    rows (its weighted SwiGLU) and an unweighted sum per token after the GEMM, the same function
    up to rounding. Its backward then needs no combine pass: the gradient cast gathers each row's
    token gradient, and the probabilities' gradient comes out of the SwiGLU's backward.

    Where ``h`` is the output of an FP8 grouped GEMM that armed a `_SwiGLUGradHandoff`, the
    backward casts ``h``'s gradient straight into that GEMM's FP8 copies (no bf16 ``grad_h``)."""
    return _ScaledGroupedMM.apply(h, w, offsets, recipe, state, weight_key, training_cache(w),
                                  _needs_backward(h, w), True, prefetched, None,
                                  *((None, None) if combine is None else (combine.plan, combine.probs_TK)),
                                  getattr(h, _HANDOFF_ATTR, None))
