"""Building blocks of the reference decoder: initialised linear and embedding layers, RMSNorm, RoPE,
the attention product.

Shared by grouped-query attention (``decoder.Attention``), multi-head latent attention
(``mla.MultiHeadLatentAttention``) and the MLPs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.models.document_mask import DocumentMask, causal_attention
from lightning_moe.models.recompute import checkpointed
from lightning_moe.models.rope_scaling import rope_attention_factor, rope_inv_freq
from lightning_moe.nn.compute_weights import CachedCastLinear
from lightning_moe.parallel.context_parallel import context_parallel_attention

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Linear(CachedCastLinear):
    """``nn.Linear`` (no bias by default) initialised from Normal(0, ``init_std``); its weight is
    cast once per optimizer step under the strategy (`CachedCastLinear`)."""

    def __init__(self, in_features: int, out_features: int, init_std: float, bias: bool = False) -> None:
        self.init_std = init_std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised from Normal(0, ``init_std``) (Megatron's embedding init)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float) -> None:
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole projection output ``[..., N]`` (OLMoE's qk-norm over all heads at once).

    Under tensor parallelism (``sharded_norm_weight_style``: the weight a ``Shard(0)`` DTensor, the
    input this rank's ``N / TP`` slice of a column-parallel projection) the mean of squares spans
    every rank's slice: the local sums of squares are added over the TP ranks, then each rank
    normalises its slice with its slice of the weight.
    """

    def forward(self, x: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(self.weight, DTensor):
            return super().forward(x)
        from lightning_moe.parallel.tensor_parallel import sum_over_tensor_parallel

        x_local = x.float()
        sum_squares = sum_over_tensor_parallel(x_local.pow(2).sum(dim=-1, keepdim=True), self.weight.device_mesh)
        inv_rms = torch.rsqrt(sum_squares / self.weight.shape[0] + self.eps)
        return (x_local * inv_rms * self.weight.to_local().float()).to(x.dtype)


def rotary_cos_sin(
    positions: Tensor, head_dim: int, theta: float, scaling: Optional[dict] = None
) -> tuple[Tensor, Tensor]:
    """fp32 ``cos``, ``sin`` of shape ``[*positions.shape, head_dim]`` (halves repeated, HF layout).

    ``scaling``: a normalised ``ModelConfig.rope_scaling`` (YaRN frequencies and cos/sin factor).
    Computed from the positions on every forward instead of a cached buffer: it costs one small
    elementwise kernel, stays exact under any module dtype cast, and needs nothing on the meta device.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=positions.device)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = rope_attention_factor(scaling)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def apply_rotary(x_BSHd: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, S, H, hd]`` by ``cos``/``sin`` ``[S, hd]`` or ``[B, S, hd]`` (rotate-half form)."""
    cos = cos.unsqueeze(-2)  # broadcast over heads
    sin = sin.unsqueeze(-2)
    x = x_BSHd.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x_BSHd.dtype)


class AttentionCore(nn.Module):
    """The attention product ``softmax(q k^T * scale + mask) v`` of ``q, k, v`` ``[B, H, S, d]``.

    Parameterless; a module of its own so that memory tools address it (Megatron's ``core_attn``:
    `ActivationOffload` and ``ModelConfig.recompute``). With ``recompute`` it keeps only q, k, v
    for backward and recomputes the product there. ``cp_group``: attend across that
    context-parallel group (`context_parallel_attention`), else over the local sequence.
    """

    def __init__(self) -> None:
        super().__init__()
        self.recompute = False

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[DocumentMask] = None,
                scale: Optional[float] = None, cp_group: Optional[ProcessGroup] = None,
                cp_comm_type: str = "p2p") -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpointed(self._attend, q, k, v, documents, scale, cp_group, cp_comm_type)
        return self._attend(q, k, v, documents, scale, cp_group, cp_comm_type)

    @staticmethod
    def _attend(q: Tensor, k: Tensor, v: Tensor, documents: Optional[DocumentMask], scale: Optional[float],
                cp_group: Optional[ProcessGroup], cp_comm_type: str) -> Tensor:
        if cp_group is not None:
            docs_BS = None if documents is None else documents.document_ids_BS
            return context_parallel_attention(q, k, v, cp_group, cp_comm_type, document_ids_BS=docs_BS)
        return causal_attention(q, k, v, documents, scale=scale)
