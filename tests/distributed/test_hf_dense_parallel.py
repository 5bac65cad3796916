"""Dense HF checkpoints (Llama, Qwen3, Qwen2) under MegatronMoEStrategy on 2 gloo ranks: with TP=2
(attention heads, MLP columns and vocabulary split) or FSDP over DP=2, each rank reads only the
blocks it holds, the model's logits equal transformers', and ``save_hf`` from the sharded model
writes the same family back; an upcycled Qwen3 under EP=2 still gives the dense logits.

Import, check and export run through ``test_hf_checkpoints_parallel._import_check_export``
(``from_hf(materialize=False)``, read after the strategy sharded and materialized the decoder).
"""

import json

import pytest
import torch
from _launch import run_distributed
from test_hf_checkpoints_parallel import IDS, _import_check_export, _validate, relative_error

transformers = pytest.importorskip("transformers")

WORLD = 2
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def save_dense(family, path):
    config_name, model_name = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms at 1, biases at 0: make them matter
                param.add_(0.1 * torch.randn_like(param))
        logits = model(IDS).logits
    model.save_pretrained(path)
    return logits


@pytest.mark.parametrize(
    "family, strategy_kwargs",
    [("llama", dict(tensor_parallel_size=2)), ("qwen3", dict(tensor_parallel_size=2)),
     ("qwen2", dict(tensor_parallel_size=2)), ("qwen3", {})],  # {}: FSDP over DP=2
)
def test_parallel_import_and_export_match_transformers(tmp_path, family, strategy_kwargs):
    want = save_dense(family, tmp_path / "hf")
    reports = run_distributed(_import_check_export, WORLD, str(tmp_path / "hf"), str(tmp_path / "out"),
                              strategy_kwargs, want, timeout=120)
    for report in reports:
        assert report["error"] < 1e-4 and report["error_reloaded"] < 1e-4, report
        assert any("attention.q_proj" in n for n in report["sharded"]), report
        assert report["bytes_read"] == report["local_bytes"] < 0.7 * report["checkpoint_bytes"], report
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(IDS).logits, want) < 1e-4


def _upcycled_under_ep2(rank, world_size, hf_dir, want):
    from lightning_moe.models import MoELanguageModel, upcycle

    module = upcycle(MoELanguageModel.from_hf(hf_dir), num_experts=4, router_topk=2, granularity=2)
    report = {}

    @torch.no_grad()
    def check(module):
        report["error"] = relative_error(module(IDS), want)

    _validate(module, dict(expert_parallel_size=2), world_size, check)
    return report


def test_upcycled_hf_model_under_expert_parallelism_gives_the_dense_logits(tmp_path):
    want = save_dense("qwen3", tmp_path / "hf")
    for report in run_distributed(_upcycled_under_ep2, WORLD, str(tmp_path / "hf"), want, timeout=120):
        assert report["error"] < 1e-4, report
