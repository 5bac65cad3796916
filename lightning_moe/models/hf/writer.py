"""Writing an HF checkpoint directory tensor by tensor: safetensors shards plus their index.

Tensors are added one at a time and buffered until the buffer reaches ``max_shard_bytes``,
then written as one shard, so at most one shard is held in host memory. Shards are named as
transformers names them (``model-00001-of-00003.safetensors``; one shard: ``model.safetensors``
and no index), which takes their count: they are written under temporary names and renamed
when the last one is done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_moe.models.hf.reader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size_bytes(size: int | str) -> int:
    """Bytes of a shard size given as an int or as transformers writes it ("5GB", "500MB", "2GiB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    text = str(size).strip().upper()
    if text.isdigit():  # a command line's plain number of bytes
        return int(text)
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * _UNITS[unit])
    raise ValueError(f"shard size {size!r} is not a number of bytes or a size like '5GB' / '500MB'.")


class ShardedSafetensorsWriter:
    """``add(name, tensor)`` in any order, then ``finish(config)``; a tensor larger than
    ``max_shard_bytes`` gets a shard of its own."""

    def __init__(self, path: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
        try:
            from safetensors.torch import save_file
        except ImportError as err:  # optional dependency
            raise ImportError(
                "writing Hugging Face checkpoints needs safetensors: pip install 'lightning-moe[hf]' (or safetensors)"
            ) from err
        self._save_file = save_file
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self._buffer or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} was added twice.")
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().cpu().contiguous()
        self._buffer_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        file = self.path / f".shard-{len(self._shards):05d}.tmp"
        self._save_file(self._buffer, str(file), metadata={"format": "pt"})
        self._shards.append((file, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self, config: dict[str, Any]) -> list[Path]:
        """Write the last shard, name the shards, write the index (several shards) and ``config.json``."""
        if self._buffer or not self._shards:
            self._flush()
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        # files of an earlier save into the same directory that this one does not overwrite
        earlier = [self.path / SINGLE_FILE, self.path / INDEX_FILE, *self.path.glob("model-*-of-*.safetensors")]
        for stale in earlier:
            if stale.exists() and stale.name not in names and not (stale.name == INDEX_FILE and count > 1):
                stale.unlink()
        weight_map = {}
        for (tmp, tensors), name in zip(self._shards, names):
            os.replace(tmp, self.path / name)
            weight_map.update({tensor: name for tensor in tensors})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (self.path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return [self.path / name for name in names]
