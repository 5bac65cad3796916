"""Shared helpers for GPU benchmarks: timing with CUDA events, metadata and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(__file__).parent)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def metadata() -> dict:
    """Device, software versions, commit and the exact command line."""
    meta = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": os.environ.get("LIGHTNING_MOE_COMMIT", git_commit()),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
        meta["num_gpus"] = torch.cuda.device_count()
    else:
        meta["device"] = "cpu"
    try:
        import transformer_engine

        meta["transformer_engine"] = transformer_engine.__version__
    except Exception:
        meta["transformer_engine"] = None
    return meta


# The spin `cuda_time_ms` queues each run behind with ``lead_cycles`` (``queued_ms``): ~2 ms at the H200's clocks.
QUEUED_LEAD_CYCLES = 4_000_000


def cuda_time_ms(fn: Callable[[], None], warmup: int = 5, iters: int = 20,
                 lead_cycles: int = 0) -> tuple[float, list[float]]:
    """Median milliseconds of ``fn`` over ``iters`` runs timed with CUDA events, after warm-up.

    Each run starts on an idle GPU, or with ``lead_cycles`` queued behind a GPU spin of that many clock
    cycles that starts before the host issues the run: the start event fires when the spin ends, by
    which time the host has issued the whole run, so no part of it waits for its host. That is not the
    same GPU work under the same conditions, though: the GPU comes to each run from a spin of one thread
    rather than from idle (at qwen3's block the gap between the two exceeded the host's measured lead:
    `trace_step.py --marks N --cuda-graph`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()  # host sync: read this iteration's elapsed time
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def cuda_time_pipelined_ms(fn: Callable[[], None], warmup: int = 5, iters: int = 20) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` runs issued back to back (one CUDA event pair
    around all of them): the CPU may run ahead of the GPU as in a training loop, so the time one
    run takes to launch its first kernels is hidden unless ``fn`` itself waits for the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()  # host sync: read the elapsed time
    return start.elapsed_time(end) / iters


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` in float64."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def write_results(name: str, payload: dict, out_dir: str | None = None, results_dir: str | Path | None = None) -> Path:
    """Write ``payload`` (plus metadata) to ``benchmarks/results/<name>.json`` (or ``results_dir``),
    and to ``$OUT`` if set."""
    payload = {"meta": metadata(), **payload}
    directory = RESULTS_DIR if results_dir is None else Path(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    text = json.dumps(payload, indent=2)
    path.write_text(text)
    extra = out_dir or os.environ.get("OUT")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / f"{name}.json").write_text(text)
    return path
