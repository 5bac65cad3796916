"""benchmarks/pipeline_bubble.py: the schedule formulas and a run on the tiny preset."""

import json

import pytest

from benchmarks.pipeline_bubble import bubble, ideal, main


def test_balanced_stages_give_the_textbook_bubbles():
    assert bubble([1.0] * 4, pp=4, virtual=1, microbatches=8) == pytest.approx(3 / 11)
    assert ideal(4, 1, 8) == pytest.approx(3 / 11)
    # interleaving V=2 chunks per rank divides the warm-up and cool-down by V
    assert bubble([0.5] * 8, pp=4, virtual=2, microbatches=8) == pytest.approx(3 / 19)
    assert ideal(4, 2, 8) == pytest.approx(3 / 19)
    # an imbalanced split idles the faster stages as well
    assert bubble([1.0, 2.0], pp=2, virtual=1, microbatches=4) > ideal(2, 1, 4)


def test_tiny_preset_rows_and_file(tmp_path):
    out = main(["--presets", "tiny", "--pp", "2", "4", "--virtual", "2", "--microbatches", "1", "2", "--out",
                str(tmp_path)])
    rows = out["rows"]
    assert {(r["pp"], r["virtual"], r["schedule"]) for r in rows} == {
        (2, 1, "gpipe"), (2, 1, "1f1b"), (2, 2, "interleaved_1f1b"), (4, 1, "gpipe"), (4, 1, "1f1b")}
    assert all(0.0 < r["ideal"] <= r["bubble"] < 1.0 for r in rows)
    saved = json.loads((tmp_path / "pipeline_bubble.json").read_text())
    assert saved["rows"] == rows and "command" in saved["meta"]
