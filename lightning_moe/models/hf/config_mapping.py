"""Hugging Face ``config.json`` <-> :class:`~lightning_moe.models.config.ModelConfig`, per architecture.

These MoE decoder families map onto the reference decoder exactly (same logits in fp32), and so do
the dense Llama, Qwen3 and Qwen2 models (`lightning_moe.models.hf.dense_families`):

============  ==========================================================================
model_type    what is particular to it
============  ==========================================================================
qwen3_moe     per-head qk-norm, ``moe_intermediate_size`` experts, dense blocks from
              ``mlp_only_layers`` / ``decoder_sparse_step``
qwen2_moe     q/k/v biases, a shared expert gated by ``sigmoid(x @ w)``, dense blocks as Qwen3
mixtral       experts of width ``intermediate_size``, top-k always renormalised
olmoe         qk-norm over the whole query / key projection, experts of ``intermediate_size``
deepseek_v3   multi-head latent attention, sigmoid group-limited routing with a correction
              bias, shared experts, dense first blocks (`lightning_moe.models.hf.deepseek_v3`)
============  ==========================================================================

Routing: HF takes a softmax over all experts, picks the top k and, with ``norm_topk_prob``
(always for Mixtral), renormalises them, which equals a softmax over the top-k logits
(``router_pre_softmax=False``); without renormalisation the weights are the full softmax's,
Megatron's ``moe_router_pre_softmax=True``. One expert per token with renormalisation (weight 1) is
``router_pre_softmax=True, router_topk_renormalize=True``. A setting the reference decoder cannot
reproduce (sliding windows, rotary scaling, attention dropout, output-projection biases, OLMoE's
``clip_qkv``) is refused with a message naming the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.hf import deepseek_v3, dense_families
from lightning_moe.models.hf.decoder_fields import llama_style_fields

ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    **dense_families.ARCHITECTURES,
}
# Architectures tried, in this order, when a model that did not come from HF is exported (the MoE
# families express no all-dense model, the dense ones no MoE block).
EXPORT_PREFERENCE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "llama", "qwen3", "qwen2")


def architecture_of(hf_config: dict[str, Any]) -> str:
    """The ``model_type`` of an HF config, checked against the supported architectures."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"HF model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)} "
            "(check config.json of the checkpoint)."
        )
    return model_type


def model_config_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments (``moe`` as a dict) equivalent to an HF ``config.json``."""
    arch = architecture_of(hf_config)
    _refuse_unsupported(hf_config, arch)
    if arch == deepseek_v3.MODEL_TYPE:
        return deepseek_v3.model_config_fields(hf_config)
    if arch in dense_families.ARCHITECTURES:
        return dense_families.model_config_fields(hf_config, arch)
    get = hf_config.get
    heads = get("num_attention_heads")
    fields: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=get("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or get("hidden_size") // heads,
        max_seq_length=get("max_position_embeddings"),
        rope_theta=float(_rope_theta(hf_config)),
        norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        init_method_std=float(get("initializer_range", 0.02)),
    )
    num_experts = get("num_experts") or get("num_local_experts")  # transformers 5 writes either
    moe: dict[str, Any] = dict(
        num_experts=num_experts,
        router_topk=get("num_experts_per_tok"),
        router_load_balancing_type="aux_loss",
        aux_loss_coeff=float(get("router_aux_loss_coef", 0.0)),
    )
    renormalized = arch == "mixtral" or bool(get("norm_topk_prob", False))
    if renormalized and get("num_experts_per_tok") == 1:  # one weight renormalised to 1
        moe.update(router_pre_softmax=True, router_topk_renormalize=True)
    else:
        moe["router_pre_softmax"] = not renormalized
    if arch in ("qwen3_moe", "qwen2_moe"):
        moe["ffn_hidden_size"] = get("moe_intermediate_size")
        fields["ffn_hidden_size"] = get("intermediate_size")
        fields["moe_layer_freq"] = qwen_moe_layer_pattern(hf_config)
    else:
        moe["ffn_hidden_size"] = get("intermediate_size")
    if arch == "qwen3_moe":
        fields["qk_norm"] = True
    if arch == "olmoe":
        fields.update(qk_norm=True, qk_norm_scope="projection")
    if arch == "qwen2_moe":
        fields["add_qkv_bias"] = bool(get("qkv_bias", True))
        moe.update(shared_expert_intermediate_size=get("shared_expert_intermediate_size"), shared_expert_gate=True)
    if arch == "mixtral" and get("router_jitter_noise"):
        moe["input_jitter_eps"] = float(get("router_jitter_noise"))
    fields["moe"] = moe
    return fields


def qwen_moe_layer_pattern(hf_config: dict[str, Any]) -> list[int]:
    """Qwen2/3-MoE's MoE blocks: ``i`` not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = hf_config.get("decoder_sparse_step", 1) or 1
    return [int(i not in dense and (i + 1) % step == 0) for i in range(hf_config["num_hidden_layers"])]


def _rope_theta(hf_config: dict[str, Any]) -> float:
    """The rotary base from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` / ``rope_scaling``."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(
            f"rotary scaling {rope_type!r} is not supported by the reference decoder: use a checkpoint "
            "with plain rotary embeddings (rope_type 'default')."
        )
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("the HF config has no rope_theta (neither in rope_parameters nor at the top level).")
    return theta


def _refuse_unsupported(hf_config: dict[str, Any], arch: str) -> None:
    """Raise for any HF setting whose computation the reference decoder does not reproduce."""
    get = hf_config.get
    problems = []
    if get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={get('hidden_act')!r} (only 'silu', SwiGLU experts)")
    if get("use_sliding_window") or (arch == "mixtral" and get("sliding_window") is not None):
        problems.append("sliding-window attention (set use_sliding_window=false / sliding_window=null)")
    if get("attention_dropout", 0.0):
        problems.append(f"attention_dropout={get('attention_dropout')} (set it to 0)")
    if get("attention_bias"):
        problems.append("attention_bias=true (biases on the output projection)")
    if arch == "olmoe" and get("clip_qkv") is not None:
        problems.append(f"clip_qkv={get('clip_qkv')} (set it to null)")
    if arch == "olmoe" and get("head_dim") not in (None, get("hidden_size") // get("num_attention_heads")):
        problems.append("olmoe with head_dim != hidden_size / num_attention_heads")
    if problems:
        raise ValueError(
            f"the {arch} checkpoint uses what the reference decoder cannot compute: {'; '.join(problems)}."
        )


def unexpressible(cfg: ModelConfig, arch: str) -> list[str]:
    """What of ``cfg`` the HF architecture ``arch`` cannot express (empty: it can)."""
    if arch == deepseek_v3.MODEL_TYPE:
        return deepseek_v3.unexpressible(cfg)
    if arch in dense_families.ARCHITECTURES:
        return dense_families.unexpressible(cfg, arch)
    moe = cfg.moe
    problems = []
    if moe is None:
        return ["a dense model (no MoE layer)"]
    if cfg.attention_type != "gqa" or cfg.rope_scaling is not None:
        problems.append(f"attention_type={cfg.attention_type!r} / rope_scaling={cfg.rope_scaling!r}")
    if moe.router_score_function != "softmax":
        problems.append(f"router_score_function={moe.router_score_function!r}")
    for name in ("router_num_groups", "router_topk_scaling_factor", "expert_capacity_factor", "z_loss_coeff"):
        if getattr(moe, name):
            problems.append(f"{name}={getattr(moe, name)!r}")
    if moe.router_enable_expert_bias:
        problems.append("router_enable_expert_bias=True")
    if moe.activation != "swiglu":
        problems.append(f"activation={moe.activation!r}")
    if arch == "mixtral" and moe.router_pre_softmax and not moe.renormalizes_topk:
        problems.append("router_pre_softmax=True (Mixtral always renormalises the top-k)")
    if arch != "mixtral" and moe.input_jitter_eps:
        problems.append(f"input_jitter_eps={moe.input_jitter_eps}")
    if arch in ("mixtral", "olmoe") and not all(cfg.moe_layer_pattern):
        problems.append("dense blocks (every block is MoE)")
    if arch in ("mixtral", "olmoe", "qwen3_moe") and moe.shared_expert_intermediate_size is not None:
        problems.append("shared experts")
    if arch == "qwen2_moe" and (moe.shared_expert_intermediate_size is None or not moe.shared_expert_gate):
        problems.append("no gated shared expert (Qwen2-MoE has one in every MoE block)")
    if arch != "qwen2_moe" and cfg.add_qkv_bias:
        problems.append("add_qkv_bias=True")
    wanted_norm = {"qwen3_moe": (True, "head"), "olmoe": (True, "projection")}.get(arch, (False, None))
    if (cfg.qk_norm, cfg.qk_norm_scope if cfg.qk_norm else None) != wanted_norm:
        problems.append(f"qk_norm={cfg.qk_norm}, qk_norm_scope={cfg.qk_norm_scope!r}")
    if arch == "olmoe" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        problems.append("head_dim * num_attention_heads != hidden_size")
    return problems


def choose_architecture(cfg: ModelConfig, requested: Optional[str] = None) -> str:
    """``requested`` if it can express ``cfg`` (else `ValueError` naming what it cannot), or the
    first architecture of `EXPORT_PREFERENCE` that can."""
    if requested is not None:
        if requested not in ARCHITECTURES:
            raise ValueError(f"architecture {requested!r} is not supported; choose one of {sorted(ARCHITECTURES)}.")
        problems = unexpressible(cfg, requested)
        if problems:
            raise ValueError(f"HF {requested} cannot express this model: {'; '.join(problems)}.")
        return requested
    reasons = {}
    for arch in EXPORT_PREFERENCE:
        reasons[arch] = unexpressible(cfg, arch)
        if not reasons[arch]:
            return arch
    detail = " | ".join(f"{arch}: {', '.join(problems)}" for arch, problems in reasons.items())
    raise ValueError(f"no supported HF architecture expresses this model ({detail}).")


def hf_config_dict(cfg: ModelConfig, arch: str, base: Optional[dict[str, Any]] = None,
                   dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as HF ``arch`` (checked by `choose_architecture`).

    ``base``: the config the model was imported from; its other entries (token ids, generation
    settings, ...) are kept, the ones describing the computation are rewritten from ``cfg``.
    """
    if arch == deepseek_v3.MODEL_TYPE:
        return deepseek_v3.hf_config_dict(cfg, base, dtype)
    if arch in dense_families.ARCHITECTURES:
        return dense_families.hf_config_dict(cfg, arch, base, dtype)
    moe = cfg.moe
    out = dict(base or {})
    out.pop("rope_scaling", None)
    out.update(
        llama_style_fields(cfg, ARCHITECTURES[arch], arch, {"rope_theta": cfg.rope_theta, "rope_type": "default"},
                           dtype),
        num_experts_per_tok=moe.router_topk,
        router_aux_loss_coef=moe.aux_loss_coeffs[0] if moe.active_aux_losses else 0.0,
    )
    if arch == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.ffn_hidden_size,
                   router_jitter_noise=moe.input_jitter_eps or 0.0, sliding_window=None)
        return out
    out.update(num_experts=moe.num_experts, norm_topk_prob=not moe.router_pre_softmax or moe.renormalizes_topk)
    if arch == "olmoe":
        out.update(intermediate_size=moe.ffn_hidden_size, attention_bias=False, clip_qkv=None)
        return out
    pattern = cfg.moe_layer_pattern
    out.update(
        moe_intermediate_size=moe.ffn_hidden_size,
        intermediate_size=cfg.ffn_hidden_size or moe.ffn_hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, is_moe in enumerate(pattern) if not is_moe],
        use_sliding_window=False,
    )
    if arch == "qwen3_moe":
        out["attention_bias"] = False
    else:
        out.update(qkv_bias=cfg.add_qkv_bias, shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
    return out
