"""Causal attention that stays inside each document of a packed sequence.

Representation (shared by the data module, the decoder and context parallelism):

* ``document_ids [B, S]`` (integer): the index of the document each token belongs to within its
  row, non-decreasing along the row (``0 0 0 1 1 2 ...``; a row's padded tail is one more document).
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
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("sdpa", "flex")
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
            from torch.nn.attention.flex_attention import create_block_mask

            docs_BS = self.document_ids_BS

            def same_document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return (q_idx >= kv_idx) & (docs_BS[b, q_idx] == docs_BS[b, kv_idx])

            batch, seq = docs_BS.shape
            self._mask = create_block_mask(same_document_causal, batch, None, seq, seq, device=docs_BS.device)
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


__all__ = ["BACKENDS", "DocumentMask", "causal_attention", "document_positions"]
