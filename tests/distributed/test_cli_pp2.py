"""`lightning-moe fit` on 2 CPU processes with PP=2 (examples/configs/pp2_cpu.yaml): it trains,
validates through the stages, logs MoEMonitor statistics of both stages' layers, writes
directory checkpoints, and a run resumed with
``--ckpt_path`` continues the uninterrupted run's loss curve exactly (Lightning re-runs
``sys.argv`` for the second process, so the CLI runs as a subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _cli_fit import metrics_by_step, run_fit

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "pp2_cpu.yaml"
STEPS, STEPS_PER_EPOCH = 4, 2

OVERRIDES = """\
trainer:
  callbacks:
    - class_path: lightning_moe.callbacks.MoEMonitor
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", every_n_epochs: 1, save_top_k: -1, save_last: link}}
"""


def _fit(tmp: Path, version: str, *extra: str) -> str:
    return run_fit(CONFIG, tmp, version, STEPS, STEPS_PER_EPOCH, "--data.seq_length=32", *extra)


def _metrics(tmp: Path, version: str) -> dict[str, dict[int, float]]:
    return metrics_by_step(tmp / "logs" / "pp2_cpu" / version / "metrics.csv")


@pytest.mark.timeout(240)
def test_pp2_cli_trains_checkpoints_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "overrides.yaml").write_text(OVERRIDES.format(ckpt=ckpt))
    stdout = _fit(tmp_path, "full")
    assert "PP stage 1" in stdout and "1f1b, 2 stages x 1 virtual, 4 micro-batches" in stdout  # the layout table
    step = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    assert {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpt / step).iterdir()}
    full = _metrics(tmp_path, "full")
    losses = full["train/loss"]
    assert sorted(losses) == list(range(STEPS))
    assert losses[STEPS - 1] < losses[0] - 0.3, losses  # it trains
    assert sorted(full["val/loss"]) == [STEPS_PER_EPOCH - 1, STEPS - 1]
    # MoEMonitor: the MoE layers of both stages, every micro-batch counted (8 sequences x 32 tokens x top-2)
    for layer in (1, 3):
        assert full[f"moe/model.layers.{layer}.mlp/tokens"] == {s: 8 * 32 * 2 for s in range(STEPS)}

    _fit(tmp_path, "resumed", f"--ckpt_path={ckpt / step}")
    resumed = _metrics(tmp_path, "resumed")
    assert sorted(resumed["train/loss"]) == list(range(STEPS_PER_EPOCH, STEPS))
    for s, loss in resumed["train/loss"].items():
        assert loss == pytest.approx(losses[s], rel=1e-6, abs=1e-7), (s, loss, losses[s])
    assert resumed["val/loss"][STEPS - 1] == pytest.approx(full["val/loss"][STEPS - 1], rel=1e-6)
