"""`benchmarks/train_step.py --devices 2` on CPU processes (gloo): the multi-device Lightning run
trains under a folded layout, rank 0 alone writes the results, and the step's tokens count
every data-parallel rank (tensor-parallel peers share their micro-batches).

Lightning launches the second process itself (it re-runs ``sys.argv``), so the script runs as a
subprocess here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SEQ, MICRO, STEPS = 32, 2, 2


def _run(tmp: Path, tag: str, *layout: str) -> dict:
    env = subprocess_env(str(ROOT))
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--accelerator", "cpu", "--devices", "2",
        *layout, "--preset", "tiny", "--layers", "2", "--seq", str(SEQ), "--micro-batch", str(MICRO),
        "--steps", str(STEPS), "--warmup", "1", "--skip-bare", "--tag", tag, "--results-dir", str(tmp),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    )
    files = sorted(p.name for p in tmp.glob("train_step_*.json"))
    assert files == [f"train_step_{tag}.json"], files  # rank 0 alone writes
    return json.loads((tmp / files[0]).read_text())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "layout, dp",
    [
        (("--expert-parallel", "2"), 2),  # dense DP2, experts EP2
        (("--tensor-parallel", "2", "--expert-parallel", "2", "--sharding", "ddp"), 1),  # TP2, EP folded over it
    ],
)
def test_multi_device_lightning_run_counts_every_data_parallel_rank(tmp_path, layout, dp):
    result = _run(tmp_path, "devices", *layout)
    config, run = result["config"], result["results"]["lightning"]
    assert config["data_parallel_size"] == dp
    assert config["tokens_per_step"] == MICRO * SEQ * dp
    assert len(run["step_times_s"]) == STEPS and len(run["losses"]) == STEPS + 1
    assert all(math.isfinite(loss) and 0 < loss < 10 for loss in run["losses"])
    assert run["tokens_per_s"] == pytest.approx(config["tokens_per_step"] / run["median_step_s"])
    assert run["peak_gib"] is None  # no CUDA memory on CPU


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--devices", "2"), "--skip-bare"),  # the bare loop runs on one device
        (("--devices", "3", "--tensor-parallel", "2", "--skip-bare"), "multiple of --tensor-parallel"),
        (("--devices", "0", "--skip-bare"), "positive multiple"),
    ],
)
def test_bad_device_counts_are_refused_before_any_run(tmp_path, flags, message):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--accelerator", "cpu", *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
