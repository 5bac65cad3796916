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


def test_idle_gaps_name_the_launch_behind_each_gap():
    from benchmarks._profile import idle_gaps

    def kernel(ts, dur, corr, name):
        return {"cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"correlation": corr}}

    events = [
        kernel(0, 10, 1, "gemm"),
        kernel(5, 20, 2, "overlapping"),  # on another stream: no gap, the busy interval grows to 25
        kernel(40, 10, 3, "late"),  # 15 us idle, launched 10 us into the gap: the CPU was late
        kernel(51, 5, 4, "queued"),  # 1 us idle, launched long before: a dependency, not the CPU
        {"cat": "cuda_runtime", "ts": 35, "dur": 3, "name": "cudaLaunchKernel", "args": {"correlation": 3}},
        {"cat": "cuda_driver", "ts": 1, "dur": 3, "name": "cuLaunchKernelEx", "args": {"correlation": 4}},
        {"cat": "cpu_op", "ts": 30, "dur": 20, "name": "MyBackward"},
        {"cat": "cpu_op", "ts": 34, "dur": 4, "name": "aten::zeros"},
        {"cat": "cpu_op", "ts": 60, "dur": 4, "name": "elsewhere"},
    ]
    wall_ms, gaps = idle_gaps(events)
    assert wall_ms == pytest.approx(0.056)
    assert [g["next_kernel"] for g in gaps] == ["late", "queued"]
    assert gaps[0]["gap_ms"] == pytest.approx(0.015) and gaps[0]["launched_after_gap_start_ms"] == pytest.approx(0.010)
    assert gaps[0]["cpu_stack"] == ["MyBackward", "aten::zeros"]
    assert gaps[1]["launched_after_gap_start_ms"] < 0 and gaps[1]["cpu_stack"] == []
    assert idle_gaps([]) == (0.0, [])
