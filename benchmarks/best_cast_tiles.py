"""The fastest launch shape per delayed-cast kind in ``fp8_quant_tune_delayed_fused.json``, as a
``LIGHTNING_MOE_CAST_TILES`` value for an A/B run of the whole block.

A kind is listed only where a shape with the same outputs beats the library launch, in time summed
over the tune's benchmark shapes, by more than ``--margin`` (default 3%); otherwise the kind keeps
its default. Prints the value (empty
when nothing wins) on stdout.

    LIGHTNING_MOE_CAST_TILES=$(python3 benchmarks/best_cast_tiles.py) python3 benchmarks/moe_block.py ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_moe.kernels.fp8_delayed_triton import TILE_SHAPES  # noqa: E402


def best_tiles(results: dict, margin: float) -> dict[str, tuple[int, int, int]]:
    """``{kind: (rows, cols, warps)}`` for each kind whose best shape beats the library launch.

    ``results``: ``{"<case>_<kind>": [{"BR", "BC", "warps", "ms", "bytes_equal"}, ...]}``, one case
    per benchmark shape. A launch shape counts only where it was timed with equal outputs in every
    case of its kind; the best is the one with the least time summed over those cases, chosen if
    that sum is below the library launch's by more than ``margin``."""
    by_kind: dict[str, list[dict]] = {}
    for case, rows in results.items():
        # the longest kind the case name ends in ("swiglu_grad" before "swiglu")
        kind = next((k for k in sorted(TILE_SHAPES, key=len, reverse=True) if case.endswith("_" + k)), None)
        if kind is None:
            raise ValueError(f"case {case!r} does not end in a kind of {sorted(TILE_SHAPES)}")
        by_kind.setdefault(kind, []).append({(r["BR"], r["BC"], r["warps"]): r["ms"] for r in rows
                                             if r.get("ms") and r.get("bytes_equal")})
    chosen = {}
    for kind, cases in by_kind.items():
        everywhere = set.intersection(*(set(times) for times in cases))
        if TILE_SHAPES[kind] not in everywhere:
            continue
        total = {shape: sum(times[shape] for times in cases) for shape in everywhere}
        best = min(total, key=total.get)
        if total[best] < total[TILE_SHAPES[kind]] * (1 - margin):
            chosen[kind] = best
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).parent / "results" / "fp8_quant_tune_delayed_fused.json"
    parser.add_argument("--results", default=str(default))
    parser.add_argument("--margin", type=float, default=0.03)
    args = parser.parse_args()
    chosen = best_tiles(json.loads(Path(args.results).read_text())["results"], args.margin)
    print(",".join(f"{kind}={r}x{c}x{w}" for kind, (r, c, w) in chosen.items()))


if __name__ == "__main__":
    main()
