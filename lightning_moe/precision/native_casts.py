"""The native FP8 backend's operand casts: each operand of a GEMM quantized by one fused Triton
kernel into every copy its GEMMs read, with the generic quantizers' bits (`precision.operands`).

Rowwise operands on CUDA go through the fused quantizers of ``kernels.fp8_quant_triton``
(`fused_rowwise`): each activation is quantized once for both of its GEMMs (rowwise for fprop /
dgrad, per expert group and transposed for the weight gradient), and the backward keeps that FP8
copy instead of the bf16 input. Delayed-scaling operands on CUDA (`fused_delayed`) take the same
copies from one read each with their history scales (``kernels.fp8_delayed_triton``): grouped
operands through `FusedGroupedOperands`, dense ones through `dense_operand`. The casts can also
compute their operand on the way in: the SwiGLU of fc1's output, or the permutation's rows
gathered from the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_moe.kernels import WGRAD_GROUP_ALIGN
from lightning_moe.precision.delayed import DelayedState, fresh_amax_reduction
from lightning_moe.precision.formats import E4M3, E5M2
from lightning_moe.precision.operands import quantize_operand
from lightning_moe.precision.quantize import Axis
from lightning_moe.precision.recipes import FP8Recipe
from lightning_moe.precision.weight_cache import FP8WeightCache

# The grouped FP8 kernels' alignment: group ends and the weight gradient's contraction in multiples of 16 rows.
ALIGN = 16


def dense_operand(t: Tensor, recipe: FP8Recipe, state: Optional[DelayedState], role: str,
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
    q, scale_inv_R, _ = delayed_cast(t, whole(t), state.scale[SLOTS[role]], amax_record_row(state, role),
                                     e5m2=recipe.format(role) is E5M2)
    return q, scale_inv_R[:1]  # every row has the tensor's scale


def dense_input_both_layouts(x_RK: Tensor, state: DelayedState) -> tuple[Tensor, Tensor, Tensor]:
    """A delayed dense linear's input cast to E4M3 in both layouts by one read of ``x`` (the tile
    kernel): ``(q [R, K], scale_inv [1], q_t [K, R padded to 16])``, its amax recorded once. The
    bytes of `dense_operand` (a cast is elementwise with one scale, so the transposed copy holds the
    row copy's bytes transposed, zeros in the padding columns): the backward's weight gradient takes
    ``q_t`` instead of transposing the row copy."""
    q, scale_inv_R, q_KR, _ = _transposed_cast(x_RK, state, "input")
    return q, scale_inv_R[:1], q_KR


def dense_grad_both_layouts(dy_RN: Tensor, recipe: FP8Recipe, state: DelayedState) -> tuple[Tensor, Tensor, Tensor]:
    """A delayed dense linear's output gradient cast in both layouts by one read of ``dy`` (the tile
    kernel, in the recipe's gradient format: E5M2 under hybrid): ``(q [R, N], scale_inv [1],
    q_t [N, R padded to 16])``, its amax recorded. The bytes of `dense_operand` on ``dy`` and of
    that row copy transposed (zeros in the padding columns), which the backward would otherwise copy."""
    q, scale_inv_R, q_NR, _ = _transposed_cast(dy_RN, state, "grad", e5m2=recipe.format("grad") is E5M2)
    return q, scale_inv_R[:1], q_NR


def _transposed_cast(t_RC: Tensor, state: DelayedState, role: str, e5m2: bool = False
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The delayed tile cast of a dense operand as one group with ``role``'s scale, its amax
    recorded: the row copy and its ``scale_inv [R]``, the transposed copy (`transposed_out`:
    ``[C, R padded to 16]``) and its column scales."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.precision.delayed import SLOTS, amax_record_row

    q_CR = transposed_out(t_RC, dtype=torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)
    q, scale_inv_R, s_col = delayed_cast(t_RC, whole(t_RC), state.scale[SLOTS[role]], amax_record_row(state, role),
                                         out_col=q_CR, stride_out_col=q_CR.shape[1], e5m2=e5m2,
                                         amax_prepass=state.fresh)
    return q, scale_inv_R, q_CR, s_col


def fused_rowwise(recipe: FP8Recipe, state: Optional[DelayedState], t: Tensor) -> bool:
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
    return recipe.name == "delayed" and local_triton_operands(*operands)


def fused_delayed(recipe: FP8Recipe, state: Optional[DelayedState], *operands: Tensor) -> bool:
    """The delayed recipe's operands take the one-read delayed casts (`native_delayed_casts`)."""
    return state is not None and native_delayed_casts(recipe, *operands)


def local_triton_operands(*operands: Tensor) -> bool:
    """Triton kernels can take the operands. Not DTensors: a tensor-parallel shard's amax is
    reduced over its shards by the generic path."""
    from torch.distributed.tensor import DTensor

    from lightning_moe.kernels import use_triton

    return all(not isinstance(t, DTensor) and use_triton(t) for t in operands)


def caching(cache: Optional[FP8WeightCache], weight_key: Optional[Hashable]) -> bool:
    """Whether this weight's FP8 operands come from the weight cache.

    With the cache both layouts are made at once (one fused quantizer) and kept until the
    optimizer step. Without it see `both_weight_layouts_now`.
    """
    return cache is not None and weight_key is not None


def both_weight_layouts_now(recipe: FP8Recipe, needs_backward: bool) -> bool:
    """Whether a grouped forward without the weight cache makes the expert weight's
    data-gradient layout too (one quantizer for both), saving it for the backward: 1 byte per
    parameter held from the forward to the backward (``FP8Recipe.quantize_weights_once``, on
    unless set False). Otherwise the backward quantizes the weight again."""
    return needs_backward and recipe.quantize_weights_once is not False


def transposed_width(rows: int, aligned_groups: int = 0) -> int:
    """Columns of `transposed_out`'s buffer for ``rows`` rows: ``rows`` padded to 16, plus, in the
    aligned group layout of ``aligned_groups`` groups of whole 16-row runs, the most each group
    can grow (``WGRAD_GROUP_ALIGN - 16``): a bound without the group sizes on the host."""
    return -(-rows // ALIGN) * ALIGN + aligned_groups * (WGRAD_GROUP_ALIGN - ALIGN)


def transposed_out(t_RC: Tensor, cols: Optional[int] = None, rows: Optional[int] = None,
                   aligned_groups: int = 0, dtype: torch.dtype = torch.float8_e4m3fn) -> Tensor:
    """Float8 ``[C, R]`` for ``t^T`` (``C`` = ``cols``, ``R`` = ``rows``, default ``t``'s) with
    ``R`` padded to 16 by zero columns (the padding is the contraction the dense weight-gradient
    GEMM reads; the rest is written by a quantizer).

    ``aligned_groups`` > 0: room for that many groups in the aligned group layout of the Triton
    weight-gradient kernel (`wgrad_aligned_ends`), which the quantizer writes whole (gaps
    included); what lies past the last aligned end is never read and stays unwritten. The bound
    holds for groups of whole 16-row runs only (`assert_groups_aligned` first): up to
    ``aligned_groups * 112`` columns more than the plain copy (11% at 128 experts of ~1,000
    tokens, about half of it written)."""
    rows = t_RC.shape[0] if rows is None else rows
    cols = t_RC.shape[1] if cols is None else cols
    q_CR = torch.empty(cols, transposed_width(rows, aligned_groups), dtype=dtype, device=t_RC.device)
    if not aligned_groups:
        q_CR[:, rows:].zero_()
    return q_CR


def wgrad_aligned_ends(offsets_E: Tensor) -> Tensor:
    """int32 ``[E]`` cumulative ends of the aligned group layout that `grouped_mm_wgrad` reads:
    each group's size rounded up to ``WGRAD_GROUP_ALIGN``. Made once per offsets tensor and
    version (the layer's two projections and their backwards share it); under CUDA-graph
    capture made afresh each call, so that the graph computes it from the offsets it replays
    with and no graph-pool tensor is kept on an eager one (as `expert_row_ends`).

    With Triton on CUDA one kernel (``kernels.aligned_ends_triton``) makes the ends and the flag
    of `assert_groups_aligned`'s check, which is then issued from it (and so done for this
    offsets version): two launches instead of about twelve in the forward."""
    from lightning_moe.kernels import use_triton
    from lightning_moe.nn.permutation import round_up

    def make() -> Tensor:
        if use_triton(offsets_E):
            from lightning_moe.kernels.aligned_ends_triton import aligned_group_ends

            ends, aligned_ok = aligned_group_ends(offsets_E, WGRAD_GROUP_ALIGN, ALIGN)
            once_per_version(offsets_E, "_aligned_checked", lambda: torch._assert_async(aligned_ok, _ALIGNED_MESSAGE))
            return ends
        sizes = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
        return round_up(sizes, WGRAD_GROUP_ALIGN).cumsum(0).to(torch.int32)

    if offsets_E.is_cuda and torch.cuda.is_current_stream_capturing():
        return make()
    return once_per_version(offsets_E, "wgrad_aligned_ends", make)


def fused_columns(t_RC: Tensor, offsets_G: Tensor) -> tuple[Tensor, Tensor]:
    """The transposed half of `fused_both` alone (its own quantizer: two reads of ``t``)."""
    from lightning_moe.kernels.fp8_quant_triton import group_column_quantize

    q_CR = transposed_out(t_RC)
    scale_inv_GC = group_column_quantize(t_RC, offsets_G, q_CR, stride_out_col=q_CR.shape[1], stride_out_group=0)
    return q_CR, scale_inv_GC.reshape(-1)


def needs_backward(x: Tensor, weight: Tensor) -> bool:
    """Whether this call will be differentiated: decided where the GEMM is called (inside an
    autograd Function's forward grad mode is off and ``needs_input_grad`` ignores it)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def fused_input(
    t_RC: Tensor, offsets_G: Tensor, needs_backward: bool, aligned_ends: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The forward's rowwise copy of an activation, and its transposed copy only when a backward
    will use it (evaluation and inference make one copy, not two)."""
    if needs_backward:
        return fused_both(t_RC, offsets_G, aligned_ends)
    from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

    return (*rowwise_quantize(t_RC), None, None)


def whole(t_RC: Tensor) -> Tensor:
    """One row group spanning every row of ``t`` (dense operands)."""
    return torch.full((1,), t_RC.shape[0], dtype=torch.int32, device=t_RC.device)


def fused_both(t_RC: Tensor, offsets_G: Tensor, aligned_ends: Optional[Tensor] = None
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
    weight-gradient kernel's aligned group layout (`wgrad_aligned_ends`), by the dual kernels.
    """
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize, rowwise_quantize

    if offsets_G.numel() == 1 and aligned_ends is None:
        return (*rowwise_quantize(t_RC), *fused_columns(t_RC, offsets_G))
    q_CR = transposed_out(t_RC, aligned_groups=0 if aligned_ends is None else offsets_G.numel())
    q_RC, s_R, s_GC = dual_quantize(t_RC, offsets_G, q_CR, stride_out_col=q_CR.shape[1], stride_out_group=0,
                                    aligned_ends=aligned_ends)
    return q_RC, s_R, q_CR, s_GC.reshape(-1)


_ROW_ENDS: dict[tuple, Tensor] = {}


def expert_row_ends(w_EKN: Tensor) -> Tensor:
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


def once_per_version(offsets: Tensor, name: str, make: Callable[[], Any]) -> Any:
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


def assert_groups_aligned(offsets: Tensor) -> None:
    """Device-side check that every group end is a multiple of 16 (the grouped FP8 kernels'
    requirement), once per offsets tensor and version (4 launches each time, none when
    `wgrad_aligned_ends` already checked this version)."""
    once_per_version(offsets, "_aligned_checked",
                     lambda: torch._assert_async((offsets % ALIGN == 0).all(), _ALIGNED_MESSAGE))


def weight_as_groups(w_EKN: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """``w [E, K, N]`` as a group-column quantizer sees it: rows ``[E * K, N]`` grouped by
    expert, and the float8 ``[E, N, K]`` fprop output with its (column, group) strides."""
    experts, k, n = w_EKN.shape
    q_ENK = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device=w_EKN.device)
    ends = expert_row_ends(w_EKN)
    # Row e*K + k, column n -> q[e, n, k] = e*N*K + n*K + k = (e*K + k) + n*K + e*K*(N-1).
    return w_EKN.reshape(experts * k, n), ends, q_ENK, k, k * (n - 1)


def fused_weight_fprop(w_EKN: Tensor) -> tuple[Tensor, Tensor]:
    """The fprop half of `fused_weight_both` alone: ``[E, N, K]`` per (expert, output column)."""
    from lightning_moe.kernels.fp8_quant_triton import group_column_quantize

    rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w_EKN)
    return q_ENK, group_column_quantize(rows, ends, q_ENK, stride_col, stride_group)


def fused_weight_both(w_EKN: Tensor, launch_stream: Optional[torch.cuda.Stream] = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``w [E, K, N]`` quantized for both grouped GEMMs from two reads (one fused quantizer):

    - fprop: per (expert, output column) over K, stored ``[E, N, K]``, scales ``[E, N]``;
    - dgrad: per (expert, row k) over N, stored ``[E * K, N]``, scales ``[E * K]``.

    ``launch_stream``: run the kernels there (the outputs are allocated on the current stream).
    """
    from lightning_moe.kernels.fp8_quant_triton import dual_quantize

    rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w_EKN)
    q_dgrad, s_dgrad, s_EN = dual_quantize(rows, ends, q_ENK, stride_col, stride_group, launch_stream)
    return q_ENK, s_EN, q_dgrad, s_dgrad


class FusedGroupedOperands:
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
        Triton weight-gradient kernel's aligned group layout (`wgrad_aligned_ends`). ``row_probs``
        (with ``swiglu``): fp32 ``[R]`` weights of the SwiGLU's rows."""
        if self.state is None:
            assert not swiglu and gather_rows is None and row_probs is None, \
                "the SwiGLU and gather casts are delayed-scaling casts"
            return fused_input(t_RC, offsets_G, transposed, aligned_ends if transposed else None)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows = t_RC.shape[0] if gather_rows is None else gather_rows.shape[0]
        aligned_groups = 0 if aligned_ends is None else offsets_G.numel()
        q_CR = (transposed_out(t_RC, t_RC.shape[1] // 2 if swiglu else None, rows=rows, aligned_groups=aligned_groups)
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
            return fused_weight_fprop(w_EKN)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w_EKN)
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

        q, s_EK, _ = delayed_cast(rows, expert_row_ends(w_EKN), self._delayed("weight")[0], None,
                                  reduce_amax=fresh_amax_reduction(self.state))
        return q, s_EK

    def weight_both(self, w_EKN: Tensor, launch_stream: Optional[torch.cuda.Stream] = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`weight_fprop` and `weight_dgrad` from one kernel (the weight cache keeps both).
        ``launch_stream``: run the kernels there; the outputs are allocated on the current
        stream, which must wait for ``launch_stream`` before reading them."""
        if self.state is None:
            return fused_weight_both(w_EKN, launch_stream)
        from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

        rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w_EKN)
        scale, record = self._delayed("weight")
        q_dgrad, s_dgrad, s_EN = delayed_cast(rows, ends, scale, record, out_col=q_ENK, stride_out_col=stride_col,
                                              stride_out_group=stride_group, launch_stream=launch_stream,
                                              amax_prepass=self.state.fresh,
                                              reduce_amax=fresh_amax_reduction(self.state))
        return q_ENK, s_EN, q_dgrad, s_dgrad


def per_row(scale_inv: Tensor, rows: Axis) -> Tensor:
    """Per-row scales of an operand quantized with whole-row tiles (rowwise or per group)."""
    return scale_inv[:, 0].index_select(0, rows.ids).contiguous()


def per_group_rows(scale_inv: Tensor, rows: Axis, groups: int) -> Tensor:
    """``[groups * P]`` group-major scales of an operand tiled per (row, group of columns)."""
    by_row = scale_inv.index_select(0, rows.ids)  # [P, groups + 1 (tail)]
    return by_row[:, :groups].t().contiguous().reshape(-1)
