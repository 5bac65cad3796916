"""The CPU-testable parts of the benchmark scripts (the GPU runs report through them)."""

import pytest

from benchmarks.compare_curves import compare, moving_average


def test_moving_average_windows():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_compare_flags_a_diverging_curve():
    baseline = [5.0 - 0.01 * i for i in range(100)]
    close = [v * 1.005 for v in baseline]
    far = baseline[:60] + [v * 1.05 for v in baseline[60:]]
    ok = compare(baseline, close, window=10)
    assert ok["final_rel_diff"] == pytest.approx(0.005, rel=1e-6)
    assert ok["max_smoothed_rel_diff"] == pytest.approx(0.005, rel=1e-6)
    bad = compare(baseline, far, window=10)
    assert bad["final_rel_diff"] == pytest.approx(0.05, rel=1e-6)
    assert bad["max_smoothed_rel_diff"] > 0.04


def test_compare_rejects_mismatched_runs():
    with pytest.raises(ValueError, match="length"):
        compare([1.0] * 40, [1.0] * 41, window=10)
    with pytest.raises(ValueError, match="at least"):
        compare([1.0] * 15, [1.0] * 15, window=10)
