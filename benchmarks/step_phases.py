"""Where a CUDA-graphed block's step, started on an idle GPU, waits for its host: the host's time in
each phase of `moe_block.py`'s timed step beside the GPU's time between the same points.

`moe_block.py` times each step from an idle GPU (``median_ms``) and again queued behind a GPU spin
(``queued_ms``, no wait for the host); at qwen3's shape the gap between the two was 0.6 ms in bf16 and
0.3 ms in FP8 (s30), more than the host's lead measured here. Here each step is split at four points (before the forward's call, after it, after
the backward's, after the optimizer-step work) with a host clock reading and a CUDA event at each, after
a sync, so that a phase whose host time exceeds the GPU's work queued before it shows where the GPU
waits::

    python benchmarks/step_phases.py --precision {bf16,fp8} [--router-logits bf16x3]

Writes ``benchmarks/results/step_phases_<precision>[_tag].json``: per phase the median host ms and the
median GPU ms between its two events.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.moe_block import (  # noqa: E402
    CASES,
    FP8_DEFAULT,
    apply_precision,
    build_layer,
    capture_and_check,
    expert_alignment,
    graph_context,
)

PHASES = ["setup", "forward", "backward", "optimizer_step_work"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="qwen3_30b_a3b", choices=sorted(CASES))
    parser.add_argument("--precision", default="fp8", choices=["bf16", "fp8"])
    parser.add_argument("--router-logits", default="fp32", choices=["fp32", "bf16x3"])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_phases.py needs a CUDA GPU")
    c = CASES[args.case]
    precision = FP8_DEFAULT[0] if args.precision == "fp8" else "bf16"
    torch.manual_seed(0)
    layer = build_layer(c, "grouped_mm", torch.bfloat16, expert_alignment(precision), args.router_logits)
    fast = FP8_DEFAULT[1] if args.precision == "fp8" else None
    context, _, optimizer_step_work = apply_precision(layer, precision, False, fast)
    x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    context = graph_context(context)
    # eager steps (with delayed scaling's updates, which give every state its scales), then the capture
    capture_and_check(layer, x, dy, optimizer_step_work, 1, context)

    host = {name: [] for name in PHASES}
    gpu = {name: [] for name in PHASES}
    total = []
    for i in range(args.iters + 5):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        torch.cuda.synchronize()  # host sync: every step starts on an idle GPU, as moe_block's median_ms
        stamps = [time.perf_counter()]
        events[0].record()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with context():
            stamps.append(time.perf_counter())
            events[1].record()
            y = layer(x)
        stamps.append(time.perf_counter())
        events[2].record()
        y.backward(dy)
        stamps.append(time.perf_counter())
        events[3].record()
        if optimizer_step_work is not None:
            optimizer_step_work()
        stamps.append(time.perf_counter())
        events[4].record()
        torch.cuda.synchronize()  # host sync: read this step's events
        if i < 5:
            continue  # warm-up
        for k, name in enumerate(PHASES):
            host[name].append((stamps[k + 1] - stamps[k]) * 1e3)
            gpu[name].append(events[k].elapsed_time(events[k + 1]))
        total.append(events[0].elapsed_time(events[-1]))
    result = {
        "case": args.case, "precision": precision, "router_logits_gemm": args.router_logits,
        "step_ms": statistics.median(total),
        "phases": {name: {"host_ms": statistics.median(host[name]), "gpu_ms": statistics.median(gpu[name])}
                   for name in PHASES},
    }
    for name, r in result["phases"].items():
        print(f"{args.precision:5s} {name:20s} host {r['host_ms']:7.3f} ms  gpu {r['gpu_ms']:7.3f} ms", flush=True)
    print(f"{args.precision:5s} step {result['step_ms']:.3f} ms", flush=True)
    write_results(f"step_phases_{args.precision}{'_' + args.tag if args.tag else ''}", result)


if __name__ == "__main__":
    main()
