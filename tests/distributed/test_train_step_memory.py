"""`benchmarks/train_step.py --offload ... --recompute ... --recompute-layers N` configure the
Lightning run (ActivationOffload and ModelConfig.recompute) and are refused where they cannot apply.
On CPU (gloo, one process) this is a plumbing check; the GPU figures come from the same flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "train_step.py")


@pytest.mark.timeout(240)
def test_memory_flags_configure_the_lightning_run(tmp_path):
    flags = ["--offload", "expert_fc1", "attn_proj", "core_attn", "--offload-keep-last-layers", "0",
             "--recompute", "moe_act", "layernorm", "--recompute-layers", "2"]
    cmd = [sys.executable, SCRIPT, "--accelerator", "cpu", "--preset", "tiny", "--layers", "3", "--seq", "32",
           "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--skip-bare", "--tag", "memory",
           "--results-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(str(ROOT)), capture_output=True, text=True,
                          timeout=200, check=False)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    result = json.loads((tmp_path / "train_step_memory.json").read_text())
    config = result["config"]
    assert config["offload"] == ["expert_fc1", "attn_proj", "core_attn"] and config["offload_keep_last_layers"] == 0
    assert config["recompute"] == ["moe_act", "layernorm"] and config["recompute_layers"] == 2
    assert list(result["results"]) == ["lightning"]
    # the activation memory (CUDA allocator statistics) is reported for every run, None on CPU
    assert {"static_gib", "measured_peak_gib", "activation_gib"} <= set(result["results"]["lightning"])
    assert result["results"]["lightning"]["activation_gib"] is None


@pytest.mark.timeout(240)
def test_lm_head_chunk_flag_configures_both_runs(tmp_path):
    """``--lm-head-chunk-tokens N`` is ModelConfig.lm_head_chunk_tokens of the bare and the Lightning
    run (0: None, the unchunked head), recorded in the JSON's config."""
    for chunk, want in (("8", 8), ("0", 0)):
        cmd = [sys.executable, SCRIPT, "--accelerator", "cpu", "--preset", "tiny", "--layers", "1", "--seq", "32",
               "--micro-batch", "1", "--steps", "1", "--warmup", "1", "--tag", f"chunk{chunk}",
               "--results-dir", str(tmp_path), "--lm-head-chunk-tokens", chunk]
        proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(str(ROOT)), capture_output=True, text=True,
                              timeout=200, check=False)
        assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
        result = json.loads((tmp_path / f"train_step_chunk{chunk}.json").read_text())
        assert result["config"]["lm_head_chunk_tokens"] == want
        assert set(result["results"]) == {"bare_torch", "lightning"}


def test_lm_head_chunk_flag_defaults_to_the_model_config():
    sys.path.insert(0, str(ROOT))
    from benchmarks.train_step import _default_lm_head_chunk, build_module
    from lightning_moe.models import ModelConfig

    assert ModelConfig.lm_head_chunk_tokens is None and _default_lm_head_chunk() == 0  # the unchunked head

    class Args:
        layers, seq, expert_backend, precision, preset = 1, 32, "auto", "bf16", "tiny"
        recompute = recompute_layers = None

    for chunk, want in ((0, None), (16, 16)):
        Args.lm_head_chunk_tokens = chunk
        assert build_module(Args).model_config.lm_head_chunk_tokens == want


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--recompute", "moe_act"), "add --skip-bare"),
        (("--offload", "moe_act", "--skip-bare", "--cuda-graph", "moe"), "--offload cannot run with --cuda-graph"),
        (("--recompute", "attention", "--skip-bare"), "invalid choice"),
        (("--lm-head-chunk-tokens", "-1"), "give a positive chunk, or 0 for off"),
    ],
)
def test_memory_flags_are_refused_before_any_run(tmp_path, flags, message):
    cmd = [sys.executable, SCRIPT, "--accelerator", "cpu", *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(str(ROOT)), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
