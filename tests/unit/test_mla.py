"""Multi-head latent attention: against a naive reference written from DeepSeek-V3's equations,
against transformers' DeepseekV3Attention, YaRN rope scaling, config checks and the preset."""

import math

import pytest
import torch

from lightning_moe.models import MoEDecoder, ModelConfig, get_preset, model_flops_per_token, total_parameters
from lightning_moe.models.layers import apply_rotary, rotary_cos_sin
from lightning_moe.models.mla import MultiHeadLatentAttention, deinterleave_rope_rows
from lightning_moe.models.rope_scaling import normalize_rope_scaling, rope_attention_factor, rope_inv_freq

HEADS, NOPE, ROPE, V, KV_RANK, Q_RANK, HIDDEN = 4, 8, 8, 12, 16, 24, 64
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(q_lora_rank=Q_RANK, rope_scaling=None, **overrides):
    fields = dict(
        vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS, ffn_hidden_size=96,
        attention_type="mla", q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V, rope_scaling=rope_scaling,
    )
    return ModelConfig(**{**fields, **overrides})


def _randomize(module):
    # Norm weights away from 1 so a skipped norm would show.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.15) + (1.0 if param.dim() == 1 else 0))
    return module


def _interleaved_rope(x_SR, positions, theta, inv_freq=None):
    """DeepSeek's reference RoPE: consecutive pairs (2i, 2i+1) as complex numbers times e^{i p f_i}."""
    seq, dim = x_SR.shape
    if inv_freq is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    pairs = torch.view_as_complex(x_SR.double().reshape(seq, dim // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).reshape(seq, dim)


def _naive_mla(weights, x_SD, theta, softmax_scale, inv_freq=None):
    """One sequence, float64, head by head, from the equations; rotary rows in DeepSeek's interleaved layout."""
    seq = x_SD.shape[0]
    x = x_SD.double()
    w = {k: v.double() for k, v in weights.items()}

    def rms(t, weight, eps=1e-6):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight

    if "q_a_proj" in w:
        q = rms(x @ w["q_a_proj"].T, w["q_a_layernorm"]) @ w["q_b_proj"].T
    else:
        q = x @ w["q_proj"].T
    q = q.view(seq, HEADS, NOPE + ROPE)
    latent = x @ w["kv_a_proj_with_mqa"].T
    c_kv, k_rope = latent[:, :KV_RANK], latent[:, KV_RANK:]
    kv = (rms(c_kv, w["kv_a_layernorm"]) @ w["kv_b_proj"].T).view(seq, HEADS, NOPE + V)
    positions = torch.arange(seq)
    k_rope = _interleaved_rope(k_rope, positions, theta, inv_freq)  # [S, ROPE], one key for all heads
    out = torch.zeros(seq, HEADS, V, dtype=torch.float64)
    for h in range(HEADS):
        q_h = torch.cat([q[:, h, :NOPE], _interleaved_rope(q[:, h, NOPE:], positions, theta, inv_freq)], dim=-1)
        k_h = torch.cat([kv[:, h, :NOPE], k_rope], dim=-1)
        scores = q_h @ k_h.T * softmax_scale
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ kv[:, h, NOPE:]
    return out.reshape(seq, HEADS * V) @ w["o_proj"].T


def _to_ours(weights, attention):
    """Load DeepSeek-layout weights (interleaved rotary rows) into our module."""
    state = {f"{k}.weight": v.clone() for k, v in weights.items()}
    q_up = "q_b_proj" if "q_b_proj" in weights else "q_proj"
    state[f"{q_up}.weight"] = deinterleave_rope_rows(weights[q_up], NOPE + ROPE, NOPE, ROPE)
    state["kv_a_proj_with_mqa.weight"] = deinterleave_rope_rows(weights["kv_a_proj_with_mqa"], KV_RANK + ROPE, KV_RANK, ROPE)
    attention.load_state_dict(state)


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None])
def test_mla_matches_naive_reference(q_lora_rank):
    cfg = _config(q_lora_rank)
    ours = MultiHeadLatentAttention(cfg)
    weights = {name.removesuffix(".weight"): p.detach().clone() for name, p in _randomize(ours).named_parameters()}
    _to_ours(weights, ours)
    x = torch.randn(2, 10, HIDDEN, generator=torch.Generator().manual_seed(3))
    cos, sin = rotary_cos_sin(torch.arange(10), ROPE, cfg.rope_theta)
    out = ours(x, cos, sin)
    expected = torch.stack([_naive_mla(weights, x[b], cfg.rope_theta, (NOPE + ROPE) ** -0.5) for b in range(2)])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_mla_with_yarn_matches_naive_reference():
    cfg = _config(rope_scaling=dict(YARN, original_max_position_embeddings=16))
    ours = _randomize(MultiHeadLatentAttention(cfg))
    weights = {name.removesuffix(".weight"): p.detach().clone() for name, p in ours.named_parameters()}
    _to_ours(weights, ours)
    x = torch.randn(1, 12, HIDDEN, generator=torch.Generator().manual_seed(4))
    cos, sin = rotary_cos_sin(torch.arange(12), ROPE, cfg.rope_theta, cfg.rope_scaling)
    mscale = 0.1 * math.log(40.0) + 1.0  # mscale_all_dim = 1
    inv_freq = rope_inv_freq(ROPE, cfg.rope_theta, cfg.rope_scaling)
    expected = _naive_mla(weights, x[0], cfg.rope_theta, (NOPE + ROPE) ** -0.5 * mscale**2, inv_freq)
    torch.testing.assert_close(ours(x, cos, sin)[0].double(), expected, rtol=1e-5, atol=1e-5)


def _hf_attention(rope_interleave, q_lora_rank, rope_parameters):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=rope_interleave,
        rope_parameters=rope_parameters, max_position_embeddings=163840,
    )
    config._attn_implementation = "eager"
    return DeepseekV3Attention(config, layer_idx=0), DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize(
    "rope_interleave, q_lora_rank, yarn",
    [(False, Q_RANK, False), (True, Q_RANK, False), (True, None, False), (True, Q_RANK, True)],
)
def test_mla_matches_transformers_deepseek_v3_attention(rope_interleave, q_lora_rank, yarn):
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        yarn_parameters = {k: v for k, v in YARN.items() if k != "type"}
        rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn_parameters}
    hf, hf_rotary = _hf_attention(rope_interleave, q_lora_rank, rope_parameters)
    _randomize(hf)
    cfg = _config(q_lora_rank, rope_scaling=YARN if yarn else None)
    ours = MultiHeadLatentAttention(cfg)
    weights = {name.removesuffix(".weight"): p.detach().clone() for name, p in hf.named_parameters()}
    if rope_interleave:
        _to_ours(weights, ours)
    else:
        ours.load_state_dict({f"{k}.weight": v for k, v in weights.items()})
    batch, seq = 2, 40  # longer than YaRN's ramp makes a difference over
    x = torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(seq).expand(batch, seq)
    mask = torch.full((seq, seq), float("-inf")).triu(1).expand(batch, 1, seq, seq)
    expected, _ = hf(x, hf_rotary(x, positions), mask)
    cos, sin = rotary_cos_sin(torch.arange(seq), ROPE, cfg.rope_theta, cfg.rope_scaling)
    assert ours.softmax_scale == pytest.approx(hf.scaling, rel=1e-12)
    out = ours(x, cos, sin)
    assert (out - expected).norm() / expected.norm() < 1e-4
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mscales", [(1.0, 1.0), (None, None), (0.707, 1.0)])
def test_yarn_frequencies_and_factor_match_transformers(mscales):
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    mscale, mscale_all_dim = mscales
    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters={"rope_theta": 10000.0, **scaling},
                              max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = normalize_rope_scaling(scaling)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, ours), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_mla_decoder_gradients_are_finite_and_reach_every_parameter():
    cfg = _config(moe={"ffn_hidden_size": 32, "num_experts": 4, "router_topk": 2}, first_k_dense_layers=1)
    model = MoEDecoder(cfg)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model.loss(input_ids, torch.roll(input_ids, -1, dims=1)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    assert sum(p.numel() for p in model.parameters()) == total_parameters(cfg)


def test_mla_meta_construction_and_init_weights_match():
    cfg = _config()
    eager = MoEDecoder(cfg)
    torch.manual_seed(7)
    eager.init_weights()
    with torch.device("meta"):
        meta = MoEDecoder(cfg)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_deepseek_v3_preset_is_mla_with_published_dims_and_counts():
    cfg = get_preset("deepseek_v3")
    assert (cfg.attention_type, cfg.q_lora_rank, cfg.kv_lora_rank) == ("mla", 1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.head_dim, cfg.num_query_groups) == (192, 128)
    moe = cfg.moe
    assert (moe.router_score_function, moe.router_enable_expert_bias, moe.router_topk_scaling_factor) == (
        "sigmoid", True, 2.5)
    assert (moe.router_num_groups, moe.router_group_topk, moe.shared_expert_intermediate_size) == (8, 4, 2048)
    with torch.device("meta"):
        model = MoEDecoder(get_preset("deepseek_v3", num_layers=4))
    attention = model.layers["3"].attention
    assert isinstance(attention, MultiHeadLatentAttention)
    shapes = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    assert shapes == {
        "q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (128 * 192, 1536),
        "kv_a_proj_with_mqa.weight": (576, 7168), "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (128 * 256, 512), "o_proj.weight": (7168, 128 * 128),
    }
    assert sum(p.numel() for p in attention.parameters()) == 187_107_328
    assert sum(p.numel() for p in model.parameters()) == total_parameters(get_preset("deepseek_v3", num_layers=4))


def test_mla_attention_flops():
    cfg = _config()
    gqa = ModelConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=2, num_attention_heads=HEADS, ffn_hidden_size=96)
    seq = 32
    matmul = model_flops_per_token(cfg, 1) - 6 * HEADS * (NOPE + ROPE + V) * 2  # S = 1 leaves the weights
    assert model_flops_per_token(cfg, seq) - matmul == pytest.approx(6 * 2 * seq * HEADS * (NOPE + ROPE + V))
    assert model_flops_per_token(gqa, seq) - model_flops_per_token(gqa, 1) == pytest.approx(
        12 * 2 * (seq - 1) * HEADS * gqa.head_dim)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attention_type="mha"), "attention_type='mha' is not one of"),
        (dict(attention_type="gqa"), "set attention_type='mla' or leave them None"),
        (dict(kv_lora_rank=None), "needs kv_lora_rank: set it"),
        (dict(num_query_groups=2), "leave num_query_groups None"),
        (dict(head_dim=64), "leave head_dim None"),
        (dict(qk_norm=True), "set qk_norm=False"),
        (dict(add_qkv_bias=True), "set add_qkv_bias=False"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7 must be even"),
        (dict(q_lora_rank=0), "q_lora_rank must be a positive int"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "only 'yarn'"),
        (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
        (dict(rope_scaling={**YARN, "low_freq_factor": 1.0}), "unknown ModelConfig.rope_scaling key"),
    ],
)
def test_mla_config_refusals_name_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_mla_config_round_trips_through_to_dict():
    cfg = _config(rope_scaling=YARN)
    again = ModelConfig(**cfg.to_dict())
    assert again == cfg and again.rope_scaling["rope_type"] == "yarn"
    assert (again.head_dim, again.num_query_groups, again.rotary_dim) == (NOPE + ROPE, HEADS, ROPE)


def test_deinterleave_rope_rows_matches_interleaved_rotation():
    # Rotating interleaved pairs equals rotating the de-interleaved rows in rotate-half form.
    weight = torch.randn(2 * (NOPE + ROPE), 5, dtype=torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64)
    positions = torch.arange(3)
    cos, sin = rotary_cos_sin(positions, ROPE, 10000.0)
    for head in range(2):
        rows = slice(head * (NOPE + ROPE) + NOPE, (head + 1) * (NOPE + ROPE))
        interleaved = _interleaved_rope(x @ weight[rows].T, positions, 10000.0)
        ours = apply_rotary((x @ deinterleave_rope_rows(weight, NOPE + ROPE, NOPE, ROPE)[rows].T)[:, None], cos, sin)
        torch.testing.assert_close(
            ours[:, 0], torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=-1), rtol=1e-6, atol=1e-6
        )
