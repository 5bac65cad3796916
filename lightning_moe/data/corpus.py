"""The embedded default corpus: the Python standard library's own source, as bytes.

Every Python installation ships it, so examples, tests and benchmarks train on real text
without a download. Policy (each choice is deterministic and independent of file system order):

* **Documents**: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (or ``root``),
  walked without following directory links. Skipped: ``site-packages`` / ``dist-packages``
  (third-party code, differs per environment), ``__pycache__``, ``_sysconfigdata*.py``
  (generated build configuration that embeds the build machine's paths), and by default test
  directories (``test``, ``tests``, ``idle_test`` at any depth): some distributions ship them
  separately, so leaving them out keeps the corpus the same across installations of one
  Python version. ``include_tests=True`` adds them (CPython 3.11: 12.1 MB -> 31.5 MB).
* **Tokens**: bytes, vocabulary 256, stored as ``uint8``. Every document is followed by
  ``EOD_TOKEN = 0``: NUL never occurs in Python source (a file containing one is skipped), so
  the separator is unambiguous.
* **Order**: documents are concatenated in sorted order of their POSIX relative path.
* **Split**: a document is in validation when the hash of its relative path (SHA-256, the
  first 8 bytes as a fraction of 2**64) is below ``val_fraction``; at least one document
  goes to validation when ``val_fraction > 0`` (the one with the smallest hash), so a small
  corpus still has a validation set. Adding or removing other files never moves a document
  between splits.
* **Cap**: ``max_bytes`` keeps whole documents (counted with their separator) in the order
  of a second, independently salted path hash until the budget is full, so a small corpus
  is a spread-out sample of the library and not its alphabetical prefix.
* **Cache**: the two token streams are saved as ``.npy`` files (memory-mapped on load, so
  every rank and worker on a node shares one page-cached copy) under ``cache_dir``,
  ``$LIGHTNING_MOE_CACHE`` or ``~/.cache/lightning_moe``. The file name carries the Python
  version and a SHA-256 fingerprint of the split settings and of every selected document's
  path and content, so an edited, added or removed file never reads a stale cache. Files are
  written to a temporary name and renamed into place; the metadata file is renamed last
  and marks a complete entry. The cache directory can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Sequence, Union

import numpy as np

VOCAB_SIZE = 256
EOD_TOKEN = 0

# Bump when the token layout or the selection/split policy changes: it is part of the fingerprint.
_FORMAT_VERSION = 1
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_SPLIT_SALT = b"lightning_moe/split\x00"
_SELECT_SALT = b"lightning_moe/select\x00"


@dataclass(frozen=True)
class Corpus:
    """Token streams of one corpus build.

    Attributes:
        root: directory the documents were read from.
        fingerprint: SHA-256 hex digest of the settings and of every selected document.
        train_tokens / val_tokens: ``uint8`` token streams ``[N]`` (memory-mapped when cached),
            each document followed by ``EOD_TOKEN``.
        train_documents / val_documents: relative POSIX paths, in stream order.
        train_offsets / val_offsets: ``int64 [num_documents + 1]``; document ``i`` occupies
            ``tokens[offsets[i] : offsets[i + 1] - 1]``, its separator sits at ``offsets[i + 1] - 1``.
        cache_prefix: path prefix of the cache entry (None when caching was off or failed).
        cache_hit: whether the streams were read from an existing cache entry.
    """

    root: str
    fingerprint: str
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    train_documents: tuple[str, ...]
    val_documents: tuple[str, ...]
    train_offsets: np.ndarray
    val_offsets: np.ndarray
    cache_prefix: Optional[str]
    cache_hit: bool

    @property
    def num_tokens(self) -> int:
        """Tokens in both splits, separators included."""
        return int(self.train_tokens.size + self.val_tokens.size)

    def document(self, relpath: str) -> bytes:
        """The bytes of one document, without its separator."""
        for names, offsets, tokens in (
            (self.train_documents, self.train_offsets, self.train_tokens),
            (self.val_documents, self.val_offsets, self.val_tokens),
        ):
            if relpath in names:
                i = names.index(relpath)
                return tokens[offsets[i] : offsets[i + 1] - 1].tobytes()
        raise KeyError(f"{relpath!r} is not a document of the corpus at {self.root}")


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """``$LIGHTNING_MOE_CACHE`` if set, else ``~/.cache/lightning_moe``."""
    env = os.environ.get("LIGHTNING_MOE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_moe"


def list_documents(root: Union[str, Path, None] = None, include_tests: bool = False) -> list[str]:
    """Sorted relative POSIX paths of the corpus documents under ``root`` (default: the stdlib)."""
    root = Path(root) if root is not None else stdlib_root()
    excluded = _EXCLUDED_DIRS if include_tests else _EXCLUDED_DIRS | _TEST_DIRS
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def _path_fraction(relpath: str, salt: bytes) -> float:
    digest = hashlib.sha256(salt + relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64


def split_documents(relpaths: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation) by the hash of each relative path.

    The result depends only on the set of paths, never on their order. Both lists are sorted.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    paths = sorted(set(relpaths))
    fractions = {p: _path_fraction(p, _SPLIT_SALT) for p in paths}
    val = {p for p in paths if fractions[p] < val_fraction}
    if val_fraction > 0 and not val and len(paths) > 1:
        val = {min(paths, key=fractions.__getitem__)}
    if len(val) == len(paths) and paths:
        raise ValueError(
            f"val_fraction={val_fraction} leaves no training document out of {len(paths)}; "
            "lower val_fraction or raise max_bytes"
        )
    return [p for p in paths if p not in val], sorted(val)


def _select_within_budget(root: Path, relpaths: list[str], max_bytes: int) -> list[str]:
    """Whole documents (size + 1 separator each) in salted-hash order while they fit."""
    chosen, used = [], 0
    for rel in sorted(relpaths, key=lambda p: _path_fraction(p, _SELECT_SALT)):
        size = (root / rel).stat().st_size + 1
        if used + size <= max_bytes:
            chosen.append(rel)
            used += size
    return sorted(chosen)


def _read_documents(root: Path, relpaths: list[str]) -> dict[str, bytes]:
    docs = {}
    for rel in relpaths:
        data = (root / rel).read_bytes()
        if bytes([EOD_TOKEN]) in data:  # the separator must stay unambiguous
            continue
        docs[rel] = data
    return docs


def _fingerprint(docs: dict[str, bytes], val_fraction: float, include_tests: bool) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([_FORMAT_VERSION, val_fraction, include_tests]).encode())
    for rel in sorted(docs):
        data = docs[rel]
        h.update(rel.encode("utf-8") + b"\x00" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _stream(docs: dict[str, bytes], names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    sep = bytes([EOD_TOKEN])
    tokens = np.frombuffer(b"".join(docs[n] + sep for n in names), dtype=np.uint8)
    offsets = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(docs[n]) + 1 for n in names], out=offsets[1:])
    return tokens, offsets


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_cache(prefix: Path, meta: dict, train: np.ndarray, val: np.ndarray) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(Path(f"{prefix}.train.npy"), lambda f: np.save(f, train))
    _atomic_write(Path(f"{prefix}.val.npy"), lambda f: np.save(f, val))
    # Written last: its presence marks a complete entry.
    _atomic_write(Path(f"{prefix}.json"), lambda f: f.write(json.dumps(meta).encode()))


def _read_cache(prefix: Path, fingerprint: str) -> Optional[tuple[dict, np.ndarray, np.ndarray]]:
    """The cached entry if it is complete and consistent, else None (it is then rebuilt)."""
    try:
        meta = json.loads(Path(f"{prefix}.json").read_text())
        train = np.load(f"{prefix}.train.npy", mmap_mode="r")
        val = np.load(f"{prefix}.val.npy", mmap_mode="r")
        ok = (
            meta["fingerprint"] == fingerprint
            and train.dtype == np.uint8
            and val.dtype == np.uint8
            and train.shape == (meta["train_offsets"][-1],)
            and val.shape == (meta["val_offsets"][-1],)
            and len(meta["train_documents"]) + 1 == len(meta["train_offsets"])
            and len(meta["val_documents"]) + 1 == len(meta["val_offsets"])
        )
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return (meta, train, val) if ok else None


def load_corpus(
    root: Union[str, Path, None] = None,
    *,
    max_bytes: Optional[int] = None,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    cache_dir: Union[str, Path, None] = None,
    use_cache: bool = True,
) -> Corpus:
    """Read (or load from cache) the byte-level corpus; see the module docstring for the policy.

    Args:
        root: directory of ``.py`` documents (default: the running interpreter's stdlib).
        max_bytes: cap on the tokens of both splits together, separators included (None: all).
        val_fraction: expected fraction of documents in validation.
        include_tests: also read test directories.
        cache_dir: cache directory (default: ``default_cache_dir()``).
        use_cache: read and write the cache; False always rebuilds in memory.
    """
    root = Path(root) if root is not None else stdlib_root()
    relpaths = list_documents(root, include_tests=include_tests)
    if max_bytes is not None:
        relpaths = _select_within_budget(root, relpaths, max_bytes)
    # Every selected file is read even on a cache hit: the fingerprint is over content, so
    # an edit that keeps a file's size and timestamp still invalidates the cache.
    docs = _read_documents(root, relpaths)
    if len(docs) < 2:
        raise ValueError(
            f"corpus at {root} has {len(docs)} usable document(s) with max_bytes={max_bytes}; "
            "need at least 2 (raise max_bytes or point root at more .py files)"
        )
    train_names, val_names = split_documents(list(docs), val_fraction)
    fingerprint = _fingerprint(docs, val_fraction, include_tests)
    version = f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"
    cache_prefix = Path(cache_dir or default_cache_dir()) / f"corpus-{version}-{fingerprint[:24]}"

    if use_cache:
        cached = _read_cache(cache_prefix, fingerprint)
        if cached is not None:
            meta, train, val = cached
            return Corpus(
                root=str(root),
                fingerprint=fingerprint,
                train_tokens=train,
                val_tokens=val,
                train_documents=tuple(meta["train_documents"]),
                val_documents=tuple(meta["val_documents"]),
                train_offsets=np.asarray(meta["train_offsets"], dtype=np.int64),
                val_offsets=np.asarray(meta["val_offsets"], dtype=np.int64),
                cache_prefix=str(cache_prefix),
                cache_hit=True,
            )

    train, train_offsets = _stream(docs, train_names)
    val, val_offsets = _stream(docs, val_names)
    written = False
    if use_cache:
        meta = {
            "fingerprint": fingerprint,
            "python": version,
            "root": str(root),
            "train_documents": train_names,
            "val_documents": val_names,
            "train_offsets": train_offsets.tolist(),
            "val_offsets": val_offsets.tolist(),
        }
        try:
            _write_cache(cache_prefix, meta, train, val)
            # Serve the written files: every caller then gets the same memory-mapped arrays.
            train = np.load(f"{cache_prefix}.train.npy", mmap_mode="r")
            val = np.load(f"{cache_prefix}.val.npy", mmap_mode="r")
            written = True
        except OSError as err:
            warnings.warn(f"corpus cache not written to {cache_prefix} ({err}); using memory only")
    return Corpus(
        root=str(root),
        fingerprint=fingerprint,
        train_tokens=train,
        val_tokens=val,
        train_documents=tuple(train_names),
        val_documents=tuple(val_names),
        train_offsets=train_offsets,
        val_offsets=val_offsets,
        cache_prefix=str(cache_prefix) if written else None,
        cache_hit=False,
    )


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as ``uint8`` tokens."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: Union[np.ndarray, Sequence[int]]) -> str:
    """Text of byte tokens (invalid UTF-8, e.g. a cut multi-byte character, becomes U+FFFD)."""
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def _unigram_entropy(tokens: Union[np.ndarray, Sequence[int]], log) -> float:
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        raise ValueError("unigram entropy of an empty token sequence is undefined")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    flat = tokens.reshape(-1)
    if int(flat.min()) < 0:
        raise ValueError("tokens must be non-negative")
    counts = np.zeros(int(flat.max()) + 1, dtype=np.int64)
    chunk = 1 << 22  # bincount widens to intp: bound that copy to 32 MiB
    for start in range(0, flat.size, chunk):
        part = np.bincount(flat[start : start + chunk], minlength=counts.size)
        counts += part
    p = counts[counts > 0] / flat.size
    return float(-(p * log(p)).sum())


def unigram_entropy_bits(tokens: Union[np.ndarray, Sequence[int]]) -> float:
    """Entropy of the token frequency distribution, in bits per token (bits/byte here).

    A model whose loss is below this has learned more than token frequencies.
    """
    return _unigram_entropy(tokens, np.log2)


def unigram_entropy_nats(tokens: Union[np.ndarray, Sequence[int]]) -> float:
    """Entropy of the token frequency distribution in nats, the unit of cross-entropy losses."""
    return _unigram_entropy(tokens, np.log)


__all__ = [
    "Corpus",
    "EOD_TOKEN",
    "VOCAB_SIZE",
    "decode",
    "default_cache_dir",
    "encode",
    "list_documents",
    "load_corpus",
    "split_documents",
    "stdlib_root",
    "unigram_entropy_bits",
    "unigram_entropy_nats",
]
