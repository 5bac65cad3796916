"""DeepSeek-V3 (HF ``model_type`` "deepseek_v3") ``config.json`` <-> `ModelConfig`.

What maps where:

- attention: multi-head latent attention (``q_lora_rank`` may be null: one ``q_proj``), the
  ``kv_lora_rank`` / ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim`` of the config;
  rotary scaling from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older configs):
  none or YaRN (the released checkpoint's, factor 40, ``ModelConfig.rope_scaling``). The rotary
  rows of the checkpoint are interleaved (``rope_interleave``, always true in DeepSeek's
  checkpoints); the tensor mapping permutes them into this package's rotate-half layout and back.
- blocks: ``first_k_dense_replace`` dense blocks of width ``intermediate_size``, then MoE blocks.
- MoE: ``n_routed_experts`` experts of width ``moe_intermediate_size``; ``n_shared_experts``
  shared experts as one ungated shared MLP of ``n_shared_experts * moe_intermediate_size``;
  router: sigmoid scores, ``e_score_correction_bias`` (the expert bias, used for selection only),
  ``n_group`` groups scored by their best two biased scores (``router_group_score_topk=2``) of which
  ``topk_group`` are kept, top-k renormalised or not as ``norm_topk_prob`` says
  (``router_topk_renormalize``, also for one expert per token, whose weight HF renormalises to 1)
  and times ``routed_scaling_factor``.
- the multi-token-prediction module (``num_nextn_predict_layers``; the released checkpoint's layer
  61) is not part of this decoder: its tensors are skipped on import and none are written.

Refused with the field named: ``rope_interleave=false``, other rotary scalings.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_moe.models.config import ModelConfig

MODEL_TYPE = "deepseek_v3"
# Every group scores the sum of its best two (biased) expert scores in DeepSeek-V3's code.
GROUP_SCORE_TOPK = 2


def model_config_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments (``moe`` as a dict) of a DeepSeek-V3 ``config.json``."""
    get = hf_config.get
    problems = []
    if get("rope_interleave") is False:
        problems.append("rope_interleave=false (DeepSeek's checkpoints interleave their rotary rows)")
    if problems:
        raise ValueError(f"the deepseek_v3 checkpoint uses what the reference decoder cannot compute: {'; '.join(problems)}.")
    theta, rope_scaling = _rope(hf_config)
    num_layers = get("num_hidden_layers")
    fields: dict[str, Any] = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        num_layers=num_layers,
        num_attention_heads=get("num_attention_heads"),
        attention_type="mla",
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        ffn_hidden_size=get("intermediate_size"),
        first_k_dense_layers=min(get("first_k_dense_replace") or 0, num_layers),
        max_seq_length=get("max_position_embeddings"),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        init_method_std=float(get("initializer_range", 0.02)),
    )
    moe_width = get("moe_intermediate_size")
    moe: dict[str, Any] = dict(
        num_experts=get("n_routed_experts") or get("num_local_experts"),
        router_topk=get("num_experts_per_tok"),
        ffn_hidden_size=moe_width,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_topk_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        router_topk_renormalize=bool(get("norm_topk_prob", True)),
        # DeepSeek's own config.json carries its sequence-wise balance loss; HF's model has none.
        router_load_balancing_type="seq_aux_loss",
        aux_loss_coeff=float(get("aux_loss_alpha") or 0.0),
    )
    if get("n_group"):
        moe.update(router_num_groups=get("n_group"), router_group_topk=get("topk_group"),
                   router_group_score_topk=GROUP_SCORE_TOPK)
    if get("n_shared_experts"):
        moe["shared_expert_intermediate_size"] = get("n_shared_experts") * moe_width
    fields["moe"] = moe
    return fields


def _rope(hf_config: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or older
    ``rope_theta`` / ``rope_scaling``; YaRN's parameters are kept as ``ModelConfig.rope_scaling``."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("the HF config has no rope_theta (neither in rope_parameters nor at the top level).")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(
            f"rotary scaling {rope_type!r} is not supported for deepseek_v3: only 'yarn' (DeepSeek-V3's) or none."
        )
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for deepseek_v3 (qk_rope_head_dim is rotated whole).")
    return theta, params  # ModelConfig validates the keys


def unexpressible(cfg: ModelConfig) -> list[str]:
    """What of ``cfg`` HF's DeepseekV3ForCausalLM cannot express (empty: it can)."""
    moe = cfg.moe
    if moe is None:
        return ["a dense model (no MoE layer)"]
    problems = []
    if cfg.attention_type != "mla":
        problems.append(f"attention_type={cfg.attention_type!r} (DeepSeek-V3 has multi-head latent attention)")
    if moe.router_score_function != "sigmoid" or not moe.router_enable_expert_bias:
        problems.append("a router without sigmoid scores and expert bias")
    if moe.router_group_topk is not None:
        per_group = moe.router_group_score_topk or moe.router_topk // moe.router_group_topk
        if per_group != GROUP_SCORE_TOPK:
            problems.append(f"groups scored by their best {per_group} experts (DeepSeek-V3: {GROUP_SCORE_TOPK})")
    for name in ("expert_capacity_factor", "z_loss_coeff", "input_jitter_eps"):
        if getattr(moe, name):
            problems.append(f"{name}={getattr(moe, name)!r}")
    if moe.activation != "swiglu":
        problems.append(f"activation={moe.activation!r}")
    k = cfg.first_k_dense_layers
    if cfg.moe_layer_pattern != [False] * k + [True] * (cfg.num_layers - k):
        problems.append("dense blocks other than the first first_k_dense_layers")
    shared = moe.shared_expert_intermediate_size
    if shared is None or shared % moe.ffn_hidden_size or moe.shared_expert_gate:
        problems.append("no ungated shared experts of a multiple of the expert width")
    return problems


def hf_config_dict(cfg: ModelConfig, base: Optional[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as DeepseekV3ForCausalLM (checked by `unexpressible`);
    ``base``'s other entries (token ids, ...) are kept."""
    moe = cfg.moe
    out = dict(base or {})
    for stale in ("rope_scaling", "rope_theta", "head_dim", "qk_head_dim", "num_local_experts", "num_mtp_layers"):
        out.pop(stale, None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope.update({k: v for k, v in cfg.rope_scaling.items() if v is not None and (k, v) != ("truncate", True)})
    groups = (moe.router_num_groups, moe.router_group_topk) if moe.router_group_topk else (1, 1)
    out.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type=MODEL_TYPE,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size or moe.ffn_hidden_size,
        moe_intermediate_size=moe.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=moe.num_experts,
        num_experts_per_tok=moe.router_topk,
        n_shared_experts=moe.shared_expert_intermediate_size // moe.ffn_hidden_size,
        n_group=groups[0],
        topk_group=groups[1],
        routed_scaling_factor=moe.router_topk_scaling_factor or 1.0,
        norm_topk_prob=moe.renormalizes_topk,
        first_k_dense_replace=cfg.first_k_dense_layers,
        max_position_embeddings=cfg.max_seq_length,
        rope_parameters=rope,
        rope_interleave=True,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.init_method_std,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        num_nextn_predict_layers=0,  # no multi-token-prediction weights are written
        dtype=dtype,
    )
    return out
