"""Low-precision training: FP8 / NVFP4 recipes, quantized GEMMs, the Lightning plugin and
an AdamW with bf16 moments. Transformer Engine is optional and imported only when used."""

from lightning_moe.precision.delayed import update_delayed_scaling
from lightning_moe.precision.formats import E2M1, E4M3, E5M2, FloatFormat, round_to_format
from lightning_moe.precision.gemm import fp8_grouped_mm, fp8_linear
from lightning_moe.precision.hadamard import hadamard_transform_matrix, random_hadamard_transform
from lightning_moe.precision.modules import FP8GroupedGemm, FP8Linear, FP8Summary, configure_fp8
from lightning_moe.precision.optim import AdamWBF16Moments
from lightning_moe.precision.plugin import FP8Precision
from lightning_moe.precision.quantize import (
    FP8Quantized,
    NVFP4Quantized,
    dequantize_fp8,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
)
from lightning_moe.precision.recipes import BACKENDS, RECIPES, FP8Recipe, resolve_backend
from lightning_moe.precision.weight_cache import FP8WeightCache, caching_fp8_weights

__all__ = [
    "BACKENDS",
    "E2M1",
    "E4M3",
    "E5M2",
    "RECIPES",
    "AdamWBF16Moments",
    "FP8GroupedGemm",
    "FP8Linear",
    "FP8Precision",
    "FP8Quantized",
    "FP8Recipe",
    "FP8Summary",
    "FP8WeightCache",
    "FloatFormat",
    "NVFP4Quantized",
    "caching_fp8_weights",
    "configure_fp8",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "fp8_grouped_mm",
    "fp8_linear",
    "hadamard_transform_matrix",
    "quantize_fp8",
    "quantize_nvfp4",
    "random_hadamard_transform",
    "resolve_backend",
    "round_to_format",
    "update_delayed_scaling",
]
