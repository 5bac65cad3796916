"""Runs dynamic CP2, static CP2 (two GPUs, NCCL) and one GPU in fp32 on the packed batches of the CPU
parity test in a fresh process (CUDA must not be initialised before the launcher forks) and prints
their results as JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

from _launch import run_distributed  # noqa: E402
from test_dynamic_context_parallel import _train  # noqa: E402


def main() -> None:
    common = dict(backend="nccl", timeout=600)
    cp2 = dict(context_parallel_size=2)
    runs = {
        "dynamic": run_distributed(_train, 2, cp2, True, "cuda", **common)[0],
        "static": run_distributed(_train, 2, cp2, False, "cuda", **common)[0],
        "ref": run_distributed(_train, 1, {}, False, "cuda", **common)[0],
    }
    out = {
        name: {"losses": r[0], "plans": [{str(k): v for k, v in p.items()} for p in r[1][0]],
               "state": {k: v.tolist() for k, v in r[3].items()}}
        for name, r in runs.items()
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
