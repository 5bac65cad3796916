"""DeepSeek-V3 checkpoints against transformers (CPU, fp32): a tiny random DeepseekV3ForCausalLM
(MLA with and without the query compression, interleaved rotary rows, YaRN, dense first block,
shared experts, group-limited sigmoid routing with a non-zero correction bias, top-k weights
renormalised or not, one expert per token) saved with
``save_pretrained``; ``MoELanguageModel.from_hf`` must give its logits, ``save_hf`` a directory
that transformers loads back to the same logits, with every tensor unchanged."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.models import MoELanguageModel, get_preset  # noqa: E402
from lightning_moe.models.hf import SafetensorsCheckpoint, choose_architecture  # noqa: E402
from lightning_moe.models.mla import MultiHeadLatentAttention  # noqa: E402
from _hf_checks import assert_reloads_as, assert_same_tensors, relative_error  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_model(**extra):
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    )
    config = transformers.DeepseekV3Config(**{**fields, **extra})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms start at 1: make them matter
                param.add_(0.1 * torch.randn_like(param))
            if "experts" in name or name.endswith("gate.weight"):  # HF leaves these uninitialised or zero
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change the chosen experts
                buffer.copy_(0.5 * torch.randn_like(buffer))
    return model


def tokens():
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "extra",
    [{}, {"q_lora_rank": None}, {"rope_parameters": YARN}, {"norm_topk_prob": False}, {"num_experts_per_tok": 1}],
    ids=["q_lora", "q_proj", "yarn", "sigmoid_not_renormalized", "top1_renormalized_to_one"],
)
def test_import_and_export_match_transformers(extra, tmp_path):
    reference = hf_model(**extra)
    reference.save_pretrained(tmp_path / "hf")
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    cfg = module.model_config
    assert isinstance(module.model.layers["0"].attention, MultiHeadLatentAttention)
    assert cfg.moe_layer_pattern == [False, True, True] and cfg.moe.router_group_score_topk == 2
    assert (cfg.rope_scaling is not None) == ("rope_parameters" in extra)
    assert cfg.moe.router_topk_renormalize == extra.get("norm_topk_prob", True)
    bias = module.model.layers["1"].mlp.router.expert_bias
    torch.testing.assert_close(bias, reference.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = tokens()
    with torch.no_grad():
        want = reference(ids).logits
        assert relative_error(module(ids), want) < 1e-4

    module.save_hf(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3" and saved["rope_interleave"]
    assert saved["norm_topk_prob"] == extra.get("norm_topk_prob", True)
    assert_reloads_as(reference, tmp_path / "out", ids, want)
    assert_same_tensors(tmp_path / "hf", tmp_path / "out")


def test_multi_token_prediction_tensors_are_skipped(tmp_path):
    # The released checkpoint stores its MTP module as layer num_hidden_layers; transformers skips it too.
    from safetensors.torch import load_file, save_file

    reference = hf_model()
    reference.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(24, 32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    module = MoELanguageModel.from_hf(tmp_path / "hf").eval()
    ids = tokens()
    with torch.no_grad():
        assert relative_error(module(ids), reference(ids).logits) < 1e-4


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(rope_interleave=False), "rope_interleave=false"),
    ],
)
def test_refusals_name_the_field(extra, message, tmp_path):
    hf_model(**extra).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=message):
        MoELanguageModel.from_hf(tmp_path / "hf", materialize=False)


def test_preset_exports_as_deepseek_v3_only():
    cfg = get_preset("deepseek_v3", num_layers=4)
    assert choose_architecture(cfg) == "deepseek_v3"
    with pytest.raises(ValueError, match="attention_type='mla'"):
        choose_architecture(cfg, "qwen3_moe")
    with pytest.raises(ValueError, match="multi-head latent attention"):
        choose_architecture(get_preset("tiny", moe={"router_score_function": "sigmoid",
                                                    "router_enable_expert_bias": True}), "deepseek_v3")


def test_interleaved_rope_reads_any_row_block_and_writes_back(tmp_path):
    # FSDP may cut a weight inside a head: every block of rows must come out de-interleaved.
    from safetensors.torch import save_file

    from lightning_moe.models.hf.rope_layout import InterleavedRope
    from lightning_moe.models.mla import deinterleave_rope_rows

    hf_weight = torch.randn(3 * 20, 5)
    save_file({"w": hf_weight}, tmp_path / "model.safetensors")
    source = InterleavedRope("w", head_width=20, rope_offset=12, rope_dim=8)
    ours = deinterleave_rope_rows(hf_weight, 20, 12, 8)
    with SafetensorsCheckpoint(tmp_path) as checkpoint:
        for lo, hi in [(0, 60), (7, 33), (15, 16), (40, 60), (21, 39)]:
            out = torch.empty(hi - lo, 3)
            source.read_into(checkpoint, (slice(lo, hi), slice(1, 4)), out)
            torch.testing.assert_close(out, ours[lo:hi, 1:4], rtol=0, atol=0)
    [(name, back)] = list(source.to_hf(ours))
    assert name == "w" and torch.equal(back, hf_weight)
