"""Emulated FP8 and NVFP4 quantizers: tiles, amax, scales and the quantized values.

A 2-D tensor ``[P, L]`` is cut into tiles, each with one scale. An `Axis` says which tile
every row (or column) belongs to; regular blocks, whole axes, and tiles that stay inside
token groups (grouped expert GEMMs) are all `Axis` values, so one routine serves every
recipe: tensorwise = one tile, rowwise = ``1 x L`` tiles, DeepSeek-style blockwise =
``1 x 128`` / ``128 x 128``, MXFP8 = ``1 x 32`` with power-of-two (E8M0) scales, NVFP4 =
``1 x 16`` (or ``16 x 16``) with E4M3 block scales under an fp32 per-tensor scale.

Scale conventions follow Transformer Engine:

- ``amax`` is the largest ``|x|`` of a tile, ignoring NaN (CUDA ``fmaxf``) but not ``inf``;
- the quantization scale is ``s = fmt.max / amax`` in fp32; ``s = 1`` when ``amax`` is 0,
  ``inf`` or NaN; ``s = FLT_MAX`` when the division overflows; power-of-two scales round
  ``s`` down to a power of two (TE's ``Float8BlockScaling`` default);
- values are ``round_to_format(x * s)`` (saturating, see `formats`), and the returned
  ``scale`` is the dequantization factor ``1 / s`` (TE's ``scale_inv``; what
  ``torch._scaled_mm`` takes), so ``x ~= q * scale``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from lightning_moe.precision.formats import E2M1, E4M3, FloatFormat, fp8_format, round_to_format

FLT_MAX = torch.finfo(torch.float32).max
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


class Axis(NamedTuple):
    """How one axis of a 2-D tensor is cut into tiles.

    ``ids[i]`` is the tile of position ``i``; ``count`` the number of tiles (an upper bound
    for data-dependent segments); ``block`` the tile length when ``ids == arange(n) // block``
    (a reshape then computes tile maxima), else None.
    """

    ids: torch.Tensor
    count: int
    block: Optional[int]


def blocks_axis(n: int, block: Optional[int], device: torch.device) -> Axis:
    """Regular tiles of ``block`` positions (None: the whole axis is one tile)."""
    if block is None or block >= n:
        return Axis(torch.zeros(n, dtype=torch.long, device=device), 1, max(n, 1))
    return Axis(torch.arange(n, device=device) // block, -(-n // block), block)


def batched_axis(batch: int, n: int, block: Optional[int], device: torch.device) -> Axis:
    """``batch`` stacked axes of length ``n`` (e.g. experts' weights) with tiles inside each."""
    block = n if block is None or block >= n else block
    per = -(-n // block)
    pos = torch.arange(batch * n, device=device)
    ids = (pos // n) * per + (pos % n) // block
    return Axis(ids, batch * per, block if n % block == 0 else None)


def groups_axis(offsets: torch.Tensor, n: int, block: Optional[int] = None) -> Axis:
    """Tiles that never cross a group boundary.

    Args:
        offsets: cumulative group ends ``[G]`` (int32, on device; no host sync is made).
        n: axis length; positions past ``offsets[-1]`` form one extra tail group.
        block: None: one tile per group (ids are group indices, ``count = G + 1``);
            else tiles of ``block`` positions restarting at every group start.
    """
    pos = torch.arange(n, device=offsets.device)
    group = torch.searchsorted(offsets.to(torch.long), pos, right=True)
    if block is None:
        return Axis(group, offsets.numel() + 1, None)
    starts = F.pad(offsets.to(torch.long), (1, 0))[group]
    new_tile = (pos - starts) % block == 0
    return Axis(torch.cumsum(new_tile, 0) - 1, max(n, 1), None)


def abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` (in ``x``'s dtype: exact) with NaN replaced by 0, so an amax ignores NaN but
    keeps ``inf``."""
    return torch.nan_to_num(x.abs(), nan=0.0, posinf=float("inf"))


def _reduce_axis(t: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Max of non-negative ``t`` over the tiles of ``axis`` along ``dim``."""
    t = t.movedim(dim, -1)
    if axis.block is not None:
        pad = (-t.shape[-1]) % axis.block
        t = F.pad(t, (0, pad)) if pad else t
        out = t.reshape(*t.shape[:-1], axis.count, axis.block).amax(-1)
    else:
        index = axis.ids.expand(*t.shape[:-1], -1)
        out = t.new_zeros(*t.shape[:-1], axis.count).scatter_reduce_(-1, index, t, "amax")
    return out.movedim(-1, dim)


def tile_amax(a: torch.Tensor, rows: Axis, cols: Axis) -> torch.Tensor:
    """Per-tile max ``[rows.count, cols.count]`` of non-negative ``a [P, L]``."""
    if a.numel() == 0:  # e.g. an expert-parallel rank that received no tokens
        return a.new_zeros(rows.count, cols.count)
    return _reduce_axis(_reduce_axis(a, cols, 1), rows, 0)


def expand(grid: torch.Tensor, rows: Axis, cols: Axis) -> torch.Tensor:
    """A per-tile ``grid`` spread back over the elements: broadcastable to ``[P, L]``
    (axes with a single tile stay size 1, axes with one tile per position are kept)."""
    for dim, axis in ((0, rows), (1, cols)):
        if axis.count > 1 and axis.block != 1:
            grid = grid.index_select(dim, axis.ids)
    return grid


def scale_from_amax(amax: torch.Tensor, fmt_max: float, power_2: bool = False) -> torch.Tensor:
    """TE's ``compute_scale_from_amax``: ``fmt_max / amax`` with its edge cases (fp32)."""
    amax = amax.float()
    scale = fmt_max / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    keep_one = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(keep_one, torch.ones_like(scale), scale)
    if power_2:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    return scale


def e8m0_scale_inv(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """MXFP8 dequantization scale: ``2**ceil(log2(amax / fmt_max))`` clamped to E8M0's range.

    TE rounds ``amax * (1 / fmt_max)`` up to a power of two (``cvt.rp ... ue8m0``), so the
    scaled block maximum never exceeds ``fmt_max``; an all-zero block gets ``2**-127``.
    """
    v = amax.float() * torch.tensor(1.0 / fmt_max, dtype=torch.float32)
    mant, exp = torch.frexp(v)
    exp = exp - 1 + (mant > 0.5).to(exp.dtype)
    exp = torch.where(v == 0, torch.full_like(exp, _E8M0_MIN_EXP), exp)
    exp = torch.where(torch.isinf(v), torch.full_like(exp, _E8M0_MAX_EXP), exp)
    exp = exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(v), exp)


def scale_and_cast(t: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat, native: bool = False) -> torch.Tensor:
    """``t * scale`` in fp32, rounded to ``fmt``.

    ``native=False``: the emulated rounding, fp32 values on the grid. ``native=True``: a real
    float8 tensor through torch's cast after saturating (bit-identical; fewer passes on GPU).
    """
    if native:
        return t.to(torch.float32, copy=True).mul_(scale).clamp_(-fmt.max, fmt.max).to(fmt.torch_dtype)
    return round_to_format(t.float() * scale, fmt)


def quantize_tiles(
    t: torch.Tensor,
    fmt: FloatFormat,
    rows: Axis,
    cols: Axis,
    *,
    power_2: bool = False,
    e8m0: bool = False,
    scale: Optional[torch.Tensor] = None,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Quantize 2-D ``t`` with one scale per tile.

    Args:
        scale: optional per-tile quantization scales (delayed scaling); computed from the
            current amax when absent.
    Returns:
        ``(q, scale_inv, amax)``: values (fp32 on the grid, or float8 when ``native``), the
        per-tile dequantization scales and the per-tile amax (None when ``scale`` was given).
    """
    amax = None
    if scale is None:
        amax = tile_amax(abs_ignoring_nan(t), rows, cols)
        if e8m0:
            scale = 1.0 / e8m0_scale_inv(amax, fmt.max)  # exact: powers of two
        else:
            scale = scale_from_amax(amax, fmt.max, power_2)
    scale_inv = 1.0 / scale
    q = scale_and_cast(t, expand(scale, rows, cols), fmt, native)
    return q, scale_inv, amax


def _tile_shape(scaling: str, block: Optional[tuple[int, int]]) -> tuple[Optional[int], Optional[int], bool]:
    """(tile rows, tile cols, e8m0) for a public ``scaling`` name."""
    if scaling == "tensorwise":
        return None, None, False
    if scaling == "rowwise":
        return 1, None, False
    if scaling == "blockwise":
        rb, cb = block or (1, 128)
        return rb, cb, False
    if scaling == "mxfp8":
        rb, cb = block or (1, MXFP8_BLOCK)
        return rb, cb, True
    raise ValueError(
        f"Unknown FP8 scaling {scaling!r}; use 'tensorwise', 'rowwise', 'blockwise' or 'mxfp8'."
    )


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() <= 1 else x.reshape(-1, x.shape[-1])


def _scale_shape(x: torch.Tensor, rows: Axis, cols: Axis, row_block: Optional[int]) -> tuple[int, ...]:
    if rows.count == 1 and cols.count == 1 and row_block is None:
        return ()
    if row_block == 1:  # one tile row per input row: keep the leading dimensions
        return (*x.shape[:-1], cols.count)
    return (rows.count, cols.count)


class FP8Quantized(NamedTuple):
    """``q``: float8 values shaped like the input; ``scale``: dequantization factors."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_fp8(
    x: torch.Tensor,
    fmt: str = "e4m3",
    scaling: str = "tensorwise",
    block: Optional[tuple[int, int]] = None,
    power_2_scale: Optional[bool] = None,
) -> FP8Quantized:
    """Quantize ``x`` to FP8 with the emulated (reference) rounding.

    Args:
        x: any shape; leading dimensions are flattened into rows of the last dimension.
        fmt: "e4m3" (max 448) or "e5m2" (max 57344).
        scaling: "tensorwise" (one scale), "rowwise" (one per row), "blockwise" (tiles of
            ``block``, default ``(1, 128)``; ``(128, 128)`` for weights) or "mxfp8" (``1 x 32``
            tiles with power-of-two E8M0 scales).
        power_2_scale: round scales down to powers of two (default: True for "blockwise",
            as TE's ``Float8BlockScaling``; False otherwise).
    Returns:
        ``FP8Quantized(q, scale)`` with ``x ~= q.float() * scale`` (scale broadcast per tile).
        Scale shapes: tensorwise ``[]``; rowwise ``[..., 1]``; ``1 x B`` tiles
        ``[..., ceil(L / B)]``; 2-D tiles ``[ceil(P / Br), ceil(L / Bc)]``.
    """
    f = fp8_format(fmt)
    rb, cb, e8m0 = _tile_shape(scaling, block)
    power_2 = (scaling == "blockwise") if power_2_scale is None else power_2_scale
    x2 = _as_2d(x)
    rows, cols = blocks_axis(x2.shape[0], rb, x.device), blocks_axis(x2.shape[1], cb, x.device)
    q, scale_inv, _ = quantize_tiles(x2, f, rows, cols, power_2=power_2, e8m0=e8m0)
    return FP8Quantized(q.to(f.torch_dtype).reshape(x.shape), scale_inv.reshape(_scale_shape(x, rows, cols, rb)))


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    scaling: str = "tensorwise",
    block: Optional[tuple[int, int]] = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_fp8` (same ``scaling`` / ``block``): ``q * scale`` per tile."""
    rb, cb, _ = _tile_shape(scaling, block)
    q2 = _as_2d(q).float()
    rows, cols = blocks_axis(q2.shape[0], rb, q.device), blocks_axis(q2.shape[1], cb, q.device)
    grid = scale.float().reshape(rows.count, cols.count)
    return (q2 * expand(grid, rows, cols)).reshape(q.shape).to(dtype)


# ----------------------------------------------------------------------------------- NVFP4
_NVFP4_GLOBAL_MAX = E2M1.max * E4M3.max  # 6 * 448
_RCP_6 = torch.tensor(1.0 / E2M1.max, dtype=torch.float32)


def nvfp4_global_scales(global_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) per-tensor fp32 scales: ``encode = 6 * 448 / amax`` (TE's rules:
    capped at FLT_MAX, 1 when ``amax`` is ``inf``), ``decode = 1 / encode``."""
    enc = (_NVFP4_GLOBAL_MAX / global_amax.float()).clamp(max=FLT_MAX)
    enc = torch.where(enc == 0, torch.ones_like(enc), enc)
    return enc, 1.0 / enc


def nvfp4_block_scales(block_amax: torch.Tensor, global_encode: torch.Tensor) -> torch.Tensor:
    """E4M3 block decode scales (as fp32 values): ``block_amax / 6`` in the global scale's
    units, saturated to 448 and rounded to E4M3."""
    dec = (block_amax.float() * (global_encode * _RCP_6.to(global_encode.device))).clamp(max=FLT_MAX)
    return round_to_format(dec.clamp(max=E4M3.max), E4M3)


def nvfp4_qdq_values(
    t: torch.Tensor, block_amax: torch.Tensor, global_amax: torch.Tensor, rand: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise NVFP4 two-level quantization.

    ``block_amax`` / ``global_amax`` broadcast to ``t`` (each element's block and tensor amax).
    Returns ``(values on the E2M1 grid, block decode scale, global decode scale)``;
    the dequantized tensor is their product.
    """
    enc, dec = nvfp4_global_scales(global_amax)
    block_scale = nvfp4_block_scales(block_amax, enc)
    block_enc = (1.0 / (block_scale * dec)).clamp(max=FLT_MAX)
    values = round_to_format((t.float() * block_enc).clamp(-E2M1.max, E2M1.max), E2M1, rand)
    return values, block_scale, dec


class NVFP4Quantized(NamedTuple):
    """NVFP4 tensor: ``values`` (fp32 on the E2M1 grid, input shape), ``block_scale``
    (float8_e4m3fn, one per 16-element block or 16x16 tile), ``global_scale`` (fp32 scalar
    decode scale ``amax / (6 * 448)``). ``x ~= values * block_scale * global_scale``."""

    values: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor


def _nvfp4_axes(x2: torch.Tensor, block_2d: bool) -> tuple[Axis, Axis]:
    rows = blocks_axis(x2.shape[0], NVFP4_BLOCK if block_2d else 1, x2.device)
    return rows, blocks_axis(x2.shape[1], NVFP4_BLOCK, x2.device)


def quantize_nvfp4(
    x: torch.Tensor,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: Optional[torch.Generator] = None,
) -> NVFP4Quantized:
    """Quantize ``x`` to NVFP4 (the two-level recipe of TE's ``NVFP4BlockScaling``).

    Args:
        x: any shape; leading dimensions are flattened into rows of the last dimension.
        block_2d: 16x16 tiles (TE's weight quantization) instead of 1x16 blocks.
        stochastic_rounding: round E2M1 values stochastically (TE does so for gradients);
            draws ``torch.rand(x2d.shape, generator=generator)`` once.
    """
    x2 = _as_2d(x).float()
    rows, cols = _nvfp4_axes(x2, block_2d)
    a = abs_ignoring_nan(x2)
    block_amax = tile_amax(a, rows, cols)
    global_amax = a.amax() if a.numel() else a.new_zeros(())
    rand = torch.rand(x2.shape, generator=generator, device=x.device) if stochastic_rounding else None
    values, _, dec = nvfp4_qdq_values(x2, expand(block_amax, rows, cols), global_amax, rand)
    block_scale = nvfp4_block_scales(block_amax, nvfp4_global_scales(global_amax)[0])
    return NVFP4Quantized(values.reshape(x.shape), block_scale.to(E4M3.torch_dtype), dec)


def dequantize_nvfp4(q: NVFP4Quantized, block_2d: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_nvfp4` (same ``block_2d``)."""
    v2 = _as_2d(q.values).float()
    rows, cols = _nvfp4_axes(v2, block_2d)
    scales = expand(q.block_scale.float(), rows, cols) * q.global_scale
    return (v2 * scales).reshape(q.values.shape).to(dtype)
