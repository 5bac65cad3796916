"""Quantizing one GEMM operand the way a recipe prescribes.

Every operand is handed over laid out ``[other, contraction]`` (the contraction dimension
last), so the same rule serves the forward, data-gradient and weight-gradient GEMMs:

    fprop  y  = x  @ w^T :  x [M, K],      w   [N, K]
    dgrad  dx = dy @ w   :  dy [M, N],     w^T [K, N]
    wgrad  dw = dy^T @ x :  dy^T [N, M],   x^T [K, M]

A `Layout` adds what grouped expert GEMMs need: token groups along the rows (``x``, ``dy``
in fprop / dgrad), along the contraction (``x^T``, ``dy^T`` in wgrad; tiles then never
cross an expert's tokens), or a batch of per-expert weights stacked as rows.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from lightning_moe.precision.delayed import (
    DelayedState,
    fresh_amax_group,
    history_scales,
    record_amax,
    reduce_current_amax,
)
from lightning_moe.precision.formats import FloatFormat
from lightning_moe.precision.hadamard import random_hadamard_transform
from lightning_moe.precision.quantize import (
    Axis,
    abs_ignoring_nan,
    batched_axis,
    blocks_axis,
    expand,
    groups_axis,
    nvfp4_qdq_values,
    quantize_tiles,
    scale_from_amax,
    tile_amax,
)
from lightning_moe.precision.recipes import FP8Recipe


class Layout(NamedTuple):
    """Token groups of an operand (cumulative int32 ends, on device) or its expert batch."""

    row_offsets: Optional[torch.Tensor] = None
    col_offsets: Optional[torch.Tensor] = None
    batch: int = 1


def operand_axes(
    tile: tuple[Optional[int], Optional[int]], shape: tuple[int, int], layout: Layout, device: torch.device
) -> tuple[Axis, Axis]:
    """Tiles of a ``[P, L]`` operand: the recipe's ``tile`` kept inside groups / experts."""
    rb, cb = tile
    rows_n, cols_n = shape
    if layout.batch > 1:
        rows = batched_axis(layout.batch, rows_n // layout.batch, rb, device)
    elif layout.row_offsets is not None and rb != 1:
        rows = groups_axis(layout.row_offsets, rows_n, rb)
    else:
        rows = blocks_axis(rows_n, rb, device)
    if layout.col_offsets is not None:
        cols = groups_axis(layout.col_offsets, cols_n, cb)
    else:
        cols = blocks_axis(cols_n, cb, device)
    return rows, cols


def _delayed_scales(
    t: torch.Tensor, fmt: FloatFormat, rows: Axis, cols: Axis, state: DelayedState, role: str, history_fmt: FloatFormat
) -> torch.Tensor:
    """Per-group scales from the amax history (current amax where there is none yet);
    records this operand's per-group amax for the step-end update. ``history_fmt``: the format
    the history's scales were made for (the recipe's for ``role``; ``fmt`` may override it)."""
    amax = tile_amax(abs_ignoring_nan(t), rows, cols)  # [groups (+tail), 1] or [1, groups (+tail)]
    full_tensor = getattr(amax, "full_tensor", None)
    if full_tensor is not None:
        # A TP-sharded (DTensor) operand: max over its shards, as TE reduces amax over TP.
        amax = full_tensor()
    groups, shape = state.scale.shape[1], amax.shape
    record_amax(state, role, amax.reshape(-1)[:groups])
    group = fresh_amax_group(state)
    if group is not None:  # no scales yet: the ranks holding this tensor scale it from one amax
        amax = torch.cat([reduce_current_amax(amax.reshape(-1)[:groups], group), amax.reshape(-1)[groups:]])
    current = scale_from_amax(amax, fmt.max).reshape(-1)
    history = history_scales(state, role, history_fmt.max, fmt.max)
    head = torch.where(history > 0, history, current[:groups])
    return torch.cat([head, current[groups:]]).view(shape)


def quantize_operand(
    t: torch.Tensor,
    recipe: FP8Recipe,
    role: str,
    layout: Optional[Layout] = None,
    state: Optional[DelayedState] = None,
    native: bool = False,
    fmt: Optional[FloatFormat] = None,
) -> tuple[torch.Tensor, torch.Tensor, Axis, Axis]:
    """FP8-quantize a ``[P, L]`` operand: ``(q, scale_inv per tile, row axis, col axis)``.

    ``native``: float8 storage through torch's cast (torch backend) instead of fp32 values
    from the emulated rounding. ``fmt`` overrides the recipe's format for this role.
    """
    history_fmt = recipe.format(role)
    fmt = fmt or history_fmt
    layout = layout or Layout()
    if native:
        t = t.contiguous()  # FP8 GEMM kernels take row-major [other, contraction] operands
    rows, cols = operand_axes(recipe.tile(role), tuple(t.shape), layout, t.device)
    scale = None
    if recipe.name == "delayed":
        if state is None:
            raise ValueError("The 'delayed' recipe needs amax-history state (FP8Linear / FP8GroupedGemm keep it).")
        scale = _delayed_scales(t, fmt, rows, cols, state, role, history_fmt)
    q, scale_inv, _ = quantize_tiles(
        t, fmt, rows, cols, power_2=recipe.power_2_scales, e8m0=recipe.name == "mxfp8", scale=scale, native=native
    )
    return q, scale_inv, rows, cols


def _nvfp4_dequantized(t: torch.Tensor, recipe: FP8Recipe, role: str, layout: Layout) -> torch.Tensor:
    rows, cols = operand_axes(recipe.tile(role), tuple(t.shape), layout, t.device)
    grows, gcols = operand_axes((None, None), tuple(t.shape), layout, t.device)
    a = abs_ignoring_nan(t)
    block_amax = expand(tile_amax(a, rows, cols), rows, cols)
    global_amax = expand(tile_amax(a, grows, gcols), grows, gcols)  # per tensor (per expert group)
    stochastic = role == "grad" and recipe.nvfp4_stochastic_rounding
    rand = torch.rand(t.shape, device=t.device) if stochastic else None
    values, block_scale, global_scale = nvfp4_qdq_values(t, block_amax, global_amax, rand)
    return values * block_scale * global_scale


def pad_contraction(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last (contraction) dimension to a multiple (zeros add nothing to a GEMM)."""
    pad = (-t.shape[-1]) % multiple
    return F.pad(t, (0, pad)) if pad else t


def dequantized_operand(
    t: torch.Tensor,
    recipe: FP8Recipe,
    role: str,
    layout: Optional[Layout] = None,
    state: Optional[DelayedState] = None,
    hadamard: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize an operand in fp32 (the emulated backend's GEMM input).

    ``hadamard``: apply NVFP4's random Hadamard transform along the contraction first (both
    operands of a GEMM must get it; the contraction must be a multiple of 16).
    """
    t = t.float()
    layout = layout or Layout()
    if hadamard:
        t = random_hadamard_transform(t, recipe.rht_seed)
    if recipe.is_fp4:
        return _nvfp4_dequantized(t, recipe, role, layout)
    q, scale_inv, rows, cols = quantize_operand(t, recipe, role, layout, state)
    return q * expand(scale_inv, rows, cols)


def symmetric_tiles(recipe: FP8Recipe, role: str) -> bool:
    """Quantizing the transposed operand gives the transposed result (tile shape symmetric,
    no per-direction randomness), so one quantization can serve two GEMMs."""
    rb, cb = recipe.tile(role)
    stochastic = recipe.is_fp4 and role == "grad" and recipe.nvfp4_stochastic_rounding
    hadamard = recipe.is_fp4 and recipe.nvfp4_rht and role != "weight"
    return rb == cb and not stochastic and not hadamard
