"""Grouped GEMM micro-benchmark: which weight layout does ``torch._grouped_mm`` prefer?

Times forward + backward of ``y = grouped_mm(x, w)`` (bf16) for the MoE block shapes with the
expert weight stored as [E, K, N] (row-major, as `GroupedExperts` stores it) and as [E, N, K]
passed transposed, with random group sizes around ``T*k/E``. Writes
``benchmarks/results/grouped_gemm_layout.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import cuda_time_ms, write_results  # noqa: E402
from benchmarks.moe_block import CASES  # noqa: E402
from lightning_moe.nn.grouped_gemm import group_offsets  # noqa: E402


def random_sizes(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.rand(experts, generator=gen) + 0.5
    sizes = (w / w.sum() * rows).long()
    sizes[-1] += rows - sizes.sum()
    return sizes


def bench(rows, k, n, experts, layout, gen):
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if layout == "EKN":
        w = torch.randn(experts, k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        wv = lambda: w  # noqa: E731
    else:
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        wv = lambda: w.transpose(1, 2)  # noqa: E731
    offs = group_offsets(random_sizes(rows, experts, gen).cuda(), rows)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        y = torch._grouped_mm(x, wv(), offs=offs)
        y.backward(dy)

    ms, _ = cuda_time_ms(fwd_bwd, warmup=3, iters=10)
    return ms, 3 * 2 * rows * k * n / (ms * 1e-3) / 1e12


def main():
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, c in CASES.items():
        rows = c["B"] * c["S"] * c["k"]
        for proj, (k, n) in {"fc1": (c["D"], 2 * c["F"]), "fc2": (c["F"], c["D"])}.items():
            for layout in ("EKN", "ENK_T"):
                ms, tf = bench(rows, k, n, c["E"], layout, gen)
                out[f"{name}/{proj}/{layout}"] = {"median_ms": ms, "tflops": tf}
                print(f"{name:18s} {proj} {layout:6s} {ms:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
    write_results("grouped_gemm_layout", {"cases": out})


if __name__ == "__main__":
    main()
