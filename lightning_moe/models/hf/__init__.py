"""Hugging Face checkpoints of the reference decoder: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and DeepSeek-V3,
and the dense Llama, Qwen3 and Qwen2.

- `config_mapping`: HF ``config.json`` <-> `ModelConfig`, and what each architecture can express
  (`deepseek_v3` and `dense_families` for those families).
- `tensor_mapping`: which HF tensors make each parameter (per-expert tensors <-> grouped layout).
- `reader`: lazy, slice-by-slice reads of safetensors files (single or sharded with an index).
- `writer`: sharded safetensors output with transformers' file names and index.
- `transfer`: loading into a parallelized model's local shards; gathering and writing back.

`MoELanguageModel.from_hf` / ``save_hf`` and ``lightning-moe convert`` are built on these.
"""

from lightning_moe.models.hf.config_mapping import (
    ARCHITECTURES,
    architecture_of,
    choose_architecture,
    model_config_fields,
)
from lightning_moe.models.hf.reader import HFCheckpointError, SafetensorsCheckpoint, read_hf_config
from lightning_moe.models.hf.transfer import load_hf_weights, save_hf_weights
from lightning_moe.models.hf.writer import ShardedSafetensorsWriter

__all__ = [
    "ARCHITECTURES",
    "HFCheckpointError",
    "SafetensorsCheckpoint",
    "ShardedSafetensorsWriter",
    "architecture_of",
    "choose_architecture",
    "load_hf_weights",
    "model_config_fields",
    "read_hf_config",
    "save_hf_weights",
]
