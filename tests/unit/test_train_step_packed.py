"""`benchmarks/train_step.py --packed`: packed documents of lognormal lengths fill every row exactly,
the batches carry the documents as the packing data module does, both the bare loop and the Lightning
run hand them to the model, and the step's FLOPs count the attention per document."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.train_step import (  # noqa: E402
    batches,
    document_lengths,
    main,
    packed_model_flops,
    step_flops,
)
from lightning_moe.models import get_preset  # noqa: E402
from lightning_moe.models.flops import forward_matmul_parameters, model_flops_per_token  # noqa: E402


def _args(**kw) -> argparse.Namespace:
    base = dict(seq=256, micro_batch=2, packed=True, doc_median=40.0, doc_sigma=1.0, doc_min=8, doc_seed=4321,
                data="random")
    return argparse.Namespace(**{**base, **kw})


def test_packed_flops_count_each_document_by_hand():
    cfg = get_preset("tiny", num_layers=2)
    assert (cfg.num_attention_heads, cfg.head_dim) == (4, 32)
    rows = [[3, 5], [8]]  # two rows of 8 tokens
    # QK^T and PV: 2 FLOPs per multiply-add, H * (head_dim + head_dim) per score pair, 2 layers,
    # forward + backward = 3 x forward: 2 * 4 * 64 * 2 * 3 = 3072 FLOPs per pair; pairs 9 + 25 + 64
    per_pair = 2 * 4 * (32 + 32) * 2 * 3
    assert per_pair == 3072
    matmul = 6 * forward_matmul_parameters(cfg) * 16
    got = packed_model_flops(cfg, rows)
    assert got["tokens"] == 16
    assert got["attention"] == per_pair * (9 + 25 + 64) == 301056
    assert got["matmul"] == matmul and got["total"] == matmul + 301056
    causal = packed_model_flops(cfg, rows, causal=True)
    assert causal["attention"] == per_pair * 98 / 2 and causal["matmul"] == matmul
    # one document filling the row is the unpacked count; cutting it into documents only lowers attention
    assert packed_model_flops(cfg, [[8], [8]])["total"] == pytest.approx(model_flops_per_token(cfg, 8) * 16, rel=1e-12)
    assert packed_model_flops(cfg, [[4, 4], [8]])["total"] < packed_model_flops(cfg, [[8], [8]])["total"]
    with pytest.raises(ValueError, match="positive"):
        packed_model_flops(cfg, [[0, 8]])


def test_step_flops_scale_the_rows_mean_to_the_step():
    cfg = get_preset("tiny", num_layers=1)
    args = _args(seq=64)
    rows = 6
    lengths = document_lengths(args, rows)
    flops = step_flops(args, cfg, tokens=2 * 64, rows=rows)  # a step of two rows
    whole = packed_model_flops(cfg, lengths)
    assert flops["total"] == pytest.approx(whole["total"] * 2 / rows)
    assert flops["total"] - flops["total_causal"] == pytest.approx(flops["attention_flops"] / 2)
    unpacked = step_flops(_args(seq=64, packed=False), cfg, tokens=2 * 64, rows=rows)
    assert unpacked["total"] == pytest.approx(model_flops_per_token(cfg, 64) * 128)
    assert flops["attention_flops"] < unpacked["attention_flops"]  # rows of several documents
    assert flops["total"] - flops["attention_flops"] == pytest.approx(unpacked["total"] - unpacked["attention_flops"])


def test_document_lengths_fill_each_row_and_are_seeded():
    args = _args(seq=4096, doc_median=300.0, doc_sigma=0.5, doc_min=50)
    rows = document_lengths(args, 40)
    assert all(sum(row) == 4096 for row in rows)
    assert all(n >= 50 for row in rows for n in row[:-1])  # only a row's last document is cut
    assert document_lengths(args, 40) == rows and document_lengths(args, 10) == rows[:10]  # seeded, one stream
    inner = sorted(n for row in rows for n in row[:-1])
    assert 240 <= inner[len(inner) // 2] <= 360  # lognormal around the median
    assert document_lengths(_args(seq=4096, doc_median=300.0, doc_sigma=0.5, doc_min=50, doc_seed=1), 40) != rows


def test_packed_batches_carry_documents_positions_and_boundary_labels():
    from lightning_moe.models.document_mask import document_positions

    args = _args(seq=64, doc_median=10.0)
    packed = list(batches(args, 256, 3, "cpu"))
    plain = list(batches(_args(seq=64, packed=False), 256, 3, "cpu"))
    lengths = document_lengths(args, 6)
    for i, (b, p) in enumerate(zip(packed, plain)):
        assert torch.equal(b["input_ids"], p["input_ids"])  # the same tokens as the unpacked run
        for r in range(2):
            row = lengths[2 * i + r]
            docs = torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
            assert torch.equal(b["document_ids"][r], docs)
            ends = torch.tensor(row).cumsum(0)[:-1] - 1
            ignored = (b["labels"][r] == -100).nonzero().flatten()
            assert torch.equal(ignored, ends)  # a document's last token does not predict the next one
            keep = b["labels"][r] != -100
            assert torch.equal(b["labels"][r][keep], p["labels"][r][keep])
        assert torch.equal(b["position_ids"], document_positions(b["document_ids"]))


@pytest.fixture
def recorded_losses(monkeypatch):
    """Every ``MoEDecoder.loss`` call's ``position_ids`` and ``document_ids``."""
    from lightning_moe.models.decoder import MoEDecoder

    calls: list = []
    real = MoEDecoder.loss

    def loss(self, input_ids, labels, position_ids=None, document_ids=None):
        calls.append((input_ids.shape, position_ids, document_ids))
        return real(self, input_ids, labels, position_ids, document_ids)

    monkeypatch.setattr(MoEDecoder, "loss", loss)
    return calls


def _run(tmp_path, tag, *flags) -> dict:
    try:
        main(["--preset", "tiny", "--layers", "1", "--seq", "128", "--micro-batch", "2", "--steps", "2",
              "--warmup", "1", "--accelerator", "cpu", "--results-dir", str(tmp_path), "--tag", tag, *flags])
    finally:  # the Lightning run initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return json.loads((tmp_path / f"train_step_{tag}.json").read_text())


def test_packed_run_end_to_end_on_cpu(tmp_path, monkeypatch, recorded_losses):
    monkeypatch.delenv("OUT", raising=False)
    out = _run(tmp_path, "packed", "--packed", "--doc-median", "24", "--doc-min", "4")
    config = out["config"]
    assert config["packed"] is True and config["doc_median"] == 24
    docs = config["documents"]
    assert docs["rows"] == 3 * 2 and docs["documents"] > docs["rows"]  # (warmup + steps) micro-batches of 2 rows
    assert docs["min"] >= 1 and docs["max"] <= 128 and 0 < docs["attention_pair_fraction"] < 1
    lengths = document_lengths(argparse.Namespace(**config), docs["rows"])
    assert docs["documents"] == sum(map(len, lengths))
    cfg = get_preset("tiny", num_layers=1, max_seq_length=128)
    flops = config["flops_model"]
    assert flops["name"] == "packed_model_flops"
    # the mean of the run's 3 micro-batches (one step each)
    assert config["model_flops_per_step"] == flops["total"]
    assert flops["total"] == pytest.approx(packed_model_flops(cfg, lengths)["total"] / 3)
    assert flops["total"] < model_flops_per_token(cfg, 128) * 256
    assert set(out["results"]) == {"bare_torch", "lightning"}
    for run in out["results"].values():
        median = run["median_step_s"]
        assert run["tflops_per_gpu"] == pytest.approx(flops["total"] / median / 1e12)
        assert run["tflops_per_gpu_causal"] == pytest.approx(flops["total_causal"] / median / 1e12)
        assert len(run["losses"]) == 3 and all(0 < loss < 10 for loss in run["losses"])
    # the same model, seed and packed batches: the bare loop and Lightning train alike
    torch.testing.assert_close(torch.tensor(out["results"]["bare_torch"]["losses"]),
                               torch.tensor(out["results"]["lightning"]["losses"]), rtol=0, atol=1e-4)
    # every loss of both runs (3 micro-batches each) saw the rows' documents and positions
    assert len(recorded_losses) == 6
    for shape, positions, documents in recorded_losses:
        assert documents is not None and positions is not None and documents.shape == shape == positions.shape
        assert int(documents.max()) > 0  # several documents in a row


def test_unpacked_run_keeps_its_flops_and_feeds_no_documents(tmp_path, monkeypatch, recorded_losses):
    monkeypatch.delenv("OUT", raising=False)
    out = _run(tmp_path, "plain", "--skip-bare")
    config = out["config"]
    assert config["packed"] is False and config["documents"] is None
    cfg = get_preset("tiny", num_layers=1, max_seq_length=128)
    assert config["model_flops_per_step"] == pytest.approx(model_flops_per_token(cfg, 128) * 256)
    assert config["flops_model"]["name"] == "model_flops_per_token"
    assert recorded_losses and all(p is None and d is None for _, p, d in recorded_losses)


def test_packed_refuses_the_hf_peer():
    with pytest.raises(SystemExit, match="--packed"):
        main(["--accelerator", "cpu", "--skip-bare", "--packed", "--peer", "hf"])
