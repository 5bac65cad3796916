"""Atomic, reshardable distributed checkpoints (torch.distributed.checkpoint).

A checkpoint is a directory written by DCP (one shard file per rank plus DCP's metadata) and a
``meta.pt`` with the trainer state (step, epoch, loops, callbacks). Every save goes to a
temporary sibling directory first; rank 0 renames it into place only after all ranks have
finished writing, then updates the ``latest`` pointer file atomically. A crash at any point
leaves the previous checkpoint and pointer untouched.

Because every sharded tensor is a DTensor with its global shape, loading into a different
layout (EP2 x EDP2 -> EP4, DP4, one process, ...) reshards automatically.

Loading a path that is no checkpoint raises :class:`CheckpointNotFoundError`; a checkpoint whose
files are missing, truncated (checked against DCP's metadata before reading, so every rank
raises alike) or unreadable raises :class:`CheckpointDamagedError` naming the file. Both are
:class:`~lightning_moe.errors.InputError`: `lightning-moe` prints the message as one line.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_moe.errors import InputError

META_FILE = "meta.pt"
LATEST_FILE = "latest"
DCP_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index of the shard files
_TMP_PREFIX = ".tmp-"


class CheckpointNotFoundError(InputError, FileNotFoundError):
    """A path given to load is no checkpoint (nor a directory whose ``latest`` names one)."""


class CheckpointDamagedError(InputError, RuntimeError):
    """A checkpoint's files are missing, truncated or unreadable; the message names the file."""


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
    metadata = _read_metadata(resolve_checkpoint(Path(path)))
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def nested_optimizer_groups(path: Path, prefix: str) -> bool:
    """Whether the optimizer state under ``prefix`` ("optimizer_0") was saved with torch's nested
    param groups (a list of groups naming their parameters, written by one rank), rather than
    flattened (`StateDictOptions(flatten_optimizer_state_dict=True)`: every hyperparameter keyed by
    its parameter's name). Only the flattened form loads into another pipeline split: a nested
    group lists the parameters of the saving rank's stage only."""
    metadata = _read_metadata(resolve_checkpoint(Path(path)))
    return any(key.startswith(f"{prefix}.param_groups.") and key.endswith(".params") for key in metadata.state_dict_metadata)


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
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check ckpt_path.")
    raise CheckpointNotFoundError(
        f"{path} is not a lightning_moe checkpoint (no {META_FILE}) nor a directory with a valid "
        f"'{LATEST_FILE}' pointer."
    )


def load_distributed(sharded_state: dict[str, Any], path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Load DCP shards into ``sharded_state`` in place (resharding as needed); returns meta.

    Raises :class:`CheckpointDamagedError`, naming the file, when a shard is missing or shorter
    than the DCP metadata says (checked before reading, on every rank alike) or a file cannot be
    read.
    """
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException

    path = resolve_checkpoint(Path(path))
    _check_shard_sizes(path, _read_metadata(path))
    try:
        load(sharded_state, storage_reader=_shard_naming_reader(FileSystemReader)(str(path)))
    except CheckpointException as err:
        raise CheckpointDamagedError(_damaged(path, f"reading its shards failed ({_failures(err)})")) from err
    try:
        return torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    except (EOFError, RuntimeError) as err:  # a truncated or corrupted torch.save zip
        raise CheckpointDamagedError(_damaged(path, f"{path / META_FILE} cannot be read ({_brief(err)})")) from err


class _ShardReadError(RuntimeError):
    """A shard file could not be read; the message names it (travels between ranks pickled)."""


def _shard_naming_reader(reader_class: type) -> type:
    """``reader_class`` (DCP's ``FileSystemReader``) whose ``read_data`` errors name the shard
    file being read: DCP's own (an ``EOFError``, an ``UnpicklingError``) name none."""

    class ShardNamingReader(reader_class):  # type: ignore[misc, valid-type]
        def read_data(self, plan: Any, planner: Any) -> Any:
            fs = getattr(self, "fs", None)
            create_stream = getattr(fs, "create_stream", None)
            if create_stream is None:
                return super().read_data(plan, planner)
            opened: list[str] = []

            def recording(path: Any, mode: str) -> Any:
                opened.append(str(path))
                return create_stream(path, mode)

            fs.create_stream = recording
            try:
                return super().read_data(plan, planner)
            except Exception as err:
                if not opened:
                    raise
                raise _ShardReadError(f"{opened[-1]}: {_brief(err)}") from err
            finally:
                del fs.create_stream

    return ShardNamingReader


def _read_metadata(path: Path) -> Any:
    """DCP's metadata of the checkpoint at ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - missing, truncated or not a pickle
        what = f"{path / DCP_METADATA_FILE} cannot be read ({_brief(err)})"
        raise CheckpointDamagedError(_damaged(path, what)) from err


def _check_shard_sizes(path: Path, metadata: Any) -> None:
    """Every shard file the metadata refers to exists and reaches the end of its last item."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if isinstance(relative, str):
            needed[relative] = max(needed.get(relative, 0), end)
    for relative in sorted(needed):
        shard = path / relative
        if not shard.is_file():
            raise CheckpointDamagedError(_damaged(path, f"its shard {shard} is missing"))
        size = shard.stat().st_size
        if size < needed[relative]:
            what = f"its shard {shard} is truncated ({size} bytes; {DCP_METADATA_FILE} needs {needed[relative]})"
            raise CheckpointDamagedError(_damaged(path, what))


def _damaged(path: Path, what: str) -> str:
    """The message of a :class:`CheckpointDamagedError`: the file at fault, the cause, the fix."""
    others = [p.name for p in _other_checkpoints(path)]
    fix = "Resume from another checkpoint (ckpt_path)."
    if others:
        listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        where = "the current directory" if str(path.parent) == os.curdir else path.parent
        fix = f"Resume from another checkpoint (ckpt_path); {where} also holds: {listed}"
    return (
        f"checkpoint {path} cannot be loaded: {what}. It was not written completely or was damaged "
        f"(an interrupted save or copy, a full disk). {fix}"
    )


def _other_checkpoints(path: Path) -> list[Path]:
    """The checkpoints beside ``path`` (links to it excluded), newest first."""
    try:
        this = path.resolve()
        found = [p for p in path.parent.iterdir() if not p.name.startswith(_TMP_PREFIX) and is_checkpoint_dir(p)]
        found = [p for p in found if p.resolve() != this]
        return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []


def _brief(err: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when there is no message)."""
    if isinstance(err, _ShardReadError):
        return str(err)
    lines = str(err).strip().splitlines()
    if not lines:
        return type(err).__name__
    first = lines[0] if len(lines[0]) <= 100 else lines[0].split(". ")[0]  # e.g. torch.load's weights_only advice
    return f"{type(err).__name__}: {first}"


def _failures(err: Any) -> str:
    """The distinct errors of a DCP ``CheckpointException`` and the ranks that raised them."""
    by_error: dict[str, list[int]] = {}
    for rank, failure in sorted(getattr(err, "failures", {}).items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        by_error.setdefault(_brief(cause) if isinstance(cause, BaseException) else str(cause), []).append(rank)
    if not by_error:
        return _brief(err)
    return "; ".join(
        f"{cause} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for cause, ranks in by_error.items()
    )


def save_consolidated(state_dict: dict[str, Any], path: Path) -> None:
    """Write a full (unsharded) state dict to one file atomically (rank 0 only)."""
    path = Path(path)
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        torch.save(state_dict, tmp)
        os.replace(tmp, path)
    _barrier()
