"""Packed windows that keep documents apart: per-document positions, document ids, no label across a boundary.

`PackedDocumentDataset` cuts the same windows as the unpacked datasets (window ``i`` is
``tokens[i*S : i*S + S + 1]``, inputs the first ``S``, labels the last ``S``) and adds, from the
documents' end offsets, what attention and the loss need to treat each document on its own
(Megatron's GPT dataset options ``reset_position_ids``, ``reset_attention_mask`` and
``eod_mask_loss`` together, with boundaries from the data instead of a search for the EOD token):

* ``position_ids [S]``: 0 at the window's first token and at the first token of each document
  that starts inside it, counting up from there (a document continued from the previous window
  starts at 0 too, as in Megatron: rotary attention depends only on position differences).
* ``document_ids [S]``: 0 for the window's first document, +1 at each document start; a padded
  tail is one more document. This is the representation of `lightning_moe.models.document_mask`,
  which the decoder and context parallelism read.
* ``labels [S]``: -100 where the target is in another document: the last token of a document
  (its EOD separator where the data has one, which then predicts nothing, as with Megatron's
  ``eod_mask_loss``; the token before it still learns to predict the EOD) does not predict the
  first token of the next one. -100 also past the stream's end.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from lightning_moe.data.indexed_dataset import MappedTokens
from lightning_moe.data.windows import LazyTokenWindows

IGNORE_INDEX = -100


class PackedDocumentDataset(LazyTokenWindows):
    """Windows of ``seq_length`` tokens over documents packed back to back (see the module doc).

    Item ``i``: ``{"input_ids", "labels", "position_ids", "document_ids"}``, each ``int64 [S]``.

    Args:
        tokens: the stream, a 1-D array or a ``MappedTokens`` file range (mapped lazily, and by
            each DataLoader worker itself).
        document_ends: ``int64 [num_documents]``, the offset in ``tokens`` where each document
            ends (exclusive), non-decreasing (empty documents are skipped), the last one ``len(tokens)``.
        seq_length: ``S``.
        pad_id: None: only whole windows (the last partial one is dropped, as
            ``TokenWindowDataset`` does); a token id: the last partial window is kept, padded with
            it (labels -100), as ``PackedTokenDataset`` does.
    """

    def __init__(
        self,
        tokens: Union[np.ndarray, MappedTokens],
        document_ends: np.ndarray,
        seq_length: int,
        pad_id: Optional[int] = None,
    ) -> None:
        ends = np.asarray(document_ends, dtype=np.int64)
        if len(tokens) and (ends.size == 0 or ends[-1] != len(tokens) or np.any(np.diff(ends) < 0) or ends[0] < 0):
            raise ValueError(
                f"document_ends must not decrease and must end at the stream length {len(tokens)} (one end offset "
                "per document); build them from the corpus offsets or the indexed dataset's document index."
            )
        super().__init__(tokens, seq_length)
        self.pad_id = pad_id
        self.document_ends = ends
        num_tokens = len(tokens)
        if pad_id is None:
            self._num_windows = max(0, (num_tokens - 1) // seq_length)
        else:
            self._num_windows = -(-(num_tokens - 1) // seq_length) if num_tokens > 1 else 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self._stream(i)
        seq, start = self.seq_length, i * self.seq_length
        chunk = tokens[start : start + seq + 1].astype(np.int64)
        window = np.full(seq + 1, 0 if self.pad_id is None else self.pad_id, dtype=np.int64)
        window[: chunk.size] = chunk
        # Document of every window token; tokens past the stream's end get num_documents (one more).
        document_S1 = np.searchsorted(self.document_ends, start + np.arange(seq + 1), side="right")
        labels = window[1:].copy()
        labels[document_S1[1:] != document_S1[:-1]] = IGNORE_INDEX  # a target in the next document
        labels[chunk.size - 1 :] = IGNORE_INDEX  # targets past the stream's end
        index = np.arange(seq)
        starts = np.ones(seq, dtype=bool)
        starts[1:] = document_S1[1:-1] != document_S1[:-2]
        document_ids = np.cumsum(starts) - 1  # consecutive, also across empty documents
        first_token = np.maximum.accumulate(np.where(starts, index, 0))  # start of each token's document
        return {
            "input_ids": torch.from_numpy(window[:-1]),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(index - first_token),
            "document_ids": torch.from_numpy(document_ids.astype(np.int64)),
        }


__all__ = ["IGNORE_INDEX", "PackedDocumentDataset"]
