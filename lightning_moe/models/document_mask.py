"""Causal attention that stays inside each document of a packed sequence.

Representation (shared by the data module, the decoder and context parallelism):

* ``document_ids [B, S]`` (integer): the index of the document each token belongs to within its
  row, non-decreasing along the row (``0 0 0 1 1 2 ...``; a row's padded tail is one more document;
  the ``"flex"`` block mask relies on the order, the ``"sdpa"`` mask only on equality).
* ``position_ids [B, S]``: restart at 0 at each document (:func:`document_positions` derives them).

Query ``q`` attends to key ``k`` of the same row iff ``k <= q`` and both carry the same document
id: Megatron's ``reset_attention_mask`` (a block-diagonal causal mask). Per-token ids are used
instead of cumulative sequence lengths because they are sharded along the sequence exactly like
the tokens (a context-parallel rank keeps the ids of the tokens it holds, whatever the order of
its chunks) and batch as fixed-size tensors; the THD form (``cu_seqlens`` over the ``B x S``
tokens) is the run lengths of the ids of each row, one after the other.

Kernels (one semantics, chosen by device, :class:`DocumentMask` ``backend``):

* ``"sdpa"`` (CPU default): ``F.scaled_dot_product_attention`` with a boolean ``[B, 1, S, S]``
  mask. On CPU FlexAttention has no backward (torch 2.13) and compiling it takes ~20 s.
* ``"flex"`` (CUDA default): compiled FlexAttention with a ``BlockMask`` built once per forward
  and shared by every layer: key blocks outside a query block's documents are skipped, so the work
  falls with the document lengths instead of staying ``S^2 / 2``, and no ``S x S`` mask is stored.
  The block mask is read off the ids at block edges (:func:`document_block_mask`: ids are
  non-decreasing, so a block's first and last ids bound it), ``O(B (S / 128)^2)`` on the device
  with no host sync and nothing to compile.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("sdpa", "flex")
FLEX_BLOCK_SIZE = 128  # FlexAttention's default tile
_compiled_flex_attention: Optional[Callable[..., Tensor]] = None


def document_positions(document_ids_BS: Tensor) -> Tensor:
    """``position_ids [B, S]`` that restart at 0 where the document id changes (no host sync)."""
    seq = document_ids_BS.shape[-1]
    index_BS = torch.arange(seq, device=document_ids_BS.device).expand_as(document_ids_BS)
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[..., 1:] = document_ids_BS[..., 1:] != document_ids_BS[..., :-1]
    # index of the latest document start at or before each token
    first_BS = torch.where(starts_BS, index_BS, torch.zeros_like(index_BS)).cummax(dim=-1).values
    return index_BS - first_BS


def _flex_attention() -> Callable[..., Tensor]:
    """FlexAttention compiled once per process (uncompiled it materialises every score)."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


class DocumentMask:
    """The document structure of one batch, built once per forward and passed to every attention.

    Args:
        document_ids_BS: see the module doc.
        backend: ``"sdpa"`` or ``"flex"``; None: ``"flex"`` on CUDA, ``"sdpa"`` elsewhere.
    """

    def __init__(self, document_ids_BS: Tensor, backend: Optional[str] = None) -> None:
        if document_ids_BS.dim() != 2 or document_ids_BS.is_floating_point():
            raise ValueError(
                f"document_ids must be an integer tensor [batch, seq], got {document_ids_BS.dtype} "
                f"{tuple(document_ids_BS.shape)}; pass the data module's batch['document_ids']."
            )
        if backend is None:
            backend = "flex" if document_ids_BS.is_cuda else "sdpa"
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: choose one of {BACKENDS} (or None for the device's default).")
        self.document_ids_BS = document_ids_BS
        self.backend = backend
        self._mask: Any = None  # the boolean mask or the BlockMask, built on first use

    def _sdpa_mask(self) -> Tensor:
        if self._mask is None:
            docs_BS = self.document_ids_BS
            seq = docs_BS.shape[1]
            causal_SS = torch.ones(seq, seq, dtype=torch.bool, device=docs_BS.device).tril()
            self._mask = ((docs_BS.unsqueeze(2) == docs_BS.unsqueeze(1)) & causal_SS).unsqueeze(1)
        return self._mask

    def _block_mask(self) -> Any:
        if self._mask is None:
            self._mask = document_block_mask(self.document_ids_BS)
        return self._mask

    def attend(self, q_BHSd: Tensor, k_BGSd: Tensor, v_BGSe: Tensor, scale: Optional[float] = None) -> Tensor:
        """Attention ``[B, H, S, e]`` of queries ``[B, H, S, d]`` over keys/values of ``G`` heads
        (grouped-query attention when ``G < H``) within each query's document, causally."""
        if q_BHSd.shape[0] != self.document_ids_BS.shape[0] or q_BHSd.shape[2] != self.document_ids_BS.shape[1]:
            raise ValueError(
                f"document_ids {tuple(self.document_ids_BS.shape)} do not match the queries' batch and sequence "
                f"({q_BHSd.shape[0]}, {q_BHSd.shape[2]}); give one id per input token."
            )
        enable_gqa = q_BHSd.shape[1] != k_BGSd.shape[1]
        if self.backend == "sdpa":
            return F.scaled_dot_product_attention(
                q_BHSd, k_BGSd, v_BGSe, attn_mask=self._sdpa_mask(), scale=scale, enable_gqa=enable_gqa
            )
        flex = _flex_attention() if q_BHSd.is_cuda else _eager_flex_attention()
        return flex(q_BHSd, k_BGSd, v_BGSe, block_mask=self._block_mask(), scale=scale, enable_gqa=enable_gqa)


def same_document_causal_mask_mod(document_ids_BS: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """FlexAttention ``mask_mod``: key visible iff causal and in the query's document."""

    def same_document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx])

    return same_document_causal


def document_block_mask(document_ids_BS: Tensor, block_size: int = FLEX_BLOCK_SIZE) -> Any:
    """The FlexAttention ``BlockMask`` of the same-document causal mask, from the ids at block edges.

    With ids non-decreasing along a row, query block ``i`` and key block ``j <= i`` share a
    document iff the key block's last id reaches the query block's first id (partial block: the
    ``mask_mod`` decides per token), and every pair is visible iff ``j < i`` and the key block's
    first id equals the query block's last id (full block: no ``mask_mod``). Equal to
    ``create_block_mask(same_document_causal_mask_mod(ids), B, None, S, S)`` without evaluating
    the mask on ``S x S`` tokens.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq = document_ids_BS.shape
    num_blocks = -(-seq // block_size)
    device = document_ids_BS.device
    starts_N = torch.arange(num_blocks, device=device) * block_size
    first_BN = document_ids_BS[:, starts_N]
    last_BN = document_ids_BS[:, (starts_N + block_size - 1).clamp(max=seq - 1)]
    block_NN = torch.arange(num_blocks, device=device)
    causal_NN = block_NN.unsqueeze(1) >= block_NN.unsqueeze(0)  # [query block, key block]
    below_NN = block_NN.unsqueeze(1) > block_NN.unsqueeze(0)
    shared_BNN = last_BN.unsqueeze(1) >= first_BN.unsqueeze(2)  # key block's last id >= query block's first
    full_BNN = below_NN & (first_BN.unsqueeze(1) == last_BN.unsqueeze(2))
    partial_BNN = causal_NN & shared_BNN & ~full_BNN

    def ordered(dense_BNN: Tensor) -> tuple[Tensor, Tensor]:
        # per query block: how many key blocks, and their indices first (stable: ascending)
        dense = dense_BNN.unsqueeze(1).to(torch.int32)  # [B, 1 (heads), N, N]
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return dense.sum(dim=-1).to(torch.int32), indices

    return BlockMask.from_kv_blocks(
        *ordered(partial_BNN), *ordered(full_BNN), BLOCK_SIZE=block_size,
        mask_mod=same_document_causal_mask_mod(document_ids_BS), seq_lengths=(seq, seq),
    )


def _eager_flex_attention() -> Callable[..., Tensor]:
    """Uncompiled FlexAttention (forward only off CUDA): checks the ``"flex"`` semantics on a CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def causal_attention(
    q_BHSd: Tensor, k_BGSd: Tensor, v_BGSe: Tensor, documents: Optional[DocumentMask], scale: Optional[float] = None
) -> Tensor:
    """Causal attention, within documents when ``documents`` is given; without it exactly
    ``F.scaled_dot_product_attention(is_causal=True)`` (no mask is built)."""
    if documents is None:
        return F.scaled_dot_product_attention(
            q_BHSd, k_BGSd, v_BGSe, is_causal=True, scale=scale, enable_gqa=q_BHSd.shape[1] != k_BGSd.shape[1]
        )
    return documents.attend(q_BHSd, k_BGSd, v_BGSe, scale)


__all__ = [
    "BACKENDS",
    "DocumentMask",
    "causal_attention",
    "document_block_mask",
    "document_positions",
    "same_document_causal_mask_mod",
]
