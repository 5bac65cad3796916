"""The chunked linear + cross-entropy (`nn.linear_cross_entropy`, the decoder's LM head under
``ModelConfig.lm_head_chunk_tokens``) on a GPU at Qwen3-30B-A3B's LM head shape (8,192 tokens,
width 2,048, 151,936 words, bf16) against the unchunked head (``F.linear`` then the fused
cross-entropy): loss and gradients within the bf16 rounding that the different GEMM tilings and the
order of the fp32 sums allow, the fp32 master weight's gradient through the cached bf16 cast (in-place
accumulation on: the bits of off), no host sync, a CUDA-graph capture, and a peak at least 2 GiB
below the unchunked head's."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

T, D, V = 8192, 2048, 151_936
CHUNK = 2048
GIB = 2**30


def _operands(weight_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).to(weight_dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels[::13] = -100
    return h, w, labels


def _ulp_bf16(x):
    exponent = torch.frexp(x.float().abs().clamp(min=2.0**-126)).exponent
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def _within(a, b, terms, name):
    """``a`` within two units of ``b``'s last place plus 2**-5 of the sum of the absolute terms: the
    logits of the chunked and the whole GEMM may differ by a unit of bf16 (other tilings), which moves
    each softmax term by up to 2**-8 x |logit| (|logit| < 8 here), and dw's fp32 sum runs in another
    order."""
    excess = (a.float() - b.float()).abs() - (2 * _ulp_bf16(b) + 2.0**-5 * terms)
    assert float(excess.max()) <= 0, f"{name}: {float(excess.max()):.3g} beyond the bound"


def test_loss_and_gradients_match_the_unchunked_head():
    from lightning_moe.nn.cross_entropy import cross_entropy_mean
    from lightning_moe.nn.linear_cross_entropy import linear_cross_entropy_mean

    h, w, labels = _operands()
    logits = F.linear(h, w)
    logits.retain_grad()
    ref = cross_entropy_mean(logits, labels)
    (ref / 8).backward()
    ref_dh, ref_dw, g_abs = h.grad, w.grad, logits.grad.float().abs()
    del logits
    h.grad = w.grad = None
    loss = linear_cross_entropy_mean(h, w, labels, chunk_tokens=CHUNK)
    (loss / 8).backward()
    assert abs(float(loss) - float(ref.detach())) <= 1e-4 * float(ref.detach())
    assert (h.grad[::13] == 0).all()
    _within(h.grad, ref_dh, g_abs @ w.detach().float().abs(), "dh")
    _within(w.grad, ref_dw, g_abs.t() @ h.detach().float().abs(), "dw")


def test_master_weight_gradient_through_the_cached_cast_and_in_place_accumulation():
    """An fp32 master weight cast once per step (ComputeWeightCache), two micro-batches: the chunked
    head's fp32 .grad with in-place accumulation has the bits of autograd's accumulation, and is
    within the bound of the unchunked head's."""
    from lightning_moe.nn.compute_weights import ComputeWeightCache, compute_weight
    from lightning_moe.nn.cross_entropy import cross_entropy_mean
    from lightning_moe.nn.linear_cross_entropy import linear_cross_entropy_mean

    h, w, labels = _operands(torch.float32)
    grads = {}
    for name, chunked, in_place in (("unchunked", False, False), ("off", True, False), ("on", True, True)):
        w.grad = None
        cache = ComputeWeightCache(accumulate_grads_in_place=in_place)
        for _ in range(2):
            with cache.active():
                w_bf16 = compute_weight(w, torch.bfloat16)
                if chunked:
                    loss = linear_cross_entropy_mean(h.detach(), w_bf16, labels, chunk_tokens=CHUNK)
                else:
                    loss = cross_entropy_mean(F.linear(h.detach(), w_bf16), labels)
            (loss / 2).backward()
        grads[name] = w.grad.clone()
    assert grads["on"].dtype == torch.float32 and torch.equal(grads["on"], grads["off"])
    # the bound of the bf16 comparison above, from the unchunked logits' gradient of one micro-batch's loss
    logits = F.linear(h.detach(), w.detach().to(torch.bfloat16)).requires_grad_()
    cross_entropy_mean(logits, labels).backward()
    terms = logits.grad.float().abs().t() @ h.detach().float().abs()
    del logits
    _within(grads["off"], grads["unchunked"], 2 * terms, "master dw")


def test_no_host_sync_and_a_cuda_graph_capture_replays_it():
    from lightning_moe.nn.linear_cross_entropy import linear_cross_entropy_mean

    h, w, labels = _operands()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_cross_entropy_mean(h, w, labels, chunk_tokens=CHUNK).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = (h.grad.clone(), w.grad.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture wants
        h.grad = w.grad = None
        linear_cross_entropy_mean(h, w, labels, chunk_tokens=CHUNK).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    h.grad = w.grad = None
    with torch.cuda.graph(graph):
        static_loss = linear_cross_entropy_mean(h, w, labels, chunk_tokens=CHUNK)
        static_loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h.grad, eager[0]) and torch.equal(w.grad, eager[1])


def _peak(fn) -> int:
    h, w, labels = _operands()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(h, w, labels).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del h, w, labels
    return peak


def test_peak_memory_at_least_2_gib_below_the_unchunked_head():
    from lightning_moe.nn.cross_entropy import cross_entropy_mean
    from lightning_moe.nn.linear_cross_entropy import linear_cross_entropy_mean

    unchunked = _peak(lambda h, w, labels: cross_entropy_mean(F.linear(h, w), labels))
    chunked = _peak(lambda h, w, labels: linear_cross_entropy_mean(h, w, labels, chunk_tokens=CHUNK))
    print(f"peak above the operands: unchunked {unchunked / GIB:.2f} GiB, chunked {chunked / GIB:.2f} GiB")
    assert unchunked >= 2 * T * V * 2  # the logits and their gradient
    assert chunked <= unchunked - 2 * GIB
    # what the chunked head holds and makes: the fp32 weight gradient, its bf16 copy, one chunk's logits,
    # dh, its fp32 product with the loss's gradient and its bf16 result, a few [T] vectors, cuBLAS workspaces
    assert chunked <= V * D * (4 + 2) + CHUNK * V * 2 + T * D * (2 * 3 + 4) + 256 * 2**20
