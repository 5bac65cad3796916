"""Compare the Lightning loss curves of two ``train_step.py`` results (e.g. FP8 vs BF16).

    python benchmarks/compare_curves.py benchmarks/results/train_step_curve_bf16.json \
        benchmarks/results/train_step_curve_tensorwise.json --tolerance 0.02

Both runs must have used the same data and seed. Reported, with the candidate against the
baseline:

- ``final_rel_diff``: relative difference of the mean loss over the last ``--window`` steps;
- ``max_smoothed_rel_diff``: the largest relative difference of the two curves' moving averages
  (``--window`` steps) after the first ``--window`` steps (single steps are noisy in both runs).

Exits non-zero when either exceeds ``--tolerance``. Writes ``benchmarks/results/curves_<tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(baseline: list[float], candidate: list[float], window: int) -> dict:
    if len(baseline) != len(candidate):
        raise ValueError(f"curves differ in length: {len(baseline)} vs {len(candidate)} steps")
    if len(baseline) < 2 * window:
        raise ValueError(f"need at least {2 * window} steps for a {window}-step window, got {len(baseline)}")
    tail_b = sum(baseline[-window:]) / window
    tail_c = sum(candidate[-window:]) / window
    smooth_b, smooth_c = moving_average(baseline, window), moving_average(candidate, window)
    diffs = [abs(c - b) / abs(b) for b, c in zip(smooth_b[window:], smooth_c[window:])]
    return {
        "steps": len(baseline),
        "window": window,
        "baseline_final_mean": tail_b,
        "candidate_final_mean": tail_c,
        "final_rel_diff": abs(tail_c - tail_b) / abs(tail_b),
        "max_smoothed_rel_diff": max(diffs),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline")
    parser.add_argument("candidate")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in (args.baseline, args.candidate)]
    curves = [r["results"]["lightning"]["losses"] for r in runs]
    summary = compare(*curves, window=args.window)
    summary.update(baseline=args.baseline, candidate=args.candidate, tolerance=args.tolerance,
                   passed=max(summary["final_rel_diff"], summary["max_smoothed_rel_diff"]) <= args.tolerance)
    print(json.dumps(summary, indent=2))
    tag = args.tag or f"{Path(args.baseline).stem}_vs_{Path(args.candidate).stem}"
    write_results(f"curves_{tag}", {"comparison": summary})
    if not summary["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
