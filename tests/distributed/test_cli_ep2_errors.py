"""`lightning-moe fit --ckpt_path=<damaged checkpoint>` on 2 CPU processes (examples/configs/ep2_cpu.yaml):
the output ends with one `error:` line (from rank 0 only, no traceback from either rank) naming the
truncated shard, the exit code is 2, and the failed start leaves no new run directory.

The checkpoint is made in this process (single-process DCP, a state that the model does not
have): the strategy checks the shard sizes against DCP's metadata before it reads anything."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _launch import subprocess_env

from lightning_moe.parallel import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "ep2_cpu.yaml"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.mark.timeout(120)
def test_ep2_truncated_shard_ends_with_one_error_line(tmp_path):
    bad = tmp_path / "checkpoints" / "epoch=0-step=3.ckpt"
    state = {"state_dict": {"w": torch.randn(64, 64)}, "optimizer_0": {"m": torch.randn(64, 64)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        ckpt.save_distributed(state, {"epoch": 0, "global_step": 3}, bad)
    shard = bad / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:1000])
    logs = tmp_path / "logs"
    (logs / "ep2_cpu" / "version_0").mkdir(parents=True)
    (logs / "ep2_cpu" / "version_0" / "metrics.csv").write_text("step,train/loss\n0,5.5\n")
    before = _tree(tmp_path)

    cmd = [
        sys.executable, "-m", "lightning_moe", "fit", "--config", str(CONFIG),
        "--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={logs}", "--data.seq_length=32", "--data.micro_batch_size=2",
        "--model.overrides={num_layers: 1}", f"--ckpt_path={bad}",
    ]  # fmt: skip
    env = subprocess_env(str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100, check=False)
    output = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 2, output
    assert "Traceback" not in proc.stdout + proc.stderr, output
    lines = proc.stderr.splitlines()
    restoring = max(i for i, line in enumerate(lines) if line.startswith("Restoring states from the checkpoint path"))
    expected = (
        f"error: checkpoint {bad} cannot be loaded: its shard {shard} is truncated (1000 bytes; .metadata needs "
        f"{size}). It was not written completely or was damaged (an interrupted save or copy, a full disk). "
        "Resume from another checkpoint (ckpt_path)."
    )
    assert lines[restoring + 1 :] == [expected], output
    assert _tree(tmp_path) == before  # no version_1, the checkpoint and the old run untouched
