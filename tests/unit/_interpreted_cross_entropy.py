"""The cross-entropy kernel (`kernels.cross_entropy_triton`) run on CPU under Triton's interpreter,
against ``F.cross_entropy`` on fp32 logits and its autograd gradient: bf16 and fp32 logits, a
vocabulary that is no multiple of the block, ignored labels, every label ignored, a strided row
layout. Run as a script with ``TRITON_INTERPRET=1`` (see `_interpreted_casts.py`); prints one line
per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_moe.kernels import cross_entropy_triton as kernel  # noqa: E402


def reference(logits, labels, ignore_index=-100):
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="sum")
    loss = loss / (labels != ignore_index).sum().clamp(min=1)
    loss.backward()
    return loss.detach(), x.grad


def check(rows: int, vocab: int, dtype: torch.dtype, ignored: str, strided: bool) -> bool:
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab + (8 if strided else 0), generator=g) * 3).to(dtype)
    if strided:
        logits = logits[:, :vocab]  # rows further apart than the vocabulary
    labels = torch.randint(0, vocab, (rows,), generator=g)
    if ignored == "some":
        labels[::3] = -100
    elif ignored == "all":
        labels[:] = -100
    loss, grad = kernel.cross_entropy_mean_and_grad(logits, labels, -100)
    want_loss, want_grad = reference(logits, labels)
    loss_ok = abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
    # the gradient rounds once to the logits' dtype (within one unit in the last place of the reference)
    grad_ok = grad.dtype == dtype and torch.allclose(grad.float(), want_grad.to(dtype).float(), rtol=0,
                                                     atol=torch.finfo(dtype).eps * float(want_grad.abs().max()) + 1e-7)
    return loss_ok and grad_ok


def main() -> None:
    kernel.BLOCK_V = 64  # several blocks per row, the last one partial
    for rows, vocab, dtype, ignored, strided in [(6, 200, torch.bfloat16, "none", False),
                                                 (7, 130, torch.float32, "some", True),
                                                 (5, 64, torch.bfloat16, "all", False),
                                                 (9, 257, torch.float16, "some", False)]:
        ok = check(rows, vocab, dtype, ignored, strided)
        print("cross_entropy", rows, vocab, dtype, ignored, "strided" if strided else "dense",
              "equal" if ok else "DIFFERENT", flush=True)
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
