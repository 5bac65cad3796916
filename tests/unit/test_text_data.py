"""Local text / JSONL fine-tuning data: a local tokenizer, packing with EOS, padded tail labels, the
DataModule and the CLI."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_moe.data.datamodule import LMDataModule
from lightning_moe.data.text import (
    IGNORE_INDEX,
    PackedTokenDataset,
    TextDataError,
    build_text_datasets,
    load_tokenizer,
    leading_bos,
    read_documents,
    text_files,
    tokenize_documents,
)

WORDS = ("the expert router sends every token to two experts and the experts send it back "
         "a dense model becomes a mixture of experts when its mlp is copied into each expert").split()


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small BPE tokenizer trained here and saved in transformers' layout (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(_documents(200), trainers.BpeTrainer(vocab_size=120,
                                                                 special_tokens=["<unk>", "<pad>", "<eos>"]))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    path = tmp_path_factory.mktemp("tokenizer")
    wrapped.save_pretrained(path)
    return path


@pytest.fixture
def text_dir(tmp_path) -> Path:
    """Two plain-text documents and a JSONL file of 30 (with a blank line and another field)."""
    root = tmp_path / "texts"
    root.mkdir()
    docs = _documents(32, seed=1)
    (root / "a.txt").write_text(docs[0])
    (root / "b.md").write_text(docs[1])
    lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs[2:])]
    (root / "c.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    (root / "notes.csv").write_text("ignored: not a text suffix")
    return root


def test_documents_are_read_in_order_from_files_and_directories(text_dir):
    files = text_files([str(text_dir)])
    assert [f.name for f in files] == ["a.txt", "b.md", "c.jsonl"]
    docs = list(read_documents(files))
    assert docs == _documents(32, seed=1)
    assert text_files(str(text_dir / "c.jsonl")) == [text_dir / "c.jsonl"]


def test_packing_puts_eos_between_documents_and_pads_the_tail(tokenizer_dir, text_dir):
    tokenizer = load_tokenizer(str(tokenizer_dir))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    train, val = build_text_datasets(str(text_dir), tokenizer, seq_length=16, val_fraction=0.1)
    docs = _documents(32, seed=1)
    expected = [t for d in docs[:29] for t in tokenizer(d, add_special_tokens=False)["input_ids"] + [eos]]
    np.testing.assert_array_equal(train.tokens, expected)
    assert int((val.tokens == eos).sum()) == 3  # the last 10% of the documents
    assert len(train) == -(-(len(expected) - 1) // 16)
    stream_inputs, stream_labels = [], []
    for i in range(len(train)):
        item = train[i]
        assert item["input_ids"].shape == item["labels"].shape == (16,)
        stream_inputs.append(item["input_ids"])
        stream_labels.append(item["labels"])
    inputs, labels = torch.cat(stream_inputs), torch.cat(stream_labels)
    real = len(expected) - 1  # every stream token but the last is an input with a label
    torch.testing.assert_close(inputs[:real], torch.tensor(expected[:-1]))
    torch.testing.assert_close(labels[:real], torch.tensor(expected[1:]))  # labels are the next tokens
    assert inputs[real] == eos  # the stream's last token: an input with nothing to predict
    assert (labels[real:] == IGNORE_INDEX).all() and (inputs[real + 1 :] == pad).all()
    assert (labels[:real] != IGNORE_INDEX).all()


def test_the_datamodule_reads_local_text_with_a_local_tokenizer(tokenizer_dir, text_dir):
    data = LMDataModule(seq_length=16, micro_batch_size=4, text_files=[str(text_dir)], tokenizer=str(tokenizer_dir),
                        val_fraction=0.1)
    assert data.vocab_size == len(load_tokenizer(str(tokenizer_dir)))
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 16)
    assert batch["input_ids"].dtype == torch.int64 and int(batch["input_ids"].max()) < data.vocab_size
    assert len(data.val_dataloader()) >= 1
    field = LMDataModule(seq_length=8, micro_batch_size=1, text_files=str(text_dir / "c.jsonl"),
                         tokenizer=str(tokenizer_dir), text_field="id")
    with pytest.raises(TextDataError, match="no string field 'id'"):
        field.setup()


def test_bad_inputs_fail_early_naming_the_fix(tokenizer_dir, text_dir, tmp_path):
    with pytest.raises(ValueError, match="go together"):
        LMDataModule(seq_length=8, micro_batch_size=1, text_files=str(text_dir))
    with pytest.raises(ValueError, match="drop data_path"):
        LMDataModule(seq_length=8, micro_batch_size=1, text_files=str(text_dir), tokenizer=str(tokenizer_dir),
                     data_path="x")
    with pytest.raises(TextDataError, match="does not exist"):
        LMDataModule(seq_length=8, micro_batch_size=1, text_files=str(tmp_path / "missing.txt"),
                     tokenizer=str(tokenizer_dir))
    with pytest.raises(TextDataError, match="not a directory"):
        load_tokenizer(str(tmp_path / "no_tokenizer"))
    small = LMDataModule(seq_length=8, micro_batch_size=1, text_files=str(text_dir), tokenizer=str(tokenizer_dir),
                         vocab_size=10)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        small.vocab_size
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(TextDataError, match="bad.jsonl:1: not a JSON object"):
        list(read_documents([tmp_path / "bad.jsonl"]))
    assert len(PackedTokenDataset(np.zeros(1, dtype=np.int32), 4, 0)) == 0


def test_json_lists_and_a_tokenizer_that_adds_bos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "d.json").write_text(json.dumps([{"body": "a b"}, {"body": "b a a"}]))
    docs = list(read_documents(text_files(str(tmp_path / "d.json")), text_field="body"))
    assert docs == ["a b", "b a a"]
    (tmp_path / "bad.json").write_text(json.dumps({"body": "a"}))
    with pytest.raises(TextDataError, match="list of objects"):
        list(read_documents([tmp_path / "bad.json"]))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    word = Tokenizer(models.WordLevel(vocab, "<unk>"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    word.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=word, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert leading_bos(llama_like) == [1]
    np.testing.assert_array_equal(tokenize_documents(llama_like, docs), [1, 3, 4, 2, 1, 4, 3, 3, 2])
    word.post_processor = None
    qwen_like = PreTrainedTokenizerFast(tokenizer_object=word, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert leading_bos(qwen_like) == []
    np.testing.assert_array_equal(tokenize_documents(qwen_like, docs), [3, 4, 2, 4, 3, 3, 2])


def test_no_eos_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, "<unk>")))
    wrapped.save_pretrained(tmp_path / "tok")
    with pytest.raises(TextDataError, match="no EOS token"):
        load_tokenizer(str(tmp_path / "tok"))


def test_fine_tuning_from_local_text_through_the_cli(tokenizer_dir, tmp_path, monkeypatch):
    from lightning_moe.cli import MoECLI

    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(300, seed=2)))
    steps = 12
    cli = MoECLI(args=[
        "fit", "--model.config=tiny", "--model.warmup_steps=2", "--model.learning_rate=3e-3",
        f"--data.text_files=[{corpus}]", f"--data.tokenizer={tokenizer_dir}", "--data.seq_length=32",
        "--data.micro_batch_size=4", "--data.val_fraction=0.1",
        f"--trainer.max_steps={steps}", "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0", f"--trainer.val_check_interval={steps}", "--trainer.limit_val_batches=2",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.enable_checkpointing=false",
    ])
    vocab = len(load_tokenizer(str(tokenizer_dir)))
    assert cli.model.model_config.vocab_size == vocab  # linked from the tokenizer
    assert cli.trainer.global_step == steps
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert losses[0] == pytest.approx(np.log(vocab), abs=0.3)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_fine_tuning_an_hf_checkpoint_on_local_text_in_one_command(tokenizer_dir, tmp_path, monkeypatch):
    """``--model.config=HF_DIR --data.tokenizer=HF_DIR``: the checkpoint's embedding (padded past the
    tokenizer's size, as published checkpoints are) keeps its vocabulary and its weights load."""
    import shutil

    import torch
    import transformers

    from lightning_moe.cli import MoECLI

    monkeypatch.setattr(sys, "argv", ["lightning-moe"])
    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16)
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    reference.save_pretrained(hf_dir)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, hf_dir / item.name)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(60, seed=3)))
    cli = MoECLI(args=[
        "fit", f"--model.config={hf_dir}", "--model.learning_rate=1e-12", "--model.warmup_steps=0",
        f"--data.text_files=[{corpus}]", f"--data.tokenizer={hf_dir}", "--data.seq_length=32",
        "--data.micro_batch_size=2", "--trainer.max_steps=2", "--trainer.accelerator=cpu",
        "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
    ])
    assert len(load_tokenizer(str(hf_dir))) < 160 and cli.model.model_config.vocab_size == 160
    assert cli.trainer.global_step == 2
    ids = torch.randint(0, 120, (2, 9))
    with torch.no_grad():
        want = reference(ids).logits
        assert ((cli.model.eval()(ids) - want).norm() / want.norm()).item() < 1e-4
