"""The fused cross-entropy (`nn.cross_entropy.cross_entropy_mean` on a GPU with Triton) against
``F.cross_entropy`` on fp32 logits: the loss, the logits' gradient after a backward with a scaled
loss (as gradient accumulation scales it), a vocabulary of Qwen3's size, the bits of the previous
formulation for a power-of-two scale, the memory it saves and holds, and a CUDA-graph capture."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _reference(logits, labels):
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, labels, reduction="sum") / (labels != -100).sum().clamp(min=1)
    return loss, x


@pytest.mark.parametrize("rows, vocab, dtype", [(512, 151_936, torch.bfloat16), (300, 32_003, torch.float32)])
def test_fused_loss_and_gradient_match_autograd(rows, vocab, dtype):
    import lightning_moe.nn.cross_entropy as ce

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[::7] = -100
    assert ce._fused(logits)
    loss = ce.cross_entropy_mean(logits, labels)
    (loss / 8).backward()
    want, x = _reference(logits, labels)
    (want / 8).backward()
    assert abs(float(loss) - float(want)) <= 2e-6 * float(want)
    scale = float(x.grad.abs().max())
    assert (logits.grad.float() - x.grad.to(dtype).float()).abs().max() <= torch.finfo(dtype).eps * scale + 1e-9
    assert (logits.grad[::7] == 0).all()
    # a power-of-two grad_loss: the bits of the previous formulation, (softmax - onehot) / kept rounded
    # to the dtype (the backward kernel's gradient for grad_loss 1) then scaled in the dtype
    from lightning_moe.kernels.cross_entropy_triton import cross_entropy_backward, cross_entropy_forward

    _, lse, kept = cross_entropy_forward(logits.detach(), labels, -100)
    one = torch.ones((), device="cuda")
    previous = cross_entropy_backward(logits.detach(), labels, lse, kept, one, -100).mul_(one / 8)
    assert torch.equal(logits.grad, previous)


def test_fused_loss_keeps_no_fp32_copy_of_the_logits():
    from lightning_moe.nn.cross_entropy import cross_entropy_mean

    rows, vocab = 4096, 151_936
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cross_entropy_mean(logits, labels)
    # held from the forward to the backward beyond the logits: the [N] fp32 log-sum-exps and scalars
    assert torch.cuda.memory_allocated() - base <= 16 * rows + 2**20
    loss.backward()
    extra = torch.cuda.max_memory_allocated() - base
    # the bf16 gradient, written by the backward (autograd's .grad of the leaf is that buffer), and
    # nothing fp32 of the logits' size
    assert extra <= 1.1 * logits.numel() * 2, extra / 2**30


def test_fused_loss_and_gradient_kernels_capture_in_a_cuda_graph():
    from lightning_moe.kernels.cross_entropy_triton import cross_entropy_backward, cross_entropy_forward

    rows, vocab = 256, 32_003
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::5] = -100
    grad_loss = torch.full((), 0.25, device="cuda")

    def step():
        loss, lse, kept = cross_entropy_forward(logits, labels, -100)
        return loss, cross_entropy_backward(logits, labels, lse, kept, grad_loss, -100)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync would fail the capture
        loss, grad = step()
    logits.copy_(torch.randn_like(logits))
    grad_loss.fill_(0.125)  # read on the device at replay
    graph.replay()
    want_loss, want_grad = step()
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
