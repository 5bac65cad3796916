"""Embedded corpus, Megatron indexed datasets, and LMDataModule sampling."""

from __future__ import annotations

import itertools
import math
import os
import pickle
import random
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_moe.data.corpus import (
    EOD_TOKEN,
    decode,
    encode,
    list_documents,
    load_corpus,
    split_documents,
    stdlib_root,
    unigram_entropy_bits,
    unigram_entropy_nats,
)
from lightning_moe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

SMALL = 200_000  # bytes of the stdlib corpus used by most tests


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))


# ----------------------------------------------------------------------------- corpus


def test_split_is_deterministic_disjoint_and_independent_of_order():
    docs = list_documents()
    assert docs == sorted(docs) and len(docs) > 100
    assert not any(part in ("test", "tests", "site-packages") for d in docs for part in d.split("/"))
    train, val = split_documents(docs, 0.02)
    shuffled = list(docs)
    random.Random(0).shuffle(shuffled)
    assert split_documents(shuffled, 0.02) == (train, val)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(docs)
    assert 0 < len(val) < 0.1 * len(docs)
    # A document keeps its split when other documents come and go.
    sub_train, sub_val = split_documents(docs[::3], 0.02)
    assert set(sub_val) <= set(val) or len(sub_val) == 1
    assert set(sub_train) <= set(train) | set(sub_val)


def test_small_corpus_split_and_cap():
    a = load_corpus(max_bytes=SMALL)
    b = load_corpus(max_bytes=SMALL)
    assert not a.cache_hit and b.cache_hit
    assert a.train_documents == b.train_documents and a.val_documents == b.val_documents
    assert set(a.train_documents).isdisjoint(a.val_documents) and len(a.val_documents) >= 1
    assert a.num_tokens <= SMALL
    assert a.train_tokens.dtype == np.uint8
    # Whole documents, each followed by exactly one separator.
    for tokens, offsets, names in (
        (a.train_tokens, a.train_offsets, a.train_documents),
        (a.val_tokens, a.val_offsets, a.val_documents),
    ):
        assert offsets[-1] == tokens.size
        assert np.count_nonzero(tokens == EOD_TOKEN) == len(names)
        assert np.all(tokens[offsets[1:] - 1] == EOD_TOKEN)


def test_full_stdlib_corpus_loads():
    corpus = load_corpus(use_cache=False)
    assert corpus.num_tokens > 5_000_000
    assert len(corpus.val_documents) >= 1
    assert np.count_nonzero(np.asarray(corpus.train_tokens) == EOD_TOKEN) == len(corpus.train_documents)


def test_document_byte_round_trip():
    corpus = load_corpus(max_bytes=SMALL)
    root = stdlib_root()
    for rel in corpus.train_documents[:3] + corpus.val_documents[:1]:
        assert corpus.document(rel) == (root / rel).read_bytes()
    text = "def f(x):\n    return 'é' + x  # ünïcode\n"
    assert decode(encode(text)) == text
    with pytest.raises(KeyError, match="not a document"):
        corpus.document("no/such/file.py")


def _write_tree(root: Path, n: int = 6) -> None:
    for i in range(n):
        (root / f"mod{i}.py").write_text(f"# module {i}\nVALUE = {i * 11}\n" * (i + 2))


def test_cache_reused_then_invalidated_by_content(tmp_path):
    root, cache = tmp_path / "src", tmp_path / "c"
    (root / "pkg" / "tests").mkdir(parents=True)
    _write_tree(root)
    (root / "pkg" / "tests" / "test_x.py").write_text("assert True\n")
    first = load_corpus(root, cache_dir=cache, val_fraction=0.2)
    assert "pkg/tests/test_x.py" not in first.train_documents + first.val_documents
    second = load_corpus(root, cache_dir=cache, val_fraction=0.2)
    assert not first.cache_hit and second.cache_hit
    assert isinstance(second.train_tokens, np.memmap)
    np.testing.assert_array_equal(first.train_tokens, second.train_tokens)

    # Same size and timestamp, different content: a stat-based key would miss this edit.
    target = root / "mod3.py"
    stat = target.stat()
    target.write_bytes(target.read_bytes().replace(b"VALUE", b"OTHER"))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = load_corpus(root, cache_dir=cache, val_fraction=0.2)
    assert not edited.cache_hit and edited.fingerprint != first.fingerprint
    assert b"OTHER" in edited.document("mod3.py")

    # The split settings are part of the key, and a damaged entry is rebuilt, not trusted.
    assert not load_corpus(root, cache_dir=cache, val_fraction=0.4).cache_hit
    expected = np.array(edited.train_tokens)  # a copy: the damage below truncates the mapped file
    Path(f"{edited.cache_prefix}.train.npy").write_bytes(b"garbage")
    rebuilt = load_corpus(root, cache_dir=cache, val_fraction=0.2)
    assert not rebuilt.cache_hit
    np.testing.assert_array_equal(rebuilt.train_tokens, expected)
    assert load_corpus(root, cache_dir=cache, val_fraction=0.2).cache_hit
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_unigram_entropy_of_known_distributions():
    uniform = np.arange(256, dtype=np.uint8).repeat(3)
    assert unigram_entropy_bits(uniform) == pytest.approx(8.0)
    assert unigram_entropy_nats(uniform) == pytest.approx(math.log(256))
    skewed = np.array([0, 0, 0, 7] * 5)  # p = (3/4, 1/4)
    expected = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))
    assert unigram_entropy_bits(skewed) == pytest.approx(expected)
    assert unigram_entropy_nats(skewed) == pytest.approx(expected * math.log(2))
    assert unigram_entropy_bits(np.full(10, 5)) == 0.0
    with pytest.raises(ValueError):
        unigram_entropy_bits(np.array([], dtype=np.int64))


# ----------------------------------------------------------------------------- indexed dataset

DOCS = [
    ([1, 2, 3, 4, 5], None),
    ([], None),
    ([9, 8, 7, 6, 5, 4, 3], [3, 0, 4]),  # one document of three sequences
    ([100], None),
]


def _write(prefix, dtype, docs=DOCS):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for tokens, lengths in docs:
            writer.add_document(np.asarray(tokens), lengths)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, np.float32])
def test_indexed_dataset_round_trip(tmp_path, dtype):
    prefix = tmp_path / "data"
    _write(prefix, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 6 and ds.num_documents == 4 and ds.num_tokens == 13
    np.testing.assert_array_equal(ds.sequence_lengths, [5, 0, 3, 0, 4, 1])
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 5, 6])
    np.testing.assert_array_equal(ds[0], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(ds[4], [6, 5, 4, 3])
    np.testing.assert_array_equal(ds[-1], [100])
    np.testing.assert_array_equal(ds.get(0, offset=1, length=3), [2, 3, 4])
    np.testing.assert_array_equal(ds.get(4, offset=2), [4, 3])
    np.testing.assert_array_equal(ds.document(2), [9, 8, 7, 6, 5, 4, 3])
    np.testing.assert_array_equal(ds.flat_tokens(), np.concatenate([d for d, _ in DOCS[:1] + DOCS[2:]]))
    np.testing.assert_array_equal(ds.flat_tokens(2, 4), [9, 8, 7, 6, 5, 4, 3, 100])
    np.testing.assert_array_equal(ds.mapped_tokens(2, 4).open(), [9, 8, 7, 6, 5, 4, 3, 100])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(ds))[4], [6, 5, 4, 3])
    with pytest.raises(IndexError):
        ds.get(0, offset=3, length=3)
    with pytest.raises(IndexError):
        ds[6]


def test_indexed_writer_rejects_bad_input_and_is_atomic(tmp_path):
    prefix = tmp_path / "data"
    _write(prefix, np.uint8)
    before = (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes())
    with pytest.raises(ValueError, match="do not fit dtype uint8"):
        with IndexedDatasetWriter(prefix, np.uint8) as writer:
            writer.add_document([1, 2])
            writer.add_document([300])
    with pytest.raises(ValueError, match="sequence_lengths"):
        IndexedDatasetWriter(tmp_path / "other", np.int32).add_document([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match="cannot be stored"):
        IndexedDatasetWriter(tmp_path / "other", np.bool_)
    assert (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("data")) == ["data.bin", "data.idx"]


def _corrupt(tmp_path, suffix, edit):
    prefix = tmp_path / "data"
    _write(prefix, np.int32)
    path = Path(f"{prefix}{suffix}")
    path.write_bytes(edit(path.read_bytes()))
    return prefix, path


@pytest.mark.parametrize(
    "suffix, edit, message",
    [
        (".bin", lambda b: b[:-1], "truncated"),
        (".bin", lambda b: b + b"\x00" * 4, "trailing data"),
        (".idx", lambda b: b[:-8], "truncated or corrupted"),
        (".idx", lambda b: b[:20], "shorter than the 34-byte header"),
        (".idx", lambda b: b"XXIDIDX\x00\x00" + b[9:], "bad magic"),
        (".idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "unsupported version 2"),
        (".idx", lambda b: b[:17] + bytes([9]) + b[18:], "unknown dtype code 9"),
        (".idx", lambda b: b[:34 + 24 + 8] + struct.pack("<q", 4) + b[34 + 24 + 16 :], "pointers"),
        (".idx", lambda b: b[: len(b) - 8] + struct.pack("<q", 5), "document indices"),
    ],
)
def test_indexed_dataset_rejects_damaged_files(tmp_path, suffix, edit, message):
    _, path = _corrupt(tmp_path, suffix, edit)
    with pytest.raises(ValueError, match=message) as err:
        IndexedDataset(tmp_path / "data")
    assert str(path) in str(err.value)


def test_missing_indexed_dataset_says_what_a_prefix_is(tmp_path):
    from lightning_moe.data.datamodule import LMDataModule
    from lightning_moe.data.indexed_dataset import IndexedDatasetNotFoundError
    from lightning_moe.errors import InputError

    prefix = tmp_path / "corpus"
    with pytest.raises(IndexedDatasetNotFoundError) as err:
        LMDataModule(seq_length=8, micro_batch_size=2, data_path=str(prefix)).setup("fit")
    text = str(err.value)
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, InputError)
    assert text.startswith(
        f"data_path: no Megatron indexed dataset at {prefix}: {prefix}.bin and {prefix}.idx do not exist."
    )
    assert "<prefix>.bin + <prefix>.idx" in text and "IndexedDatasetWriter" in text and "preprocess_data.py" in text
    assert text.endswith("Or leave data_path unset to train on the embedded corpus.") and "\n" not in text

    _write(prefix, np.int32)
    for suffix in (".bin", ".idx"):  # the name of one of its files instead of the prefix
        with pytest.raises(FileNotFoundError, match=f"give the prefix without '{suffix}' \\({prefix}\\)"):
            IndexedDataset(f"{prefix}{suffix}")
    os.unlink(f"{prefix}.idx")
    with pytest.raises(FileNotFoundError, match=f"{prefix}.idx does not exist"):
        IndexedDataset(prefix)


def test_megatron_interop(tmp_path):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, size=int(n)) for n in rng.integers(0, 40, size=25)]

    ours = tmp_path / "ours"
    with IndexedDatasetWriter(ours, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = megatron.IndexedDataset(str(ours))
    assert len(theirs) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)

    ref = tmp_path / "megatron"
    builder = megatron.IndexedDatasetBuilder(f"{ref}.bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [doc.size])
    builder.finalize(f"{ref}.idx")
    read = IndexedDataset(ref)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(read[i], doc)
    # Same content, byte-identical files.
    for suffix in (".bin", ".idx"):
        assert Path(f"{ours}{suffix}").read_bytes() == Path(f"{ref}{suffix}").read_bytes()


# ----------------------------------------------------------------------------- datamodule


def _datamodule(rank=None, world=None, **kwargs):
    from lightning_moe.data.datamodule import LMDataModule

    args = dict(seq_length=32, micro_batch_size=4, max_corpus_bytes=SMALL, seed=7)
    args.update(kwargs)
    dm = LMDataModule(**args)
    if world is not None:
        kwargs = dict(num_replicas=world, rank=rank)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))
    dm.setup("fit")
    return dm


def test_datamodule_batches_shapes_and_shift():
    dm = _datamodule()
    assert dm.vocab_size == 256
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and batch["labels"].shape == (4, 32)
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].dtype == torch.int64
    torch.testing.assert_close(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    tokens = torch.from_numpy(np.asarray(load_corpus(max_bytes=SMALL).train_tokens).astype(np.int64))
    num_windows = (tokens.numel() - 1) // 32
    windows = tokens[: num_windows * 32].view(num_windows, 32)
    for row in range(4):
        # Every sample is an aligned window of the stream; its labels are the next tokens.
        start = 32 * int((windows == batch["input_ids"][row]).all(dim=1).nonzero()[0])
        assert torch.equal(tokens[start + 1 : start + 33], batch["labels"][row])
    val = list(dm.val_dataloader())
    assert val and all(b["input_ids"].shape[1] == 32 for b in val)


def _indices(dm, steps=None, epoch=0):
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    per_batch = [list(batch_indices) for batch_indices in loader.batch_sampler]
    return per_batch if steps is None else per_batch[:steps]


def test_datamodule_data_parallel_sharding_is_disjoint_and_reproducible():
    rank0, rank1 = _indices(_datamodule(0, 2)), _indices(_datamodule(1, 2))
    flat0, flat1 = {i for b in rank0 for i in b}, {i for b in rank1 for i in b}
    assert flat0 and flat1 and flat0.isdisjoint(flat1)
    assert _indices(_datamodule(0, 2)) == rank0  # same rank, fresh construction: same batches
    assert _indices(_datamodule(0, 2), epoch=1) != rank0  # the epoch reshuffles
    assert _indices(_datamodule(0, 2, seed=8)) != rank0
    # One step of DP=2 x micro-batch 2 reads the same windows as DP=1 x micro-batch 4.
    single = _indices(_datamodule(micro_batch_size=4), steps=3)
    dp0 = _indices(_datamodule(0, 2, micro_batch_size=2), steps=3)
    dp1 = _indices(_datamodule(1, 2, micro_batch_size=2), steps=3)
    for step in range(3):
        assert sorted(single[step]) == sorted(dp0[step] + dp1[step])
    # Tensor batches differ across DP ranks and repeat for the same rank.
    a = next(iter(_datamodule(0, 2).train_dataloader()))["input_ids"]
    b = next(iter(_datamodule(1, 2).train_dataloader()))["input_ids"]
    assert not torch.equal(a, b)
    assert torch.equal(a, next(iter(_datamodule(0, 2).train_dataloader()))["input_ids"])
    v0, v1 = (list(_datamodule(r, 2).val_dataloader().sampler) for r in (0, 1))
    assert set(v0).isdisjoint(v1) and v0 == sorted(v0)


def test_datamodule_reads_megatron_data(tmp_path):
    prefix = tmp_path / "tok"
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 999, size=200) for _ in range(20)]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    dm = _datamodule(data_path=str(prefix), max_corpus_bytes=None, seq_length=16, val_fraction=0.1)
    assert dm.vocab_size == int(max(d.max() for d in docs)) + 1
    # Megatron-style split: the last 10% of documents validate.
    assert len(dm.train_dataset) == (18 * 200 - 1) // 16 and len(dm.val_dataset) == (2 * 200 - 1) // 16
    first_val = dm.val_dataset[0]
    np.testing.assert_array_equal(first_val["input_ids"].numpy(), docs[18][:16])
    np.testing.assert_array_equal(first_val["labels"].numpy(), docs[18][1:17])
    # Workers receive the file range, not the tokens.
    restored = pickle.loads(pickle.dumps(dm.train_dataset))
    assert len(pickle.dumps(dm.train_dataset)) < 1000
    torch.testing.assert_close(restored[5]["input_ids"], dm.train_dataset[5]["input_ids"])
    assert _datamodule(data_path=str(prefix), max_corpus_bytes=None, vocab_size=4096).vocab_size == 4096


def test_lightning_keeps_our_distributed_sampler():
    """Lightning replaces a sampler only when it is not a DistributedSampler (2.6 behaviour)."""
    import lightning as L
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", devices=2, use_distributed_sampler=True, logger=False
    )
    dm = _datamodule()
    dm.trainer = trainer
    loader = dm.train_dataloader()
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, 0)
    assert _process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, loader) is loader


def test_datamodule_workers_map_the_cached_corpus():
    dm = _datamodule()
    payload = pickle.dumps(dm.train_dataset)
    assert len(payload) < 1000  # a file range, not the tokens
    torch.testing.assert_close(pickle.loads(payload)[3], dm.train_dataset[3])
    with_workers = itertools.islice(_datamodule(num_workers=2).train_dataloader(), 3)
    in_process = itertools.islice(_datamodule().train_dataloader(), 3)
    for a, b in zip(with_workers, in_process, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
