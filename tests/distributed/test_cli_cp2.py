"""`lightning-moe fit` on 2 CPU processes with CP=2 (examples/configs/cp2_cpu.yaml): it trains, writes
directory checkpoints, and a run resumed with ``--ckpt_path`` continues the uninterrupted run's
loss curve exactly.

Lightning launches the second process itself (it re-runs ``sys.argv``), so the CLI runs as a
subprocess here, not in the test process.

The checkpoint resumed from ends an epoch (``limit_train_batches`` = 3 steps per epoch).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _cli_fit import metrics_by_step, run_fit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "cp2_cpu.yaml"
SEQ, MICRO, TOPK = 32, 4, 2
STEPS, STEPS_PER_EPOCH = 6, 3

OVERRIDES = """\
trainer:
  callbacks:
    - class_path: lightning_moe.callbacks.MoEMonitor
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", every_n_epochs: 1, save_top_k: -1, save_last: link}}
model:
  overrides: {{num_layers: 2}}
"""


def _fit(tmp: Path, version: str, *extra: str) -> None:
    run_fit(CONFIG, tmp, version, STEPS, STEPS_PER_EPOCH, f"--data.seq_length={SEQ}",
            f"--data.micro_batch_size={MICRO}", *extra)


def _metrics(tmp: Path, version: str) -> dict[str, dict[int, float]]:
    return metrics_by_step(tmp / "logs" / "cp2_cpu" / version / "metrics.csv")


@pytest.mark.timeout(240)
def test_cp2_cli_trains_checkpoints_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "overrides.yaml").write_text(OVERRIDES.format(ckpt=ckpt))

    _fit(tmp_path, "full")
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt", "latest"]
    for name in ("epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"):
        assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpt / name).iterdir()}
    assert (ckpt / "last.ckpt").is_symlink() and os.readlink(ckpt / "last.ckpt") == "epoch=1-step=6.ckpt"
    assert (ckpt / "latest").read_text().strip() == "epoch=1-step=6.ckpt"

    full = _metrics(tmp_path, "full")
    losses = full["train/loss"]
    assert sorted(losses) == list(range(STEPS))
    assert losses[STEPS - 1] < losses[0] - 0.3, losses  # it trains
    # Routing counts are summed over both ranks: each routes its half of every sequence.
    for step in range(STEPS):
        assert full["moe/model.layers.1.mlp/tokens"][step] == MICRO * SEQ * TOPK

    _fit(tmp_path, "resumed", f"--ckpt_path={ckpt / 'epoch=0-step=3.ckpt'}")
    resumed = _metrics(tmp_path, "resumed")
    assert sorted(resumed["train/loss"]) == list(range(STEPS_PER_EPOCH, STEPS))
    for step, loss in resumed["train/loss"].items():
        assert loss == pytest.approx(losses[step], rel=1e-6, abs=1e-7), (step, loss, losses[step])
    final = STEPS - 1
    assert resumed["val/loss"][final] == pytest.approx(full["val/loss"][final], rel=1e-6)
