"""`ModelConfig`: the validated shape of the reference MoE decoder.

One dataclass covers dense, all-MoE (Mixtral, Qwen3-MoE) and DeepSeek-style mixed stacks
(``first_k_dense_layers`` dense blocks, then MoE blocks). The MoE layer itself is described by
an embedded :class:`~lightning_moe.nn.config.MoEConfig`, so the routing flags keep their
Megatron names. Field names follow Megatron-Core's ``TransformerConfig`` where one exists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from lightning_moe.models.rope_scaling import normalize_rope_scaling
from lightning_moe.nn.config import MoEConfig, check_field_names

QK_NORM_SCOPES = ("head", "projection")
ATTENTION_TYPES = ("gqa", "mla")
_DEEPSEEK_V3_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


@dataclass
class ModelConfig:
    """Configuration of :class:`~lightning_moe.models.decoder.MoEDecoder`.

    Args:
        vocab_size: number of token ids ``V``.
        hidden_size: model width ``D``.
        num_layers: number of transformer blocks ``L``.
        num_attention_heads: query heads ``H``.
        num_query_groups: key/value heads ``G`` (grouped-query attention); None: ``H`` (MHA).
        head_dim: width of one head; None: ``D // H`` (Megatron's ``kv_channels``). Qwen3 sets it
            explicitly (``H * head_dim != D`` is allowed).
        ffn_hidden_size: width of the SwiGLU MLP of dense blocks; required when any block is dense.
        moe: the MoE layer of MoE blocks (None: a dense model). A dict is accepted (e.g. from YAML);
            its ``hidden_size`` defaults to this config's ``hidden_size`` and its
            ``init_method_std`` to this config's ``init_method_std``.
        first_k_dense_layers: the first ``k`` blocks use the dense MLP (DeepSeek's
            ``first_k_dense_replace``), the rest follow ``moe_layer_freq``.
        moe_layer_freq: Megatron's ``moe_layer_freq``. An int ``f``: block ``i`` is MoE when
            ``i % f == 0`` (and ``i >= first_k_dense_layers``); a list of 0/1 of length
            ``num_layers``: the explicit pattern (1 = MoE).
        max_seq_length: longest sequence the model is trained on (rotary positions beyond it are
            still computed; this bounds the data pipeline and the FLOP estimates).
        rope_theta: rotary embedding base.
        norm_eps: RMSNorm epsilon.
        tie_word_embeddings: share the input embedding with the output projection.
        init_method_std: std of the normal initialisation of every weight matrix; the output
            projections of each block (``o_proj``, ``down_proj``, expert ``fc2``) use
            ``init_method_std / sqrt(2 * num_layers)`` (Megatron's ``output_layer_init_method``).
        qk_norm: RMSNorm over the queries and keys before rotary embedding (Qwen3, OLMoE).
        qk_norm_scope: what one qk-norm normalises: "head" (each head of width ``head_dim``, Qwen3,
            Megatron's ``qk_layernorm``) or "projection" (the whole query / key projection, all heads
            at once, OLMoE; its weights are ``[H * head_dim]`` and ``[G * head_dim]``).
        add_qkv_bias: a bias on the query, key and value projections (Megatron's ``add_qkv_bias``;
            Qwen2-MoE).
        rope_scaling: None (plain RoPE) or YaRN as HF configs spell it (``{"type": "yarn", "factor",
            "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}``,
            DeepSeek-V3's long-context checkpoints); see ``lightning_moe.models.rope_scaling``.
        attention_type: "gqa" (grouped-query attention) or "mla" (DeepSeek-V2/V3 multi-head latent
            attention, ``lightning_moe.models.mla``). MLA needs ``kv_lora_rank``, ``qk_nope_head_dim``,
            ``qk_rope_head_dim`` and ``v_head_dim``; its ``num_query_groups`` is ``H`` and its ``head_dim``
            the query/key width ``qk_nope_head_dim + qk_rope_head_dim`` (both resolved if None).
        q_lora_rank: MLA only: rank of the query compression (``q_a_proj`` -> ``q_a_layernorm`` ->
            ``q_b_proj``); None: one full-rank ``q_proj``.
        kv_lora_rank: MLA only: width of the compressed key/value latent.
        qk_nope_head_dim: MLA only: per-head query/key dims without rotary embedding.
        qk_rope_head_dim: MLA only: per-head query dims (and the one shared key) with rotary embedding.
        v_head_dim: MLA only: per-head value width.
        recompute: selective recomputation, Megatron-Core's ``--recompute-modules`` names
            ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"):
            what they cover is in `lightning_moe.models.recompute`. None: nothing recomputed.
        recompute_every_n_layers: recompute whole blocks ``0, N, 2N, ...`` in backward (N = 1: every
            block; Megatron's full recompute); None: none. The selective names apply to the others.
        lm_head_chunk_tokens: the training loss's output projection and cross-entropy run this many
            tokens at a time (`lightning_moe.nn.linear_cross_entropy`): at most ``chunk x vocab_size``
            logits exist at once instead of ``tokens x vocab_size`` kept until the backward plus a
            gradient of that size (qwen3's 151,936 words at 8,192 tokens: 2.5 GB each in bf16), for the
            same GEMMs and an fp32 ``[vocab_size, hidden_size]`` weight gradient held from the forward to
            the backward. 2048 is a good size (at most ``2048 x V`` logits: 0.6 GB at qwen3's vocabulary,
            GEMMs of 2048 rows). Default None (the unchunked head) until its step time is measured on a
            GPU against the unchunked head. It applies where the output projection is a plain weight on this process (single
            device, DDP, FSDP, expert / context parallelism, tied embeddings); the unchunked head (logits,
            then `causal_lm_loss`) stays where it cannot: tensor parallelism (a vocabulary-parallel
            DTensor head), pipeline stages, an FP8-converted or otherwise replaced head, a head with
            forward hooks. ``model(ids)`` returns logits either way. None: always the unchunked head.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None
    head_dim: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    moe: Optional[Union[MoEConfig, dict[str, Any]]] = None
    first_k_dense_layers: int = 0
    moe_layer_freq: Union[int, list[int]] = 1
    max_seq_length: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    add_qkv_bias: bool = False
    rope_scaling: Optional[dict[str, Any]] = None
    attention_type: str = "gqa"
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    recompute: Optional[list[str]] = None
    recompute_every_n_layers: Optional[int] = None
    lm_head_chunk_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_seq_length"):
            _check_positive_int(name, getattr(self, name))
        self._resolve_attention_type()
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _check_positive_int("num_query_groups", self.num_query_groups)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}: change one so that the query groups divide the heads."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}: set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.rotary_dim % 2:
            name = "qk_rope_head_dim" if self.attention_type == "mla" else "head_dim"
            raise ValueError(f"{name}={self.rotary_dim} must be even for rotary embeddings.")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        for name in ("rope_theta", "norm_eps", "init_method_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)!r}.")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"ModelConfig.qk_norm_scope={self.qk_norm_scope!r} is not one of {QK_NORM_SCOPES}.")
        self._resolve_moe()
        self._validate_layer_pattern()
        self._validate_recompute()
        if self.lm_head_chunk_tokens is not None:
            _check_positive_int("lm_head_chunk_tokens", self.lm_head_chunk_tokens)

    def _validate_recompute(self) -> None:
        from lightning_moe.models.recompute import RECOMPUTE_MODULES

        if self.recompute_every_n_layers is not None:
            _check_positive_int("recompute_every_n_layers", self.recompute_every_n_layers)
        if self.recompute is None:
            return
        if isinstance(self.recompute, str) or not all(isinstance(name, str) for name in self.recompute):
            raise ValueError(f"ModelConfig.recompute must be a list of module names, got {self.recompute!r}.")
        self.recompute = list(dict.fromkeys(self.recompute))
        unknown = [name for name in self.recompute if name not in RECOMPUTE_MODULES]
        if unknown:
            raise ValueError(f"ModelConfig.recompute: unknown {unknown}; choose from {list(RECOMPUTE_MODULES)}.")
        pattern = self.moe_layer_pattern
        absent = {
            "mla_up_proj": self.attention_type != "mla" and "attention_type='gqa' has no up-projections: drop it",
            "moe": not any(pattern) and "the model has no MoE block: drop it (dense blocks: 'mlp')",
            "moe_act": not any(pattern) and "the model has no MoE block: drop it",
            "shared_experts": (self.moe is None or self.moe.shared_expert_intermediate_size is None)
            and "the model has no shared experts: drop it",
            "mlp": all(pattern) and "every block is MoE: use 'moe' (or 'moe_act')",
        }
        for name in self.recompute:
            if absent.get(name):
                raise ValueError(
                    f"ModelConfig.recompute={self.recompute}: {name!r} recomputes nothing, {absent[name]}."
                )

    def recomputed_modules(self, layer: int) -> tuple[bool, frozenset[str]]:
        """(whether block ``layer`` is recomputed whole, the selective names that apply to it)."""
        every = self.recompute_every_n_layers
        if every is not None and layer % every == 0:
            return True, frozenset()
        return False, frozenset(self.recompute or ())

    def _resolve_attention_type(self) -> None:
        """Check the MLA fields against ``attention_type``; for MLA resolve ``num_query_groups`` (H)
        and ``head_dim`` (the query/key width)."""
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"ModelConfig.attention_type={self.attention_type!r} is not one of {ATTENTION_TYPES}.")
        mla_fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention_type == "gqa":
            given = [name for name in mla_fields if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} describe multi-head latent attention: set attention_type='mla' "
                    "or leave them None."
                )
            return
        for name in mla_fields[1:]:
            if getattr(self, name) is None:
                raise ValueError(f"attention_type='mla' needs {name}: set it (DeepSeek-V3: {_DEEPSEEK_V3_MLA[name]}).")
        for name in mla_fields:
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        heads, qk_width = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.num_query_groups not in (None, heads):
            raise ValueError(
                f"num_query_groups={self.num_query_groups} with attention_type='mla': every head has its own key "
                f"and value (from the shared latent), so leave num_query_groups None (= num_attention_heads={heads})."
            )
        if self.head_dim not in (None, qk_width):
            raise ValueError(
                f"head_dim={self.head_dim} with attention_type='mla': the query/key width is qk_nope_head_dim + "
                f"qk_rope_head_dim = {qk_width}; leave head_dim None."
            )
        if self.qk_norm:
            raise ValueError(
                "qk_norm with attention_type='mla': MLA normalises its latents (q_a_layernorm, kv_a_layernorm) "
                "instead; set qk_norm=False."
            )
        if self.add_qkv_bias:
            raise ValueError("add_qkv_bias with attention_type='mla' is not supported: set add_qkv_bias=False.")
        self.num_query_groups, self.head_dim = heads, qk_width

    @property
    def rotary_dim(self) -> int:
        """Width the rotary embedding rotates: ``head_dim`` (GQA) or ``qk_rope_head_dim`` (MLA)."""
        return self.qk_rope_head_dim if self.attention_type == "mla" else self.head_dim

    def _resolve_moe(self) -> None:
        if isinstance(self.moe, dict):
            check_field_names("MoEConfig", self.moe, (f.name for f in fields(MoEConfig) if f.init))
            kwargs = {"hidden_size": self.hidden_size, "init_method_std": self.init_method_std, **self.moe}
            self.moe = MoEConfig(**kwargs)
        if self.moe is None:
            return
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(
                f"ModelConfig.moe must be a MoEConfig, a dict of its fields or None, got {type(self.moe).__name__}."
            )
        if self.moe.hidden_size != self.hidden_size:
            raise ValueError(
                f"moe.hidden_size={self.moe.hidden_size} differs from hidden_size={self.hidden_size}: "
                "make them equal (or pass moe as a dict without hidden_size)."
            )

    def _validate_layer_pattern(self) -> None:
        if not isinstance(self.first_k_dense_layers, int) or not 0 <= self.first_k_dense_layers <= self.num_layers:
            raise ValueError(
                f"first_k_dense_layers={self.first_k_dense_layers!r} must be an int in "
                f"[0, num_layers={self.num_layers}]."
            )
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or any(v not in (0, 1) for v in freq):
                raise ValueError(
                    f"moe_layer_freq as a list must hold num_layers={self.num_layers} values of 0 or 1, got {freq!r}."
                )
            self.moe_layer_freq = [int(v) for v in freq]
        else:
            _check_positive_int("moe_layer_freq", freq)
        if not all(self.moe_layer_pattern) and self.ffn_hidden_size is None:
            raise ValueError(
                "some blocks are dense (no moe, first_k_dense_layers or moe_layer_freq) but ffn_hidden_size is None: "
                "set ffn_hidden_size."
            )
        if self.ffn_hidden_size is not None:
            _check_positive_int("ffn_hidden_size", self.ffn_hidden_size)

    @property
    def moe_layer_pattern(self) -> list[bool]:
        """``pattern[i]`` is True when block ``i`` is an MoE block."""
        if self.moe is None:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            base = [bool(v) for v in freq]
        else:
            base = [i % freq == 0 for i in range(self.num_layers)]
        return [moe and i >= self.first_k_dense_layers for i, moe in enumerate(base)]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def output_init_std(self) -> float:
        """Init std of the projections that write into the residual stream (Megatron's scaled init)."""
        return self.init_method_std / (2.0 * self.num_layers) ** 0.5

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (``moe`` as a dict): YAML- and ``weights_only``-checkpoint friendly."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["moe"] = None if self.moe is None else self.moe.to_dict()
        if isinstance(out["moe_layer_freq"], list):
            out["moe_layer_freq"] = list(out["moe_layer_freq"])
        if out["rope_scaling"] is not None:
            out["rope_scaling"] = dict(out["rope_scaling"])
        if out["recompute"] is not None:
            out["recompute"] = list(out["recompute"])
        return out


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")

