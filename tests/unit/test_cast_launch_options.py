"""The delayed casts' per-kind launch options (the amax accumulator's fold, the register cap), module
constants that benchmarks patch, and the fold's rows per tile."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels module imports Triton (the test extra installs it on Linux x86_64)")

from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402


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
