"""Atomic, reshardable distributed checkpoints (torch.distributed.checkpoint).

A checkpoint is a directory written by DCP (one shard file per rank plus DCP's metadata) and a
``meta.pt`` with the trainer state (step, epoch, loops, callbacks). Every save goes to a
temporary sibling directory first; rank 0 renames it into place only after all ranks have
finished writing, then updates the ``latest`` pointer file atomically. A crash at any point
leaves the previous checkpoint and pointer untouched.

Because every sharded tensor is a DTensor with its global shape, loading into a different
layout (EP2 x EDP2 -> EP4, DP4, one process, ...) reshards automatically.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

META_FILE = "meta.pt"
LATEST_FILE = "latest"
_TMP_PREFIX = ".tmp-"


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_str(value: str) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    obj = [value]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def save_distributed(
    sharded_state: dict[str, Any],
    meta: dict[str, Any],
    path: Path,
    *,
    crash_hook: Optional[Callable[[str], None]] = None,
) -> Path:
    """Write ``sharded_state`` (DCP) and ``meta`` (rank 0, torch.save) to ``path`` atomically.

    ``crash_hook(stage)`` is called between stages (tests use it to simulate a crash).
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    path = Path(path)
    tmp_name = _broadcast_str(f"{_TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    tmp = path.parent / tmp_name
    if _rank() == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    _barrier()
    save(sharded_state, storage_writer=FileSystemWriter(str(tmp)))
    if crash_hook is not None:
        crash_hook("after_shards")
    if _rank() == 0:
        _check_loadable(meta)
        torch.save(meta, tmp / META_FILE)
        _fsync_dir(tmp)
    _barrier()
    if crash_hook is not None:
        crash_hook("before_rename")
    if _rank() == 0:
        _replace_dir(tmp, path)
        _write_latest(path)
    _barrier()
    return path


def _check_loadable(meta: dict[str, Any]) -> None:
    """Fail at save time if ``meta`` would not load with ``weights_only=True`` (the default)."""
    import io

    for key, value in meta.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except Exception as err:  # the unpickler names the unsupported type
            raise ValueError(
                f"checkpoint entry {key!r} holds a type that cannot be loaded with weights_only=True "
                f"({err.__class__.__name__}: {str(err).splitlines()[0]}); store plain Python values "
                "(e.g. str instead of pathlib.Path) in hyperparameters and callback states."
            ) from err


def saved_prefixes(path: Path) -> set[str]:
    """Top-level keys ("state_dict", "optimizer_0", ...) present in a checkpoint's DCP shards."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(resolve_checkpoint(Path(path)))).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.parent / f"{_TMP_PREFIX}old-{dst.name}-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_latest(path: Path) -> None:
    pointer = path.parent / LATEST_FILE
    tmp = path.parent / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(path.name + "\n")
    os.replace(tmp, pointer)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint; if it is a directory of checkpoints, the one
    its ``latest`` pointer names."""
    path = Path(path)
    if is_checkpoint_dir(path):
        return path
    # A crash between the two renames of an overwrite leaves the previous checkpoint moved aside.
    aside = sorted(path.parent.glob(f"{_TMP_PREFIX}old-{path.name}-*"), key=os.path.getmtime, reverse=True)
    for old in aside:
        if is_checkpoint_dir(old):
            return old
    pointer = path / LATEST_FILE
    if pointer.is_file():
        return resolve_checkpoint(path / pointer.read_text().strip())
    raise FileNotFoundError(
        f"{path} is not a lightning_moe checkpoint (no {META_FILE}) nor a directory with a valid "
        f"'{LATEST_FILE}' pointer."
    )


def load_distributed(sharded_state: dict[str, Any], path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Load DCP shards into ``sharded_state`` in place (resharding as needed); returns meta."""
    from torch.distributed.checkpoint import FileSystemReader, load

    path = resolve_checkpoint(Path(path))
    load(sharded_state, storage_reader=FileSystemReader(str(path)))
    return torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)


def save_consolidated(state_dict: dict[str, Any], path: Path) -> None:
    """Write a full (unsharded) state dict to one file atomically (rank 0 only)."""
    path = Path(path)
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        torch.save(state_dict, tmp)
        os.replace(tmp, path)
    _barrier()
