"""The CPU-testable parts of the benchmark scripts (the GPU runs report through them)."""

import pytest
import torch

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


def test_best_cast_launch_needs_equal_bytes_everywhere_and_the_margin(monkeypatch):
    pytest.importorskip("triton")  # benchmarks.best_cast_tiles imports the Triton kernels
    from benchmarks.best_cast_tiles import as_python, best_tiles, library_launch

    lib = library_launch("swiglu_grad")
    row = dict(zip(("BR", "BC", "warps", "amax_rows", "max_registers"), lib))
    capped = dict(BR=16, BC=16, warps=1, amax_rows=0, max_registers=96)  # not a library launch
    wrong = dict(BR=16, BC=32, warps=1, amax_rows=0, max_registers=96)
    results = {
        "qwen3_swiglu_grad": [dict(row, ms=1.0, bytes_equal=True), dict(capped, ms=0.80, bytes_equal=True),
                              dict(wrong, ms=0.5, bytes_equal=False)],
        "mixtral_swiglu_grad": [dict(row, ms=2.0, bytes_equal=True), dict(capped, ms=1.95, bytes_equal=True)],
        # "swiglu" cases must not be read as "swiglu_grad" ones, nor the reverse
        "qwen3_swiglu": [dict(zip(("BR", "BC", "warps", "amax_rows", "max_registers"), library_launch("swiglu")),
                              ms=1.0, bytes_equal=True), dict(capped, ms=0.99, bytes_equal=True)],
    }
    chosen = best_tiles(results, margin=0.03)
    # summed: 2.75 against 3.0 (8%); the faster launch with other bytes is never chosen; swiglu's 1% is no win
    assert chosen == {"swiglu_grad": (16, 16, 1, 0, 96)}
    assert best_tiles(results, margin=0.1) == {}
    printed = as_python(chosen)
    assert printed.splitlines() == ["TILE_SHAPES.update({'swiglu_grad': (16, 16, 1)})",
                                    "AMAX_FOLD_ROWS.update({'swiglu_grad': 0})",
                                    "MAX_REGISTERS.update({'swiglu_grad': 96})"]
    # run in the kernel module (as run_gpu_suite.sh's casttune part does), they make it take the chosen launch
    from lightning_moe.kernels import fp8_delayed_triton as fd

    plain = library_launch("plain")
    for table in (fd.TILE_SHAPES, fd.AMAX_FOLD_ROWS, fd.MAX_REGISTERS):
        # the library's entries (or their absence) come back after the test
        monkeypatch.setitem(table, "swiglu_grad", table.get("swiglu_grad", 0))
    exec(printed, vars(fd))
    assert library_launch("swiglu_grad") == chosen["swiglu_grad"]
    assert fd.register_cap("swiglu_grad") == {"maxnreg": 96} and fd.amax_rows("swiglu_grad", 16) == 16
    assert library_launch("plain") == plain  # other kinds untouched
    assert as_python({}) == ""


def test_best_cast_launch_reads_rows_without_register_options_as_unfolded_and_uncapped():
    pytest.importorskip("triton")  # benchmarks.best_cast_tiles imports the Triton kernels
    from benchmarks.best_cast_tiles import best_tiles
    from lightning_moe.kernels.fp8_delayed_triton import TILE_SHAPES

    # the library's plain launch folds its amax: a row of its shape from an older tune (no fold) is another
    # launch, so nothing can be compared with the library's and nothing is chosen
    shape = dict(zip(("BR", "BC", "warps"), TILE_SHAPES["plain"]))
    results = {"qwen3_plain": [dict(shape, ms=1.0, bytes_equal=True),
                               dict(BR=128, BC=64, warps=8, ms=0.5, bytes_equal=True)]}
    assert best_tiles(results, margin=0.03) == {}
    results["qwen3_plain"][0].update(amax_rows=16, max_registers=0)  # now the library's launch
    assert best_tiles(results, margin=0.03) == {"plain": (128, 64, 8, 0, 0)}


def test_marginal_layer_projects_the_full_depth_from_two_layer_counts():
    from benchmarks.train_step import marginal_layer

    # 4 layers: 100 ms, 4e15 FLOPs; 8 layers: 160 ms, 6e15 FLOPs -> 15 ms and 5e14 FLOPs a layer
    m = marginal_layer((0.100, 0.160), (4e15, 6e15), (4, 8), full_layers=48, full_flops=26e15, devices=2)
    assert m["step_s_per_layer"] == pytest.approx(0.015)
    assert m["flops_per_layer"] == pytest.approx(5e14)
    assert m["tflops_per_gpu_per_layer"] == pytest.approx(5e14 / 0.015 / 1e12 / 2)
    assert m["projected_full_step_s"] == pytest.approx(0.100 + 44 * 0.015)
    assert m["projected_full_tflops_per_gpu"] == pytest.approx(26e15 / (0.100 + 44 * 0.015) / 1e12 / 2)
    # the same two runs given the other way round project the same
    swapped = marginal_layer((0.160, 0.100), (6e15, 4e15), (8, 4), full_layers=48, full_flops=26e15, devices=2)
    assert swapped["projected_full_step_s"] == pytest.approx(m["projected_full_step_s"])
    with pytest.raises(ValueError, match="two different layer counts"):
        marginal_layer((0.1, 0.1), (1.0, 1.0), (4, 4), full_layers=48, full_flops=1.0, devices=1)


def test_the_hf_peer_is_the_same_model_shape_and_trains():
    """`train_step.py --peer hf`: HF's Qwen3-MoE built from a preset has exactly our parameter count,
    trains (finite losses on CPU), and a shape it cannot express is refused."""
    pytest.importorskip("transformers")
    import argparse

    from benchmarks.hf_peer import hf_config, hf_loop, hf_model
    from benchmarks.train_step import batches
    from lightning_moe.models import get_preset
    from lightning_moe.models.flops import total_parameters

    cfg = get_preset("qwen3_30b_a3b", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     head_dim=16, vocab_size=512, ffn_hidden_size=128,
                     moe={"ffn_hidden_size": 32, "num_experts": 8, "router_topk": 2})
    assert sum(p.numel() for p in hf_model(cfg, "cpu").parameters()) == total_parameters(cfg)
    args = argparse.Namespace(steps=2, warmup=1, accumulate=2, clip=1.0, micro_batch=2, seq=16, data="random")
    times, losses = hf_loop(args, cfg, batches, "cpu")
    assert len(times) == 2 and len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    with pytest.raises(ValueError, match="qk-norm"):
        hf_config(get_preset("mixtral_8x7b", num_layers=1))


@pytest.mark.parametrize("model", ["qwen3", "mixtral"])
def test_transpose_benchmark_operands_are_the_dense_attention_layers(model):
    """`benchmarks/fp8_transpose.py` times the float8 copies the dense attention's backward transposes:
    the weights' shapes are those of the reference decoder's projections, the activations' widths their
    input and output widths."""
    pytest.importorskip("triton")  # benchmarks.fp8_transpose imports the Triton kernel
    from benchmarks.fp8_transpose import PRESETS, TOKENS, operands
    from lightning_moe.models import get_preset
    from lightning_moe.models.decoder import Attention

    with torch.device("meta"):
        attention = Attention(get_preset(PRESETS[model]))
    shapes = operands(model)
    for name, proj in (("q", attention.q_proj), ("k/v", attention.k_proj), ("o", attention.o_proj)):
        assert shapes[f"{name} weight"] == tuple(proj.weight.shape)
        assert shapes[f"{name} output gradient"] == (TOKENS, proj.weight.shape[0])
    assert shapes["q/k/v input"] == (TOKENS, attention.q_proj.weight.shape[1])
    assert shapes["o input"] == (TOKENS, attention.o_proj.weight.shape[1])


@pytest.mark.parametrize("warmup, steps", [(1, 2), (1, 3), (5, 20), (0, 1), (3, 1)])
def test_the_profiled_step_does_not_write_the_modules_metrics(warmup, steps):
    """`train_step.py --profile`: the traced optimizer step is one the module runs like the steps
    around it (not the fit's last, which logs the metrics and registers them on first use) where
    there is such a step after the warm-up, else the last; always a step of the fit."""
    from types import SimpleNamespace

    from benchmarks.train_step import profiled_optimizer_step
    from lightning_moe.models import MoELanguageModel

    module = MoELanguageModel("tiny", overrides={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64})
    step = profiled_optimizer_step(warmup, steps)
    assert 0 <= step < warmup + steps
    fit_steps = warmup + steps
    writes = []
    for global_step in range(fit_steps):  # Trainer(logger=False, max_steps=fit_steps), log_every_n_steps=50
        module._trainer = SimpleNamespace(log_every_n_steps=50, max_steps=fit_steps, global_step=global_step)
        writes.append(module._writes_metrics_this_step())
    assert writes[-1] and not any(writes[:-1])
    assert writes[step] == (steps < 2)
