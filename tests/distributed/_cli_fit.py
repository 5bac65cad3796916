"""The example-config CLI tests' shared parts: one `lightning-moe fit` run in a subprocess, and
the metrics its CSVLogger wrote."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from _launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]


def run_fit(config: Path, tmp: Path, version: str, steps: int, steps_per_epoch: int, *extra: str) -> str:
    """``python -m lightning_moe fit`` on ``config`` plus ``tmp/overrides.yaml``: ``steps`` steps,
    validation every epoch of ``steps_per_epoch``, metrics logged every step under ``tmp/logs``.
    Fails the test with the run's output unless it exits 0; returns its stdout."""
    cmd = [
        sys.executable, "-m", "lightning_moe", "fit",
        "--config", str(config),
        "--config", str(tmp / "overrides.yaml"),
        f"--trainer.max_steps={steps}",
        f"--trainer.limit_train_batches={steps_per_epoch}",
        f"--trainer.val_check_interval={steps_per_epoch}",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={tmp / 'logs'}",
        f"--trainer.logger.init_args.version={version}",
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=subprocess_env(str(ROOT)), capture_output=True, text=True, timeout=150,
                          check=False)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def metrics_by_step(csv_path: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from a Lightning ``metrics.csv`` (empty cells skipped)."""
    out: dict[str, dict[int, float]] = {}
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out
