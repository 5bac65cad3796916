"""Runs the EP=2 (two GPUs) and one-GPU bf16 trainings in a fresh process (CUDA must not be
initialised before the launcher forks) and prints their results as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

from _launch import run_distributed  # noqa: E402
from _parity import train  # noqa: E402


def main() -> None:
    common = dict(backend="nccl", timeout=300)
    args = (5, 1, None, None, 0.5, "bf16-mixed", "cuda")
    ep2 = run_distributed(train, 2, dict(expert_parallel_size=2), 2, *args, **common)[0]
    copy_engine = dict(expert_parallel_size=2, token_dispatcher="allgather", dispatch_transport="copy_engine")
    ep2_ce = run_distributed(train, 2, copy_engine, 2, *args, **common)[0]
    ref = run_distributed(train, 1, {}, 1, 5, 2, None, None, 0.5, "bf16-mixed", "cuda", **common)[0]
    out = {
        name: {"losses": r["rank_losses"].tolist(), "state": {k: v.tolist() for k, v in r["state"].items()}}
        for name, r in (("ep2", ep2), ("ep2_allgather_copy_engine", ep2_ce), ("ref", ref))
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
