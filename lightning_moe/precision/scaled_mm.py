"""The native FP8 backend's autograd functions: FP8 linears and grouped GEMMs on ``torch._scaled_mm``
/ ``torch._scaled_grouped_mm`` and our Triton kernels (`precision.native_gemms`), their operands from
the fused casts (`precision.native_casts`).

CUDA only (tensorwise sm89+, rowwise and grouped sm90+; `resolve_backend` checks). Operands are
quantized exactly as in the emulated backend (same tiles and scales; torch's saturating float8 cast
instead of the reference rounding, bit-identical). Accumulation per GEMM follows
``recipe.fast_accumulation`` (default: fast fprop, split dgrad / wgrad, as Transformer Engine).

A training forward quantizes each expert weight for both of its GEMMs with one cast
(``FP8Recipe.quantize_weights_once``; see `native_casts.both_weight_layouts_now`), takes both from
the weight cache, or from the copies `precision.weight_prefetch` started before routing. Under
delayed scaling a SwiGLU expert's second projection can take ``h = [gate | up]`` itself
(`scaled_grouped_mm_swiglu`): its input cast computes ``silu(gate) * up`` on the fly, so the
SwiGLU output is never written in bf16 and read back.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_moe.nn.compute_weights import accumulation_grad, in_place_accumulation_target
from lightning_moe.precision.autocast import compute_dtype, no_autocast
from lightning_moe.precision.delayed import DelayedState, fresh_amax_group
from lightning_moe.precision.formats import E4M3
from lightning_moe.precision.native_casts import (
    ALIGN,
    FusedGroupedOperands,
    assert_groups_aligned,
    both_weight_layouts_now,
    caching,
    dense_grad_both_layouts,
    dense_input_both_layouts,
    dense_operand,
    fused_both,
    fused_columns,
    fused_delayed,
    fused_input,
    fused_rowwise,
    needs_backward,
    per_group_rows,
    per_row,
    transposed_out,
    transposed_width,
    wgrad_aligned_ends,
    whole,
)
from lightning_moe.precision.native_gemms import (
    group_gemm,
    group_weight_gradient,
    host_group_ends,
    pad_fp8,
    scaled_mm_rows,
    transposed_fp8,
    triton_grouped,
)
from lightning_moe.precision.operands import Layout, quantize_operand
from lightning_moe.precision.recipes import FP8Recipe
from lightning_moe.precision.weight_cache import FP8WeightCache, cached, training_cache
from lightning_moe.precision.weight_prefetch import PrefetchedWeight


# Experiment toggle (benchmarks patch it; `train_step.py --dense-transposed-copies`): a delayed dense
# linear's input is cast in both layouts by one read in the forward, the transposed copy saved for the
# weight gradient (see `DENSE_GRAD_BOTH_LAYOUTS` for the output gradient), and its weight's transposed
# FP8 copy is kept in the weight cache (made once per optimizer step), instead of the backward
# transposing those FP8 copies every micro-batch. The same bytes either way. Measured 1.4-1.5% faster
# FP8 steps (qwen3 and mixtral shapes, accumulate 8, same call); off until measured beside the other
# changes of that session (see benchmarks/NOTES.md).
DENSE_TRANSPOSED_COPIES = False

# Experiment toggle (benchmarks patch it; `train_step.py --dense-grad-both-layouts`): under
# `DENSE_TRANSPOSED_COPIES` the backward casts its output gradient in both layouts by one read (the
# tile kernel, E5M2 under hybrid) instead of transposing the row copy. The same bytes; off until a
# same-run measurement of the step (see benchmarks/NOTES.md).
DENSE_GRAD_BOTH_LAYOUTS = False


class _ScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                state: Optional[DelayedState], weight_key: Optional[Hashable],
                cache: Optional[FP8WeightCache], needs_backward: bool,
                accumulate_into: tuple[Optional[Tensor]] = (None,)) -> Tensor:
        out_dtype = compute_dtype(x)
        with no_autocast(x):
            x2 = x.reshape(-1, x.shape[-1])
            fused = fused_rowwise(recipe, state, x2)
            delayed = not fused and fused_delayed(recipe, state, x2, weight)
            # `DENSE_TRANSPOSED_COPIES`: both layouts of the input now (in E4M3, the input's format
            # under both of delayed scaling's formats) and the weight's transposed copy once per
            # optimizer step where the cache holds the weight; the latter rides on ctx like the fused
            # path's (an activation-checkpointing recompute runs outside the cache and transposes in
            # the backward instead)
            transposed_copies = DENSE_TRANSPOSED_COPIES and delayed and needs_backward
            transposed_input = bool(transposed_copies and x2.numel() and recipe.format("input") is E4M3)
            weight_t = None
            if fused:
                from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

                # Both copies of the input made now: the forward's, and the transposed one the
                # backward needs (kept in FP8 instead of the bf16 input).
                qx, sx, qx_t, sx_t = fused_input(x2, whole(x2), needs_backward)
                if caching(cache, weight_key):
                    qw, sw, qw_t, sw_t = cached(cache, weight_key, weight, "dense_fused",
                                                lambda: fused_both(weight, whole(weight)))
                    weight_dgrad: Optional[tuple[Tensor, Tensor]] = (qw_t, sw_t)
                else:
                    # A dense weight's two layouts take two single quantizers either way (see
                    # `fused_both`), so making both now would only hold memory longer.
                    qw, sw = rowwise_quantize(weight)
                    weight_dgrad = None  # quantized again in the backward
            else:
                if transposed_input:
                    assert state is not None  # fused_delayed
                    qx, sx, qx_t = dense_input_both_layouts(x2, state)
                else:
                    qx, sx = dense_operand(x2, recipe, state, "input", delayed)
                qw, sw = cached(cache, weight_key, weight, "dense_fprop",
                                lambda: dense_operand(weight, recipe, state, "weight", delayed))
                if transposed_copies and caching(cache, weight_key):
                    weight_t = cached(cache, weight_key, weight, "dense_fprop_transposed", lambda: transposed_fp8(qw))
            y = scaled_mm_rows(qx, sx, qw, sw, out_dtype, fast=recipe.fast("fprop"))
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
            ctx.save_for_backward(*(((qx_t if transposed_input else qx), sx, qw, sw) if tensorwise else (x2, weight)))
            ctx.input_transposed, ctx.weight_transposed = transposed_input, weight_t
        ctx.fused, ctx.delayed = fused, delayed
        ctx.tensorwise, ctx.recipe, ctx.state, ctx.cache, ctx.weight_key = tensorwise, recipe, state, cache, weight_key
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # A reference in a tuple, not an input: no second edge to the weight's AccumulateGrad.
        (ctx.accumulate_into,) = accumulate_into
        ctx.w_numel = weight.numel()
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], ...]:
        recipe, state = ctx.recipe, ctx.state
        with no_autocast(dy):
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ctx.tensorwise:
                if DENSE_GRAD_BOTH_LAYOUTS and ctx.input_transposed and dy2.numel():  # one read, both layouts
                    qdy, sdy, qdy_t = dense_grad_both_layouts(dy2, recipe, state)
                else:
                    qdy, sdy = dense_operand(dy2, recipe, state, "grad", ctx.delayed)
                    qdy_t = transposed_fp8(qdy, ALIGN)
                sdy_t = sdy
                qx, sx, qw, sw = ctx.saved_tensors  # qx: the transposed copy with ctx.input_transposed
                qw_t = ctx.weight_transposed if ctx.weight_transposed is not None else transposed_fp8(qw)
                sw_t = sw
                qx_t, sx_t = (qx if ctx.input_transposed else transposed_fp8(qx, ALIGN)), sx
            elif ctx.fused:
                qx_t, sx_t, weight = ctx.saved_tensors
                if ctx.weight_dgrad is not None:
                    qw_t, sw_t = ctx.weight_dgrad
                else:
                    qw_t, sw_t = fused_columns(weight, whole(weight))
                qdy, sdy, qdy_t, sdy_t = fused_both(dy2, whole(dy2))
            else:
                x2, weight = ctx.saved_tensors
                qw_t, sw_t, _, _ = cached(ctx.cache, ctx.weight_key, weight, "dense_dgrad", lambda: quantize_operand(
                    weight.t(), recipe, "weight", state=state, native=True))
                # (per-row or per-block scales: a delayed recipe is tensorwise and took the first branch)
                qdy, sdy, _, _ = quantize_operand(dy2, recipe, "grad", state=state, native=True)
                qdy_t, sdy_t, _, _ = quantize_operand(dy2.t(), recipe, "grad", state=state, native=True)
                qx_t, sx_t, _, _ = quantize_operand(x2.t(), recipe, "input", state=state, native=True)
            dx = scaled_mm_rows(qdy, sdy, qw_t, sw_t, ctx.x_dtype, fast=recipe.fast("dgrad"))
            # Added into the weight's fp32 .grad where `in_place_accumulation_target` chose it and it
            # has one (then None for autograd), else returned.
            dw = scaled_mm_rows(pad_fp8(qdy_t), sdy_t, pad_fp8(qx_t), sx_t, ctx.w_dtype, fast=recipe.fast("wgrad"),
                                accumulate_into=accumulation_grad(ctx.accumulate_into, ctx.w_numel))
            db = None if ctx.bias_dtype is None else dy2.float().sum(0).to(ctx.bias_dtype)
        return dx.reshape(ctx.x_shape), dw, db, None, None, None, None, None, None


def scaled_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: FP8Recipe,
                  state: Optional[DelayedState], weight_key: Optional[Hashable] = None) -> Tensor:
    """FP8 ``x @ weight.T (+ bias)``; ``weight_key`` names the weight for an active `FP8WeightCache`.
    Under in-place gradient accumulation (`in_place_accumulation_target`: the strategy's
    ``accumulate_grads_in_place``) the backward adds the weight gradient into the weight's fp32
    ``.grad`` once it has one, and hands autograd none."""
    return _ScaledLinear.apply(x, weight, bias, recipe, state, weight_key, training_cache(weight),
                               needs_backward(x, weight), (in_place_accumulation_target(weight),))


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
    none, and ``torch.autograd.grad(..., inputs=[h])`` finds ``h`` unused. Hence opt-in
    (``FP8Recipe.fuse_swiglu_backward``)."""

    def __init__(self) -> None:
        self.quantizer: Optional[FusedGroupedOperands] = None  # fc1's, set by fc1's forward
        self.aligned = False  # fc1's transposed copies in the weight-gradient kernel's aligned layout
        self.claimed = False  # by the fc2 call that will cast into it
        self.operands: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None

    def arm(self, quantizer: FusedGroupedOperands, aligned: bool) -> None:
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
        aligned_ends = wgrad_aligned_ends(offsets) if self.aligned else None
        q_CR = transposed_out(h_RF2, f2, rows=rows, aligned_groups=offsets.numel() if self.aligned else 0)
        scale, record = self.quantizer._delayed("grad")
        q_RC, s_R, s_GC, grad_p = delayed_swiglu_grad_cast(h_RF2, g_RF, row_probs, offsets, scale, record, q_CR,
                                                           q_CR.shape[1], aligned_ends)
        self.operands = (q_RC, s_R, q_CR, s_GC.reshape(-1))
        return grad_p

    def take(self) -> Optional[tuple[Tensor, Tensor, Tensor, Tensor]]:
        operands, self.operands = self.operands, None
        return operands


@dataclass
class _GroupedCall:
    """What one `_ScaledGroupedMM` call does, besides its tensors.

    input_swiglu: ``x`` is ``h = [gate | up]`` and the GEMM's input is ``silu(gate) * up``,
        quantized straight from ``h`` (see `scaled_grouped_mm_swiglu`).
    gather: a `PermutationPlan`: ``x`` is the tokens ``[T, K]`` and the GEMM's input is
        ``permute(x, gather)``, gathered inside the cast (see `scaled_grouped_mm_gathered`).
    combine: a `PermutationPlan` (under ``input_swiglu``): the SwiGLU's rows are weighted by their
        probabilities ``probs [T, K]`` and the output rows are summed per token (an unweighted
        combine, ``[T, N]``), so the backward's gradient cast gathers the token gradients itself.
    handoff: fc1's output gradient handed over already cast (`_SwiGLUGradHandoff`), opt-in.
    accumulate_into: the parameter into whose fp32 ``.grad`` the backward adds the weight gradient
        once it has one, handing autograd none (`in_place_accumulation_target`), or None.
    """

    recipe: FP8Recipe
    state: Optional[DelayedState]
    weight_key: Optional[Hashable]
    cache: Optional[FP8WeightCache]
    needs_backward: bool
    input_swiglu: bool = False
    prefetched: Optional[PrefetchedWeight] = None
    gather: Any = None
    combine: Any = None
    handoff: Optional[_SwiGLUGradHandoff] = None
    accumulate_into: Optional[Tensor] = None


class _ForwardOperands(NamedTuple):
    """A grouped forward's FP8 operands: the input's row copy and scales (and its transposed copy,
    kept for the weight gradient, on the fused path), the weight's forward layout, and its
    data-gradient layout (``saved_dgrad``: a saved tensor pair, empty placeholders when it is
    not saved; ``kept_dgrad``: a cached copy that rides on ctx instead)."""

    qx: Tensor
    sx_R: Tensor
    qx_t: Optional[Tensor]
    sx_t: Optional[Tensor]
    qw_ENK: Tensor
    sw_EN: Tensor
    saved_dgrad: Optional[tuple[Tensor, Tensor]]  # fused path only
    kept_dgrad: Optional[tuple[Tensor, Tensor]]
    aligned_ends: Optional[Tensor]
    quantizer: Optional[FusedGroupedOperands]


def _fused_forward_operands(x: Tensor, w: Tensor, offsets: Tensor, row_probs: Optional[Tensor], call: _GroupedCall,
                            triton_here: bool, out_dtype: torch.dtype) -> _ForwardOperands:
    """Both copies of the input and of the weight from one fused cast each: the backward keeps
    FP8 operands (input^T for the weight gradient, the weight for the data gradient), not bf16."""
    recipe = call.recipe
    quantizer = FusedGroupedOperands(recipe, call.state)
    # The gathered cast reads the tokens in the GEMM's dtype, as the unfused path casts its
    # permuted rows (autocast over an fp32 residual stream): the tokens are rounded here, one row
    # per token instead of one per assignment.
    source = x if call.gather is None or x.dtype == out_dtype else x.to(out_dtype)
    # Our weight-gradient kernel where it runs: the transposed copies (this input's now, the
    # gradient's in the backward) are then cast into its aligned group layout.
    aligned_ends = None
    if call.needs_backward and triton_here:
        # The aligned layout's buffer bound holds for 16-row groups only: checked on the device
        # before the first cast writes it (once per offsets tensor and version; with Triton the
        # ends' kernel makes the check's flag, so it comes first).
        aligned_ends = wgrad_aligned_ends(offsets)
        assert_groups_aligned(offsets)
    qx, sx_R, qx_t, sx_t = quantizer.activation(
        source, offsets, "input", call.needs_backward, swiglu=call.input_swiglu,
        gather_rows=None if call.gather is None else call.gather.row_token_R, aligned_ends=aligned_ends,
        row_probs=row_probs)
    # Waited for only now, so the input's cast above overlaps the weight's.
    prefetched_layouts = call.prefetched.take(w) if call.prefetched is not None else None
    weight_dgrad: Optional[tuple[Tensor, Tensor]]
    if caching(call.cache, call.weight_key):
        qw_ENK, sw_EN, qw_dgrad, sw_EK = cached(call.cache, call.weight_key, w, f"grouped_fused_{recipe.name}",
                                                lambda: quantizer.weight_both(w))
        weight_dgrad = (qw_dgrad, sw_EK)
    elif both_weight_layouts_now(recipe, call.needs_backward):
        qw_ENK, sw_EN, qw_dgrad, sw_EK = (prefetched_layouts if prefetched_layouts is not None
                                          else quantizer.weight_both(w))
        weight_dgrad = (qw_dgrad, sw_EK)
    else:
        qw_ENK, sw_EN = quantizer.weight_fprop(w)
        weight_dgrad = None  # quantized again in the backward
    # The weight's data-gradient copy is a saved tensor when the recipe makes it in every
    # training forward, so activation checkpointing drops it after the forward and its recompute
    # (outside any cache) makes it again, with the same metadata. Otherwise empty placeholders
    # keep the saved count fixed, and a cached copy rides on ctx (the cache keeps it anyway).
    if weight_dgrad is not None and both_weight_layouts_now(recipe, call.needs_backward):
        saved_dgrad, weight_dgrad = weight_dgrad, None
    else:
        placeholder = torch.empty(0, device=w.device)
        saved_dgrad = (placeholder, placeholder)
    return _ForwardOperands(qx, sx_R, qx_t, sx_t, qw_ENK, sw_EN, saved_dgrad, weight_dgrad, aligned_ends, quantizer)


def _generic_forward_operands(x: Tensor, w: Tensor, offsets: Tensor, call: _GroupedCall) -> _ForwardOperands:
    """The generic quantizers' copies (`precision.operands`), for torch's kernels."""
    recipe, state = call.recipe, call.state
    experts, k, n = w.shape
    qx, sx, rx, _ = quantize_operand(x, recipe, "input", Layout(row_offsets=offsets), state, True, E4M3)

    def weight_fprop() -> tuple[Tensor, Tensor]:
        qw, sw, rw, _ = quantize_operand(w.transpose(1, 2).reshape(experts * n, k), recipe, "weight",
                                         Layout(batch=experts), state, True, E4M3)
        return qw.view(experts, n, k), per_row(sw, rw).view(experts, n)

    qw_ENK, sw_EN = cached(call.cache, call.weight_key, w, "grouped_fprop", weight_fprop)
    return _ForwardOperands(qx, per_row(sx, rx), None, None, qw_ENK, sw_EN, None, None, None, None)


class _ScaledGroupedMM(torch.autograd.Function):
    """``x @ w`` per group (``y[rows of e] = x[rows of e] @ w[e]``) with FP8 operands, as `_GroupedCall`
    says: the input possibly computed inside its cast (a SwiGLU, a gather) and the output possibly
    combined per token (``probs``, the routing probabilities, only then)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offsets: Tensor, probs: Optional[Tensor],
                call: _GroupedCall) -> Tensor:
        recipe, state = call.recipe, call.state
        out_dtype = compute_dtype(x)
        with no_autocast(x):
            fused = fused_rowwise(recipe, state, x) or fused_delayed(recipe, state, x, w)
            assert fused or not call.input_swiglu, "scaled_grouped_mm_swiglu checks swiglu_fusable first"
            assert call.gather is None or (fused and state is not None and not call.input_swiglu), \
                "scaled_grouped_mm_gathered needs the native delayed casts"
            assert call.combine is None or (call.input_swiglu and probs is not None), "combine weights a SwiGLU's rows"
            row_probs = None
            if call.combine is not None:
                from lightning_moe.nn.permutation import row_probs as gather_row_probs

                # [R] fp32, 0 for padding rows; the backward maps the rows' gradient back by gathers
                row_probs = gather_row_probs(probs, call.combine).float()
            if call.prefetched is not None and not fused:
                call.prefetched.release()
            # Whether our Triton grouped GEMMs run here (fast or split accumulation, as the recipe says).
            triton_here = triton_grouped(x)
            operands = (_fused_forward_operands(x, w, offsets, row_probs, call, triton_here, out_dtype) if fused
                        else _generic_forward_operands(x, w, offsets, call))
            triton_dgrad = call.needs_backward and triton_here
            # The host list of group ends only where products run per expert: none when the Triton
            # kernels take them (the weight gradient then takes ours or torch's grouped kernel, with
            # no host sync at all).
            ends = None if triton_here else host_group_ends(offsets, w.shape[0])
            y = group_gemm(operands.qx, operands.sx_R, operands.qw_ENK, operands.sw_EN, offsets, ends,
                           fast=recipe.fast("fprop"), triton=triton_here)
        if fused:
            # Same tensors with and without the cache (see _ScaledLinear.forward). Under
            # input_swiglu h is kept for the SwiGLU's backward (the unfused SwiGLU keeps it too).
            ctx.save_for_backward(operands.qx_t, operands.sx_t, offsets, w, *operands.saved_dgrad,
                                  *((x,) if call.input_swiglu else ()),
                                  *((row_probs,) if call.combine is not None else ()))
            ctx.weight_dgrad = operands.kept_dgrad
        else:
            ctx.save_for_backward(x, w, offsets)
        # The backward needs neither the prefetched layouts (a reference would keep a graphed cast's
        # outputs in use until then) nor the handoff (on ctx where it applies, below).
        handoff, call.prefetched, call.handoff = call.handoff, None, None
        ctx.call, ctx.triton_dgrad, ctx.ends, ctx.fused = call, triton_dgrad, ends, fused
        # fc1 (a fused delayed cast in training): its output gradient may come through the handoff
        # (armed here), with no gradient from autograd; fc2: hands its input's gradient over.
        ctx.handoff = None
        # (not for a fresh state reduced over a group: the handoff's fused cast finds missing
        # scales by itself, rank-locally; the plain gradient cast reduces them first)
        if (handoff is not None and fused and state is not None and call.needs_backward
                and fresh_amax_group(state) is None):
            if not call.input_swiglu:
                assert operands.quantizer is not None
                handoff.arm(operands.quantizer, operands.aligned_ends is not None)
                ctx.set_materialize_grads(False)
                ctx.handoff = handoff
            elif handoff.claim():
                ctx.handoff = handoff
        # Whether the transposed copies are in the aligned layout. The backward takes the ends from
        # the saved offsets, as the saved input copy (which activation checkpointing recomputes).
        ctx.wgrad_aligned = operands.aligned_ends is not None
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.dtype, w.dtype, w.shape
        ctx.probs_dtype = None if probs is None else probs.dtype
        y = y.to(out_dtype)
        if call.combine is not None:
            from lightning_moe.kernels.combine_triton import combine as combine_rows

            # The probabilities were applied before this GEMM: each token's rows are summed as they are.
            y = combine_rows(y, call.combine.dest_TK)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        call = ctx.call
        recipe = call.recipe
        experts, k, n = ctx.w_shape
        # fc1's output gradient as fc2's backward cast it (see `_SwiGLUGradHandoff`), or None
        handed = ctx.handoff.take() if ctx.handoff is not None and not call.input_swiglu else None
        if handed is None and dy is None:  # fc1 armed a handoff that nothing filled: no gradient
            return None, None, None, None, None
        if handed is not None and dy is not None:
            raise RuntimeError(
                "FP8 grouped GEMM: fc1's output received a gradient from a consumer besides fc2's fused SwiGLU cast, "
                "which hands fc1 its gradient already cast. Feed fc1's output to fc2 alone, or set "
                "FP8Recipe(fuse_swiglu_backward=False).")
        # Unpacked once: activation checkpointing refuses a second unpack of a saved tensor.
        saved = ctx.saved_tensors
        offsets = saved[2]
        assert_groups_aligned(offsets)
        with no_autocast(offsets):
            dy = None if dy is None else dy.contiguous()
            backward_operands = _fused_backward_operands if ctx.fused else _generic_backward_operands
            qdy, sdy_R, qdy_t, sdy_t, qx_t, sx_t, qw, sw_EK, aligned_ends = backward_operands(ctx, saved, dy, handed)
            dx = group_gemm(qdy, sdy_R, qw.view(experts, k, n), sw_EK.view(experts, k), offsets, ctx.ends,
                            fast=recipe.fast("dgrad"), triton=ctx.triton_dgrad)
            # Added into the weight's fp32 .grad where the call chose it and it has one (None for
            # autograd then; our Triton kernel adds in its epilogue), else returned.
            dw = group_weight_gradient(qx_t, sx_t.view(experts, k), qdy_t, sdy_t.view(experts, n), offsets, ctx.ends,
                                       fast=recipe.fast("wgrad"), aligned_ends=aligned_ends, out_dtype=ctx.w_dtype,
                                       accumulate_into=accumulation_grad(call.accumulate_into, experts * k * n))
            # A gathered fc1 over fp32 tokens (an fp32 residual stream): the permutation's backward
            # below sums the rows into fp32 itself, the bits of widening them first without the copy.
            sum_widened = call.gather is not None and ctx.x_dtype == torch.float32
            if not sum_widened:
                dx = dx.to(ctx.x_dtype)
            grad_probs = None
            if ctx.handoff is not None and call.input_swiglu and ctx.needs_input_grad[0]:
                # fc1's output gradient goes to fc1's backward already cast (see `_SwiGLUGradHandoff`)
                grad_rows = ctx.handoff.cast(saved[6], dx, saved[7] if call.combine is not None else None, offsets)
                dx = None
            elif call.combine is not None:
                from lightning_moe.kernels.swiglu_triton import weighted_swiglu_backward

                # dx is the gradient of row_probs * silu(gate) * up
                dx, grad_rows = weighted_swiglu_backward(saved[6], dx, saved[7])
            elif call.input_swiglu:
                from lightning_moe.kernels.swiglu_triton import swiglu_backward

                # dx is the gradient of silu(gate) * up, as the unfused SwiGLU would receive it
                dx = swiglu_backward(saved[6], dx)
            if call.combine is not None:
                # Each kept assignment (t, k) holds one row, dest[t, k]; dropped ones (dest == R) get 0.
                grad_probs = torch.cat([grad_rows, grad_rows.new_zeros(1)])[call.combine.dest_TK]
                grad_probs = grad_probs.to(ctx.probs_dtype)
        if call.gather is not None:
            from lightning_moe.nn.permutation import permute_backward

            # the gradient of the permutation the cast read
            dx = permute_backward(dx, call.gather, out_dtype=torch.float32 if sum_widened else None)
        return dx, dw, None, grad_probs, None


def _fused_backward_operands(ctx: Any, saved: tuple[Tensor, ...], dy: Optional[Tensor],
                             handed: Optional[tuple[Tensor, Tensor, Tensor, Tensor]]) -> tuple:
    """The backward's FP8 operands on the fused path: the output gradient's copies (cast now, or
    handed over by fc2's backward), the input's transposed copy the forward kept, the weight's
    data-gradient layout; and the aligned ends where the weight gradient takes our kernel."""
    call = ctx.call
    qx_t, sx_t, offsets, w, qw_saved, sw_saved = saved[:6]
    qw, sw_EK = _saved_weight_dgrad(ctx, qw_saved, sw_saved, w)
    # Under combine ``dy`` is the tokens' gradient [T, N]: row r's is dy[row_token[r]], gathered by
    # the cast (zeros for padding rows), as the combine's backward would.
    token_rows = None if call.combine is None else call.combine.row_token_R
    source = handed[0] if handed is not None else dy if token_rows is None else token_rows
    aligned_ends = _saved_wgrad_layout(qx_t, offsets, source.shape[0], ctx.wgrad_aligned)
    if handed is not None:
        qdy, sdy_R, qdy_t, sdy_t = handed
    else:
        qdy, sdy_R, qdy_t, sdy_t = FusedGroupedOperands(call.recipe, call.state).activation(
            dy, offsets, "grad", True, gather_rows=token_rows, aligned_ends=aligned_ends)
    return qdy, sdy_R, qdy_t, sdy_t, qx_t, sx_t, qw, sw_EK, aligned_ends


def _generic_backward_operands(ctx: Any, saved: tuple[Tensor, ...], dy: Tensor, handed: None) -> tuple:
    """The backward's FP8 operands from the generic quantizers, for torch's kernels."""
    call = ctx.call
    recipe, state = call.recipe, call.state
    x, w, offsets = saved
    experts, k, n = ctx.w_shape
    qdy, sdy, rdy, _ = quantize_operand(dy, recipe, "grad", Layout(row_offsets=offsets), state, True, E4M3)

    def weight_dgrad() -> tuple[Tensor, Tensor]:
        qw, sw, rw, _ = quantize_operand(w.reshape(experts * k, n), recipe, "weight", Layout(batch=experts),
                                         state, True, E4M3)
        return qw, per_row(sw, rw)

    qw, sw_EK = cached(call.cache, call.weight_key, w, "grouped_dgrad", weight_dgrad)
    cols = Layout(col_offsets=offsets)
    qx_t, sx_t, rx_t, _ = quantize_operand(x.t(), recipe, "input", cols, state, True, E4M3)
    qdy_t, sdy_t, rdy_t, _ = quantize_operand(dy.t(), recipe, "grad", cols, state, True, E4M3)
    # zero tokens past the last group keep the 16-byte strides the kernel needs
    qx_t, qdy_t = pad_fp8(qx_t), pad_fp8(qdy_t)
    sx_t, sdy_t = per_group_rows(sx_t, rx_t, experts), per_group_rows(sdy_t, rdy_t, experts)
    return qdy, per_row(sdy, rdy), qdy_t, sdy_t, qx_t, sx_t, qw, sw_EK, None


def _saved_weight_dgrad(ctx: Any, qw_saved: Tensor, sw_saved: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """The weight's data-gradient copy and scales: saved by the forward, kept on ``ctx`` (a cached
    copy), or quantized now."""
    if qw_saved.numel():
        return qw_saved, sw_saved
    if ctx.weight_dgrad is not None:
        return ctx.weight_dgrad
    return FusedGroupedOperands(ctx.call.recipe, ctx.call.state).weight_dgrad(w)


def _saved_wgrad_layout(qx_t: Tensor, offsets: Tensor, rows: int, aligned: bool) -> Optional[Tensor]:
    """The aligned ends when the forward cast its input's transposed copy ``qx_t`` into the
    aligned layout (``aligned``), else None, after checking that the saved copy (recomputed under
    activation checkpointing) has the width of that layout: a recompute that decided otherwise
    (the Triton switch flipped in between) would give a wrong weight gradient silently."""
    if qx_t.shape[1] != transposed_width(rows, offsets.numel() if aligned else 0):
        raise RuntimeError("FP8 grouped GEMM: the saved input copy is not in the layout its forward chose for the "
                           "weight gradient (was native_gemms.TRITON_GROUPED_GEMM changed between "
                           "a forward and its recompute?); keep it fixed during a step")
    return wgrad_aligned_ends(offsets) if aligned else None


def scaled_grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe,
                      state: Optional[DelayedState], weight_key: Optional[Hashable] = None,
                      prefetched: Optional[PrefetchedWeight] = None) -> Tensor:
    """FP8 grouped GEMM; ``weight_key`` names ``w`` for an active `FP8WeightCache`;
    ``prefetched``: ``w``'s layouts from `prefetch_weight_layouts`. The output may carry a
    `_SwiGLUGradHandoff` for `scaled_grouped_mm_swiglu`."""
    return _first_projection(x, w, offsets, recipe, state, weight_key, prefetched, None)


def _first_projection(x: Tensor, w: Tensor, offsets: Tensor, recipe: FP8Recipe, state: Optional[DelayedState],
                      weight_key: Optional[Hashable], prefetched: Optional[PrefetchedWeight], gather: Any) -> Tensor:
    """`_ScaledGroupedMM` for a first projection (no SwiGLU input, no combine). With
    ``FP8Recipe.fuse_swiglu_backward``, its output carries a fresh `_SwiGLUGradHandoff` where the
    forward armed it."""
    handoff = _SwiGLUGradHandoff() if recipe.fuse_swiglu_backward else None
    call = _GroupedCall(recipe, state, weight_key, training_cache(w), needs_backward(x, w), prefetched=prefetched,
                        gather=gather, handoff=handoff, accumulate_into=in_place_accumulation_target(w))
    h = _ScaledGroupedMM.apply(x, w, offsets, None, call)
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
    return _first_projection(tokens, w, offsets, recipe, state, weight_key, prefetched, plan)


def swiglu_fusable(h: Tensor, w: Tensor, recipe: FP8Recipe, state: Optional[DelayedState]) -> bool:
    """Whether `scaled_grouped_mm_swiglu` can take ``h``: the delayed recipe's one-read casts on
    CUDA, in a training pass (evaluation casts the row copy alone, whose kernel reads whole
    rows of a materialized input)."""
    return fused_delayed(recipe, state, h, w) and needs_backward(h, w)


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
    call = _GroupedCall(recipe, state, weight_key, training_cache(w), needs_backward(h, w), input_swiglu=True,
                        prefetched=prefetched, combine=None if combine is None else combine.plan,
                        handoff=getattr(h, _HANDOFF_ATTR, None), accumulate_into=in_place_accumulation_target(w))
    return _ScaledGroupedMM.apply(h, w, offsets, None if combine is None else combine.probs_TK, call)
