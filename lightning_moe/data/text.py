"""Local text for fine-tuning: read documents, tokenize them with a local tokenizer, pack them.

* **Documents.** A ``.jsonl`` file holds one document per line, the string in ``text_field``
  (default "text"; blank lines are skipped); a ``.json`` file a list of such objects. Any other
  file (``.txt``, ``.md``, ...) is one document. A directory stands for its files with these suffixes (``TEXT_SUFFIXES``), recursively,
  in sorted order. Files are read in the order given.
* **Tokenizer.** A local Hugging Face tokenizer directory (``save_pretrained``'s layout: at least
  ``tokenizer.json`` or the slow tokenizer's files and ``tokenizer_config.json``), loaded with
  ``transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)``: nothing is
  downloaded. Documents are tokenized without the tokenizer's special tokens, and its EOS token
  follows each one, so the model learns where a document ends; a tokenizer without an EOS token
  is refused. A tokenizer that puts its BOS token before a text itself (Llama's) gets BOS before
  each document too; one that does not (Qwen's) gets none.
* **Packing.** The documents' tokens are concatenated into one stream (document, EOS, document,
  EOS, ...) and cut into windows of ``S + 1`` tokens as `TokenWindowDataset` does (input = the
  first ``S``, labels = the last ``S``: labels are already shifted). The last, partial window is
  kept, padded with the pad token (EOS when there is none), and its labels are -100 from the
  first padded position on, so no token is lost and no loss is computed on padding. With
  ``pack_sequences`` the windows also carry ``position_ids`` and ``document_ids`` and no label
  crosses a document boundary (`lightning_moe.data.packing`).
* **Split.** The last ``val_fraction`` of the documents (at least one when ``val_fraction > 0``
  and there are two or more) form the validation stream, as for Megatron ``data_path`` data.

Tokenizing happens in ``setup`` on every rank (fast tokenizers batch it in Rust); for corpora too
large for that, write a Megatron indexed dataset once (`IndexedDatasetWriter`) and use
``data_path``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_moe.data.packing import PackedDocumentDataset
from lightning_moe.errors import InputError

IGNORE_INDEX = -100
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json")
_BATCH_DOCUMENTS = 512  # documents per tokenizer call


class TextDataError(InputError, ValueError):
    """A text file or tokenizer directory cannot be used (the message names it and the fix)."""


def text_files(paths: Union[str, Sequence[str]]) -> list[Path]:
    """The files that ``paths`` (files or directories) stand for, in order; fails naming a missing one."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise TextDataError(f"text_files: directory {str(path)!r} holds no {', '.join(TEXT_SUFFIXES)} file.")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise TextDataError(f"text_files: {str(path)!r} does not exist; give existing text/JSONL files or "
                                "directories.")
    if not files:
        raise TextDataError("text_files is empty: give at least one text or JSONL file.")
    return files


def read_documents(files: Sequence[Path], text_field: str = "text") -> Iterator[str]:
    """Every document of ``files`` (see the module doc), in order."""
    for path in files:
        if path.suffix == ".json":
            yield from _json_documents(path, text_field)
            continue
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise TextDataError(f"{path}:{line_number}: not a JSON object ({err.msg}); each line of a .jsonl "
                                        "file must be one.") from None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise TextDataError(f"{path}:{line_number}: no string field {text_field!r}; set text_field to the "
                                        "field holding the text.")
                yield text


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of a ``.json`` file: a list of objects with a string in ``text_field``."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TextDataError(f"{path}: not JSON ({err.msg} at line {err.lineno}).") from None
    if not isinstance(records, list):
        raise TextDataError(f"{path}: a .json file must hold a list of objects (or use .jsonl, one per line).")
    for i, record in enumerate(records):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise TextDataError(f"{path}: item {i} has no string field {text_field!r}; set text_field to the field "
                                "holding the text.")
        yield text


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved in the local directory ``path`` (no download); it must have an EOS token."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise TextDataError(f"tokenizer: {str(directory)!r} is not a directory; give the local directory a tokenizer "
                            "was saved to (tokenizer.save_pretrained(dir)).")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        raise TextDataError(f"tokenizer: cannot load a tokenizer from {str(directory)!r} ({err}); it needs "
                            "save_pretrained's files (tokenizer.json, tokenizer_config.json).") from None
    if tokenizer.eos_token_id is None:
        raise TextDataError(f"tokenizer: {str(directory)!r} has no EOS token, which separates packed documents; set "
                            "eos_token in its tokenizer_config.json.")
    return tokenizer


def leading_bos(tokenizer: Any) -> list[int]:
    """``[bos_token_id]`` when the tokenizer puts BOS before a text by itself (Llama), else ``[]``."""
    bos = tokenizer.bos_token_id
    added = tokenizer("", add_special_tokens=True)["input_ids"]
    return [bos] if bos is not None and added[:1] == [bos] else []


def tokenize_documents(tokenizer: Any, documents: Sequence[str]) -> np.ndarray:
    """One ``int32`` stream: each document's tokens (no special tokens) followed by EOS, preceded by
    BOS where the tokenizer adds one itself (:func:`leading_bos`)."""
    return tokenize_documents_with_ends(tokenizer, documents)[0]


def tokenize_documents_with_ends(tokenizer: Any, documents: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tokenize_documents`'s stream and ``int64 [num_documents]``, where each document
    (BOS and EOS included) ends in it, for packing with document boundaries."""
    bos, eos = leading_bos(tokenizer), [tokenizer.eos_token_id]
    pieces: list[np.ndarray] = []
    for start in range(0, len(documents), _BATCH_DOCUMENTS):
        batch = list(documents[start : start + _BATCH_DOCUMENTS])
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray(bos + ids + eos, dtype=np.int32))
    ends = np.cumsum([piece.size for piece in pieces], dtype=np.int64)
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)), ends


def split_documents(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """``(train, val)``: the last ``val_fraction`` of the documents are validation (at least one when
    ``val_fraction > 0`` and there are two or more documents)."""
    num_val = int(round(len(documents) * val_fraction))
    if val_fraction > 0 and len(documents) > 1:
        num_val = max(1, num_val)
    first_val = len(documents) - num_val
    return documents[:first_val], documents[first_val:]


class PackedTokenDataset(Dataset):
    """Windows of ``seq_length`` tokens of a packed stream, the last partial one padded.

    Item ``i`` is ``{"input_ids": [S], "labels": [S]}`` (int64) from ``tokens[i*S : i*S + S + 1]``,
    labels shifted by one; where the stream ends inside the window, the rest of the input is
    ``pad_id`` and the labels are -100 (:data:`IGNORE_INDEX`).
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, pad_id: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.tokens = tokens
        self.seq_length = seq_length
        self.pad_id = pad_id
        self._num_windows = -(-(len(tokens) - 1) // seq_length) if len(tokens) > 1 else 0

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self._num_windows:
            raise IndexError(f"window {i} out of range for {self._num_windows} windows")
        start = i * self.seq_length
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_length + 1].astype(np.int64))
        window = torch.full((self.seq_length + 1,), self.pad_id, dtype=torch.int64)
        window[: len(chunk)] = chunk
        labels = window[1:].clone()
        labels[len(chunk) - 1 :] = IGNORE_INDEX  # targets past the stream's end are padding
        return {"input_ids": window[:-1], "labels": labels}


def build_text_datasets(
    paths: Union[str, Sequence[str]],
    tokenizer: Any,
    seq_length: int,
    val_fraction: float,
    text_field: str = "text",
    pack_sequences: bool = False,
) -> tuple[Dataset, Dataset]:
    """``(train, val)`` packed datasets from local text files (see the module doc); with
    ``pack_sequences`` they keep the documents apart (`lightning_moe.data.packing`)."""
    documents = list(read_documents(text_files(paths), text_field))
    if not documents:
        raise TextDataError(f"text_files {paths!r} hold no document (only blank JSONL lines?).")
    train_docs, val_docs = split_documents(documents, val_fraction)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pack_sequences:
        train_tokens, train_ends = tokenize_documents_with_ends(tokenizer, train_docs)
        val_tokens, val_ends = tokenize_documents_with_ends(tokenizer, val_docs)
        return (PackedDocumentDataset(train_tokens, train_ends, seq_length, pad_id),
                PackedDocumentDataset(val_tokens, val_ends, seq_length, pad_id))
    return (PackedTokenDataset(tokenize_documents(tokenizer, train_docs), seq_length, pad_id),
            PackedTokenDataset(tokenize_documents(tokenizer, val_docs), seq_length, pad_id))


__all__ = [
    "IGNORE_INDEX",
    "PackedTokenDataset",
    "TextDataError",
    "build_text_datasets",
    "leading_bos",
    "load_tokenizer",
    "read_documents",
    "split_documents",
    "text_files",
    "tokenize_documents",
    "tokenize_documents_with_ends",
]
