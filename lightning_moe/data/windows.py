"""Windows over a token stream that may be a lazily mapped file range.

The datasets that cut a stream into windows share how they hold it: an in-memory array as it
is, a `MappedTokens` file range mapped on first use, by each DataLoader worker itself (the
mapping is never pickled into a worker).
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
from torch.utils.data import Dataset

from lightning_moe.data.indexed_dataset import MappedTokens


class LazyTokenWindows(Dataset):
    """Base of the window datasets: ``seq_length``, the stream, and ``_num_windows`` (set by the
    subclass); `_stream` checks an index and returns the mapped stream."""

    def __init__(self, tokens: Union[np.ndarray, MappedTokens], seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length = seq_length
        self._source = tokens
        self._tokens: Optional[np.ndarray] = tokens if isinstance(tokens, np.ndarray) else None
        self._num_windows = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if isinstance(self._source, MappedTokens):
            state["_tokens"] = None  # workers map the file themselves
        return state

    def __len__(self) -> int:
        return self._num_windows

    def _stream(self, i: int) -> np.ndarray:
        """The token stream, mapped on first use, after checking that window ``i`` exists."""
        if not 0 <= i < self._num_windows:
            raise IndexError(f"window {i} out of range for {self._num_windows} windows")
        if self._tokens is None:
            self._tokens = self._source.open()
        return self._tokens
