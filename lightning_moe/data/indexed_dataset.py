"""Reader and writer for Megatron-Core indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``).

Files produced by Megatron's ``tools/preprocess_data.py`` are read directly, and files written
here are read by Megatron's ``IndexedDataset``. The ``.bin`` file is the concatenation of all
token sequences; the ``.idx`` file (all integers little-endian) is::

    offset  size    field
    0       9       magic b"MMIDIDX\\x00\\x00"
    9       8       version, uint64 == 1
    17      1       dtype code, uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                    6 float64, 7 float32, 8 uint16)
    18      8       sequence count S, uint64
    26      8       document count D, uint64 (entries of the document index array)
    34      4*S     sequence lengths, int32 (in tokens)
            8*S     sequence pointers, int64 (byte offsets into .bin)
            8*D     document indices, int64: document d is sequences
                    [indices[d], indices[d + 1]); indices[0] == 0, indices[-1] == S

A document may hold several sequences (Megatron's sentence splitting). The multimodal variant
(an extra int8 mode per sequence) is rejected. Both files are validated on open so that a
truncated or corrupted dataset fails with a message naming the file, never with wrong tokens.
"""

from __future__ import annotations

import array
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from lightning_moe.errors import InputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
_CHECK_CHUNK = 1 << 22  # validate the index in chunks: bounded memory for huge datasets


def idx_path(path_prefix: Union[str, Path]) -> str:
    """``<prefix>.idx``."""
    return f"{path_prefix}.idx"


def bin_path(path_prefix: Union[str, Path]) -> str:
    """``<prefix>.bin``."""
    return f"{path_prefix}.bin"


class IndexedDatasetNotFoundError(InputError, FileNotFoundError):
    """``<prefix>.bin`` or ``<prefix>.idx`` does not exist; the message says how to make them."""


class IndexedDatasetDamagedError(InputError, ValueError):
    """``<prefix>.bin`` / ``<prefix>.idx`` are truncated, corrupted or of an unsupported variant."""


def _not_found_message(path_prefix: str, missing: list[str]) -> str:
    """What is missing, the prefix meant when a file name was given, and how to write a dataset."""
    stem, suffix = os.path.splitext(path_prefix)
    if suffix in (".bin", ".idx") and os.path.isfile(idx_path(stem)) and os.path.isfile(bin_path(stem)):
        return (
            f"{path_prefix} is a file of the indexed dataset {stem}: give the prefix without "
            f"'{suffix}' ({stem})."
        )
    what = " and ".join(missing) + (" does" if len(missing) == 1 else " do") + " not exist"
    return (
        f"no Megatron indexed dataset at {path_prefix}: {what}. A dataset is the pair "
        "<prefix>.bin + <prefix>.idx, named by its prefix; write one with "
        "lightning_moe.data.IndexedDatasetWriter(prefix).add_document(tokens) or Megatron-LM's "
        "tools/preprocess_data.py."
    )


@dataclass(frozen=True)
class MappedTokens:
    """A contiguous token range of a file, memory-mapped on ``open()``.

    Pickles as the four fields, so DataLoader workers (spawned or forked) map the file
    themselves instead of receiving a copy of the tokens.
    """

    path: str
    dtype: str
    offset: int  # in bytes
    count: int  # in tokens

    def __len__(self) -> int:
        return self.count

    def open(self) -> np.ndarray:
        """The tokens ``[count]`` as a read-only memory map."""
        if self.count == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))


class IndexedDataset:
    """Memory-mapped reader of a Megatron indexed dataset.

    ``dataset[i]`` is sequence ``i`` as a read-only array of the file's dtype.

    Raises:
        IndexedDatasetNotFoundError: ``.idx`` or ``.bin`` is missing (a ``FileNotFoundError``).
        IndexedDatasetDamagedError: the files are truncated, corrupted, or use an unsupported
            variant (a ``ValueError``).
    """

    def __init__(self, path_prefix: Union[str, Path]) -> None:
        self.path_prefix = str(path_prefix)
        self._open()

    def _open(self) -> None:
        idx, bin_ = idx_path(self.path_prefix), bin_path(self.path_prefix)
        missing = [path for path in (bin_, idx) if not os.path.isfile(path)]
        if missing:
            raise IndexedDatasetNotFoundError(_not_found_message(self.path_prefix, missing))
        idx_size, bin_size = os.path.getsize(idx), os.path.getsize(bin_)

        def bad(path: str, what: str) -> ValueError:
            return IndexedDatasetDamagedError(f"invalid indexed dataset file {path}: {what}")

        with open(idx, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise bad(idx, f"{idx_size} bytes, shorter than the {HEADER_BYTES}-byte header (truncated)")
        if header[:9] != MAGIC:
            raise bad(idx, f"bad magic {header[:9]!r}, expected {MAGIC!r} (not an MMIDIDX index)")
        version, code, num_sequences, num_doc_entries = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise bad(idx, f"unsupported version {version}, only version {VERSION} exists")
        if code not in DTYPE_CODES:
            raise bad(idx, f"unknown dtype code {code}, known codes are {sorted(DTYPE_CODES)}")
        expected = HEADER_BYTES + 12 * num_sequences + 8 * num_doc_entries
        if idx_size == expected + num_sequences and num_sequences > 0:
            raise bad(idx, "it carries per-sequence modes (multimodal dataset), which are not supported")
        if idx_size != expected:
            raise bad(
                idx,
                f"header declares {num_sequences} sequences and {num_doc_entries} document index "
                f"entries, which need {expected} bytes, but the file has {idx_size} (truncated or corrupted)",
            )
        if num_doc_entries < 1:
            raise bad(idx, "the document index is empty; it must at least hold the leading 0")

        self.dtype: np.dtype = DTYPE_CODES[code]
        self._idx_map = np.memmap(idx, dtype=np.uint8, mode="r")
        buf = self._idx_map
        off = HEADER_BYTES
        self.sequence_lengths: np.ndarray = np.frombuffer(buf, np.int32, num_sequences, off)
        off += 4 * num_sequences
        self.sequence_pointers: np.ndarray = np.frombuffer(buf, np.int64, num_sequences, off)
        off += 8 * num_sequences
        self.document_indices: np.ndarray = np.frombuffer(buf, np.int64, num_doc_entries, off)
        self._check_index(idx, bad)

        num_bytes = self.num_tokens * self.dtype.itemsize
        if bin_size != num_bytes:
            raise bad(
                bin_,
                f"{bin_size} bytes, but {idx} describes {self.num_tokens} tokens of {self.dtype} = "
                f"{num_bytes} bytes ({'truncated' if bin_size < num_bytes else 'trailing data'})",
            )
        self._bin_map = (
            np.memmap(bin_, dtype=self.dtype, mode="r") if num_bytes else np.empty(0, self.dtype)
        )

    def _check_index(self, idx: str, bad) -> None:
        """Lengths non-negative, pointers contiguous, document indices monotone from 0 to S."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize, expected_start, total = self.dtype.itemsize, 0, 0
        for start in range(0, lengths.size, _CHECK_CHUNK):
            lens = lengths[start : start + _CHECK_CHUNK].astype(np.int64)
            if lens.size and lens.min() < 0:
                raise bad(idx, "negative sequence length (corrupted)")
            ends = expected_start + np.cumsum(lens * itemsize)
            starts = np.concatenate(([expected_start], ends[:-1]))
            if not np.array_equal(pointers[start : start + _CHECK_CHUNK], starts):
                raise bad(idx, "sequence pointers do not match the cumulative sequence lengths (corrupted)")
            expected_start = int(ends[-1])
            total += int(lens.sum())
        self._num_tokens = total
        if docs[0] != 0 or docs[-1] != lengths.size:
            raise bad(
                idx,
                f"document indices must run from 0 to the sequence count {lengths.size}, "
                f"got {int(docs[0])} .. {int(docs[-1])} (corrupted)",
            )
        for start in range(0, docs.size, _CHECK_CHUNK):
            chunk = docs[start : start + _CHECK_CHUNK + 1]
            if chunk.size > 1 and np.any(np.diff(chunk) < 0):
                raise bad(idx, "document indices decrease (corrupted)")

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def _token_offset(self, sequence: int) -> int:
        """Token offset of the start of ``sequence`` (``len(self)`` gives the end of the data)."""
        if sequence == len(self):
            return self._num_tokens
        return int(self.sequence_pointers[sequence]) // self.dtype.itemsize

    def _normalize(self, idx: int) -> int:
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"sequence index must be an integer, got {type(idx).__name__}")
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences")
        return int(idx) % n

    def __getitem__(self, idx: int) -> np.ndarray:
        """Sequence ``idx`` (negative indices count from the end)."""
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (default: to its end)."""
        idx = self._normalize(idx)
        seq_len = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"offset={offset}, length={length} outside sequence {idx} of length {seq_len}"
            )
        start = self._token_offset(idx) + offset
        return self._bin_map[start : start + length]

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences are contiguous in ``.bin``)."""
        start, end = self.document_token_range(doc, doc + 1)
        return self._bin_map[start:end]

    def document_token_range(
        self, first_document: int = 0, last_document: Optional[int] = None
    ) -> tuple[int, int]:
        """Token offsets ``(start, end)`` of documents ``[first_document, last_document)``."""
        last = self.num_documents if last_document is None else last_document
        if not 0 <= first_document <= last <= self.num_documents:
            raise IndexError(
                f"document range [{first_document}, {last}) outside 0..{self.num_documents}"
            )
        start = self._token_offset(int(self.document_indices[first_document]))
        end = self._token_offset(int(self.document_indices[last]))
        return start, end

    def flat_tokens(
        self, first_document: int = 0, last_document: Optional[int] = None
    ) -> np.ndarray:
        """Tokens of documents ``[first_document, last_document)`` as one read-only stream.

        Language-model windows are cut from this stream. Documents are not separated unless the
        data was written with one (Megatron's ``preprocess_data.py --append-eod``).
        """
        start, end = self.document_token_range(first_document, last_document)
        return self._bin_map[start:end]

    def document_ends(self, first_document: int = 0, last_document: Optional[int] = None) -> np.ndarray:
        """``int64 [last - first]``: where each of documents ``[first_document, last_document)`` ends
        (exclusive), as token offsets into their ``flat_tokens`` stream (the boundaries packing keeps)."""
        start, _ = self.document_token_range(first_document, last_document)
        last = self.num_documents if last_document is None else last_document
        end_sequences = np.asarray(self.document_indices[first_document + 1 : last + 1], dtype=np.int64)
        # a document's end is the start of the sequence after its last one (the data's end for the last)
        pointers = np.append(self.sequence_pointers // self.dtype.itemsize, self._num_tokens)
        return pointers[end_sequences] - start

    def mapped_tokens(
        self, first_document: int = 0, last_document: Optional[int] = None
    ) -> MappedTokens:
        """Like ``flat_tokens`` but as a picklable ``MappedTokens`` description."""
        start, end = self.document_token_range(first_document, last_document)
        return MappedTokens(
            path=os.path.abspath(bin_path(self.path_prefix)),
            dtype=self.dtype.str,
            offset=start * self.dtype.itemsize,
            count=end - start,
        )

    def max_token(self) -> int:
        """Largest token id (a full pass over ``.bin``, chunked)."""
        if self.num_tokens == 0:
            raise ValueError(f"{bin_path(self.path_prefix)} holds no tokens")
        chunks = range(0, self.num_tokens, _CHECK_CHUNK)
        return max(int(self._bin_map[s : s + _CHECK_CHUNK].max()) for s in chunks)


class IndexedDatasetWriter:
    """Writes a Megatron indexed dataset, one document at a time.

    Tokens stream to a temporary ``.bin`` next to the target; ``finalize()`` writes the
    ``.idx`` the same way, then renames ``.bin`` and then ``.idx`` into place. An interrupted
    writer leaves any previous dataset at ``path_prefix`` untouched (between the two renames
    a reader sees a size mismatch and raises). Use as a context manager to remove the
    temporary files on error.
    """

    def __init__(
        self, path_prefix: Union[str, Path], dtype: Union[np.dtype, type, str] = np.int32
    ) -> None:
        self.path_prefix = str(path_prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            names = ", ".join(str(d) for d in DTYPE_CODES.values())
            raise ValueError(f"dtype {self.dtype} cannot be stored in an indexed dataset; use one of {names}")
        directory = os.path.dirname(os.path.abspath(self.path_prefix))
        base = os.path.basename(self.path_prefix)
        fd, self._bin_tmp = tempfile.mkstemp(dir=directory, prefix=base + ".bin.", suffix=".tmp")
        self._bin_file = os.fdopen(fd, "wb")
        self._lengths = array.array("q")
        self._doc_indices = array.array("q", [0])
        self._done = False

    def add_document(
        self, tokens: Union[np.ndarray, Sequence[int]], sequence_lengths: Optional[Sequence[int]] = None
    ) -> None:
        """Append one document.

        Args:
            tokens: the document's tokens (any array-like; converted to the dataset dtype,
                values must fit it exactly).
            sequence_lengths: split of the document into sequences (default: one sequence).
        """
        if self._done:
            raise ValueError(f"writer for {self.path_prefix} is already finalized")
        data = np.asarray(tokens).reshape(-1)
        converted = data.astype(self.dtype)
        if data.size and not np.array_equal(converted, data):
            raise ValueError(
                f"tokens do not fit dtype {self.dtype} exactly (range {data.min()}..{data.max()}); "
                "choose a wider dtype"
            )
        lengths = [data.size] if sequence_lengths is None else [int(n) for n in sequence_lengths]
        if sum(lengths) != data.size or any(n < 0 or n >= 2**31 for n in lengths):
            raise ValueError(
                f"sequence_lengths {lengths} must be non-negative int32 values summing to {data.size}"
            )
        self._bin_file.write(converted.tobytes())
        self._lengths.extend(lengths)
        self._doc_indices.append(len(self._lengths))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._done:
            raise ValueError(f"writer for {self.path_prefix} is already finalized")
        self._done = True
        try:
            self._bin_file.flush()
            os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int64)
            pointers = np.zeros(lengths.size, dtype=np.int64)
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            header = MAGIC + struct.pack(
                "<QBQQ", VERSION, _CODE_OF_DTYPE[self.dtype], lengths.size, len(self._doc_indices)
            )
            directory = os.path.dirname(os.path.abspath(self.path_prefix))
            base = os.path.basename(self.path_prefix)
            fd, idx_tmp = tempfile.mkstemp(dir=directory, prefix=base + ".idx.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(header)
                    f.write(lengths.astype("<i4").tobytes())
                    f.write(pointers.astype("<i8").tobytes())
                    f.write(np.frombuffer(self._doc_indices, dtype=np.int64).astype("<i8").tobytes())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(self._bin_tmp, bin_path(self.path_prefix))
                os.replace(idx_tmp, idx_path(self.path_prefix))
            finally:
                if os.path.exists(idx_tmp):
                    os.unlink(idx_tmp)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard the temporary files; the target paths are left as they were."""
        self._done = True
        if not self._bin_file.closed:
            self._bin_file.close()
        if os.path.exists(self._bin_tmp):
            os.unlink(self._bin_tmp)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


__all__ = [
    "DTYPE_CODES",
    "IndexedDataset",
    "IndexedDatasetDamagedError",
    "IndexedDatasetNotFoundError",
    "IndexedDatasetWriter",
    "MappedTokens",
    "bin_path",
    "idx_path",
]
