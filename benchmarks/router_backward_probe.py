"""Which GEMM kernels the router's backward runs in the bf16 and the FP8 block (qwen3 shape), and
under which fp32 matmul settings: both blocks keep the router in fp32, so both should run the
same kernels.

    python benchmarks/router_backward_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_block import CASES, apply_precision, build_layer, expert_alignment  # noqa: E402


def probe(precision: str) -> None:
    c = dict(CASES["qwen3_30b_a3b"])
    torch.manual_seed(0)
    recipe = "delayed" if precision == "fp8" else "bf16"
    layer = build_layer(c, "grouped_mm", torch.bfloat16, expert_alignment(recipe))
    context, _, step_work = apply_precision(layer, recipe, False,
                                            ["fprop", "dgrad", "wgrad"] if precision == "fp8" else None)
    x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def hook(grad):
        seen["tf32"] = torch.backends.cuda.matmul.allow_tf32
        seen["precision"] = torch.get_float32_matmul_precision()
        seen["grad_dtype"] = grad.dtype
        return grad

    layer.router.weight.register_hook(hook)
    for _ in range(3):
        with context():
            y = layer(x)
        y.backward(torch.ones_like(y))
        if step_work is not None:
            step_work()
        layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with context():
            y = layer(x)
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
    print(f"== {precision}: forward tf32={torch.backends.cuda.matmul.allow_tf32} "
          f"precision={torch.get_float32_matmul_precision()}; in backward {seen}")
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and any(k in e.key for k in ("gemm", "nvjet", "sgemm", "xmma")):
            print(f"   {e.device_time_total / 1e3:.3f} ms x{e.count} {e.key[:110]}")


if __name__ == "__main__":
    for precision in ("bf16", "fp8"):
        probe(precision)
