"""The config.json entries every Llama-style family writes the same way from a `ModelConfig`
(attention, widths, rotary base, norm, initialisation); each family adds its own."""

from __future__ import annotations

from typing import Any

from lightning_moe.models.config import ModelConfig


def llama_style_fields(cfg: ModelConfig, architecture: str, model_type: str, rope: dict[str, Any],
                       dtype: Any) -> dict[str, Any]:
    """The shared entries of ``architecture`` / ``model_type``'s config.json; ``rope``: its
    ``rope_parameters``."""
    return dict(
        architectures=[architecture],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_length,
        rope_parameters=rope,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.init_method_std,
        hidden_act="silu",
        attention_dropout=0.0,
        dtype=dtype,
    )
