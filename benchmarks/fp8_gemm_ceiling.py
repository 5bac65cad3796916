"""The GEMM ceilings behind the FP8 MoE block: operands already quantized, no casts timed.

    python benchmarks/fp8_gemm_ceiling.py

For each expert GEMM of the benchmark shapes (fprop ``[rows, K] x [E, K, N]`` and the weight
gradient ``X_e^T dY_e``), TFLOP/s of:
  * bf16 ``torch._grouped_mm``;
  * FP8 ``torch._scaled_grouped_mm`` (rowwise scales, CUTLASS);
  * FP8 one ``torch._scaled_mm`` per expert, tensorwise (cuBLASLt) and rowwise (CUTLASS).
Each FP8 kernel with fast accumulation (fprop's default) and, where marked, split
accumulation (promoted to fp32: the dgrad / wgrad default, as in Transformer Engine).
The ratio of the best FP8 column to bf16 bounds what an FP8 MoE block can gain over bf16.
Writes ``benchmarks/results/fp8_gemm_ceiling.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_ms, write_results  # noqa: E402

FP8 = torch.float8_e4m3fn
# name: experts, rows per expert, K, N
SHAPES = {
    "mixtral_fc1": (8, 2048, 4096, 28672),
    "mixtral_fc2": (8, 2048, 14336, 4096),
    "qwen3_fc1": (128, 1024, 2048, 1536),
    "qwen3_fc2": (128, 1024, 768, 2048),
    "deepseek_fc1": (32, 2048, 7168, 4096),
}


def _time_all(runs: dict, flops: int) -> dict:
    """TFLOP/s of each named GEMM callable; an error (a kernel this torch lacks) is recorded."""
    out = {}
    for name, fn in runs.items():
        try:
            ms, _ = cuda_time_ms(fn, warmup=3, iters=10)
            out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as error:
            out[name] = {"error": f"{type(error).__name__}: {error}"[:200]}
    return out


def fprop(E: int, M: int, K: int, N: int) -> dict:
    flops = 2 * E * M * K * N
    x = torch.randn(E * M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M
    qx = x.to(FP8)
    qw_ENK = w.transpose(1, 2).contiguous().to(FP8)  # column-major per expert
    sx, sw = torch.ones(E * M, device="cuda"), torch.ones(E, N, device="cuda")
    one = torch.ones((), device="cuda")
    xs = list(qx.split(M))
    runs = {
        "bf16_grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
        "fp8_scaled_grouped_mm_rowwise": lambda: torch._scaled_grouped_mm(
            qx, qw_ENK.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8_scaled_grouped_mm_rowwise_split_accumulation": lambda: torch._scaled_grouped_mm(
            qx, qw_ENK.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False),
        "fp8_per_expert_tensorwise": lambda: [
            torch._scaled_mm(xs[e], qw_ENK[e].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                             use_fast_accum=True) for e in range(E)],
        "fp8_per_expert_rowwise_split_accumulation": lambda: [
            torch._scaled_mm(xs[e], qw_ENK[e].t(), scale_a=sx[:M, None], scale_b=sw[e][None],
                             out_dtype=torch.bfloat16, use_fast_accum=False) for e in range(E)],
        "fp8_per_expert_rowwise": lambda: [
            torch._scaled_mm(xs[e], qw_ENK[e].t(), scale_a=sx[:M, None], scale_b=sw[e][None],
                             out_dtype=torch.bfloat16, use_fast_accum=True) for e in range(E)],
    }
    return _time_all(runs, flops)


def wgrad(E: int, M: int, K: int, N: int) -> dict:
    """dW_e [K, N] = X_e^T [K, M] @ dY_e [M, N]: the token dimension is the contraction."""
    flops = 2 * E * M * K * N
    xt = torch.randn(K, E * M, device="cuda", dtype=torch.bfloat16)  # X^T, tokens contiguous
    dy = torch.randn(E * M, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * M
    qxt = xt.to(FP8)
    qdyt = dy.t().contiguous().to(FP8)  # [N, tokens]
    one = torch.ones((), device="cuda")
    sx, sd = torch.ones(E * K, device="cuda"), torch.ones(E * N, device="cuda")
    runs = {
        "bf16_grouped_mm": lambda: torch._grouped_mm(xt, dy, offs=offs),
        "fp8_scaled_grouped_mm_rowwise_split_accumulation": lambda: torch._scaled_grouped_mm(
            qxt, qdyt.t(), sx, sd, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False),
        "fp8_scaled_grouped_mm_rowwise": lambda: torch._scaled_grouped_mm(
            qxt, qdyt.t(), sx, sd, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8_per_expert_tensorwise": lambda: [
            torch._scaled_mm(qxt[:, e * M:(e + 1) * M], qdyt[:, e * M:(e + 1) * M].t(), scale_a=one,
                             scale_b=one, out_dtype=torch.bfloat16) for e in range(E)],
    }
    return _time_all(runs, flops)


def main() -> None:
    results = {}
    for name, shape in SHAPES.items():
        results[name] = {"shape_E_M_K_N": shape, "fprop": fprop(*shape), "wgrad": wgrad(*shape)}
        for kind in ("fprop", "wgrad"):
            row = "  ".join(f"{k}={v.get('tflops', float('nan')):.0f}" for k, v in results[name][kind].items())
            print(f"{name:14s} {kind}: {row}", flush=True)
        torch.cuda.empty_cache()
    write_results("fp8_gemm_ceiling", {"results": results})


if __name__ == "__main__":
    main()
