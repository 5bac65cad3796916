"""Reference decoder-only MoE transformer: RMSNorm, RoPE, grouped-query or multi-head latent
attention, SwiGLU / MoE.

Plain PyTorch, no parallel state. Module names are chosen so a parallel strategy can address
them with tensor-parallel plans (see :meth:`MoEDecoder.tensor_parallel_plan`)::

    embed_tokens
    layers.{i}.attention_norm        RMSNorm
    layers.{i}.attention.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}      (attention_type "gqa")
    layers.{i}.attention.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
                          kv_a_layernorm, kv_b_proj, o_proj}                    ("mla", DeepSeek's names)
    layers.{i}.mlp_norm              RMSNorm
    layers.{i}.mlp                   DenseMLP (gate_proj, up_proj, down_proj) or MoELayer
    norm
    lm_head                          absent with tied embeddings

Every module that owns parameters has ``reset_parameters()`` initialising exactly its own
parameters, so Lightning's meta-device materialisation and :meth:`MoEDecoder.init_weights`
give the intended initialisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.document_mask import DocumentMask, document_positions
from lightning_moe.models.layers import (
    AttentionCore,
    Embedding,
    Linear,
    ProjectionRMSNorm,
    RMSNorm,
    rotary_cos_sin,
)
from lightning_moe.models.mla import MultiHeadLatentAttention
from lightning_moe.models.rotary import norm_rotary
from lightning_moe.models.recompute import checkpointed
from lightning_moe.nn.compute_weights import autocast_dtype, compute_weight
from lightning_moe.nn.cross_entropy import cross_entropy_mean
from lightning_moe.nn.linear_cross_entropy import linear_cross_entropy_mean, linear_cross_entropy_supported
from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.nn.saved_tensors import OutputRecompute

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor.parallel import ParallelStyle

IGNORE_INDEX = -100


class Attention(nn.Module):
    """Causal grouped-query self-attention through ``F.scaled_dot_product_attention``.

    The number of heads is read from the projected tensors at forward time (``view(B, S, -1, hd)``),
    so after column-parallel sharding of ``q_proj``/``k_proj``/``v_proj`` each rank runs its local
    heads with no change here. ``qk_norm`` normalises each head (``qk_norm_scope="head"``) or the
    whole query / key projection (``"projection"``, OLMoE) before the rotary embedding. With
    ``documents`` (a packed batch) no query attends across a document boundary.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        q_size = cfg.num_attention_heads * hd
        kv_size = cfg.num_query_groups * hd
        bias = cfg.add_qkv_bias
        self.q_proj = Linear(cfg.hidden_size, q_size, cfg.init_method_std, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, kv_size, cfg.init_method_std, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, kv_size, cfg.init_method_std, bias=bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.output_init_std)
        self.norms_projection = cfg.qk_norm_scope == "projection"
        norm = ProjectionRMSNorm if self.norms_projection else RMSNorm
        q_norm_size, k_norm_size = (q_size, kv_size) if self.norms_projection else (hd, hd)
        self.q_norm: Optional[RMSNorm] = norm(q_norm_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm: Optional[RMSNorm] = norm(k_norm_size, cfg.norm_eps) if cfg.qk_norm else None
        self.core_attention = AttentionCore()
        self.cp_group: Optional[ProcessGroup] = None  # set_context_parallel
        self.cp_comm_type = "p2p"

    def set_context_parallel(self, group: Optional[ProcessGroup], comm_type: str = "p2p") -> None:
        """Attend across the context-parallel ``group`` (MegatronMoEStrategy calls this): the input is
        then this rank's load-balanced shard of each sequence (`lightning_moe.parallel.context_parallel`)."""
        self.cp_group, self.cp_comm_type = group, comm_type

    def reset_parameters(self) -> None:
        for module in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.q_norm, self.k_norm):
            if module is not None:
                module.reset_parameters()

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, documents: Optional[DocumentMask] = None) -> Tensor:
        batch, seq = x_BSD.shape[:2]
        q_BSX, k_BSX = self.q_proj(x_BSD), self.k_proj(x_BSD)
        if self.q_norm is not None and self.norms_projection:
            q_BSX, k_BSX = self.q_norm(q_BSX), self.k_norm(k_BSX)
        q_BSHd = q_BSX.view(batch, seq, -1, self.head_dim)
        k_BSGd = k_BSX.view(batch, seq, -1, self.head_dim)
        v_BSGd = self.v_proj(x_BSD).view(batch, seq, -1, self.head_dim)
        # Per-head qk-norm (or none) and the rotary embedding: one Triton kernel each way on a GPU
        # (`models.rotary`); the projection-wide norm ran above.
        head_norms = self.q_norm is not None and not self.norms_projection
        q_BSHd = norm_rotary(q_BSHd, cos, sin, self.q_norm if head_norms else None)
        k_BSGd = norm_rotary(k_BSGd, cos, sin, self.k_norm if head_norms else None)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHd, k_BSGd, v_BSGd))
        out_BHSd = self.core_attention(q, k, v, documents, cp_group=self.cp_group, cp_comm_type=self.cp_comm_type)
        return self.o_proj(out_BHSd.transpose(1, 2).reshape(batch, seq, -1))


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``.

    Gate and up are separate projections (not one fused ``[2F, D]`` weight) so that column-wise
    tensor parallelism gives every rank matching gate and up rows.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, init_std: float, output_init_std: float) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, ffn_hidden_size, init_std)
        self.up_proj = Linear(hidden_size, ffn_hidden_size, init_std)
        self.down_proj = Linear(ffn_hidden_size, hidden_size, output_init_std)

    def reset_parameters(self) -> None:
        for module in (self.gate_proj, self.up_proj, self.down_proj):
            module.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; ``mlp`` dense or MoE.

    ``recompute_layer``: the whole block is recomputed in backward; ``recompute``: the selective
    recompute names that apply to it (`lightning_moe.models.recompute`).
    """

    def __init__(self, cfg: ModelConfig, is_moe: bool, recompute_layer: bool = False,
                 recompute: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.recompute_layer = recompute_layer
        self.recompute = frozenset(recompute)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention: nn.Module
        if cfg.attention_type == "mla":
            self.attention = MultiHeadLatentAttention(cfg)
        else:
            self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp: nn.Module
        if is_moe:
            self.mlp = MoELayer(cfg.moe, output_init_std=cfg.output_init_std)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.ffn_hidden_size, cfg.init_method_std, cfg.output_init_std)
        self.attention.core_attention.recompute = "core_attn" in self.recompute
        if isinstance(self.attention, MultiHeadLatentAttention):
            self.attention.recompute_up_proj = "mla_up_proj" in self.recompute
        if is_moe:
            self.mlp.experts.recompute_activation = "moe_act" in self.recompute
            self.mlp.recompute_shared_experts = "shared_experts" in self.recompute

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoELayer)

    def reset_parameters(self) -> None:
        for module in (self.attention_norm, self.attention, self.mlp_norm, self.mlp):
            module.reset_parameters()

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, documents: Optional[DocumentMask] = None) -> Tensor:
        if self.recompute_layer and torch.is_grad_enabled():
            return checkpointed(self._block, x_BSD, cos, sin, documents)
        return self._block(x_BSD, cos, sin, documents)

    def _block(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, documents: Optional[DocumentMask]) -> Tensor:
        recompute_norms = "layernorm" in self.recompute
        with OutputRecompute(recompute_norms) as outputs:
            # documents goes by keyword: the TP plan's PrepareModuleInput lays out the positional inputs only
            h_BSD = x_BSD + self.attention(outputs.run(self.attention_norm, x_BSD), cos, sin, documents=documents)
        with OutputRecompute(recompute_norms) as outputs:
            n_BSD = outputs.run(self.mlp_norm, h_BSD)
            if ("moe" if self.is_moe else "mlp") in self.recompute and torch.is_grad_enabled():
                return h_BSD + checkpointed(self.mlp, n_BSD)
            return h_BSD + self.mlp(n_BSD)


class MoEDecoder(nn.Module):
    """Decoder-only language model; block ``i`` is MoE where ``cfg.moe_layer_pattern[i]``.

    ``forward(input_ids [B, S], position_ids=None, document_ids=None) -> logits [B, S, V]``;
    ``loss(input_ids, labels, position_ids=None, document_ids=None)`` is the mean next-token
    cross-entropy. ``document_ids [B, S]`` marks the documents of a packed batch
    (`lightning_moe.models.document_mask`): attention stays inside each document, and positions
    default to restarting at 0 at each one. ``labels`` are already
    shifted (``labels[b, s]`` is the target of position ``s``, as Megatron and torchtitan data
    pipelines produce; this keeps sequence sharding for context parallelism simple) and
    ``-100`` marks positions to ignore.

    Meta-device construction then ``to_empty(device=...)`` and ``init_weights()`` gives the same
    parameters as any other construction followed by ``init_weights()`` under the same seed.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_method_std)
        # A ModuleDict keyed "0".."L-1" keeps parameter names stable if a pipeline stage drops layers.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, is_moe, *cfg.recomputed_modules(i))
             for i, is_moe in enumerate(cfg.moe_layer_pattern)}
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head: Optional[Linear] = None
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_method_std)
        # Pipeline parallelism (`lightning_moe.parallel.pipeline`): the strategy prunes the model to
        # this rank's stages and sets the runner through which `loss` then goes.
        self.pipeline_runner: Optional[Callable[..., Tensor]] = None
        self.pipeline_pruned = False

    def init_weights(self) -> None:
        """(Re)initialise every parameter and router buffer in a fixed order from the global RNG.

        Use after ``to_empty(device=...)`` of a meta-device model; under a fixed seed the result
        is the same whatever device or construction path the model came from.
        """
        for module in (self.embed_tokens, *self.layers.values(), self.norm, self.lm_head):
            if module is not None:  # a pipeline stage holds some of them
                module.reset_parameters()

    def moe_layers(self) -> Iterator[MoELayer]:
        """The MoE feed-forward blocks, in layer order."""
        for layer in self.layers.values():
            if isinstance(layer.mlp, MoELayer):
                yield layer.mlp

    def output_weight(self) -> Tensor:
        """``[V, D]`` weight of the output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self, input_ids: Tensor, position_ids: Optional[Tensor] = None, document_ids: Optional[Tensor] = None
    ) -> Tensor:
        """Final normed hidden states ``[B, S, D]`` (before the output projection)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}.")
        self._check_whole()
        cos, sin, documents = _rotary_and_documents(self.config, input_ids, position_ids, document_ids)
        return self.norm(_run_layers(self.layers.values(), self.embed_tokens(input_ids), cos, sin, documents))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        document_ids: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
    ) -> Tensor:
        """Logits ``[B, S, V]`` for ``input_ids`` ``[B, S]``; ``position_ids`` ``[S]`` or ``[B, S]``
        (default ``0..S-1``, or restarting at each document of ``document_ids [B, S]``).

        With ``labels`` ``[B, S]``: the mean cross-entropy instead (what `loss` returns), the output
        projection and the loss chunked over tokens where ``config.lm_head_chunk_tokens`` applies
        (no ``[B, S, V]`` logits; `lightning_moe.nn.linear_cross_entropy`). It runs inside
        ``forward``, so that wrappers which gather parameters around it (FSDP) hold the head's weight."""
        h_BSD = self.hidden_states(input_ids, position_ids, document_ids)
        if labels is not None:
            return self.head_loss(h_BSD, labels)
        return self._project(h_BSD)

    def _project(self, h_BSD: Tensor) -> Tensor:
        if self.lm_head is None:
            return F.linear(h_BSD, compute_weight(self.embed_tokens.weight, autocast_dtype(h_BSD)))
        return self.lm_head(h_BSD)

    def head_loss(self, h_BSD: Tensor, labels_BS: Tensor) -> Tensor:
        """Mean cross-entropy of the output projection of the final hidden states ``h_BSD`` against
        ``labels_BS``: chunked (`linear_cross_entropy_mean`) where `chunked_head_weight` gives a
        weight, else `causal_lm_loss` of the logits."""
        weight = self.chunked_head_weight(h_BSD)
        if weight is None:
            return causal_lm_loss(self._project(h_BSD), labels_BS)
        if h_BSD.shape[:-1] != labels_BS.shape:
            raise ValueError(f"labels {tuple(labels_BS.shape)} do not match logits {tuple(h_BSD.shape[:-1])}.")
        # A tied embedding's weight also gets the lookup's gradient: autograd accumulates their sum.
        return linear_cross_entropy_mean(h_BSD, weight, labels_BS, IGNORE_INDEX, self.config.lm_head_chunk_tokens,
                                         accumulate_in_place=self.lm_head is not None)

    def chunked_head_weight(self, h_BSD: Tensor) -> Optional[Tensor]:
        """The ``[V, D]`` weight the chunked loss multiplies ``h_BSD`` with (`compute_weight` of the
        output projection's or tied embedding's parameter), or None where the unchunked head stays:
        ``lm_head_chunk_tokens`` None; a head that is not this package's plain ``Linear`` forward
        (FP8-converted, Transformer Engine, a bias), has forward hooks or is its own FSDP unit (its
        weight is gathered in its own forward); a tensor subclass weight or input (tensor
        parallelism's DTensors)."""
        from lightning_moe.nn.compute_weights import CachedCastLinear
        from lightning_moe.parallel.fsdp import is_fsdp_managed

        if self.config.lm_head_chunk_tokens is None or type(h_BSD) is not Tensor:
            return None
        head: nn.Module = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.lm_head is not None and (
            not isinstance(head, CachedCastLinear) or type(head).forward is not CachedCastLinear.forward
            or getattr(head, "is_fp8_linear", False) or head.bias is not None):
            return None
        if head._forward_hooks or head._forward_pre_hooks or is_fsdp_managed(head):
            return None
        param = head.weight
        if type(param) is not nn.Parameter and type(param) is not Tensor or type(param.data) is not Tensor:
            return None
        weight = compute_weight(param, autocast_dtype(h_BSD))
        return weight if linear_cross_entropy_supported(h_BSD, weight) else None

    def loss(
        self,
        input_ids: Tensor,
        labels: Tensor,
        position_ids: Optional[Tensor] = None,
        document_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """Mean cross-entropy over the tokens whose label is not -100 (router losses excluded:
        their gradients reach the routers by themselves). In a packed batch the data module sets
        the label of each document's last token to -100: it does not predict the next document.
        The output projection and the loss run ``config.lm_head_chunk_tokens`` tokens at a time
        where that applies (`head_loss`): no ``[B, S, V]`` logits.

        Under pipeline parallelism (``pipeline_runner`` set by the strategy) the batch runs through
        the pipeline schedule instead (forward and backward in training), and the returned loss is
        the batch's token mean, detached, on every rank."""
        if self.pipeline_runner is not None:
            return self.pipeline_runner(input_ids, labels=labels, position_ids=position_ids, document_ids=document_ids)
        return self(input_ids, position_ids, document_ids, labels=labels)

    def _check_whole(self) -> None:
        if self.pipeline_pruned:
            raise RuntimeError(
                "this MoEDecoder holds one pipeline stage only (pipeline_parallel_size > 1): call "
                "model.loss(input_ids, labels, ...), which runs the pipeline schedule, not forward()."
            )

    # ------------------------------------------------------------ pipeline split hook
    def pipeline_layers(self) -> list[str]:
        """Block names in execution order (`lightning_moe.parallel.pipeline` split hook)."""
        return [f"layers.{name}" for name in self.layers]

    def pipeline_edge_modules(self) -> tuple[list[str], list[str]]:
        """Modules of the first chunk (the embedding) and of the last (final norm, output projection;
        the embedding again when tied)."""
        return ["embed_tokens"], ["norm", "lm_head" if self.lm_head is not None else "embed_tokens"]

    def pipeline_shared_parameters(self) -> list[str]:
        """Parameters both the first and the last chunk hold (the tied embedding): the strategy sums
        their gradients between those stages and counts them once in the gradient norm."""
        return ["embed_tokens.weight"] if self.config.tie_word_embeddings else []

    def pipeline_prune(self, keep: set[str], first: bool, last: bool) -> None:
        """Keep the blocks named in ``keep`` and, on the first / last stage, the embedding / final
        norm and output projection (with tied embeddings the last stage keeps the embedding as its
        output projection). Block keys stay ``"0".."L-1"``, so parameter names do not change."""
        for name in list(self.layers):
            if f"layers.{name}" not in keep:
                del self.layers[name]
        if not first and not (last and self.config.tie_word_embeddings):
            self.embed_tokens = None
        if not last:
            self.norm = None
            self.lm_head = None
        self.pipeline_pruned = True

    def pipeline_chunk(self, layer_names: list[str], first: bool, last: bool) -> "DecoderChunk":
        """The module one pipeline chunk runs: the named blocks, with the embedding when ``first``
        and the final norm, output projection and loss when ``last``."""
        blocks = [self.get_submodule(name) for name in layer_names]
        head = (self.lm_head if self.lm_head is not None else self.embed_tokens) if last else None
        return DecoderChunk(self.config, blocks, self.embed_tokens if first else None,
                            self.norm if last else None, head)

    def tensor_parallel_plan(self, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        """Tensor-parallel styles for ``parallelize_module(model, tp_mesh, plan)`` (dense parts).

        Attention: q/k/v column-parallel (heads split), o row-parallel (multi-head latent attention:
        ``q_b_proj`` or ``q_proj`` and ``kv_b_proj`` column-parallel, o row-parallel, the low-rank
        a-projections and their norms replicated, the shared rotary key's gradient summed over
        the TP ranks); per-head qk-norms see their input
        sharded over the head dim (``SequenceParallel(sequence_dim=2)`` so their weight gradients
        are summed over the TP ranks); qk-norms over whole projections (OLMoE) shard their weight
        like the heads and sum their mean of squares over the TP ranks (``sharded_norm_weight_style``). Dense MLP: gate/up column-parallel, down row-parallel.
        Embedding row-parallel (vocab split), output projection column-parallel with replicated
        logits. With ``sequence_parallel`` the residual stream is sharded over the sequence
        (``Shard(1)``): norms run on the local slice, attention and dense-MLP inputs are
        all-gathered, their outputs reduce-scattered. MoE blocks are not in this plan: the strategy
        makes each TP rank route a distinct slice of the sequence through them (with or without
        sequence parallelism) and sums the router's per-slice gradients over the TP ranks.

        Raises:
            ValueError: tied embeddings.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        from lightning_moe.parallel.tensor_parallel import sharded_norm_weight_style, sum_input_gradients_style

        cfg = self.config
        if cfg.tie_word_embeddings:
            raise ValueError(
                "tensor parallelism is not supported with tie_word_embeddings=True: set tie_word_embeddings=False."
            )
        residual = Shard(1) if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        # A pipeline stage holds the embedding, the final norm and the output projection or not.
        if self.embed_tokens is not None:
            plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        if self.lm_head is not None:
            plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
        if sequence_parallel and self.norm is not None:
            plan["norm"] = SequenceParallel()
        for name, layer in self.layers.items():
            prefix = f"layers.{name}"
            if sequence_parallel:
                plan[f"{prefix}.attention_norm"] = SequenceParallel()
                plan[f"{prefix}.mlp_norm"] = SequenceParallel()
                plan[f"{prefix}.attention"] = PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                    # MLA's replicated a-projections take the gathered input as a plain tensor.
                    use_local_output=cfg.attention_type == "mla",
                )
            if cfg.attention_type == "mla":
                # Heads split by the up-projections; the a-projections, their norms and the
                # shared rotary key stay replicated (lightning_moe.models.mla, "Tensor parallelism").
                q_up = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
                column_parallel = (q_up, "kv_b_proj")
                plan[f"{prefix}.attention.shared_rope_key"] = sum_input_gradients_style()
            else:
                column_parallel = ("q_proj", "k_proj", "v_proj")
            for proj in column_parallel:
                plan[f"{prefix}.attention.{proj}"] = ColwiseParallel()
            plan[f"{prefix}.attention.o_proj"] = RowwiseParallel(output_layouts=residual)
            for norm in ("q_norm", "k_norm") if cfg.qk_norm else ():
                if cfg.qk_norm_scope == "projection":
                    plan[f"{prefix}.attention.{norm}"] = sharded_norm_weight_style()
                else:
                    plan[f"{prefix}.attention.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            if layer.is_moe:
                continue  # the strategy splits MoE tokens over TP (apply_moe_token_split)
            if sequence_parallel:
                plan[f"{prefix}.mlp"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
            plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=residual)
        return plan


def _rotary_and_documents(
    cfg: ModelConfig, tokens_BS: Tensor, position_ids: Optional[Tensor], document_ids: Optional[Tensor]
) -> tuple[Tensor, Tensor, Optional[DocumentMask]]:
    """Rotary cos/sin of the positions (default ``0..S-1``, or restarting at each document of
    ``document_ids [B, S]``) and the packed batch's document mask (None without documents)."""
    documents: Optional[DocumentMask] = None
    if document_ids is not None:
        if document_ids.shape != tokens_BS.shape:
            raise ValueError(f"document_ids {tuple(document_ids.shape)} must match input_ids "
                             f"{tuple(tokens_BS.shape)}: one document index per token.")
        documents = DocumentMask(document_ids)  # built once, shared by every layer
        if position_ids is None:
            position_ids = document_positions(document_ids)
    if position_ids is None:
        position_ids = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
    cos, sin = rotary_cos_sin(position_ids, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    return cos, sin, documents


def _run_layers(layers: Iterable[nn.Module], h_BSD: Tensor, cos: Tensor, sin: Tensor,
                documents: Optional[DocumentMask]) -> Tensor:
    for layer in layers:
        h_BSD = layer(h_BSD, cos, sin) if documents is None else layer(h_BSD, cos, sin, documents=documents)
    return h_BSD


class DecoderChunk(nn.Module):
    """A run of `MoEDecoder` blocks that one pipeline stage executes (`MoEDecoder.pipeline_chunk`).

    ``forward(x, labels, position_ids=None, document_ids=None)``: ``x`` is ``input_ids [B, S]``
    on the first chunk (which holds the embedding) and the previous chunk's hidden states
    ``[B, S_local, D]`` otherwise (``S_local = S / TP`` under sequence parallelism); ``labels
    [B, S]`` give every chunk the sequence length (rotary positions) and the last chunk its loss.
    Returns the hidden states, or on the last chunk the fp32 SUM of the token cross-entropies
    (0-dim): the pipeline divides by the batch's labelled tokens. The modules are the decoder's
    own (not copies), so the decoder's state dict and parameter names are unchanged. ``lm_head``:
    the output projection, or the embedding itself when tied (its weight ``[V, D]`` then projects).
    """

    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module], embed_tokens: Optional[nn.Module],
                 norm: Optional[nn.Module], lm_head: Optional[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(blocks)
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x: Tensor, labels: Tensor, position_ids: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        cos, sin, documents = _rotary_and_documents(self.config, labels, position_ids, document_ids)
        h_BSD = self.embed_tokens(x) if self.embed_tokens is not None else x
        h_BSD = _run_layers(self.layers, h_BSD, cos, sin, documents)
        if self.norm is None:
            return h_BSD
        h_BSD = self.norm(h_BSD)
        if isinstance(self.lm_head, nn.Embedding):  # tied: the embedding's weight projects
            logits_BSV = F.linear(h_BSD, compute_weight(self.lm_head.weight, autocast_dtype(h_BSD)))
        else:
            logits_BSV = self.lm_head(h_BSD)
        tokens = (labels != IGNORE_INDEX).sum()
        return causal_lm_loss(logits_BSV, labels).float() * tokens


def causal_lm_loss(logits_BSV: Tensor, labels_BS: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean fp32 cross-entropy over non-ignored tokens; 0 (not NaN) when every label is ignored
    (`lightning_moe.nn.cross_entropy.cross_entropy_mean`: on a GPU, the loss in one read of the
    logits and their gradient in the backward in one more read and one write). The token count
    stays on the device (no host sync).
    """
    if logits_BSV.shape[:-1] != labels_BS.shape:
        raise ValueError(f"labels {tuple(labels_BS.shape)} do not match logits {tuple(logits_BSV.shape[:-1])}.")
    return cross_entropy_mean(logits_BSV.reshape(-1, logits_BSV.shape[-1]), labels_BS.reshape(-1), ignore_index)
