"""The chunked linear + cross-entropy (`nn.linear_cross_entropy`) and the decoder's chunked head
(`ModelConfig.lm_head_chunk_tokens`) against the unchunked head (logits, then `cross_entropy_mean`):
loss and gradients of the hidden states, the weight and a tied embedding, in fp32 (atol 1e-5) and
bf16 (one rounding of a differently ordered fp32 sum: one unit in the last place), with ignored
labels, a partial last chunk and chunk sizes 1, odd and larger than the tokens; no tensor of the
logits' ``[T, V]`` size is made; in-place gradient accumulation gives the bits of autograd's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.models import MoEDecoder, ModelConfig
from lightning_moe.models.decoder import causal_lm_loss
from lightning_moe.nn import linear_cross_entropy as lce
from lightning_moe.nn.compute_weights import ComputeWeightCache
from lightning_moe.nn.cross_entropy import cross_entropy_mean

T, D, V = 13, 8, 37
CHUNKS = (1, 3, 5, 13, 100)  # 1, odd with a partial last chunk (13 = 4 x 3 + 1, 2 x 5 + 3), exactly T, > T


def _operands(dtype, seed=0, ignored=(0, 5, 12)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[list(ignored)] = -100
    return h, w, labels


def _run(fn, h, w, labels, grad_loss):
    h.grad = w.grad = None
    loss = fn(h, w, labels)
    (loss * grad_loss).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _unchunked(h, w, labels):
    return cross_entropy_mean(F.linear(h, w), labels)


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 values (8 significant bits)."""
    exponent = torch.frexp(x.float().abs().clamp(min=2.0**-126)).exponent
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("grad_loss", [1.0, 0.3])
def test_fp32_matches_unchunked(chunk, grad_loss):
    h, w, labels = _operands(torch.float32)
    ref = _run(_unchunked, h, w, labels, grad_loss)
    got = _run(lambda *a: lce.linear_cross_entropy_mean(*a, chunk_tokens=chunk), h, w, labels, grad_loss)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for name, a, b in zip(("loss", "dh", "dw"), got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
    assert ref[2].abs().max() > 1e-2  # a gradient that the comparison can see


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("grad_loss", [0.5, 0.3])
def test_bf16_matches_unchunked(chunk, grad_loss):
    h, w, labels = _operands(torch.bfloat16, seed=1)
    logits = {}

    def unchunked(h, w, labels):
        logits["x"] = F.linear(h, w)
        logits["x"].retain_grad()
        return cross_entropy_mean(logits["x"], labels)

    ref = _run(unchunked, h, w, labels, grad_loss)
    got = _run(lambda *a: lce.linear_cross_entropy_mean(*a, chunk_tokens=chunk), h, w, labels, grad_loss)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    # The loss is fp32 arithmetic on the same bf16 logits (the per-row values summed in another order).
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-5)
    # dh: the same product of the logits' gradient (for a power-of-two grad_loss the same bits: a unit gradient
    # rounded, times 0.5, is the scaled gradient rounded) with w, rounded, then scaled: one unit in the last
    # place; for grad_loss 0.3 the logits' gradient was rounded before the scaling instead of after (one bf16
    # unit, 2**-8 relative, per term) and the product is rounded twice: 2**-8 x |grad| @ |w| + 2 units.
    # dw: an fp32 sum over the tokens in another order (and, for 0.3, the same per-term rounding), rounded once.
    g_abs = logits["x"].grad.float().abs()
    terms = {"dh": g_abs @ w.detach().float().abs(), "dw": g_abs.t() @ h.detach().float().abs()}
    for name, a, b in (("dh", got[1], ref[1]), ("dw", got[2], ref[2])):
        if grad_loss == 0.5:
            allowed = _ulp_bf16(b)
        else:
            allowed = 2 * _ulp_bf16(b) + 2.0**-8 * terms[name]
        assert ((a.float() - b.float()).abs() <= allowed).all(), name
    if grad_loss == 0.5:  # the logits' gradient: the same bits, so dh has the same bits too here
        assert torch.equal(got[1], ref[1])


def test_every_label_ignored_gives_zero_and_no_nan():
    h, w, labels = _operands(torch.float32, ignored=range(T))
    loss, dh, dw = _run(lambda *a: lce.linear_cross_entropy_mean(*a, chunk_tokens=4), h, w, labels, 1.0)
    assert loss.item() == 0.0 and not dh.any() and not dw.any()


def test_no_grad_gives_the_loss():
    h, w, labels = _operands(torch.float32)
    with torch.no_grad():
        loss = lce.linear_cross_entropy_mean(h, w, labels, chunk_tokens=4)
        ref = _unchunked(h, w, labels)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-5)


def test_only_the_hidden_states_or_only_the_weight_need_grad():
    h, w, labels = _operands(torch.float32)
    ref = _run(_unchunked, h, w, labels, 1.0)
    w.requires_grad_(False)
    h.grad = None
    lce.linear_cross_entropy_mean(h, w, labels, chunk_tokens=3).backward()
    torch.testing.assert_close(h.grad, ref[1], rtol=0, atol=1e-5)
    w.requires_grad_(True)
    w.grad = None
    h = h.detach()
    lce.linear_cross_entropy_mean(h, w, labels, chunk_tokens=3).backward()
    torch.testing.assert_close(w.grad, ref[2], rtol=0, atol=1e-5)


class _Shapes(TorchDispatchMode):
    """The shapes of every tensor an op makes (outputs), forward and backward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _largest_vocab_rows(fn, h, w, labels):
    """The most rows of any tensor with a vocabulary-sized last dimension made in forward and
    backward, the weight ``[V, D]`` and its gradient aside."""
    with _Shapes() as mode:
        fn(h, w, labels).backward()
    return max((s[0] for s in mode.shapes if len(s) == 2 and s[-1] == V and s != (D, V)), default=0)


@pytest.mark.parametrize("chunk", [1, 4])
def test_no_tensor_of_the_logits_size(chunk):
    h, w, labels = _operands(torch.bfloat16)
    # The detector sees the unchunked head's [T, V] logits (and their gradient)...
    assert _largest_vocab_rows(_unchunked, h, w, labels) == T
    # ...and nothing above one chunk of them here.
    rows = _largest_vocab_rows(lambda *a: lce.linear_cross_entropy_mean(*a, chunk_tokens=chunk), h, w, labels)
    assert rows == chunk


def test_rejects_a_bad_chunk_and_mismatched_labels():
    h, w, labels = _operands(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        lce.linear_cross_entropy_mean(h, w, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels"):
        lce.linear_cross_entropy_mean(h, w, labels[:-1], chunk_tokens=4)


# ------------------------------------------------------------------ the decoder's head

def _config(**overrides):
    base = dict(vocab_size=V, hidden_size=16, num_layers=2, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=24, first_k_dense_layers=1, max_seq_length=16,
                moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=16, aux_loss_coeff=1e-2, z_loss_coeff=1e-3))
    return ModelConfig(**{**base, **overrides})


def _batch(seed=0, batch=2, seq=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, seq), generator=g)
    labels = torch.randint(0, V, (batch, seq), generator=g)
    labels[0, -1] = labels[1, 3] = -100
    documents = torch.tensor([[0] * 4 + [1] * (seq - 4), [0] * seq])
    return ids, labels, documents


def _decoder_grads(model, ids, labels, documents=None):
    model.zero_grad(set_to_none=True)
    loss = model.loss(ids, labels, document_ids=documents)
    loss.backward()
    aux = {n: v.detach().clone() for m in model.moe_layers() for n, v in m.router.latest_losses.items()}
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, aux


def _twins(**overrides):
    torch.manual_seed(0)
    plain = MoEDecoder(_config(lm_head_chunk_tokens=None, **overrides))
    chunked = MoEDecoder(_config(lm_head_chunk_tokens=5, **overrides))
    chunked.load_state_dict(plain.state_dict())
    return plain, chunked


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_decoder_loss_and_gradients_match_the_unchunked_head(tied, packed):
    plain, chunked = _twins(tie_word_embeddings=tied)
    ids, labels, documents = _batch()
    documents = documents if packed else None
    assert chunked.chunked_head_weight(chunked.hidden_states(ids)) is not None
    assert plain.chunked_head_weight(plain.hidden_states(ids)) is None
    ref_loss, ref_grads, ref_aux = _decoder_grads(plain, ids, labels, documents)
    loss, grads, aux = _decoder_grads(chunked, ids, labels, documents)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, causal_lm_loss(plain(ids, document_ids=documents), labels).detach(),
                               rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    assert ("embed_tokens.weight" in grads) and (("lm_head.weight" in grads) != tied)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5, msg=name)
    assert aux.keys() == ref_aux.keys() and aux
    for name, value in ref_aux.items():
        torch.testing.assert_close(aux[name], value, rtol=0, atol=0, msg=name)


def test_model_call_still_returns_logits():
    plain, chunked = _twins()
    ids, _, _ = _batch()
    logits = chunked(ids)
    assert logits.shape == (*ids.shape, V)
    torch.testing.assert_close(logits, plain(ids), rtol=0, atol=0)


def test_unchunked_where_the_head_is_not_the_plain_linear():
    _, chunked = _twins()
    ids, labels, _ = _batch()
    h = chunked.hidden_states(ids)
    handle = chunked.lm_head.register_forward_hook(lambda *a: None)
    assert chunked.chunked_head_weight(h) is None  # a hook that wants to see the logits
    handle.remove()

    class Replaced(torch.nn.Linear):  # an FP8 or other linear with its own forward
        def forward(self, x):
            return super().forward(x)

    original = chunked.lm_head
    chunked.lm_head = Replaced(16, V, bias=False)
    assert chunked.chunked_head_weight(h) is None
    chunked.lm_head = original
    original.is_fp8_linear = True
    assert chunked.chunked_head_weight(h) is None
    del original.is_fp8_linear
    assert chunked.chunked_head_weight(h) is not None
    # the loss through the unchunked fallback is the same
    with _Shapes() as mode:
        chunked.lm_head.register_forward_hook(lambda *a: None)
        chunked.loss(ids, labels)
    assert (ids.numel(), V) in mode.shapes or (*ids.shape, V) in mode.shapes


def test_decoder_makes_no_logits_in_training():
    _, chunked = _twins()
    ids, labels, _ = _batch()
    with _Shapes() as mode:
        chunked.loss(ids, labels).backward()
    hidden = chunked.config.hidden_size
    assert not [s for s in mode.shapes if s[-1:] == (V,) and s != (hidden, V) and torch.Size(s).numel() > 5 * V]


def test_config_validates_the_chunk():
    with pytest.raises(ValueError, match="lm_head_chunk_tokens"):
        _config(lm_head_chunk_tokens=0)
    assert _config().lm_head_chunk_tokens is None  # off by default until measured on a GPU
    assert _config(lm_head_chunk_tokens=2048).to_dict()["lm_head_chunk_tokens"] == 2048


# ------------------------------------------------------------------ accumulation over micro-batches

def _accumulated(model, batches, in_place, autocast):
    model.zero_grad(set_to_none=True)
    cache = ComputeWeightCache(accumulate_grads_in_place=in_place)
    for ids, labels in batches:
        with cache.active(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(ids, labels)
        (loss / len(batches)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_in_place_accumulation_has_the_bits_of_autograds(autocast, tied, monkeypatch):
    _, chunked = _twins(tie_word_embeddings=tied)
    batches = [_batch(seed)[:2] for seed in range(3)]
    off = _accumulated(chunked, batches, in_place=False, autocast=autocast)
    taken = []
    original = lce.accumulation_grad

    def counting(param, numel):
        main = original(param, numel)
        taken.append(main is not None)
        return main

    monkeypatch.setattr(lce, "accumulation_grad", counting)
    on = _accumulated(chunked, batches, in_place=True, autocast=autocast)
    assert on.keys() == off.keys()
    for name, g in off.items():
        if tied and autocast and name == "embed_tokens.weight":
            # The bf16 cast's backward (not this op) adds the head's share into .grad before autograd adds
            # the lookup's: fp32 sums in another order, as with the unchunked head (lm_head_chunk_tokens=None).
            torch.testing.assert_close(on[name], g, rtol=0, atol=1e-7, msg=name)
            continue
        assert torch.equal(on[name], g), name
    if not autocast and not tied:  # the fp32 head's weight gradient went into .grad here, after the first
        assert taken == [False, True, True]
