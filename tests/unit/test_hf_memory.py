"""Host memory of an HF import: a sharded checkpoint loads with a peak below one shard plus the model.

A ~75 MB Mixtral-shaped checkpoint is written in ~16 MB shards. A fresh Python process measures
its resident set (``VmHWM``, the peak, reset through ``/proc/self/clear_refs`` after the imports,
so file pages mapped by the reader count too) while ``MoELanguageModel.from_hf`` loads it. The
same measurement of a loader that first copies every shard into memory must exceed the bound,
which shows the check can fail.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2
CHILD = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from lightning_moe.models import MoELanguageModel

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, mode = Path(sys.argv[1]), sys.argv[2]
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
before = status("VmRSS")
# the control: the whole checkpoint copied into host memory first (load_file's tensors may still
# be views of the mapped file, pages that count only once touched; a copy makes them resident)
shards = sorted(path.glob("*.safetensors")) if mode == "load_every_shard_first" else []
held = [{name: tensor.clone() for name, tensor in load_file(f).items()} for f in shards]
module = MoELanguageModel.from_hf(path)
peak = status("VmHWM")
model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
print(json.dumps({"growth": peak - before, "model_bytes": model_bytes}))
"""


def _measure(path: Path, mode: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # this checkout's lightning_moe
    result = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_sharded_checkpoint_loads_below_one_shard_plus_the_model(tmp_path):
    config = transformers.MixtralConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2)
    with torch.device("cpu"):
        transformers.MixtralForCausalLM(config).save_pretrained(tmp_path, max_shard_size="16MB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 4
    largest_shard = max(f.stat().st_size for f in shards)
    checkpoint_bytes = json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"]["total_size"]

    lazy = _measure(tmp_path, "lazy")
    bound = lazy["model_bytes"] + largest_shard + 8 * MiB  # 8 MiB: allocator and interpreter slack
    assert lazy["model_bytes"] >= 0.95 * checkpoint_bytes  # the model is the checkpoint's size
    assert lazy["growth"] < bound, f"peak grew {lazy['growth'] / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB"

    eager = _measure(tmp_path, "load_every_shard_first")
    assert eager["growth"] > bound, f"the control grew only {eager['growth'] / MiB:.1f} MiB"
