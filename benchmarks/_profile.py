"""One profiled step for the GPU benchmarks: where the GPU time goes and where the GPU waits.

``profile_step(step)`` runs ``step`` once to warm up, then once under ``torch.profiler`` and
returns a JSON-ready dict:

- ``kernel_ms``: summed GPU kernel time; ``wall_ms``: first kernel start to last kernel end.
  ``wall_ms - kernel_ms`` is time the GPU idled (or kernels overlapped on other streams);
- ``kernels``: the heaviest kernels (ms, calls, share) and ``nccl_share`` of kernel time;
- ``idle_gaps``: the longest gaps between consecutive kernels, each with the next kernel and
  the CPU ops that launched it, and whether that launch came after the gap began (the GPU
  waited for the CPU: launch overhead or a host sync) or before (it waited on a dependency);
- ``host_syncs`` and ``cpu_top``: synchronizing calls and the heaviest CPU ops (self time);
- ``timeline``: every kernel of the step in start order, ``[name, ms]`` (which call of a kernel
  that runs several times costs what).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch

_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize", "cudaMemcpyAsync")


def _trace_events(prof) -> list[dict]:
    """The profiler's Chrome-trace events (the structured API does not expose launch times)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def _gpu_events(events: list[dict]) -> list[dict]:
    """The kernels, memsets and copies among Chrome-trace ``events``, in start order."""
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])


def idle_gaps(events: list[dict], top: int = 8) -> tuple[float, list[dict]]:
    """``(wall_ms, gaps)`` from Chrome-trace ``events``: the ``top`` longest gaps between kernels.

    A kernel's launch is the CUDA runtime event with the same correlation id; the CPU ops
    whose intervals contain the launch (innermost last) say which code issued it.
    """
    kernels = _gpu_events(events)
    if not kernels:
        return 0.0, []
    # runtime launches (cudaLaunchKernel) and driver ones (cuLaunchKernelEx: Triton kernels)
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    gaps = []
    end = kernels[0]["ts"] + kernels[0].get("dur", 0)
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap > 0:
            gaps.append((gap, end, k))
        end = max(end, k["ts"] + k.get("dur", 0))
    wall_ms = (end - kernels[0]["ts"]) / 1e3
    rows = []
    for gap, gap_start, k in sorted(gaps, key=lambda g: g[0], reverse=True)[:top]:
        launch = launches.get(k.get("args", {}).get("correlation"))
        row = {"gap_ms": gap / 1e3, "next_kernel": k["name"][:100]}
        if launch is not None:
            t = launch["ts"]
            stack = sorted((op for op in cpu_ops if op["ts"] <= t <= op["ts"] + op["dur"]), key=lambda op: -op["dur"])
            row["launched_after_gap_start_ms"] = (t - gap_start) / 1e3  # > 0: the GPU waited for the CPU
            row["cpu_stack"] = [op["name"][:60] for op in stack][-6:]
        rows.append(row)
    return wall_ms, rows


def timeline(events: list[dict]) -> list[list]:
    """``[name (60 characters), ms]`` of each kernel, memset and copy in start order."""
    return [[k["name"][:60], round(k.get("dur", 0) / 1e3, 4)] for k in _gpu_events(events)]


def profile_step(step: Callable[[], None], top_kernels: int = 25) -> dict:
    """Profile one call of ``step`` (after one warm-up call); see the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()  # host sync: the profiled step starts on an idle GPU, as a timed one
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()  # host sync: every kernel of the step inside the trace
    return summarize_profile(prof, top_kernels)


def summarize_profile(prof, top_kernels: int = 25) -> dict:
    """The `profile_step` summary of a finished ``torch.profiler.profile`` (for a step that a loop
    other than ours drives, such as Lightning's)."""
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    kernels = sorted((e for e in averages if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in kernels) or 1.0
    nccl = sum(e.device_time_total for e in kernels if "nccl" in e.key.lower())
    peer_copies = sum(e.device_time_total for e in kernels if "PtoP" in e.key)  # copy-engine transfers
    syncs = [e for e in averages if "Synchronize" in e.key or e.key in _SYNC_OPS]
    cpu_top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    events = _trace_events(prof)
    wall_ms, gaps = idle_gaps(events)
    return {
        "kernel_ms": total / 1e3,
        "wall_ms": wall_ms,
        "nccl_share": nccl / total,
        "peer_copy_ms": peer_copies / 1e3,
        "kernels": [{"name": e.key[:120], "cuda_ms": e.device_time_total / 1e3, "share": e.device_time_total / total,
                     "calls": e.count} for e in kernels[:top_kernels]],
        "idle_gaps": gaps,
        "host_syncs": [{"name": e.key, "calls": e.count, "cpu_ms": e.cpu_time_total / 1e3} for e in syncs],
        "cpu_top": [{"name": e.key[:80], "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                    for e in cpu_top],
        "timeline": timeline(events),
    }


def save_trace(step: Callable[[], None], path: str, steps: int = 3) -> None:
    """Write a Chrome trace (with shapes and CPU stacks) of ``steps`` calls of ``step`` issued
    back to back, as a training loop issues them (after one warm-up call); gzipped when ``path``
    ends in ``.gz``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()  # host sync: the traced steps start on an idle GPU
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()  # host sync: every kernel of the traced steps inside the trace
    prof.export_chrome_trace(path)


def print_profile(profile: dict, rows: int = 20) -> None:
    """The heaviest kernels and the longest GPU idle gaps of a `profile_step` result."""
    print(f"    kernels {profile['kernel_ms']:.2f} ms of {profile['wall_ms']:.2f} ms GPU wall time")
    for row in profile["kernels"][:rows]:
        print(f"    {row['share']*100:5.1f}% {row['cuda_ms']:8.3f} ms x{row['calls']:<4d} {row['name'][:100]}")
    for gap in profile["idle_gaps"]:
        print(f"    idle {gap['gap_ms']:.3f} ms before {gap['next_kernel'][:60]} "
              f"(launched {gap.get('launched_after_gap_start_ms', float('nan')):+.3f} ms; {gap.get('cpu_stack', [])})")
