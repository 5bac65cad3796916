"""The fastest launch per delayed-cast kind in a ``fp8_quant_tune.py --delayed-fused`` JSON, as Python
statements that set the library's launch constants to it.

A launch is (rows, columns, warps) and, in the ``--registers`` sweeps, the amax accumulator's rows
and the register cap. A kind is listed only where a launch with the same outputs beats the library
launch, in time summed over the tune's benchmark shapes, by more than ``--margin`` (default 3%);
otherwise the kind keeps its default. Prints on stdout (nothing when nothing wins) one statement per
dict of `lightning_moe.kernels.fp8_delayed_triton`, to paste below the dicts there or to run in that
module's namespace for an A/B run of the whole block (``run_gpu_suite.sh``'s casttune part does)::

    TILE_SHAPES.update({'swiglu_grad': (16, 16, 1)})
    AMAX_FOLD_ROWS.update({'swiglu_grad': 0})
    MAX_REGISTERS.update({'swiglu_grad': 96})

(a fold of 0: the tile's own rows; a cap of 0: none).

    python3 benchmarks/best_cast_tiles.py [--results R.json] [--margin 0.03]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_moe.kernels.fp8_delayed_triton import MAX_REGISTERS, TILE_SHAPES, amax_rows  # noqa: E402

Launch = tuple[int, int, int, int, int]  # rows, columns, warps, amax accumulator rows (0: the tile's), cap (0: none)


def library_launch(kind: str) -> Launch:
    """The launch the library takes for ``kind`` (`TILE_SHAPES`, `amax_rows`, `MAX_REGISTERS`)."""
    rows, cols, warps = TILE_SHAPES[kind]
    fold = amax_rows(kind, rows)
    return rows, cols, warps, 0 if fold == rows else fold, MAX_REGISTERS.get(kind, 0)


def _launch(row: dict) -> Launch:
    # a tune row's launch; rows from before the sweeps recorded the fold and the cap (before 75df913)
    # ran without either
    fold = row.get("amax_rows", 0)
    return row["BR"], row["BC"], row["warps"], fold if 0 < fold < row["BR"] else 0, row.get("max_registers", 0)


def best_tiles(results: dict, margin: float) -> dict[str, Launch]:
    """``{kind: launch}`` for each kind whose best launch beats the library's.

    ``results``: ``{"<case>_<kind>": [{"BR", "BC", "warps", ["amax_rows", "max_registers"], "ms",
    "bytes_equal"}, ...]}``, one case per benchmark shape. A launch counts only where it was timed
    with equal outputs in every case of its kind; the best is the one with the least time summed over
    those cases, chosen if that sum is below the library launch's by more than ``margin``. Rows without
    the fold and cap (tunes before 75df913) ran neither, so they cannot stand for a folded or capped
    library launch: a kind whose library launch is not among them gets nothing chosen."""
    by_kind: dict[str, list[dict]] = {}
    for case, rows in results.items():
        # the longest kind the case name ends in ("swiglu_grad" before "swiglu")
        kind = next((k for k in sorted(TILE_SHAPES, key=len, reverse=True) if case.endswith("_" + k)), None)
        if kind is None:
            raise ValueError(f"case {case!r} does not end in a kind of {sorted(TILE_SHAPES)}")
        by_kind.setdefault(kind, []).append({_launch(r): r["ms"] for r in rows
                                             if r.get("ms") and r.get("bytes_equal")})
    chosen = {}
    for kind, cases in by_kind.items():
        everywhere = set.intersection(*(set(times) for times in cases))
        library = library_launch(kind)
        if library not in everywhere:
            continue
        total = {launch: sum(times[launch] for times in cases) for launch in everywhere}
        best = min(total, key=total.get)
        if total[best] < total[library] * (1 - margin):
            chosen[kind] = best
    return chosen


def as_python(chosen: dict[str, Launch]) -> str:
    """Statements updating `TILE_SHAPES`, `AMAX_FOLD_ROWS` and `MAX_REGISTERS` to the launches ``chosen``
    (Python literals, one line per dict; empty: nothing chosen)."""
    if not chosen:
        return ""
    tiles = {kind: (r, c, w) for kind, (r, c, w, _, _) in chosen.items()}
    folds = {kind: fold for kind, (_, _, _, fold, _) in chosen.items()}
    caps = {kind: cap for kind, (_, _, _, _, cap) in chosen.items()}
    return (f"TILE_SHAPES.update({tiles!r})\nAMAX_FOLD_ROWS.update({folds!r})\n"
            f"MAX_REGISTERS.update({caps!r})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).parent / "results" / "fp8_quant_tune_delayed_fused.json"
    parser.add_argument("--results", default=str(default))
    parser.add_argument("--margin", type=float, default=0.03)
    args = parser.parse_args()
    chosen = best_tiles(json.loads(Path(args.results).read_text())["results"], args.margin)
    if chosen:
        print(as_python(chosen))


if __name__ == "__main__":
    main()
