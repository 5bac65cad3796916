"""The fastest launch shape per delayed-cast kind in ``fp8_quant_tune_delayed_fused.json``, as a
``LIGHTNING_MOE_CAST_TILES`` value for an A/B run of the whole block.

A kind is listed only where a shape whose outputs equal the library launch's beats that launch by
more than ``--margin`` (default 3%); otherwise the kind keeps its default. Prints the value (empty
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
    """``{kind: (rows, cols, warps)}`` for each case whose best bit-equal shape beats the default."""
    chosen = {}
    for case, rows in results.items():
        kind = case.rsplit("_", 1)[-1]
        if kind not in TILE_SHAPES:
            raise ValueError(f"case {case!r} does not end in a kind of {sorted(TILE_SHAPES)}")
        default = TILE_SHAPES[kind]
        timed = [r for r in rows if r.get("gb_s") and r.get("bytes_equal")]
        base = [r for r in timed if (r["BR"], r["BC"], r["warps"]) == default]
        if not base or not timed:
            continue
        best = max(timed, key=lambda r: r["gb_s"])
        if best["gb_s"] > base[0]["gb_s"] * (1 + margin):
            chosen[kind] = (best["BR"], best["BC"], best["warps"])
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
