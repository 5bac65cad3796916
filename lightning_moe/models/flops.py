"""Parameter and FLOP accounting for :class:`~lightning_moe.models.decoder.MoEDecoder`, from the config.

Conventions:
- ``total_parameters`` equals ``sum(p.numel() for p in MoEDecoder(cfg).parameters())`` exactly
  (the tied output projection counted once; router buffers such as the expert bias excluded).
- ``active_parameters`` is what one token touches: everything except the ``E - K`` routed
  experts it is not sent to (embedding and output projection included, as published MoE
  "active" counts do).
- ``model_flops_per_token`` is the training cost (forward + backward = 3 x forward) with
  2 FLOPs per multiply-add of every matrix product a token goes through: attention projections,
  router gate, its K experts, shared experts, dense MLPs and the output projection (the
  embedding lookup and the norms are not counted). Attention scores and values add
  ``4 * S * H * head_dim`` per layer in forward (``2 * S * H * (qk_nope_head_dim + qk_rope_head_dim +
  v_head_dim)`` with multi-head latent attention) for the FULL ``S x S`` score matrix, without
  halving for the causal mask: the convention of PaLM's MFU (``6N + 12 L H Q T``), torchtitan's
  ``get_num_flop_per_token`` and Megatron-LM's original ``num_floating_point_operations``, so MFU
  numbers compare with theirs. To count only the causal half, subtract
  ``attention_flops_per_token(cfg, S) / 2``.
"""

from __future__ import annotations

from lightning_moe.models.config import ModelConfig
from lightning_moe.nn.config import MoEConfig


def _attention_projection_parameters(cfg: ModelConfig) -> int:
    if cfg.attention_type == "mla":
        return _latent_attention_projection_parameters(cfg)
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_query_groups * cfg.head_dim
    return cfg.hidden_size * (2 * q_size + 2 * kv_size)  # q, o and k, v


def _latent_attention_projection_parameters(cfg: ModelConfig) -> int:
    """MLA's weight matrices: query (low-rank pair or full), kv down- and up-projection, output."""
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    q_out = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if cfg.q_lora_rank is None:
        q = hidden * q_out
    else:
        q = hidden * cfg.q_lora_rank + cfg.q_lora_rank * q_out
    kv_a = hidden * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv_a + kv_b + heads * cfg.v_head_dim * hidden


def _dense_mlp_parameters(cfg: ModelConfig) -> int:
    if cfg.num_dense_layers == 0:
        return 0  # ffn_hidden_size may be None
    return 3 * cfg.hidden_size * cfg.ffn_hidden_size  # SwiGLU: gate, up, down


def _mlp_parameters(hidden: int, ffn: int, gated: bool) -> int:
    return hidden * ffn * (3 if gated else 2)


def _moe_parameters(moe: MoEConfig, num_routed: int) -> int:
    """Router + ``num_routed`` routed experts + shared experts (with their gate)."""
    params = moe.num_experts * moe.hidden_size  # router gate [E, D]
    params += num_routed * _mlp_parameters(moe.hidden_size, moe.ffn_hidden_size, moe.is_gated)
    if moe.shared_expert_intermediate_size is not None:
        params += _mlp_parameters(moe.hidden_size, moe.shared_expert_intermediate_size, moe.is_gated)
        if moe.shared_expert_gate:
            params += moe.hidden_size
    return params


def _count(cfg: ModelConfig, active: bool) -> int:
    # norm weights and q/k/v biases of one block
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    qk_norms = (q_size + kv_size if cfg.qk_norm_scope == "projection" else 2 * cfg.head_dim) if cfg.qk_norm else 0
    vectors_per_layer = 2 * cfg.hidden_size + qk_norms + (q_size + 2 * kv_size if cfg.add_qkv_bias else 0)
    if cfg.attention_type == "mla":  # q_a_layernorm, kv_a_layernorm
        vectors_per_layer += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    params = cfg.vocab_size * cfg.hidden_size  # embedding
    params += cfg.num_layers * (_attention_projection_parameters(cfg) + vectors_per_layer)
    params += cfg.num_dense_layers * _dense_mlp_parameters(cfg)
    if cfg.num_moe_layers:
        routed = cfg.moe.router_topk if active else cfg.moe.num_experts
        params += cfg.num_moe_layers * _moe_parameters(cfg.moe, routed)
    params += cfg.hidden_size  # final norm
    if not cfg.tie_word_embeddings:
        params += cfg.vocab_size * cfg.hidden_size
    return params


def total_parameters(cfg: ModelConfig) -> int:
    """Number of parameters of ``MoEDecoder(cfg)``."""
    return _count(cfg, active=False)


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses: all but the routed experts it does not go to."""
    return _count(cfg, active=True)


def forward_matmul_parameters(cfg: ModelConfig) -> int:
    """Weights one token multiplies in forward: active parameters minus the embedding table
    and norm weights, plus the output projection even when it is tied to the embedding."""
    params = cfg.num_layers * _attention_projection_parameters(cfg)
    params += cfg.num_dense_layers * _dense_mlp_parameters(cfg)
    if cfg.num_moe_layers:
        params += cfg.num_moe_layers * _moe_parameters(cfg.moe, cfg.moe.router_topk)
    params += cfg.vocab_size * cfg.hidden_size  # output projection
    return params


def attention_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of ``QK^T`` and ``PV`` over all layers (full ``S x S``, see module doc).

    ``2 * S * H * (qk_width + v_width)`` per layer in forward: ``head_dim`` both for GQA, and
    ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim`` for MLA (the latent projections are
    counted as weights, the keys and values expanded per head as the module computes them).
    """
    v_width = cfg.v_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    forward = 2 * seq_length * cfg.num_attention_heads * (cfg.head_dim + v_width) * cfg.num_layers
    return 3.0 * forward


def model_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_length``.

    ``6 * forward_matmul_parameters(cfg) + 12 * L * S * H * head_dim`` (MLA: ``6 * L * S * H *
    (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)``); multiply by tokens per step
    and divide by step time and peak FLOP/s for MFU.
    """
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}.")
    return 6.0 * forward_matmul_parameters(cfg) + attention_flops_per_token(cfg, seq_length)
