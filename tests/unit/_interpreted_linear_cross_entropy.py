"""The chunked linear + cross-entropy (`nn.linear_cross_entropy`) through the cross-entropy kernels
(`kernels.cross_entropy_triton.cross_entropy_rows_and_grad_`, the path it takes on a GPU) on CPU
under Triton's interpreter, against its eager path (``F.cross_entropy`` and autograd per chunk) and
against the unchunked ``F.linear`` + `cross_entropy_mean`: the loss, ``dh`` and ``dw``, with ignored
labels, a partial last chunk and a vocabulary that is no multiple of the kernels' block. The kernel
writes each chunk's gradient over its logits: that gradient must have the bits of
`cross_entropy_backward`'s for a unit loss gradient. Run as a script with ``TRITON_INTERPRET=1``;
prints one line per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_moe.kernels import cross_entropy_triton as kernel  # noqa: E402
from lightning_moe.nn import linear_cross_entropy as lce  # noqa: E402
from lightning_moe.nn.cross_entropy import cross_entropy_mean  # noqa: E402


def check(tokens: int, dim: int, vocab: int, dtype: torch.dtype, chunk: int) -> str:
    g = torch.Generator().manual_seed(tokens * vocab + chunk)
    h = torch.randn(tokens, dim, generator=g).to(dtype)
    w = (torch.randn(vocab, dim, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::4] = -100
    bad = []

    # the kernel: losses into a slice of the caller's buffer, the gradient over the logits
    logits = h[:chunk] @ w.t()
    kept = (labels != -100).sum()
    loss_rows = torch.zeros(tokens)
    _, lse, _ = kernel.cross_entropy_forward(logits, labels[:chunk], -100)
    want_grad = kernel.cross_entropy_backward(logits, labels[:chunk], lse, kept, torch.tensor(1.0), -100)
    out = kernel.cross_entropy_rows_and_grad_(logits, labels[:chunk], loss_rows[:chunk], kept, -100)
    if out.data_ptr() != logits.data_ptr() or not torch.equal(out, want_grad):
        bad.append("in-place gradient differs from cross_entropy_backward's")
    want_rows = F.cross_entropy((h[:chunk] @ w.t()).float(), labels[:chunk], ignore_index=-100, reduction="none")
    if not torch.allclose(loss_rows[:chunk], want_rows, rtol=0, atol=1e-5) or loss_rows[chunk:].any():
        bad.append("row losses")

    # the whole op: the kernels' path against the eager path and the unchunked head
    results = {}
    for path in ("kernel", "eager"):
        lce.use_triton = (lambda t: True) if path == "kernel" else (lambda t: False)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = lce.linear_cross_entropy_mean(hh, ww, labels, chunk_tokens=chunk)
        (loss * 0.5).backward()
        results[path] = (loss.detach(), hh.grad, ww.grad)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = cross_entropy_mean(F.linear(hh, ww), labels)
    (loss * 0.5).backward()
    results["unchunked"] = (loss.detach(), hh.grad, ww.grad)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    for path in ("eager", "unchunked"):
        for name, a, b in zip(("loss", "dh", "dw"), results["kernel"], results[path]):
            scale = max(1.0, float(b.abs().max())) if name != "loss" else 1.0
            if not torch.allclose(a.float(), b.float(), rtol=0, atol=tol * scale):
                bad.append(f"{name} off the {path} path by {float((a.float() - b.float()).abs().max()):.3g}")
    name = f"linear_cross_entropy {tokens} {dim} {vocab} {str(dtype).removeprefix('torch.')} chunk={chunk}"
    return name + (" " + "; ".join(bad) + " DIFFERENT" if bad else " equal")


def main() -> None:
    kernel.BLOCK_V = 64  # several blocks per row, the last one partial
    for case in [(11, 8, 150, torch.float32, 4), (9, 16, 130, torch.bfloat16, 9), (7, 8, 64, torch.bfloat16, 3)]:
        line = check(*case)
        print(line, flush=True)
        if not line.endswith("equal"):
            sys.exit(1)


if __name__ == "__main__":
    main()
