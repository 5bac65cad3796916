"""Lazy reads of a Hugging Face safetensors checkpoint: one slice of one tensor at a time.

A checkpoint directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Nothing is read until a
slice is asked for, and then only that slice (safetensors' ``get_slice``); at most one file is
open (memory-mapped) at a time, so the pages of the host's page cache that a load touches are
those of one shard plus what the caller keeps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_moe.errors import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class HFCheckpointError(InputError, ValueError):
    """An HF checkpoint directory is missing a file or does not match the model; the message
    names the file or tensor."""


def safe_open_module() -> Any:
    """``safetensors.safe_open``, or an error naming the package to install."""
    try:
        from safetensors import safe_open
    except ImportError as err:  # optional dependency
        raise ImportError(
            "reading Hugging Face checkpoints needs safetensors: pip install 'lightning-moe[hf]' (or safetensors)"
        ) from err
    return safe_open


def is_hf_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a ``config.json`` (as ``save_pretrained`` writes)."""
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise HFCheckpointError(f"{file} does not exist: pass a directory written by save_pretrained.")
    return json.loads(file.read_text())


def read_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of a safetensors file, from its JSON header only
    (8 bytes of length, then the header; no tensor data is read)."""
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise HFCheckpointError(f"{file} is not a safetensors file (its header cannot be parsed).") from err
    header.pop("__metadata__", None)
    return {name: (tuple(info["shape"]), _DTYPES[info["dtype"]]) for name, info in header.items()}


class SafetensorsCheckpoint:
    """The tensors of an HF checkpoint directory, read lazily slice by slice.

    ``shape(name)`` / ``dtype(name)`` read headers only; ``read(name, box)`` returns the slice
    ``box`` (one ``slice`` per dimension, steps of 1) as a new CPU tensor. ``bytes_read`` counts
    the bytes of every slice returned, the measure tests use to check that a rank reads only
    what it holds.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._safe_open = safe_open_module()
        index = self.path / INDEX_FILE
        if index.is_file():
            files = sorted({self.path / file for file in json.loads(index.read_text())["weight_map"].values()})
        elif (self.path / SINGLE_FILE).is_file():
            files = [self.path / SINGLE_FILE]
        else:
            raise HFCheckpointError(f"{self.path} holds neither {SINGLE_FILE} nor {INDEX_FILE}.")
        self.files: dict[str, Path] = {}
        self._headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in files:
            if not file.is_file():
                raise HFCheckpointError(f"{file}, named by {index}, does not exist: the checkpoint is incomplete.")
            for name, (shape, dtype) in read_header(file).items():
                self.files[name] = file
                self._headers[name] = (shape, dtype)
        self._open_file: Optional[Path] = None
        self._handle: Any = None
        self.bytes_read = 0

    def names(self) -> set[str]:
        return set(self.files)

    def _file_handle(self, name: str) -> Any:
        if name not in self.files:
            raise HFCheckpointError(f"tensor {name!r} is not in the checkpoint {self.path}.")
        file = self.files[name]
        if file != self._open_file:
            self.close()  # unmap the previous file before mapping the next one
            self._handle = self._safe_open(str(file), framework="pt").__enter__()
            self._open_file = file
        return self._handle

    def _header(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        if name not in self._headers:
            raise HFCheckpointError(f"tensor {name!r} is not in the checkpoint {self.path}.")
        return self._headers[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        return self._header(name)[1]

    def read(self, name: str, box: Sequence[slice]) -> Tensor:
        """The slice ``box`` of tensor ``name`` (a copy, in the checkpoint's dtype)."""
        shape = self.shape(name)
        if len(box) != len(shape):
            raise HFCheckpointError(f"tensor {name!r} has shape {list(shape)}, read with {len(box)} indices.")
        if any(s.stop - s.start <= 0 for s in box):
            return torch.empty([max(0, s.stop - s.start) for s in box], dtype=self.dtype(name))
        tensor = self._file_handle(name).get_slice(name)[tuple(box)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
