"""Low-precision number formats and a reference rounding routine for them.

`round_to_format` is the emulated backend's cast: it maps fp32 values onto the value grid of
FP8 E4M3 / E5M2 or FP4 E2M1 with plain fp32 arithmetic (`frexp` / `ldexp` / `round`), so it
runs on any device and documents exactly what the hardware cast does. The unit tests check
it bit for bit against ``torch``'s own float8 casts.

Conventions (those of Transformer Engine's casts, which use the saturating ``satfinite``
conversion):

- round to nearest, ties to even (or stochastic rounding when ``rand`` is given);
- finite values beyond the format's largest value saturate to ``±max``: 448 (E4M3),
  57344 (E5M2; torch's own E5M2 cast would overflow to ``inf`` instead), 6 (E2M1);
- ``±inf`` saturates to ``±max`` as well (E4M3/E5M2 under ``satfinite``);
- NaN stays NaN (E2M1 has no NaN encoding; emulated values keep the NaN visible rather
  than inventing a number);
- signed zeros and subnormals are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A small floating-point format: ``mantissa_bits`` explicit mantissa bits, smallest
    normal exponent ``min_exp`` (subnormal spacing ``2**(min_exp - mantissa_bits)``) and
    largest finite value ``max``."""

    name: str
    mantissa_bits: int
    min_exp: int
    max: float
    torch_dtype: Optional[torch.dtype]


E4M3 = FloatFormat("e4m3", mantissa_bits=3, min_exp=-6, max=448.0, torch_dtype=torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", mantissa_bits=2, min_exp=-14, max=57344.0, torch_dtype=torch.float8_e5m2)
# E2M1 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and negatives). Stored emulated as fp32 values.
E2M1 = FloatFormat("e2m1", mantissa_bits=1, min_exp=0, max=6.0, torch_dtype=None)

FP8_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def fp8_format(name: str) -> FloatFormat:
    """The FP8 format called ``name`` ("e4m3" or "e5m2")."""
    if name not in FP8_FORMATS:
        raise ValueError(f"Unknown FP8 format {name!r}; use one of {sorted(FP8_FORMATS)}.")
    return FP8_FORMATS[name]


def round_to_format(x: torch.Tensor, fmt: FloatFormat, rand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round fp32 ``x`` onto the value grid of ``fmt``; returns fp32 values on that grid.

    Args:
        x: values to round (any shape; computed in fp32).
        fmt: target format (`E4M3`, `E5M2`, `E2M1`).
        rand: optional uniform [0, 1) numbers shaped like ``x``: stochastic rounding, where a
            value between grid neighbours ``lo < |x| < hi`` rounds up with probability
            ``(|x| - lo) / (hi - lo)`` (up when ``rand < that``). ``None``: nearest, ties to even.
    """
    x = x.float()
    a = x.abs().clamp(max=fmt.max)  # saturate (inf -> max); NaN passes through clamp
    # floor(log2(a)) from the fp32 exponent field (0 and fp32 subnormals land below min_exp)
    exp = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    quantum_exp = torch.clamp(exp, min=fmt.min_exp) - fmt.mantissa_bits  # grid spacing 2**quantum_exp
    steps = a * _pow2(-quantum_exp)  # exact: a power-of-two rescale
    if rand is None:
        steps = torch.round(steps)  # round half to even
    else:
        low = torch.floor(steps)
        steps = low + (rand < (steps - low)).to(steps.dtype)
    # a <= max and max lies on the grid, so rounding cannot exceed max
    return torch.copysign(steps * _pow2(quantum_exp), x)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0**k`` for int32 ``k`` in fp32's normal range, built from the exponent bits."""
    return ((k + 127) << 23).view(torch.float32)
