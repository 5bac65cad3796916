"""Dense HF checkpoints against transformers (CPU, fp32): Llama, Qwen3 (qk-norm), Qwen2 (q/k/v biases).

A tiny random-weight transformers model is saved with ``save_pretrained``; ``from_hf`` must give
its logits as the reference decoder with every block dense, and ``save_hf`` must write the same
family back, tensor for tensor, which transformers loads to the same logits. What the decoder
cannot compute is refused naming the field.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.models import MoELanguageModel  # noqa: E402
from lightning_moe.models.flops import model_flops_per_token, total_parameters  # noqa: E402
from lightning_moe.models.hf import SafetensorsCheckpoint  # noqa: E402
from _hf_checks import assert_reloads_as, assert_same_tensors, relative_error  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # head_dim != hidden / heads, as Qwen3 checkpoints have
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


def hf_model(family, **extra):
    config_name, model_name, kwargs = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **{**kwargs, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def tokens():
    return torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_and_export_match_transformers(family, tmp_path):
    reference = hf_model(family)
    reference.save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    cfg = module.model_config
    assert cfg.moe is None and cfg.num_moe_layers == 0 and cfg.ffn_hidden_size == 48
    assert (cfg.qk_norm, cfg.add_qkv_bias) == {"llama": (False, False), "qwen3": (True, False),
                                               "qwen2": (False, True)}[family]
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        assert relative_error(module(ids), want) < 1e-4

    module.save_hf(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    assert_reloads_as(reference, tmp_path / "out", ids, want)
    assert_same_tensors(tmp_path / "hf", tmp_path / "out")


def test_yarn_and_tied_embeddings(tmp_path):
    """Qwen3's long-context YaRN (rope_parameters) and Qwen3-0.6B's tied embeddings."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8}
    reference = hf_model("qwen3", rope_parameters=yarn, max_position_embeddings=32, tie_word_embeddings=True)
    reference.save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    assert module.model_config.rope_scaling["factor"] == 4.0 and module.model.lm_head is None
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))  # beyond the original 8
    with torch.no_grad():
        want = reference(ids).logits
        assert relative_error(module(ids), want) < 1e-4
    module.save_hf(tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(ids).logits, want) < 1e-4


@pytest.mark.parametrize(
    "family, change, message",
    [
        ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
         "rope_type='llama3'"),
        ("llama", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type='linear'"),
        ("llama", dict(attention_bias=True), "attention_bias"),
        ("llama", dict(mlp_bias=True), "mlp_bias"),
        ("llama", dict(hidden_act="gelu"), "hidden_act"),
        ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        ("qwen2", dict(use_sliding_window=True), "sliding-window"),
        ("qwen2", dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}),
         "partial_rotary_factor"),
    ],
)
def test_what_the_decoder_cannot_compute_is_refused(tmp_path, family, change, message):
    hf_model(family).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        MoELanguageModel.from_hf(tmp_path)


def test_export_chooses_the_dense_family_or_names_what_none_expresses(tmp_path):
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48)
    for fields, family in [({}, "llama"), ({"qk_norm": True}, "qwen3"), ({"add_qkv_bias": True}, "qwen2")]:
        module = MoELanguageModel({**base, **fields})
        module.configure_model()
        module.save_hf(tmp_path / family)
        assert json.loads((tmp_path / family / "config.json").read_text())["model_type"] == family
    module = MoELanguageModel({**base, "qk_norm": True, "add_qkv_bias": True})
    module.configure_model()
    with pytest.raises(ValueError, match="qwen3: add_qkv_bias=True"):
        module.save_hf(tmp_path / "none")
    with pytest.raises(ValueError, match="HF llama cannot express.*qk_norm=True"):
        module.save_hf(tmp_path / "none", architecture="llama")


def test_a_dense_config_counts_its_parameters_and_flops(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    module = MoELanguageModel.from_hf(tmp_path)
    cfg = module.model_config
    assert total_parameters(cfg) == sum(p.numel() for p in module.parameters())
    assert model_flops_per_token(cfg, 12) > 6 * cfg.num_layers * 3 * cfg.hidden_size * cfg.ffn_hidden_size
    assert module.parallel_constraints() == {
        "num_attention_heads": 4, "num_query_groups": 2, "num_moe_layers": 0, "context_parallel_attention": True,
        "num_layers": cfg.num_layers,
    }


@pytest.mark.parametrize("kwargs", [dict(expert_parallel_size=2), dict(expert_tensor_parallel_size=2)])
def test_the_strategy_refuses_expert_parallelism_for_a_dense_model_before_process_groups(tmp_path, kwargs):
    import lightning as L
    import torch.distributed as dist

    from lightning_moe import MegatronMoEStrategy

    hf_model("llama").save_pretrained(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MegatronMoEStrategy(**kwargs), logger=False)
    trainer.strategy._lightning_module = MoELanguageModel.from_hf(tmp_path, materialize=False)
    with pytest.raises(ValueError, match="no MoE block .*set both to 1"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_a_dense_module_fits_with_the_moe_callbacks_and_converts_both_ways(tmp_path):
    """Lightning fit (MoEMonitor, MoEThroughput see no MoE block), then `lightning-moe convert`
    to a distributed checkpoint and back to the same Llama tensors."""
    import lightning as L

    from lightning_moe.callbacks import MoEMonitor, MoEThroughput
    from lightning_moe.models.hf.convert import checkpoint_to_hf, hf_to_checkpoint

    hf_model("llama").save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf", module_kwargs=dict(warmup_steps=1))
    ids = torch.randint(0, 64, (8, 13), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": ids[i : i + 2, :-1], "labels": ids[i : i + 2, 1:]} for i in range(0, 8, 2)]
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[MoEMonitor(log_every_n_steps=1), MoEThroughput()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    assert trainer.global_step == 4 and torch.isfinite(trainer.callback_metrics["train/loss"])

    hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
    checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"
    with SafetensorsCheckpoint(tmp_path / "hf") as original, SafetensorsCheckpoint(tmp_path / "back") as back:
        assert back.names() == original.names()
        for name in original.names():
            box = [slice(0, n) for n in original.shape(name)]
            torch.testing.assert_close(back.read(name, box), original.read(name, box), rtol=0, atol=0)
