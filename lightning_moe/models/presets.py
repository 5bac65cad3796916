"""Named model shapes: two to train (``tiny``, ``small``) and three published MoE shapes.

``get_preset(name, **overrides)`` returns a validated :class:`ModelConfig`. Overrides are
``ModelConfig`` fields (``num_layers=4`` for a shallow slice of a large model); ``moe`` may be a
partial dict of :class:`~lightning_moe.nn.config.MoEConfig` fields merged into the preset's,
a full ``MoEConfig``, or None (dense). Changing ``hidden_size`` or ``init_method_std`` carries
over to the MoE layer unless the ``moe`` override sets them.

Parameter counts (``total_parameters`` / ``active_parameters``, embeddings and output included):

============== ======== ========= =========================================================
preset         total    active    notes
============== ======== ========= =========================================================
tiny           1.84 M   0.66 M    byte vocabulary; trains on 2 CPU cores in minutes
small          238 M    111 M     one GPU
qwen3_30b_a3b  30.53 B  3.35 B    published: 30.5 B total, 3.3 B active
mixtral_8x7b   46.70 B  12.88 B   published: 46.7 B total, 12.9 B active
deepseek_v3    671.03 B 37.55 B   published: 671 B total, 37 B active (MTP module excluded)
============== ======== ========= =========================================================
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from lightning_moe.models.config import ModelConfig
from lightning_moe.nn.config import check_field_names


def _tiny() -> dict[str, Any]:
    """Byte-level (V=256) model for CPU tests and examples: D=128, 4 blocks, 8 experts top-2."""
    return dict(
        vocab_size=256,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=512,
        moe=dict(
            ffn_hidden_size=128,
            num_experts=8,
            router_topk=2,
            router_load_balancing_type="aux_loss",
            aux_loss_coeff=1e-2,
            z_loss_coeff=1e-3,
        ),
        max_seq_length=256,
        rope_theta=10000.0,
        norm_eps=1e-6,
    )


def _small() -> dict[str, Any]:
    """~238 M total / ~111 M active: one GPU, fine-grained experts (16 experts top-4)."""
    return dict(
        vocab_size=32000,
        hidden_size=768,
        num_layers=12,
        num_attention_heads=12,
        num_query_groups=4,
        ffn_hidden_size=3072,
        moe=dict(
            ffn_hidden_size=384,
            num_experts=16,
            router_topk=4,
            router_load_balancing_type="aux_loss",
            aux_loss_coeff=1e-2,
            z_loss_coeff=1e-3,
        ),
        max_seq_length=2048,
        rope_theta=10000.0,
        norm_eps=1e-6,
    )


def _qwen3_30b_a3b() -> dict[str, Any]:
    """Qwen3-30B-A3B: 48 blocks, GQA 32/4 with head_dim 128 and qk-norm, 128 experts top-8.

    Softmax over the top-8 logits equals Qwen's softmax-then-renormalise (``norm_topk_prob``).
    ``ffn_hidden_size`` is Qwen's dense ``intermediate_size`` (unused: every block is MoE).
    """
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        moe=dict(
            ffn_hidden_size=768,
            num_experts=128,
            router_topk=8,
            router_load_balancing_type="aux_loss",
            aux_loss_coeff=1e-3,
        ),
        max_seq_length=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
    )


def _mixtral_8x7b() -> dict[str, Any]:
    """Mixtral-8x7B: 32 blocks, GQA 32/8, 8 experts top-2 of width 14336."""
    return dict(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        moe=dict(
            ffn_hidden_size=14336,
            num_experts=8,
            router_topk=2,
            router_load_balancing_type="aux_loss",
            aux_loss_coeff=1e-2,
        ),
        max_seq_length=4096,
        rope_theta=1_000_000.0,
        norm_eps=1e-5,
    )


def _deepseek_v3() -> dict[str, Any]:
    """DeepSeek-V3: 61 blocks (first 3 dense, ffn 18432), 256 routed experts top-8 + 1 shared.

    Multi-head latent attention with the published dims: 128 heads, query rank 1536, key/value
    latent 512, query/key width 128 + 64 rotary, value width 128 (~187 M parameters per block).
    Routing as published: sigmoid scores, aux-loss-free expert bias (HF's
    ``e_score_correction_bias``), 8 groups of which the best 4 are kept (a group scores the sum of
    its best two biased scores), top-8 renormalised and scaled by 2.5, a small sequence-level aux
    loss (1e-4). The counts exclude the multi-token-prediction module (the 685 B of the released
    checkpoint include its 14 B). Without ``rope_scaling``: DeepSeek-V3 pretrained at 4K with plain
    RoPE; its released checkpoint adds YaRN (factor 40) for 128K contexts, which ``rope_scaling``
    takes.
    """
    return dict(
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        attention_type="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        ffn_hidden_size=18432,
        first_k_dense_layers=3,
        moe=dict(
            ffn_hidden_size=2048,
            num_experts=256,
            router_topk=8,
            router_score_function="sigmoid",
            router_enable_expert_bias=True,
            router_bias_update_rate=1e-3,
            router_num_groups=8,
            router_group_topk=4,
            router_group_score_topk=2,
            router_topk_scaling_factor=2.5,
            router_load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-4,
            shared_expert_intermediate_size=2048,
        ),
        max_seq_length=4096,
        rope_theta=10000.0,
        norm_eps=1e-6,
    )


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "tiny": _tiny,
    "small": _small,
    "qwen3_30b_a3b": _qwen3_30b_a3b,
    "mixtral_8x7b": _mixtral_8x7b,
    "deepseek_v3": _deepseek_v3,
}


def list_presets() -> list[str]:
    """Names accepted by :func:`get_preset`."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset ``name`` with ``overrides`` applied, validated.

    Example: ``get_preset("qwen3_30b_a3b", num_layers=2)`` (a two-block slice for a benchmark),
    ``get_preset("tiny", moe={"num_experts": 4, "router_topk": 1, "router_pre_softmax": True})``.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {list_presets()}.")
    return ModelConfig(**apply_overrides(PRESETS[name](), overrides))


def apply_overrides(fields: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (ModelConfig keyword arguments) updated by ``overrides``; a dict ``moe`` override
    is merged into a dict ``moe`` field, any other ``moe`` value (MoEConfig, None) replaces it."""
    check_field_names("ModelConfig", overrides, ModelConfig.__dataclass_fields__)
    merged = copy.deepcopy(fields)
    for key, value in copy.deepcopy(overrides).items():
        if key == "moe" and isinstance(value, dict) and isinstance(merged.get("moe"), dict):
            merged["moe"] = {**merged["moe"], **value}
        else:
            merged[key] = value
    return merged
