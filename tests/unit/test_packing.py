"""LMDataModule(pack_sequences=True): per-document positions, document ids and labels that stop at
document boundaries, for the embedded corpus, Megatron .bin/.idx data and local text; equal to
Megatron's reset_position_ids / reset_attention_mask / eod_mask_loss where the data ends documents
with EOD; a packed fit through the CLI."""

from __future__ import annotations

import csv
import sys
import warnings

import numpy as np
import pytest
import torch

from lightning_moe.data.corpus import EOD_TOKEN
from lightning_moe.data.indexed_dataset import IndexedDatasetWriter
from lightning_moe.data.packing import IGNORE_INDEX, PackedDocumentDataset
from lightning_moe.models.document_mask import DocumentMask, document_positions

SMALL = 200_000


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))


def _datamodule(**kwargs):
    from lightning_moe.data.datamodule import LMDataModule

    args = dict(seq_length=64, micro_batch_size=4, max_corpus_bytes=SMALL, seed=7, pack_sequences=True)
    args.update(kwargs)
    dm = LMDataModule(**args)
    dm.setup("fit")
    return dm


def _check_window(item, window_tokens, window_documents):
    """``item`` against a window of ``S + 1`` tokens whose documents are ``window_documents``
    (any labels, one per token; -1 past the stream's end)."""
    doc = np.asarray(window_documents)
    inputs, targets = doc[:-1], doc[1:]
    real = inputs >= 0
    np.testing.assert_array_equal(item["input_ids"].numpy()[real], np.asarray(window_tokens)[:-1][real])
    crosses = (inputs != targets) | (targets < 0)
    labels = item["labels"].numpy()
    assert np.all(labels[crosses] == IGNORE_INDEX)
    np.testing.assert_array_equal(labels[~crosses], np.asarray(window_tokens)[1:][~crosses])
    ids = item["document_ids"].numpy()
    starts = np.r_[True, inputs[1:] != inputs[:-1]]
    np.testing.assert_array_equal(ids, np.cumsum(starts) - 1)
    np.testing.assert_array_equal(item["position_ids"].numpy(), document_positions(torch.from_numpy(ids)[None])[0])


def test_windows_of_a_small_stream():
    tokens = np.arange(100, 117)  # documents of 3, 6, 1 and 7 tokens
    ends = np.array([3, 9, 10, 17])
    data = PackedDocumentDataset(tokens, ends, seq_length=5)
    assert len(data) == 3  # (17 - 1) // 5 whole windows
    first = data[0]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1]
    assert first["document_ids"].tolist() == [0, 0, 0, 1, 1]
    assert first["labels"].tolist() == [101, 102, -100, 104, 105]
    second = data[1]  # tokens 5..10: document 1 continues at position 0 (Megatron), then 2 and 3
    assert second["input_ids"].tolist() == [105, 106, 107, 108, 109]
    assert second["position_ids"].tolist() == [0, 1, 2, 3, 0]
    assert second["document_ids"].tolist() == [0, 0, 0, 0, 1]
    assert second["labels"].tolist() == [106, 107, 108, -100, -100]  # the 1-token document predicts nothing
    padded = PackedDocumentDataset(tokens, ends, seq_length=5, pad_id=0)
    assert len(padded) == 4
    last = padded[3]  # token 15, 16, then padding: one more document
    assert last["input_ids"].tolist() == [115, 116, 0, 0, 0]
    assert last["labels"].tolist() == [116, -100, -100, -100, -100]
    assert last["document_ids"].tolist() == [0, 0, 1, 1, 1] and last["position_ids"].tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match="must end at the stream length"):
        PackedDocumentDataset(tokens, np.array([3, 9]), seq_length=5)


def test_corpus_packing_equals_megatron_eod_options():
    """The corpus ends each document with EOD: Megatron's reset_position_ids, reset_attention_mask
    and eod_mask_loss on the same window give our positions, attention mask and loss mask."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    dm = _datamodule()
    plain = _datamodule(pack_sequences=False)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(t.shape == (4, 64) and t.dtype == torch.int64 for t in batch.values())
    checked_boundaries = 0
    for i in range(len(dm.train_dataset)):
        item, unpacked = dm.train_dataset[i], plain.train_dataset[i]
        torch.testing.assert_close(item["input_ids"], unpacked["input_ids"])  # the same windows
        if i % 50 and not (unpacked["input_ids"] == EOD_TOKEN).any():
            continue  # every window with a boundary, and some without
        tokens = item["input_ids"]
        mask, loss_mask, positions = _get_ltor_masks_and_position_ids(tokens, EOD_TOKEN, True, True, True, True)
        torch.testing.assert_close(item["position_ids"], positions)
        assert torch.equal(item["labels"] == IGNORE_INDEX, loss_mask == 0)
        assert torch.equal(item["labels"][loss_mask == 1], unpacked["labels"][loss_mask == 1])
        visible = DocumentMask(item["document_ids"][None], backend="sdpa")._sdpa_mask()[0, 0]
        assert torch.equal(visible, ~mask[0])
        checked_boundaries += int((tokens == EOD_TOKEN).sum())
    assert checked_boundaries > 10


def test_megatron_data_boundaries_come_from_the_document_index(tmp_path):
    """No EOD in the data: the document index still separates documents (also documents made of
    several sequences, and an empty one)."""
    prefix = tmp_path / "tok"
    rng = np.random.default_rng(1)
    lengths = [7, 30, 1, 0, 45, 12, 20, 9, 33, 18]
    docs = [rng.integers(1, 999, size=n) for n in lengths]
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for doc in docs:
            split = [len(doc) // 2, len(doc) - len(doc) // 2] if len(doc) > 4 else None
            writer.add_document(doc, sequence_lengths=split)
    dm = _datamodule(data_path=str(prefix), max_corpus_bytes=None, seq_length=16, micro_batch_size=2,
                     val_fraction=0.2)
    train_docs = docs[:8]
    stream = np.concatenate(train_docs)
    document_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(train_docs)])
    assert len(dm.train_dataset) == (len(stream) - 1) // 16
    for i in range(len(dm.train_dataset)):
        window = slice(i * 16, i * 16 + 17)
        _check_window(dm.train_dataset[i], stream[window], document_of[window])
    val_stream = np.concatenate(docs[8:])
    val_document_of = np.r_[np.zeros(33, int), np.ones(18, int)]  # validation: the last two documents
    for i in range(len(dm.val_dataset)):
        _check_window(dm.val_dataset[i], val_stream[i * 16 : i * 16 + 17], val_document_of[i * 16 : i * 16 + 17])
    assert dm.val_dataset[2]["labels"][0] == IGNORE_INDEX and dm.val_dataset[2]["position_ids"][1] == 0
    # workers get the file range and the document ends, not the tokens
    import pickle

    assert len(pickle.dumps(dm.train_dataset)) < 2000


def test_local_text_packing(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate("abcdefgh")}}
    word = Tokenizer(models.WordLevel(vocab, "<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word, unk_token="<unk>", pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(tmp_path / "tok")
    texts = ["a b c", "d e f g h a b", "c", "d e", "f g h a b c d e f", "g h", "a", "b c d"]
    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    dm = _datamodule(text_files=[str(tmp_path / "docs.jsonl")], tokenizer=str(tmp_path / "tok"),
                     max_corpus_bytes=None, seq_length=8, micro_batch_size=1, val_fraction=0.25)
    train = [[vocab[w] for w in t.split()] + [2] for t in texts[:6]]
    stream = np.concatenate(train)
    document_of = np.concatenate([np.full(len(d), i) for i, d in enumerate(train)])
    assert len(dm.train_dataset) == -(-(len(stream) - 1) // 8)  # the last window padded
    for i in range(len(dm.train_dataset)):
        window = np.full(9, 1)
        docs = np.full(9, -1)
        part = stream[i * 8 : i * 8 + 9]
        window[: len(part)], docs[: len(part)] = part, document_of[i * 8 : i * 8 + 9]
        item = dm.train_dataset[i]
        _check_window(item, window, docs)
        # every EOS input predicts nothing (eod_mask_loss)
        assert torch.all(item["labels"][item["input_ids"] == 2] == IGNORE_INDEX)
    tail = dm.train_dataset[len(dm.train_dataset) - 1]
    padding = tail["input_ids"] == 1
    assert padding.any() and torch.all(tail["labels"][padding] == IGNORE_INDEX)
    assert tail["document_ids"][padding].unique().numel() == 1  # padding is one document of its own


def test_packed_fit_through_the_cli(tmp_path, monkeypatch):
    """``lightning-moe fit --config examples/configs/tiny_cpu.yaml --data.pack_sequences=true``, shortened."""
    from lightning_moe.cli import MoECLI

    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    seen = []
    from lightning_moe.models.lightning_module import MoELanguageModel

    original = MoELanguageModel._batch_loss
    monkeypatch.setattr(MoELanguageModel, "_batch_loss", lambda self, batch: seen.append(set(batch)) or
                        original(self, batch))
    steps = 6
    cli = MoECLI(args=[
        "fit", "--config", "examples/configs/tiny_cpu.yaml", "--data.pack_sequences=true",
        f"--data.max_corpus_bytes={SMALL}", "--data.micro_batch_size=4", "--data.seq_length=64",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--model.warmup_steps=2",
    ])
    assert cli.datamodule.pack_sequences and cli.trainer.global_step == steps
    assert seen and all(keys == {"input_ids", "labels", "position_ids", "document_ids"} for keys in seen)
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == steps and all(np.isfinite(losses))
    assert any(r.get("val/loss") for r in rows)
