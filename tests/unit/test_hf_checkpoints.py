"""HF checkpoint import/export against transformers (CPU, fp32): Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE.

For each architecture a tiny random-weight transformers model is saved with ``save_pretrained``;
``MoELanguageModel.from_hf`` must give its logits, and ``save_hf`` must write a directory that
``AutoModelForCausalLM.from_pretrained`` loads back to the same logits.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.models import MoELanguageModel, get_preset  # noqa: E402
from lightning_moe.models.hf import HFCheckpointError, SafetensorsCheckpoint, load_hf_weights  # noqa: E402
from lightning_moe.models.decoder import MoEDecoder  # noqa: E402
from _hf_checks import assert_reloads_as, assert_same_tensors, relative_error  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2)
ARCHITECTURES = {
    # dense block 1 (mlp_only_layers), renormalised top-k, explicit head_dim != hidden / heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])),
    # shared expert with sigmoid gate, q/k/v biases, no renormalisation, dense block 0
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    # qk-norm over whole projections, no renormalisation
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, norm_topk_prob=False, pad_token_id=0,
                                                       eos_token_id=1)),
}


def hf_model(arch, **extra):
    config_name, model_name, kwargs = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**COMMON, **kwargs, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def save_hf_model(arch, path, **save_kwargs):
    model = hf_model(arch)
    model.save_pretrained(path, **save_kwargs)
    return model


def tokens():
    return torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_import_and_export_match_transformers(arch, tmp_path):
    reference = save_hf_model(arch, tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        assert relative_error(module(ids), want) < 1e-4

    module.save_hf(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == arch
    assert_reloads_as(reference, tmp_path / "out", ids, want)
    assert_same_tensors(tmp_path / "hf", tmp_path / "out")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_top1_renormalised_to_weight_one_matches_transformers(arch, tmp_path):
    # HF renormalises the one chosen softmax weight to 1: pre-softmax with router_topk_renormalize=True.
    extra = {} if arch == "mixtral" else {"norm_topk_prob": True}
    reference = hf_model(arch, num_experts_per_tok=1, **extra)
    reference.save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    moe = module.model_config.moe
    assert moe.router_topk == 1 and moe.router_pre_softmax and moe.router_topk_renormalize
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        assert relative_error(module(ids), want) < 1e-4
    module.save_hf(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["num_experts_per_tok"] == 1 and saved.get("norm_topk_prob", True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, want) < 1e-4


def test_config_mapping_of_routing_and_layers(tmp_path):
    save_hf_model("qwen2_moe", tmp_path / "qwen2")
    cfg = MoELanguageModel.from_hf(tmp_path / "qwen2", materialize=False).model_config
    assert cfg.moe_layer_pattern == [False, True, True]
    assert cfg.moe.router_pre_softmax  # norm_topk_prob=False: the full softmax's top-k weights
    assert cfg.moe.shared_expert_gate and cfg.moe.shared_expert_intermediate_size == 24
    assert cfg.add_qkv_bias and not cfg.qk_norm
    save_hf_model("qwen3_moe", tmp_path / "qwen3")
    cfg = MoELanguageModel.from_hf(tmp_path / "qwen3", materialize=False, max_seq_length=128).model_config
    assert not cfg.moe.router_pre_softmax and cfg.qk_norm and cfg.qk_norm_scope == "head"
    assert cfg.head_dim == 16 and cfg.max_seq_length == 128


def test_sharded_index_and_lazy_build(tmp_path):
    reference = save_hf_model("mixtral", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    module = MoELanguageModel.from_hf(tmp_path / "hf", materialize=False)
    assert module.model is None
    module.configure_model()  # built on a real device: the weights are read right away
    ids = tokens()
    with torch.no_grad():
        assert relative_error(module.eval()(ids), reference(ids).logits) < 1e-4
    module.save_hf(tmp_path / "out", max_shard_size="20KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "out" / f).is_file() for f in files)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, reference(ids).logits) < 1e-4
    module.save_hf(tmp_path / "out")  # one file now: the earlier shards and index are removed
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_bf16_checkpoint_loads_into_fp32_masters(tmp_path):
    hf_model("olmoe").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf")
    assert all(p.dtype == torch.float32 for p in module.parameters())
    with SafetensorsCheckpoint(tmp_path / "hf") as checkpoint:
        name = "model.layers.0.mlp.experts.3.up_proj.weight"
        up_FD = checkpoint.read(name, [slice(0, n) for n in checkpoint.shape(name)])
    assert up_FD.dtype == torch.bfloat16
    torch.testing.assert_close(module.model.layers["0"].mlp.experts.fc1_weight[3, :, 1, :], up_FD.float().T)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (dict(use_sliding_window=True), "sliding-window"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rotary scaling 'yarn'"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, change, message):
    save_hf_model("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        MoELanguageModel.from_hf(tmp_path)


def test_mismatched_checkpoint_fails_before_reading(tmp_path):
    save_hf_model("qwen3_moe", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    module = MoELanguageModel.from_hf(tmp_path, materialize=False)
    wrong = MoEDecoder(module.model_config.__class__(**{**module.model_config.to_dict(), "qk_norm": False}))
    with pytest.raises(HFCheckpointError, match="would ignore.*q_norm"):
        load_hf_weights(wrong, tmp_path, "qwen3_moe")
    config["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="lacks .* tensor"):
        MoELanguageModel.from_hf(tmp_path)


def test_export_refuses_what_an_architecture_cannot_express(tmp_path):
    module = MoELanguageModel(get_preset("tiny", num_layers=1))  # z-loss: no HF family has it
    module.configure_model()
    with pytest.raises(ValueError, match="no supported HF architecture.*z_loss_coeff"):
        module.save_hf(tmp_path)
    save_hf_model("qwen3_moe", tmp_path / "hf")
    with pytest.raises(ValueError, match="HF mixtral cannot express.*qk_norm"):
        MoELanguageModel.from_hf(tmp_path / "hf").save_hf(tmp_path / "out", architecture="mixtral")


def test_export_of_a_model_not_from_hf(tmp_path):
    cfg = get_preset("tiny", num_layers=2, qk_norm=True, moe={"z_loss_coeff": None})
    module = MoELanguageModel(cfg)
    module.configure_model()
    module.save_hf(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, module.eval()(ids)) < 1e-4


def test_tied_embeddings(tmp_path):
    reference = hf_model("qwen3_moe", tie_word_embeddings=True)
    reference.save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    assert module.model_config.tie_word_embeddings and module.model.lm_head is None
    ids = tokens()
    with torch.no_grad():
        assert relative_error(module(ids), reference(ids).logits) < 1e-4
    module.save_hf(tmp_path / "out")
    with SafetensorsCheckpoint(tmp_path / "out") as exported:
        assert "lm_head.weight" not in exported.names()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, reference(ids).logits) < 1e-4


def test_shard_sizes_as_transformers_writes_them():
    from lightning_moe.models.hf.writer import shard_size_bytes

    assert shard_size_bytes("5GB") == 5 * 10**9 and shard_size_bytes("2GiB") == 2 * 2**30
    assert shard_size_bytes(" 500mb ") == 500 * 10**6 and shard_size_bytes(1234) == 1234
    with pytest.raises(ValueError, match="like '5GB'"):
        shard_size_bytes("five gigabytes")
