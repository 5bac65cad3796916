"""Packed sequences in the reference decoder: attention stays inside each document, so a packed
batch gives every document the logits, loss and gradients it gets alone (GQA with qk-norm, MLA);
the SDPA (CPU) and FlexAttention (CUDA) masks agree; the unpacked path is unchanged."""

import pytest
import torch

from lightning_moe.models import MoEDecoder, get_preset
from lightning_moe.models.document_mask import (
    DocumentMask,
    causal_attention,
    document_block_mask,
    document_positions,
    same_document_causal_mask_mod,
)

# Two rows of 24 tokens: row 0 holds documents of 5, 11 and 8 tokens, row 1 of 1, 16 and 7.
LENGTHS = ([5, 11, 8], [1, 16, 7])
SEQ = 24
NO_ROUTER_LOSSES = {"aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}  # batch statistics, not per document


def _gqa():
    return get_preset("tiny", num_layers=2, qk_norm=True, moe=NO_ROUTER_LOSSES)


def _mla():
    return get_preset(
        "tiny", num_layers=2, num_query_groups=None, attention_type="mla", q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, moe=NO_ROUTER_LOSSES,
    )


def _packed_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (2, SEQ), generator=g)
    labels = torch.randint(0, 256, (2, SEQ), generator=g)
    document_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in LENGTHS])
    ends = torch.ones_like(document_ids, dtype=torch.bool)
    ends[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    labels[ends] = -100  # a document's last token predicts nothing (as the data module packs)
    return input_ids, labels, document_ids


def _segments(document_ids):
    for b in range(document_ids.shape[0]):
        for d in document_ids[b].unique().tolist():
            yield b, (document_ids[b] == d).nonzero().squeeze(1)


def _model(cfg_fn):
    torch.manual_seed(0)
    model = MoEDecoder(cfg_fn())
    model.init_weights()
    return model


@pytest.mark.parametrize("cfg_fn", [_gqa, _mla], ids=["gqa_qk_norm", "mla"])
def test_packed_batch_equals_each_document_alone(cfg_fn):
    model = _model(cfg_fn)
    input_ids, labels, document_ids = _packed_batch()
    position_ids = document_positions(document_ids)

    packed_logits = model(input_ids, position_ids, document_ids)
    packed_loss = model.loss(input_ids, labels, position_ids, document_ids)
    tokens = (labels != -100).sum()
    (packed_loss * tokens).backward()  # the summed per-token loss
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    weighted, count = 0.0, 0
    for b, index in _segments(document_ids):
        alone_logits = model(input_ids[b, index][None])  # positions 0..n-1, plain causal attention
        torch.testing.assert_close(packed_logits[b, index][None], alone_logits, rtol=0, atol=2e-5)
        alone_labels = labels[b, index][None]
        n = int((alone_labels != -100).sum())
        if n:
            loss = model.loss(input_ids[b, index][None], alone_labels)
            (loss * n).backward()
            weighted, count = weighted + loss.detach() * n, count + n
    torch.testing.assert_close(packed_loss.detach(), weighted / count, rtol=0, atol=1e-6)
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert alone_grads.keys() == packed_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_one_document_per_row_is_the_unpacked_path():
    model = _model(_gqa)
    input_ids, _, _ = _packed_batch()
    one_document = torch.zeros_like(input_ids)
    torch.testing.assert_close(model(input_ids, document_ids=one_document), model(input_ids), rtol=0, atol=1e-6)


def test_document_positions_restart_at_each_document():
    _, _, document_ids = _packed_batch()
    positions = document_positions(document_ids)
    assert positions[0].tolist() == list(range(5)) + list(range(11)) + list(range(8))
    assert positions[1].tolist() == [0] + list(range(16)) + list(range(7))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("groups,value_dim", [(2, 16), (4, 12)], ids=["gqa", "mla_value_width"])
def test_flex_and_sdpa_masks_agree(groups, value_dim):
    """The CUDA default (FlexAttention BlockMask) and the CPU one (SDPA boolean mask) hide the same
    keys: checked with FlexAttention's eager forward, which runs on a CPU."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, SEQ, 16, generator=g)
    k = torch.randn(2, groups, SEQ, 16, generator=g)
    v = torch.randn(2, groups, SEQ, value_dim, generator=g)
    _, _, document_ids = _packed_batch()
    sdpa = DocumentMask(document_ids, backend="sdpa").attend(q, k, v, scale=0.3)
    with torch.no_grad():
        flex = DocumentMask(document_ids, backend="flex").attend(q, k, v, scale=0.3)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    # a brute-force reference: each document's own causal attention
    for b, index in _segments(document_ids):
        alone = causal_attention(q[b:b + 1, :, index], k[b:b + 1, :, index], v[b:b + 1, :, index], None, scale=0.3)
        torch.testing.assert_close(sdpa[b:b + 1, :, index], alone, rtol=0, atol=1e-6)


def _random_documents(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, 40, (1,), generator=g)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    return torch.stack(rows)


@pytest.mark.parametrize("seq,block", [(48, 8), (64, 16), (256, 128)])
def test_block_mask_from_block_edges_equals_create_block_mask(seq, block):
    """The BlockMask read off the ids at block edges equals FlexAttention's own, built by evaluating
    the mask on every token pair: the same partial and full blocks in the same order. (With a
    partial last block, create_block_mask also evaluates the padding queries past ``S``, whose
    outputs are dropped; the forward test below covers that case.)"""
    from torch.nn.attention.flex_attention import create_block_mask

    for seed in range(3):
        docs = _random_documents(3, seq, seed)
        ours = document_block_mask(docs, block)
        want = create_block_mask(same_document_causal_mask_mod(docs), 3, None, seq, seq, BLOCK_SIZE=block)
        for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(ours, field), getattr(want, field)), field


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_over_several_blocks_and_a_partial_one_equals_sdpa():
    g = torch.Generator().manual_seed(2)
    docs = _random_documents(2, 300, seed=5)
    q, k, v = (torch.randn(2, n, 300, 8, generator=g) for n in (4, 2, 2))
    sdpa = DocumentMask(docs, backend="sdpa").attend(q, k, v)
    with torch.no_grad():
        flex = DocumentMask(docs, backend="flex").attend(q, k, v)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


def test_bad_document_ids_name_the_fix():
    model = _model(_gqa)
    input_ids, _, document_ids = _packed_batch()
    with pytest.raises(ValueError, match="one document index per token"):
        model(input_ids, document_ids=document_ids[:, :-1])
    with pytest.raises(ValueError, match="integer tensor"):
        DocumentMask(document_ids.float())
    with pytest.raises(ValueError, match="choose one of"):
        DocumentMask(document_ids, backend="varlen")
