"""The cross-entropy kernels (`kernels.cross_entropy_triton`) and their autograd function
(`nn.cross_entropy._FusedCrossEntropyMean`) run on CPU under Triton's interpreter, against
``F.cross_entropy`` on fp32 logits and its autograd gradient: bf16, fp16 and fp32 logits, a
vocabulary that is no multiple of the block (a partial last block), ignored labels (-100 and
another ignore index), every label ignored, a strided row layout, and the loss's gradient
``grad_loss`` 1, 0.125 and 0.3. For a power-of-two ``grad_loss`` the gradient must have the bits of
the previous formulation (``(softmax - onehot) / kept`` rounded to the logits' dtype, then
multiplied by ``grad_loss``); the logits must be left as they were. Run as a script with
``TRITON_INTERPRET=1`` (see `_interpreted_casts.py`); prints one line per case and ``grad_loss`` and
exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_moe.kernels import cross_entropy_triton as kernel  # noqa: E402
from lightning_moe.nn.cross_entropy import _FusedCrossEntropyMean  # noqa: E402

GRAD_LOSSES = (1.0, 0.125, 0.3)  # 1, a power of two (1 / accumulation steps), neither
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def reference(logits, labels, ignore_index, grad_loss):
    """Autograd's loss and gradient on fp32 logits, for the loss scaled by ``grad_loss``."""
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="sum")
    loss = loss / (labels != ignore_index).sum().clamp(min=1)
    (loss * grad_loss).backward()
    return loss.detach(), x.grad


def previous(logits, labels, ignore_index, lse, grad_loss):
    """The previous formulation's gradient in torch: ``(exp(x - lse) - onehot) * (1 / kept)`` in fp32
    rounded to the logits' dtype in the forward, multiplied by the 0-dim fp32 ``grad_loss`` in the
    backward. (Its exp and its rounding are torch's: the interpreter's exp is numpy's, which differs
    in the last fp32 bit, and it rounds to bf16 toward zero, so this is within one unit of the
    kernel's bits, not equal to them.)"""
    kept_N = labels != ignore_index
    inv_kept = 1.0 / kept_N.sum().float().clamp(min=1.0)
    onehot = F.one_hot(labels.clamp(min=0), logits.shape[1]).float() * kept_N[:, None]
    g = (torch.exp(logits.float() - lse[:, None]) - onehot) * torch.where(kept_N, inv_kept, 0.0)[:, None]
    return g.to(logits.dtype).mul_(torch.tensor(grad_loss, dtype=torch.float32))


def within_one_unit(a, b, slack=0.0):
    """``a`` within one unit in the last place of ``b`` (of their dtype; subnormals' unit below), plus
    ``slack``."""
    info = torch.finfo(b.dtype)
    tol = info.eps * b.float().abs() + info.eps * info.smallest_normal + slack
    return bool(((a.float() - b.float()).abs() <= tol).all())


def exp_slack(labels, ignore_index, grad_loss):
    """What one fp32 unit of difference between two exps (of values up to 1) can move a gradient
    element: ``2**-23 * grad_loss / kept``, doubled."""
    return 2 * torch.finfo(torch.float32).eps * grad_loss / max(1, int((labels != ignore_index).sum()))


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))


def check(rows: int, vocab: int, dtype: torch.dtype, ignored: str, strided: bool, ignore_index: int) -> list[str]:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab + (8 if strided else 0), generator=g) * 3).to(dtype)
    if strided:
        logits = logits[:, :vocab]  # rows further apart than the vocabulary
    labels = torch.randint(0, vocab, (rows,), generator=g)
    if ignored == "some":
        labels[::3] = ignore_index
    elif ignored == "all":
        labels[:] = ignore_index
    kept_N = labels != ignore_index
    before = logits.clone()

    # the forward kernel: the loss and the rows' log-sum-exps
    loss, lse, kept = kernel.cross_entropy_forward(logits, labels, ignore_index)
    want_loss, _ = reference(logits, labels, ignore_index, 1.0)
    want_lse = torch.logsumexp(logits.float(), dim=1)
    failures = []
    if abs(float(loss) - float(want_loss)) > 1e-5 * max(1.0, abs(float(want_loss))):
        failures.append(f"loss {float(loss)} != {float(want_loss)}")
    if int(kept) != int(kept_N.sum()) or lse.dtype != torch.float32 or lse.shape != (rows,):
        failures.append("kept or lse shape")
    elif not torch.allclose(lse[kept_N], want_lse[kept_N], rtol=1e-6, atol=1e-6):
        failures.append("log-sum-exp")

    lines = []
    for grad_loss in GRAD_LOSSES:
        bad = list(failures)
        # the autograd function: forward, then backward with the loss scaled as accumulation scales it
        x = logits.detach().requires_grad_()
        fused_loss = _FusedCrossEntropyMean.apply(x, labels, ignore_index)
        (fused_loss * grad_loss).backward()
        grad = x.grad
        want_loss, want_grad = reference(logits, labels, ignore_index, grad_loss)
        if not same_bits(fused_loss.detach(), loss):
            bad.append("autograd function loss")
        # one rounding of the fp32 gradient to the logits' dtype: within one unit in the last place
        tol = torch.finfo(dtype).eps * float(want_grad.abs().max()) + 1e-7 * grad_loss
        if grad.dtype != dtype or not torch.allclose(grad.float(), want_grad.to(dtype).float(), rtol=0, atol=tol):
            bad.append(f"gradient off autograd's by {float((grad.float() - want_grad).abs().max()):.3g}")
        if not (grad[~kept_N] == 0).all():
            bad.append("ignored rows' gradient not zero")
        if not same_bits(grad, kernel.cross_entropy_backward(logits, labels, lse, kept,
                                                              torch.tensor(grad_loss), ignore_index)):
            bad.append("kernel and autograd function gradients differ")
        if not same_bits(logits, before) or grad.data_ptr() == logits.data_ptr():
            bad.append("logits written")
        # the previous formulation: (softmax - onehot) / kept rounded to the dtype, times grad_loss. Its
        # rounded gradient with the interpreter's exp and rounding is the kernel's for grad_loss 1 (the
        # same fp32 operations: the fp32 factor is 1 / kept); in torch it is within one unit of that.
        rounded = kernel.cross_entropy_backward(logits, labels, lse, kept, torch.tensor(1.0), ignore_index)
        if not within_one_unit(rounded, previous(logits, labels, ignore_index, lse, 1.0),
                               exp_slack(labels, ignore_index, 1.0)):
            bad.append("gradient for grad_loss 1 more than one unit off the previous formulation in torch")
        old = rounded.mul_(torch.tensor(grad_loss, dtype=torch.float32))  # the previous backward's mul_
        if not within_one_unit(grad, previous(logits, labels, ignore_index, lse, grad_loss),
                               exp_slack(labels, ignore_index, grad_loss)):
            bad.append("gradient more than one unit off the previous formulation in torch")
        differ = (old.view(BITS[dtype]) != grad.view(BITS[dtype])) & kept_N[:, None]
        differing = int(differ.sum())
        if grad_loss in (1.0, 0.125):
            # the same bits for a power of two, but where the previous formulation rounded twice:
            # subnormals of the dtype (fp16 gradients below 2**-14), within one of their units
            subnormal = old.float().abs() < torch.finfo(dtype).smallest_normal
            if (differ & ~subnormal).any() or not within_one_unit(grad, old):
                bad.append(f"{int((differ & ~subnormal).sum())} normal elements differ from the previous bits")
        elif not within_one_unit(grad, old):  # it rounded twice, this once
            bad.append("more than one unit off the previous formulation")
        name = (f"cross_entropy {rows} {vocab} {str(dtype).removeprefix('torch.')} ignored={ignored}:{ignore_index}"
                f" {'strided' if strided else 'dense'} grad_loss={grad_loss} differing_from_previous={differing}")
        lines.append(name + (" " + "; ".join(bad) + " DIFFERENT" if bad else " equal"))
    return lines


def main() -> None:
    kernel.BLOCK_V = 64  # several blocks per row, the last one partial
    for rows, vocab, dtype, ignored, strided, ignore_index in [(6, 200, torch.bfloat16, "none", False, -100),
                                                               (7, 130, torch.float32, "some", True, -100),
                                                               (5, 64, torch.bfloat16, "all", False, -100),
                                                               (9, 257, torch.float16, "some", False, -100),
                                                               (8, 190, torch.bfloat16, "some", True, 5)]:
        for line in check(rows, vocab, dtype, ignored, strided, ignore_index):
            print(line, flush=True)
            if not line.endswith("equal"):
                sys.exit(1)


if __name__ == "__main__":
    main()
