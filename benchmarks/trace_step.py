"""A Chrome trace of one MoE block step, timed as ``moe_block.py`` times it (started on an idle GPU).

    python benchmarks/trace_step.py --case qwen3_30b_a3b --precision fp8 --master-weights fp32
    python benchmarks/trace_step.py --precision fp8 --graph-weight-casts --with-stack

Builds the block as ``moe_block.py`` does (same shapes, precision setup and step: forward,
backward, the once-per-step FP8 work), runs ``--warmup`` steps, then one step under
``torch.profiler`` (CPU ops, CUDA kernels and their launches; with ``--with-stack`` also the
Python functions, at a higher host cost) and writes the trace, gzipped, to
``benchmarks/results/trace_<tag>.json.gz``: open it in Perfetto, or read it with a script to see
which host code the GPU waited for. Prints the longest idle gaps (``_profile.idle_gaps``). The
profiler's own first CUDA call on each thread (CUPTI's activity buffers) stalls that thread about
2 ms: the gaps at the start of the forward and of the backward are mostly that.

With ``--marks N`` no profiler runs: N steps, each started on an idle GPU, record CUDA events after
the setup (gradients cleared, contexts entered), after the forward's and the backward's launches and
after the step, beside the host clock at the same points; printed and written
(``benchmarks/results/marks_<tag>.json``) as medians: when the host finished issuing each phase and
when the GPU finished running it, both from the step's start. A phase whose GPU end trails its host
end by about its last kernels' time was host-bound. ``--cuda-graph`` captures the block first
(`capture_moe_layer`, checked against an eager step, as ``moe_block.py --cuda-graph``), so the marks
are of the two graphs' replays; ``--router-logits`` picks the router's logits GEMM as in ``moe_block.py``.
(s30's ``step_phases_*_s30c3.json`` came from ``benchmarks/step_phases.py`` at d69a6ca, folded in here.)
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._profile import idle_gaps  # noqa: E402
from benchmarks.moe_block import (  # noqa: E402
    CASES,
    FP8_DEFAULT,
    apply_precision,
    bf16_mixed_context,
    build_layer,
    capture_and_check,
    expert_alignment,
    graph_context,
)


def _phase_marks(layer, x, dy, step_work, steps: int, context) -> dict:
    """Median host and GPU ends of the setup, the forward, the backward and the step (ms from the
    step's start), over ``steps`` steps each started on an idle GPU."""
    import statistics
    import time

    rows = []
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        torch.cuda.synchronize()  # host sync: each step starts on an idle GPU, as moe_block times it
        events[0].record()
        t0 = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with context():  # the forward only, as in `step`
            events[1].record()
            t_setup = time.perf_counter()
            y = layer(x)
        events[2].record()
        t1 = time.perf_counter()
        y.backward(dy)
        events[3].record()
        t2 = time.perf_counter()
        if step_work is not None:
            step_work()
        events[4].record()
        t3 = time.perf_counter()
        torch.cuda.synchronize()  # host sync: read the events
        rows.append({"host_setup_ms": (t_setup - t0) * 1e3, "gpu_setup_ms": events[0].elapsed_time(events[1]),
                     "host_forward_ms": (t1 - t0) * 1e3, "gpu_forward_ms": events[0].elapsed_time(events[2]),
                     "host_backward_ms": (t2 - t0) * 1e3, "gpu_backward_ms": events[0].elapsed_time(events[3]),
                     "host_step_ms": (t3 - t0) * 1e3, "gpu_step_ms": events[0].elapsed_time(events[4])})
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="qwen3_30b_a3b", choices=list(CASES))
    parser.add_argument("--precision", default="fp8", help="bf16, fp8 (moe_block's FP8 setup) or an FP8 recipe name")
    parser.add_argument("--master-weights", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--graph-weight-casts", action="store_true")
    parser.add_argument("--with-stack", action="store_true", help="also record Python functions")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--marks", type=int, default=0, help="time N steps phase by phase instead of tracing")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the block in CUDA graphs first, as moe_block.py --cuda-graph")
    parser.add_argument("--router-logits", default="fp32", choices=["fp32", "bf16x3"],
                        help="MoEConfig.router_logits_gemm, as moe_block.py --router-logits")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("trace_step.py needs a CUDA GPU")
    precision, fast = (FP8_DEFAULT if args.precision == "fp8" else (args.precision, None))
    c = CASES[args.case]
    master_fp32 = args.master_weights == "fp32"
    torch.manual_seed(0)
    layer = build_layer(c, "grouped_mm", torch.float32 if master_fp32 else torch.bfloat16, expert_alignment(precision),
                        args.router_logits)
    context, _, step_work = apply_precision(layer, precision, fast_accumulation=fast,
                                            graph_weight_casts=args.graph_weight_casts)
    if master_fp32 and precision == "bf16":
        context = bf16_mixed_context
    x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    if args.cuda_graph:
        # eager steps (delayed scaling's updates give every state its scales), the capture, a checked replay
        context = graph_context(context)
        capture_and_check(layer, x, dy, step_work, 1, context)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.profiler.record_function("forward"), context():  # backward outside autocast
            y = layer(x)
        with torch.profiler.record_function("backward"):
            y.backward(dy)
        if step_work is not None:
            with torch.profiler.record_function("step_work"):
                step_work()

    tag = args.tag or "_".join([args.case, args.precision, args.master_weights + "master"]
                               + (["graphed"] if args.graph_weight_casts else [])
                               + (["cudagraph"] if args.cuda_graph else [])
                               + (["bf16x3router"] if args.router_logits == "bf16x3" else [])
                               + (["stack"] if args.with_stack else []))
    if args.marks:
        for _ in range(args.warmup):
            step()
        marks = _phase_marks(layer, x, dy, step_work, args.marks, context)
        from benchmarks._common import write_results

        print(f"{tag}: " + "  ".join(f"{k} {v:.2f}" for k, v in marks.items()))
        write_results(f"marks_{tag}", {"case": args.case, "precision": args.precision,
                                       "master_weights": args.master_weights, "cuda_graph": args.cuda_graph,
                                       "router_logits_gemm": args.router_logits,
                                       "graph_weight_casts": args.graph_weight_casts, "steps": args.marks, **marks})
        return
    from torch.profiler import ProfilerActivity, profile

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()  # host sync: the traced step starts on an idle GPU
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.with_stack) as prof:
        step()
        torch.cuda.synchronize()  # host sync: every kernel of the step inside the trace
    out = Path(__file__).resolve().parent / "results" / f"trace_{tag}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        import json

        with open(raw) as f:
            events = json.load(f)["traceEvents"]
    wall_ms, gaps = idle_gaps(events)
    print(f"{tag}: GPU wall {wall_ms:.2f} ms; trace {out}")
    for g in gaps:
        print(f"  idle {g['gap_ms']:.3f} ms before {g['next_kernel'][:60]} "
              f"(launched {g.get('launched_after_gap_start_ms', float('nan')):+.3f} ms; {g.get('cpu_stack')})")


if __name__ == "__main__":
    main()
