"""The delayed casts' per-kind launch options read from the environment for A/B timings (tile
shapes, the amax accumulator's fold, the register cap) and the fold's rows per tile."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels module imports Triton (the test extra installs it on Linux x86_64)")

from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402


def test_per_kind_settings_parse_and_reject_bad_items(monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_TEST_KINDS", "plain=16, swiglu_grad=128,")
    assert fd._per_kind_from_env("LIGHTNING_MOE_TEST_KINDS", "plain=16") == {"plain": 16, "swiglu_grad": 128}
    for bad in ("tiles=16", "plain=sixteen", "plain"):
        monkeypatch.setenv("LIGHTNING_MOE_TEST_KINDS", bad)
        with pytest.raises(ValueError, match="LIGHTNING_MOE_TEST_KINDS: .* is not KIND=N with KIND one of plain"):
            fd._per_kind_from_env("LIGHTNING_MOE_TEST_KINDS", "plain=16")
    with pytest.raises(ValueError, match="is not KIND=ROWSxCOLSxWARPS"):
        fd._tile_shapes_from_env("gather=64x128")


def test_amax_fold_rows_and_register_cap(monkeypatch):
    monkeypatch.setattr(fd, "AMAX_FOLD_ROWS", {"plain": 16})
    monkeypatch.setattr(fd, "MAX_REGISTERS", {"swiglu_grad": 128})
    assert fd.amax_rows("plain", 64) == 16
    assert fd.amax_rows("plain", 16) == 16  # a fold onto the tile's own rows is no fold
    assert fd.amax_rows("gather", 128) == 128  # no fold for the kind: the tile's rows
    monkeypatch.setattr(fd, "AMAX_FOLD_ROWS", {"plain": 24})
    with pytest.raises(ValueError, match="does not divide the tile's 64 rows"):
        fd.amax_rows("plain", 64)
    assert fd.register_cap("swiglu_grad") == {"maxnreg": 128}
    assert fd.register_cap("plain") == {}
