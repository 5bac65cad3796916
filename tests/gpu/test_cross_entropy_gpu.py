"""The fused cross-entropy (`nn.cross_entropy.cross_entropy_mean` on a GPU with Triton) against
``F.cross_entropy`` on fp32 logits: the loss, the logits' gradient after a backward with a scaled
loss (as gradient accumulation scales it), a vocabulary of Qwen3's size, and the memory it saves."""

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


def test_fused_loss_keeps_no_fp32_copy_of_the_logits():
    from lightning_moe.nn.cross_entropy import cross_entropy_mean

    rows, vocab = 4096, 151_936
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = cross_entropy_mean(logits, labels)
    loss.backward()
    extra = torch.cuda.max_memory_allocated() - base
    # the bf16 gradient buffer (and autograd's .grad of the leaf, the same buffer) and nothing fp32
    assert extra <= 1.1 * logits.numel() * 2, extra / 2**30
