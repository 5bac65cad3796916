"""Multi-head latent attention (MLA), as DeepSeek-V2/V3 define it (arXiv 2405.04434, 2412.19437).

With ``H`` heads, query/key width ``n + r`` (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and value
width ``v``, for a token ``x`` (width ``D``)::

    c_q = RMSNorm(x W_qa)                   [q_lora_rank]         q_a_proj, q_a_layernorm
    q   = c_q W_qb                          [H, n + r]            q_b_proj (x W_q without q_lora_rank)
    c_kv, k_r = split(x W_kva)              [kv_lora_rank], [r]   kv_a_proj_with_mqa
    k_n, v = split(RMSNorm(c_kv) W_kvb)     [H, n], [H, v]        kv_a_layernorm, kv_b_proj
    q = [q_n, RoPE(q_r)],  k = [k_n, RoPE(k_r)]  (k_r one rotary key shared by every head)
    o = softmax(q k^T * scale + causal) v   scale = mscale^2 / sqrt(n + r)
    out = o W_o                             [D]                   o_proj

Module and parameter names are those of DeepSeek-V3's HF checkpoints, so its attention weights map
one to one. The rotary part uses this package's rotate-half layout; DeepSeek's checkpoints store
the rotary rows of ``q_b_proj`` and ``kv_a_proj_with_mqa`` interleaved (``rope_interleave``), which
an importer permutes once (``deinterleave_rope_rows``) instead of every forward.

Tensor parallelism (``MoEDecoder.tensor_parallel_plan``): heads are split over the TP ranks
(``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel); the
low-rank a-projections and their norms are replicated, their gradients complete because every
column-parallel input gradient is all-reduced, and the shared rotary key, which each rank's heads
use without a column-parallel projection in between, goes through ``shared_rope_key``: an identity
whose gradient the plan sums over the TP ranks (Megatron's ``copy_to_tensor_model_parallel_region``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.document_mask import DocumentMask
from lightning_moe.models.layers import AttentionCore, Linear, RMSNorm
from lightning_moe.models.recompute import checkpointed
from lightning_moe.models.rope_scaling import latent_softmax_mscale
from lightning_moe.models.rotary import norm_rotary


class SharedRopeKey(nn.Identity):
    """Identity on the rotary key that all heads share; the TP plan hooks it to sum the key's
    gradient over the ranks, whose local heads each contribute a share of it."""


class MultiHeadLatentAttention(nn.Module):
    """Causal MLA through ``F.scaled_dot_product_attention``; ``forward(x [B, S, D], cos, sin)``
    with ``cos``/``sin`` of width ``qk_rope_head_dim`` (``[S, r]`` or ``[B, S, r]``); with
    ``documents`` (a packed batch) no query attends across a document boundary.

    The number of heads is read from the projections at forward time, so each TP rank runs its
    local heads unchanged. SDPA takes values narrower than queries/keys (``v_head_dim`` 128 against
    192 in DeepSeek-V3): torch's math and memory-efficient kernels accept it, its flash kernel does
    not and is skipped by SDPA's dispatcher.

    ``recompute_up_proj`` (``ModelConfig.recompute`` "mla_up_proj"): everything between the
    low-rank latents and the q, k, v handed to the attention product (``q_b_proj`` or ``q_proj``,
    ``kv_b_proj``, the latent norms, the rotary embedding) is recomputed in backward. The product
    itself is ``core_attention`` (`AttentionCore`, "core_attn").
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        heads, std = cfg.num_attention_heads, cfg.init_method_std
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.q_proj: Optional[Linear] = None
        self.q_a_proj: Optional[Linear] = None
        self.q_a_layernorm: Optional[RMSNorm] = None
        self.q_b_proj: Optional[Linear] = None
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, heads * qk_head_dim, std)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk_head_dim, std)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, std)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), std)
        self.o_proj = Linear(heads * cfg.v_head_dim, cfg.hidden_size, cfg.output_init_std)
        self.shared_rope_key = SharedRopeKey()
        self.core_attention = AttentionCore()
        self.recompute_up_proj = False
        self.softmax_scale = qk_head_dim**-0.5 * latent_softmax_mscale(cfg.rope_scaling)

    def reset_parameters(self) -> None:
        for module in (
            self.q_proj,
            self.q_a_proj,
            self.q_a_layernorm,
            self.q_b_proj,
            self.kv_a_proj_with_mqa,
            self.kv_a_layernorm,
            self.kv_b_proj,
            self.o_proj,
        ):
            if module is not None:
                module.reset_parameters()

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor, documents: Optional[DocumentMask] = None) -> Tensor:
        batch, seq = x_BSD.shape[:2]
        # the query's input to its up-projection: the normed low-rank latent, or x for a full-rank q_proj
        q_in = x_BSD if self.q_proj is not None else self.q_a_layernorm(self.q_a_proj(x_BSD))
        latent_BSC = self.kv_a_proj_with_mqa(x_BSD)
        if self.recompute_up_proj and torch.is_grad_enabled():
            q, k, v = checkpointed(self._up_project, q_in, latent_BSC, cos, sin)
        else:
            q, k, v = self._up_project(q_in, latent_BSC, cos, sin)
        out_BHSv = self.core_attention(q, k, v, documents, scale=self.softmax_scale)
        return self.o_proj(out_BHSv.transpose(1, 2).reshape(batch, seq, -1))

    def _up_project(self, q_in: Tensor, latent_BSC: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[B, H, S, n + r]``, k ``[B, H, S, n + r]``, v ``[B, H, S, v]`` from the latents."""
        batch, seq = latent_BSC.shape[:2]
        q_BSX = (self.q_proj if self.q_proj is not None else self.q_b_proj)(q_in)
        q_BSHq = q_BSX.view(batch, seq, -1, self.qk_head_dim)
        q_nope_BSHn, q_rope_BSHr = q_BSHq.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        kv_latent_BSL, k_rope_BSr = latent_BSC.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_BSX = self.kv_b_proj(self.kv_a_layernorm(kv_latent_BSL))
        kv_BSHe = kv_BSX.view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope_BSHn, v_BSHv = kv_BSHe.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = k_nope_BSHn.shape[2]

        q_rope_BSHr = norm_rotary(q_rope_BSHr, cos, sin)  # rotary only (one Triton kernel on a GPU)
        k_rope_BS1r = self.shared_rope_key(norm_rotary(k_rope_BSr.unsqueeze(2), cos, sin))
        q_BSHq = torch.cat([q_nope_BSHn, q_rope_BSHr], dim=-1)
        k_BSHq = torch.cat([k_nope_BSHn, k_rope_BS1r.expand(-1, -1, heads, -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q_BSHq, k_BSHq, v_BSHv))
        return q, k, v


def deinterleave_rope_rows(weight_OI: Tensor, head_width: int, rope_offset: int, rope_dim: int) -> Tensor:
    """Reorder the rotary output rows of a projection from interleaved pairs to rotate-half layout.

    DeepSeek's checkpoints rotate pairs ``(2i, 2i + 1)`` of the rotary dims by frequency ``i``
    (HF's ``rope_interleave=True``); this package rotates ``(i, i + r/2)``. Within each block of
    ``head_width`` rows (one head of ``q_b_proj``, or the single block of ``kv_a_proj_with_mqa``),
    rows ``rope_offset .. rope_offset + rope_dim`` become ``[even rows, odd rows]``: the rotated
    queries and keys are then those of the interleaved form with their rotary dims permuted the
    same way, so every attention score is unchanged. ``weight_OI`` is ``[O, I]`` with ``O`` a
    multiple of ``head_width``; a new tensor is returned.
    """
    out_features = weight_OI.shape[0]
    if out_features % head_width or rope_offset + rope_dim > head_width or rope_dim % 2:
        raise ValueError(
            f"cannot de-interleave {rope_dim} rotary rows at offset {rope_offset} of heads of width {head_width} "
            f"in a weight with {out_features} rows."
        )
    order = torch.arange(head_width)
    rope = torch.arange(rope_offset, rope_offset + rope_dim)
    order[rope_offset : rope_offset + rope_dim] = torch.cat([rope[0::2], rope[1::2]])
    blocks = out_features // head_width
    index = (order + head_width * torch.arange(blocks).unsqueeze(1)).reshape(-1)
    return weight_OI[index.to(weight_OI.device)].clone()
