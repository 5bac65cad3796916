"""Dense Llama-family checkpoints (HF ``model_type`` "llama", "qwen3", "qwen2") <-> `ModelConfig`.

All three are the reference decoder with every block dense (``moe=None``: ``ffn_hidden_size`` is
the SwiGLU MLP's ``intermediate_size``); they differ in their attention:

==========  =================================================================================
llama       plain grouped-query attention, no biases
qwen3       per-head RMSNorm of queries and keys (``qk_norm``, scope "head")
qwen2       biases on the query, key and value projections (``add_qkv_bias``), none on ``o_proj``
==========  =================================================================================

Rotary embeddings: plain, or YaRN (``rope_parameters`` / ``rope_scaling`` with ``rope_type``
"yarn", as Qwen's long-context configs set it; transformers' and the decoder's YaRN agree).
Refused with the field named: other rotary scalings (Llama 3's "llama3", "linear", "dynamic",
...), ``partial_rotary_factor`` != 1, sliding-window layers (``use_sliding_window``,
``layer_types``), ``mlp_bias``, and (in `config_mapping`) ``attention_bias`` (it puts a bias on
``o_proj`` too), other activations and attention dropout. Upcycled, a qwen3 model exports as
Qwen3-MoE and a llama model as Mixtral (`config_mapping.choose_architecture`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.hf.decoder_fields import llama_style_fields

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# (qk_norm, add_qkv_bias) of each family's attention
_ATTENTION = {"llama": (False, False), "qwen3": (True, False), "qwen2": (False, True)}


def model_config_fields(hf_config: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a dense ``arch`` ``config.json`` (every block dense)."""
    get = hf_config.get
    problems = []
    if get("mlp_bias"):
        problems.append("mlp_bias=true (biases on the MLP projections; set it false)")
    sliding = [i for i, kind in enumerate(get("layer_types") or []) if kind != "full_attention"]
    if sliding:
        problems.append(f"layer_types: layers {sliding[:4]} are not 'full_attention' (sliding-window attention)")
    if problems:
        raise ValueError(f"the {arch} checkpoint uses what the reference decoder cannot compute: {'; '.join(problems)}.")
    theta, rope_scaling = _rope(hf_config, arch)
    heads = get("num_attention_heads")
    qk_norm, qkv_bias = _ATTENTION[arch]
    return dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads,
        ffn_hidden_size=get("intermediate_size"),
        moe=None,
        max_seq_length=get("max_position_embeddings"),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        init_method_std=float(get("initializer_range", 0.02)),
        qk_norm=qk_norm,
        add_qkv_bias=qkv_bias,
    )


def _rope(hf_config: dict[str, Any], arch: str) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` /
    ``rope_scaling``: plain rotary embeddings, or YaRN's parameters for ``ModelConfig.rope_scaling``."""
    # transformers 5 reads an old ``rope_scaling`` (its type spelled "type") over ``rope_parameters``
    scaling = dict(hf_config.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    params = {**(hf_config.get("rope_parameters") or {}), **scaling}
    theta = params.pop("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("the HF config has no rope_theta (neither in rope_parameters nor at the top level).")
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{arch}: partial_rotary_factor != 1 is not supported (the decoder rotates whole heads).")
    rope_type = params.get("rope_type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(
            f"{arch}: rotary scaling rope_type={rope_type!r} (rope_parameters / rope_scaling) is not supported by "
            "the reference decoder: only 'yarn' or plain rotary embeddings ('default')."
        )
    params.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings"))
    return theta, params  # ModelConfig validates the keys


def unexpressible(cfg: ModelConfig, arch: str) -> list[str]:
    """What of ``cfg`` the dense HF family ``arch`` cannot express (empty: it can)."""
    problems = []
    if cfg.num_moe_layers:
        problems.append(f"{cfg.num_moe_layers} MoE block(s) ({arch} has dense blocks only)")
    if cfg.attention_type != "gqa":
        problems.append(f"attention_type={cfg.attention_type!r}")
    qk_norm, qkv_bias = _ATTENTION[arch]
    if (cfg.qk_norm, cfg.qk_norm_scope if cfg.qk_norm else None) != (qk_norm, "head" if qk_norm else None):
        problems.append(f"qk_norm={cfg.qk_norm}, qk_norm_scope={cfg.qk_norm_scope!r}")
    if cfg.add_qkv_bias != qkv_bias:
        problems.append(f"add_qkv_bias={cfg.add_qkv_bias}")
    return problems


def hf_config_dict(cfg: ModelConfig, arch: str, base: Optional[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as the dense family ``arch`` (checked by `unexpressible`);
    ``base``'s other entries (token ids, ...) are kept."""
    out = dict(base or {})
    out.pop("rope_scaling", None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update({k: v for k, v in cfg.rope_scaling.items() if v is not None and (k, v) != ("truncate", True)})
    out.update(llama_style_fields(cfg, ARCHITECTURES[arch], arch, rope, dtype), intermediate_size=cfg.ffn_hidden_size)
    if arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.num_layers)
    if arch == "qwen3":
        out["attention_bias"] = False
    return out
