"""benchmarks/dynamic_cp_sim.py on CPU: the simulation from a given calibration file, the fit the
GPU calibration uses, the calibration pipeline timed on the host, and its refusal without a GPU."""

import json

import numpy as np
import pytest
import torch

from benchmarks.dynamic_cp_sim import draw_micro_batch, exchange_constants, fit_compute_constants, main
from lightning_moe.parallel.dynamic_cp import CALIBRATION_FORMAT, CostModel


def _calibration(path, **values):
    constants = dict(attention_s_per_token_pair=6e-9, linear_s_per_token=4e-5, cp_s_per_token=2e-6,
                     cp_s_per_exchange=3e-3)
    constants.update(values)
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "cost_model": constants}))
    return path


def test_simulation_reports_dynamic_over_static_per_gpu_count(tmp_path, capsys):
    calibration = _calibration(tmp_path / "calibration.json")
    out = tmp_path / "sim.json"
    main(["--calibration", str(calibration), "--out", str(out), "--gpus", "8", "16", "--cp", "4",
          "--tokens-per-gpu", "4096", "--max-len", "16384", "--steps", "3"])
    result = json.loads(out.read_text())
    assert result["simulation"] is True
    assert result["cost_model"]["linear_s_per_token"] == 4e-5
    assert [r["gpus"] for r in result["rows"]] == [8, 16]
    for row in result["rows"]:
        assert row["dp"] == row["gpus"] // 4
        assert 0 < row["dynamic_over_static"] <= 1.0
        assert row["dynamic_over_static"] == pytest.approx(row["dynamic_step_s"] / row["static_step_s"])
        assert sum(row["documents_per_cp_size"].values()) == pytest.approx(row["documents_per_step"])
        assert set(row["documents_per_cp_size"]) <= {"1", "2", "4"}
    assert "dyn/static" in capsys.readouterr().out


def test_costly_exchanges_favour_small_groups_in_the_simulation(tmp_path):
    cheap, costly = tmp_path / "cheap.json", tmp_path / "costly.json"
    _calibration(tmp_path / "c1.json", cp_s_per_exchange=0.0, cp_s_per_token=0.0)
    _calibration(tmp_path / "c2.json", cp_s_per_exchange=0.05)
    common = ["--gpus", "8", "--cp", "4", "--tokens-per-gpu", "4096", "--max-len", "16384", "--steps", "3"]
    main(["--calibration", str(tmp_path / "c1.json"), "--out", str(cheap), *common])
    main(["--calibration", str(tmp_path / "c2.json"), "--out", str(costly), *common])
    ratio = {p: json.loads(p.read_text())["rows"][0]["dynamic_over_static"] for p in (cheap, costly)}
    assert ratio[costly] < ratio[cheap] <= 1.0


def test_fit_recovers_the_quadratic_and_linear_terms():
    lengths = [1024, 2048, 4096, 8192, 16384]
    seconds = [3e-9 * n * n / 2 + 2e-5 * n + 1e-3 for n in lengths]
    a, b, c = fit_compute_constants(lengths, seconds)
    assert a == pytest.approx(3e-9, rel=1e-6) and b == pytest.approx(2e-5, rel=1e-6) and c == pytest.approx(1e-3)
    token, exchange = exchange_constants(2048, 48, 150e9, 20e-6)
    assert token == pytest.approx(3 * 2048 * 48 / 150e9) and exchange == pytest.approx(3 * 20e-6 * 48)


def test_drawn_micro_batches_fill_the_budget_within_the_length_range():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = draw_micro_batch(rng, 32768, 2048.0, 1.5, 16, 16384)
        assert sum(lengths) == 32768 and max(lengths) <= 16384 and min(lengths[:-1]) >= 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_calibrate_needs_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main(["--calibrate", "--out", str(tmp_path / "c.json")])


def test_calibration_pipeline_on_the_host_writes_a_file_the_simulation_reads(tmp_path):
    calibration, sim = tmp_path / "calibration.json", tmp_path / "sim.json"
    main(["--calibrate", "--device", "cpu", "--preset", "tiny", "--layers", "1", "--target-layers", "4",
          "--lengths", "32", "64", "128", "--warmup", "0", "--iters", "1", "--out", str(calibration)])
    document = json.loads(calibration.read_text())
    assert document["measured"]["lengths"] == [32, 64, 128] and len(document["measured"]["seconds"]) == 3
    assert document["measured"]["target_layers"] == 4 and document["meta"]["device"] == "cpu"
    cost = CostModel.from_json(calibration)
    kv_bytes = document["assumed"]["kv_bytes_per_token_layer"]
    assert cost.cp_s_per_token == pytest.approx(3 * kv_bytes * 4 / 150e9)
    main(["--calibration", str(calibration), "--out", str(sim), "--gpus", "8", "--cp", "4", "--tokens-per-gpu", "1024",
          "--max-len", "4096", "--median", "256", "--steps", "2"])
    assert json.loads(sim.read_text())["rows"][0]["dynamic_over_static"] <= 1.0
