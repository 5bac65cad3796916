"""A checkpoint that cannot be loaded fails with a short message naming the file at fault and the
fix (lightning_moe.parallel.checkpoint), and loading it changes nothing on disk."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lightning_moe.errors import InputError
from lightning_moe.parallel import checkpoint as ckpt


def _state() -> dict:
    return {"state_dict": {"w": torch.zeros(32, 32), "b": torch.zeros(32)}}


@pytest.fixture
def saved(tmp_path) -> Path:
    """``tmp_path/checkpoints`` with two single-process checkpoints, the newest one first in ``latest``."""
    torch.manual_seed(0)
    state = {"state_dict": {"w": torch.randn(32, 32), "b": torch.randn(32)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        ckpt.save_distributed(state, {"epoch": 0}, tmp_path / "checkpoints" / "epoch=0.ckpt")
        ckpt.save_distributed(state, {"epoch": 1}, tmp_path / "checkpoints" / "epoch=1.ckpt")
    return tmp_path / "checkpoints"


def _load(path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ckpt.load_distributed(_state(), path)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "damage, names, message",
    [
        (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:1000]),
         "__0_0.distcp", r"is truncated \(1000 bytes; .metadata needs \d+\)"),
        (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp", "is missing"),
        (lambda d: (d / "__0_0.distcp").write_bytes(b"\xff" * 64 + (d / "__0_0.distcp").read_bytes()[64:]),
         "__0_0.distcp", "reading its shards failed"),
        (lambda d: (d / ".metadata").write_bytes(b""), ".metadata", r"cannot be read \(EOFError"),
        (lambda d: (d / "meta.pt").write_bytes((d / "meta.pt").read_bytes()[:100]), "meta.pt", "cannot be read"),
    ],
    ids=["truncated-shard", "missing-shard", "corrupt-shard", "empty-metadata", "truncated-meta"],
)  # fmt: skip
def test_damaged_checkpoint_names_the_file_and_the_fix(saved, damage, names, message):
    bad = saved / "epoch=1.ckpt"
    damage(bad)
    before = _files(saved)
    for path in (bad, saved):  # the checkpoint itself, or its directory (whose `latest` names it)
        with pytest.raises(ckpt.CheckpointDamagedError, match=message) as err:
            _load(path)
        text = str(err.value)
        assert isinstance(err.value, InputError) and isinstance(err.value, RuntimeError)
        assert text.startswith(f"checkpoint {bad} cannot be loaded: ") and str(bad / names) in text, text
        assert text.endswith(f"Resume from another checkpoint (ckpt_path); {saved} also holds: epoch=0.ckpt"), text
        assert "\n" not in text
    assert _files(saved) == before  # nothing on disk changed
    assert _load(saved / "epoch=0.ckpt") == {"epoch": 0}  # the other checkpoint still loads


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFoundError, match=f"checkpoint {tmp_path / 'nope.ckpt'} does not exist"):
        _load(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError, match="is not a lightning_moe checkpoint"):
        _load(tmp_path)
