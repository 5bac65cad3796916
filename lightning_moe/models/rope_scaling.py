"""YaRN rotary scaling, as DeepSeek-V3's checkpoints configure it (HF ``rope_scaling``).

DeepSeek-V3's ``config.json`` carries ``{"type": "yarn", "factor": 40, "original_max_position_embeddings":
4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}``. YaRN (arXiv 2309.00071)
changes three things, all reproduced here with transformers' semantics:

- the rotary inverse frequencies: high frequencies (many rotations over the original context) are
  kept, low ones are divided by ``factor``, with a linear ramp between the dimensions where
  ``beta_fast`` and ``beta_slow`` rotations fit in ``original_max_position_embeddings``;
- ``cos`` / ``sin`` are multiplied by an attention factor, ``mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)`` (1 for DeepSeek-V3), or ``mscale(factor)`` when either is unset;
- multi-head latent attention multiplies its softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
  (DeepSeek's reference code; the non-rotary query/key dims get the temperature too).

``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1``, else 1. Other scaling types are refused.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

# Keys accepted in ModelConfig.rope_scaling (HF spells the type "type" in old configs, "rope_type" in new).
_YARN_DEFAULTS: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": None,
    "original_max_position_embeddings": None,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": None,
    "mscale_all_dim": None,
    "attention_factor": None,
    "truncate": True,
}


def normalize_rope_scaling(value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The canonical form of a ``rope_scaling`` dict (every key present, ``rope_type`` spelled so),
    or None. Raises ``ValueError`` naming the fix for anything but YaRN with a factor and an
    original context length."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"ModelConfig.rope_scaling must be a dict or None, got {type(value).__name__}.")
    raw = dict(value)
    kind = raw.pop("type", None)
    kind = raw.pop("rope_type", kind)
    if kind != "yarn":
        raise ValueError(
            f"ModelConfig.rope_scaling type {kind!r} is not supported: only 'yarn' (DeepSeek-V3's) is; "
            "set rope_scaling=None for plain RoPE."
        )
    unknown = sorted(set(raw) - set(_YARN_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown ModelConfig.rope_scaling key(s) {unknown}; valid keys: {sorted(set(_YARN_DEFAULTS) | {'type'})}."
        )
    out = {**_YARN_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    factor, original = out["factor"], out["original_max_position_embeddings"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"rope_scaling['factor'] must be a number >= 1, got {factor!r}.")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ValueError(
            f"rope_scaling['original_max_position_embeddings'] must be a positive int (the pretraining context), "
            f"got {original!r}."
        )
    for key in ("beta_fast", "beta_slow"):
        if not out[key] > 0:
            raise ValueError(f"rope_scaling[{key!r}] must be positive, got {out[key]!r}.")
    out["factor"] = float(factor)
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Optional[dict[str, Any]]) -> float:
    """Multiplier of the rotary ``cos`` / ``sin`` (1 without scaling)."""
    if scaling is None:
        return 1.0
    if scaling["attention_factor"] is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def latent_softmax_mscale(scaling: Optional[dict[str, Any]]) -> float:
    """Factor on multi-head latent attention's softmax scale: ``mscale(factor, mscale_all_dim) ** 2``."""
    if scaling is None or not scaling["mscale_all_dim"]:
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict[str, Any]], device=None) -> Tensor:
    """fp32 ``[dim // 2]`` inverse frequencies of the rotary embedding, YaRN-blended when configured."""
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    original = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits num_rotations times into the original context.
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return inv_freq / scaling["factor"] * (1.0 - keep) + inv_freq * keep
