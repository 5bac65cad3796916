"""Runs the PP=2 (two GPUs, 1F1B and interleaved 1F1B with 2 virtual stages) and one-GPU bf16
trainings in a fresh process (CUDA must not be initialised before the launcher forks) and prints
their results as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

from _launch import run_distributed  # noqa: E402
from _parity import tiny_config  # noqa: E402
from _pipeline_parity import train  # noqa: E402

STEPS, MICRO = 5, 4
CONFIG = {**tiny_config(), "num_layers": 4}


def main() -> None:
    common = dict(backend="nccl", timeout=300)
    tail = (CONFIG, None, 0.5, None, None, False, False, 1, "cuda", "bf16-mixed")
    runs = {
        "pp2_1f1b": run_distributed(train, 2, dict(pipeline_parallel_size=2), 1, STEPS, MICRO, *tail, **common)[0],
        "pp2_interleaved": run_distributed(
            train, 2, dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2),
            1, STEPS, MICRO, *tail, **common)[0],
        "ref": run_distributed(train, 1, {}, 1, STEPS, MICRO, *tail, **common)[0],
    }
    out = {
        name: {"losses": r["rank_losses"].tolist(), "state": {k: v.tolist() for k, v in r["state"].items()}}
        for name, r in runs.items()
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
