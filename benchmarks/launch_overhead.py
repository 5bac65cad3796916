"""Host time to issue one MoE block step (forward, backward, per-step work), GPU kept busy.

    python benchmarks/launch_overhead.py                                  # bf16 and fp8, all shapes
    python benchmarks/launch_overhead.py --cases qwen3_30b_a3b --precisions fp8 --host-profile

A block timed one step at a time (``moe_block.py``'s ``median_ms``) starts on an idle GPU, so
whenever the host issues work more slowly than the GPU runs it, the GPU waits. This script
measures that host cost alone: before each step it queues a long ``torch.cuda._sleep`` kernel,
so every launch of the step is asynchronous and the host never waits for the GPU (a host sync in
the step would wait for the sleep and shows up as a step far longer than the others). It reports
the median host milliseconds of the forward, of the backward and of what the precision plugin
runs once per optimizer step, over ``--iters`` steps, with the number of CUDA kernel launches
per step; with ``--host-profile`` also the Python functions and the torch ops that took most host
time (one step each); with ``--phases`` the host time of the layer's parts (router, dispatch,
experts, combine), of the FP8 casts and GEMMs and of all Triton launches, per step.
Writes ``benchmarks/results/launch_overhead_<tag>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.moe_block import CASES, FP8_DEFAULT, apply_precision, build_layer, expert_alignment  # noqa: E402

# Long enough to cover the host side of one step (tens of ms) on any clock: ~100 ms at 1.98 GHz.
SLEEP_CYCLES = 200_000_000


def _kernel_launches(step) -> int:
    """CUDA kernel launches of one ``step()`` (counted by the profiler's runtime events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()  # the profiler needs the step's kernels finished
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def _host_profile(step, top: int) -> dict:
    """Where one ``step()``'s host time goes, GPU kept busy: the ``top`` Python functions of the
    calling thread by cumulative time (cProfile; this covers the forward and the per-step work,
    since autograd runs the backward's Python on its own device thread), and the ``top`` torch ops
    and autograd nodes of every thread by self host time (torch profiler, CPU events only)."""
    from torch.profiler import ProfilerActivity, profile

    profiler = cProfile.Profile()
    torch.cuda._sleep(SLEEP_CYCLES)
    profiler.enable()
    step()
    profiler.disable()
    torch.cuda.synchronize()  # drain before the next measurement
    stats = pstats.Stats(profiler, stream=io.StringIO())
    python = []
    for (filename, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        python.append({"function": f"{Path(filename).name}:{line}({func})", "calls": calls,
                       "self_ms": tottime * 1e3, "cumulative_ms": cumtime * 1e3})
    torch.cuda._sleep(SLEEP_CYCLES)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    torch.cuda.synchronize()
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
            "total_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()]
    return {"python": sorted(python, key=lambda r: -r["cumulative_ms"])[:top],
            "ops": sorted(ops, key=lambda r: -r["self_ms"])[:top]}


class _PhaseTimer:
    """Host time per labelled call: wraps methods / module functions so every call adds its
    ``perf_counter`` span to its label (nested labels each count their own span)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        had_own = attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original if had_own else None))

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def _wrap_phases(timer: _PhaseTimer, layer) -> None:
    """The MoE layer's parts, the FP8 casts and GEMMs, and every Triton launch."""
    import triton.runtime.jit as triton_jit

    import lightning_moe.kernels.fp8_delayed_triton as delayed
    import lightning_moe.kernels.launch as launch_module
    import lightning_moe.nn.dispatcher as dispatcher_module

    # The whole forward and the layer's own checks between its parts: what the parts below
    # leave out of the forward's host time shows up here.
    timer.wrap(layer, "forward", "layer.forward")
    timer.wrap(layer, "_route_and_combine", "layer._route_and_combine")
    timer.wrap(layer.experts, "takes_deferred_permutation", "experts.takes_deferred_permutation")
    timer.wrap(layer.experts, "takes_deferred_combine", "experts.takes_deferred_combine")
    timer.wrap(layer.experts, "release_prefetched", "experts.release_prefetched")
    timer.wrap(layer.dispatcher, "deferred_combine", "dispatcher.deferred_combine")
    timer.wrap(layer.experts, "prefetch", "experts.prefetch")
    timer.wrap(layer.router, "forward", "router")
    timer.wrap(layer.dispatcher, "dispatch", "dispatch")
    timer.wrap(dispatcher_module, "plan_for", "dispatch.plan")
    timer.wrap(layer.experts, "forward", "experts.forward")
    timer.wrap(layer.dispatcher, "combine", "combine")
    timer.wrap(delayed, "delayed_cast", "fp8.delayed_cast")
    timer.wrap(torch, "_scaled_grouped_mm", "torch._scaled_grouped_mm")
    timer.wrap(torch, "_grouped_mm", "torch._grouped_mm")
    # Triton's binding path (first launches of a key, and kernels launched without kernels.launch),
    # and the direct launches of kernels kept by kernels.launch, which skip JITFunction.run.
    timer.wrap(triton_jit.JITFunction, "run", "triton launch")
    timer.wrap(launch_module._CompiledLaunch, "__call__", "triton launch, kept kernel")
    if layer.experts.quantization is not None:
        import lightning_moe.precision.modules as fp8_modules_module
        import lightning_moe.precision.native_casts as native_casts
        import lightning_moe.precision.scaled_mm as scaled_mm
        import lightning_moe.precision.weight_prefetch as weight_prefetch

        quantization = layer.experts.quantization
        timer.wrap(quantization, "grouped_mm", "fp8.grouped_mm")
        timer.wrap(quantization, "grouped_mm_swiglu", "fp8.grouped_mm_swiglu")
        timer.wrap(fp8_modules_module, "resolve_backend", "prefetch: resolve_backend")
        timer.wrap(weight_prefetch, "can_prefetch_weight_layouts", "prefetch: can_prefetch")
        timer.wrap(weight_prefetch, "prefetch_weight_layouts", "prefetch: prefetch_weight_layouts")
        timer.wrap(quantization, "_delayed_state_fits", "prefetch: _delayed_state_fits")
        timer.wrap(quantization, "_state_and_key", "_state_and_key")
        timer.wrap(native_casts.FusedGroupedOperands, "weight_both", "weight_both")
        timer.wrap(native_casts.FusedGroupedOperands, "activation", "activation cast")
        timer.wrap(delayed, "_launch_delayed_cast", "_launch_delayed_cast")
        timer.wrap(scaled_mm, "group_gemm", "group_gemm")
        timer.wrap(scaled_mm, "host_group_ends", "host_group_ends")
        timer.wrap(scaled_mm, "wgrad_aligned_ends", "wgrad_aligned_ends")
        timer.wrap(scaled_mm, "assert_groups_aligned", "assert_groups_aligned")
        timer.wrap(scaled_mm, "transposed_out", "transposed_out")
        timer.wrap(quantization, "grouped_mm_gathered", "fp8.grouped_mm_gathered")


def _primitive_costs(repeats: int = 200) -> dict[str, float]:
    """Host microseconds of single operations the block's host path is made of, GPU kept busy."""
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.load(ptr + offs, mask=offs < n), mask=offs < n)

    buf = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    cases = {
        "torch.empty": lambda: torch.empty(1024, device="cuda"),
        "torch.zeros (1 launch)": lambda: torch.zeros(1024, device="cuda"),
        "tensor.add_ (1 launch)": lambda: buf.add_(0.0),
        "view slice": lambda: buf[1:100],
        "triton launch, 2 args": lambda: _noop[(1,)](buf, 1024, BLOCK=1024),
        "record_stream": lambda: buf.record_stream(side),
        "wait_stream": lambda: side.wait_stream(torch.cuda.current_stream()),
        "with torch.cuda.stream": lambda: torch.cuda.stream(side).__enter__() and None,
        "torch.cuda.Event + record": lambda: torch.cuda.Event().record(side),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "get_device_capability": torch.cuda.get_device_capability,
    }
    out = {}
    for label, fn in cases.items():
        fn()  # first call compiles / caches
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[label] = (time.perf_counter() - t0) / repeats * 1e6
        if label == "with torch.cuda.stream":
            torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.synchronize()
    return out


def run_case(name: str, c: dict, precision: str, args) -> dict:
    torch.manual_seed(0)
    recipe, fast = (FP8_DEFAULT if precision == "fp8" else (precision, None))
    layer = build_layer(c, "grouped_mm", torch.bfloat16, expert_alignment(recipe))
    context, _, optimizer_step_work = apply_precision(layer, recipe, fast_accumulation=fast,
                                                      graph_weight_casts=args.graph_weight_casts and recipe != "bf16")
    x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step_work": []}

    def step(record: bool = False) -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        t0 = time.perf_counter()
        with context():  # the forward only: a training loop calls backward outside autocast
            y = layer(x)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        if optimizer_step_work is not None:
            optimizer_step_work()
        t3 = time.perf_counter()
        if record:
            phases["forward"].append((t1 - t0) * 1e3)
            phases["backward"].append((t2 - t1) * 1e3)
            phases["step_work"].append((t3 - t2) * 1e3)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    for _ in range(args.iters):
        torch.cuda._sleep(SLEEP_CYCLES)  # the GPU is busy for the whole host side of the step
        step(record=True)
        torch.cuda.synchronize()  # one step at a time: the next sleep starts on an idle GPU
    launches = _kernel_launches(step)
    phases_ms = None
    if args.phases:
        timer = _PhaseTimer()
        _wrap_phases(timer, layer)
        try:
            per_step: dict[str, list[float]] = {}
            for _ in range(args.iters):
                timer.reset()
                torch.cuda._sleep(SLEEP_CYCLES)
                step()
                torch.cuda.synchronize()  # one step at a time, as above
                for label, total in timer.totals.items():
                    per_step.setdefault(label, []).append(total * 1e3)
            calls = dict(timer.calls)
        finally:
            timer.restore()
        phases_ms = {label: {"median_ms": statistics.median(v), "calls": calls[label]}
                     for label, v in per_step.items()}
    host_profile = _host_profile(step, args.top) if args.host_profile else None
    result = {"shape": c, "precision": recipe, "fast_accumulation": fast, "kernel_launches": launches,
              "graph_weight_casts": args.graph_weight_casts and recipe != "bf16"}
    for phase, values in phases.items():
        result[f"{phase}_host_ms"] = statistics.median(values)
        result[f"{phase}_host_ms_max"] = max(values)
    result["step_host_ms"] = sum(result[f"{p}_host_ms"] for p in phases)
    if host_profile is not None:
        result["host_profile"] = host_profile
    if phases_ms is not None:
        result["phases"] = phases_ms
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                        help='"bf16", "fp8" (as moe_block.py --precision fp8) or an FP8 recipe name')
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--phases", action="store_true",
                        help="host time of the layer's parts, the FP8 casts and GEMMs and the Triton launches")
    parser.add_argument("--graph-weight-casts", action="store_true",
                        help="FP8 runs with FP8Recipe(graph_weight_casts=True)")
    parser.add_argument("--top", type=int, default=40, help="functions and ops listed by --host-profile")
    parser.add_argument("--tag", default="latest")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead.py needs a CUDA GPU")
    results: dict[str, dict] = {}
    if args.phases:
        primitives = _primitive_costs()
        results["host_primitives_us"] = primitives
        for label, us in primitives.items():
            print(f"  {label:32s} {us:7.2f} us")
    for name in args.cases:
        for precision in args.precisions:
            r = run_case(name, CASES[name], precision, args)
            torch.cuda.empty_cache()  # the case's layer and inputs are gone with its frame
            results[f"{name}/{precision}"] = r
            print(f"{name:20s} {precision:6s} host ms: forward {r['forward_host_ms']:6.2f}  backward "
                  f"{r['backward_host_ms']:6.2f}  step work {r['step_work_host_ms']:5.2f}  "
                  f"(max fwd {r['forward_host_ms_max']:.2f} bwd {r['backward_host_ms_max']:.2f})  "
                  f"{r['kernel_launches']} launches", flush=True)
            for label, p in r.get("phases", {}).items():
                print(f"    phase {label:28s} {p['median_ms']:7.3f} ms  {p['calls']:3d} calls")
            if "host_profile" in r:
                for row in r["host_profile"]["python"]:
                    print(f"    py {row['cumulative_ms']:7.3f} cum {row['self_ms']:7.3f} self {row['calls']:5d}x "
                          f"{row['function']}")
                for row in r["host_profile"]["ops"]:
                    print(f"    op {row['total_ms']:7.3f} total {row['self_ms']:7.3f} self {row['calls']:5d}x "
                          f"{row['op']}")
    path = write_results(f"launch_overhead_{args.tag}", {"cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
