"""Mean cross-entropy over a large vocabulary: the forward in one read of the logits, the gradient
in the backward in one read and one write.

Forward (`cross_entropy_forward`): one program per row reads the row once, keeping a running
maximum and sum, and stores the row's log-sum-exp (fp32) and its loss ``lse - x[label]``; the mean
over kept rows (label not ``ignore_index``) is ``sum(loss) / kept``. Nothing of the size of the
logits is written: what the backward needs is the logits themselves, the labels, the ``[N]`` fp32
log-sum-exps and the kept count.

Backward (`cross_entropy_backward`): ``grad[r] = (exp(x[r] - lse[r]) - onehot(label[r])) *
(grad_loss / kept)`` for kept rows, zero for ignored ones, computed in fp32 and stored once in the
logits' dtype into a new tensor; ``grad_loss`` (the loss's 0-dim gradient) and ``kept`` are read
from device memory by the kernel (no host sync: the pair can be captured in a CUDA graph).
Ignored rows are not read, in either pass.

The fp32 arithmetic is the earlier single-kernel version's (which wrote ``(softmax - onehot) /
kept`` in the forward, rounded to the logits' dtype, and multiplied it by ``grad_loss`` in the
backward): the same log-sum-exp and loss bits, and the same gradient bits wherever ``grad_loss`` is
a power of two (``1 / accumulation steps``) and the gradient is a normal number of its dtype; fp16
gradients below 2**-14 can differ by one unit (that version rounded twice, this rounds once), as
can any gradient for another ``grad_loss``; ignored rows' zeros are all +0.

Traffic per logit for bf16 logits: 2 bytes read in the forward, 2 read + 2 written in the
backward (6), against 4 read + 2 written in that version's forward and 2 + 2 for its scaling of
the stored gradient (10). Held from the forward to the backward: 4 bytes per row besides the
logits, against a gradient buffer of the logits' size. The autograd formulation
(``F.cross_entropy(logits.float())``) widens the logits to fp32, keeps the fp32 log-softmax for the
backward and writes an fp32 gradient that is then narrowed: about 38 bytes of traffic per logit and
5 bytes per logit of extra memory (a 151,936-word vocabulary at 8,192 tokens: 6.2 GB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_moe.kernels.launch import launch

BLOCK_V = 4096  # logits per step of a row's loop


@triton.jit
def _cross_entropy_forward_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_logits, ignore_index,
                                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    label = tl.load(labels_ptr + row)
    kept = label != ignore_index
    cols = tl.arange(0, BLOCK_V)
    running_max = float("-inf")  # loop-carried fp32 scalars
    running_sum = 0.0
    for start in range(0, tl.where(kept, V, 0), BLOCK_V):  # an ignored row is not read
        x = tl.load(row_logits + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    lse = tl.where(kept, running_max + tl.log(tl.where(kept, running_sum, 1.0)), 0.0)
    in_vocab = (label >= 0) & (label < V)
    x_label = tl.load(row_logits + label, mask=kept & in_vocab, other=0.0).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(kept, lse - x_label, 0.0))


@triton.jit
def _cross_entropy_backward_kernel(logits_ptr, grad_ptr, labels_ptr, lse_ptr, kept_ptr, grad_loss_ptr, V,
                                   stride_logits, stride_grad, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    row_grad = grad_ptr + row.to(tl.int64) * stride_grad
    label = tl.load(labels_ptr + row)
    kept = label != ignore_index
    lse = tl.load(lse_ptr + row)
    inv_kept = 1.0 / tl.maximum(tl.load(kept_ptr).to(tl.float32), 1.0)
    # grad_loss / kept as one fp32 factor: a power-of-two grad_loss scales inv_kept exactly
    scale = tl.where(kept, inv_kept * tl.load(grad_loss_ptr).to(tl.float32), 0.0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_logits + start + cols, mask=mask & kept, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(start + cols == label, 1.0, 0.0)
        tl.store(row_grad + start + cols, (g * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_forward(logits_NV: Tensor, labels_N: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(fp32 scalar mean loss over rows whose label is not ``ignore_index`` (0 when there are none),
    the rows' fp32 log-sum-exps ``[N]`` (0 for ignored rows), the kept count as a 0-dim int64 device
    tensor): what `cross_entropy_backward` needs besides the logits and labels. Labels outside the
    vocabulary (other than ``ignore_index``) fail a device-side check, as ``F.cross_entropy``'s do."""
    rows, vocab = logits_NV.shape
    if logits_NV.stride(1) != 1:
        raise ValueError("cross_entropy_forward needs logits with unit column stride")
    kept_N = labels_N != ignore_index
    torch._assert_async(((labels_N >= 0) & (labels_N < vocab) | ~kept_N).all(),
                        "cross-entropy label outside the vocabulary")
    kept = kept_N.sum()  # stays on the device: the backward kernel reads it (no host sync)
    loss_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
    lse_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
    if rows:
        launch(_cross_entropy_forward_kernel, (rows,), logits_NV, labels_N, loss_N, lse_N, vocab,
               logits_NV.stride(0), ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
    return loss_N.sum() / kept.clamp(min=1), lse_N, kept


def cross_entropy_backward(logits_NV: Tensor, labels_N: Tensor, lse_N: Tensor, kept: Tensor, grad_loss: Tensor,
                           ignore_index: int) -> Tensor:
    """The gradient of ``grad_loss * mean loss`` with respect to ``logits_NV``, in the logits' dtype
    (a new contiguous tensor; the logits are only read), from `cross_entropy_forward`'s ``lse_N``
    and ``kept``. ``grad_loss``: a 0-dim tensor on the logits' device, read by the kernel."""
    rows, vocab = logits_NV.shape
    if logits_NV.stride(1) != 1:
        raise ValueError("cross_entropy_backward needs logits with unit column stride")
    grad_NV = torch.empty_like(logits_NV, memory_format=torch.contiguous_format)
    if rows:
        grad_loss = grad_loss.detach().to(device=logits_NV.device, dtype=torch.float32).reshape(())
        launch(_cross_entropy_backward_kernel, (rows,), logits_NV, grad_NV, labels_N, lse_N, kept, grad_loss,
               vocab, logits_NV.stride(0), grad_NV.stride(0), ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
    return grad_NV


def cross_entropy_rows_and_grad_(logits_NV: Tensor, labels_N: Tensor, loss_N: Tensor, kept: Tensor,
                                 ignore_index: int) -> Tensor:
    """One chunk of a chunked linear + cross-entropy (`nn.linear_cross_entropy`): each row's fp32
    loss ``lse - x[label]`` (0 for ignored rows) into ``loss_N`` (a contiguous ``[N]`` slice of the
    caller's buffer), and the logits overwritten, in place, with their gradient for a unit gradient
    of the mean loss, ``(softmax - onehot) / kept``, in their dtype (zeros in ignored rows).
    ``kept``: the 0-dim device count of kept labels over all chunks (read by the kernel: no host
    sync). The two kernels are `cross_entropy_forward`'s and `cross_entropy_backward`'s (the same
    fp32 arithmetic and bits); each backward program reads a block of its row before it writes that
    block, so the gradient can take the logits' memory. Returns the logits tensor."""
    rows, vocab = logits_NV.shape
    if logits_NV.stride(1) != 1 or not loss_N.is_contiguous():
        raise ValueError("cross_entropy_rows_and_grad_ needs logits with unit column stride and a contiguous loss_N")
    if rows:
        lse_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
        unit = torch.ones((), dtype=torch.float32, device=logits_NV.device)
        launch(_cross_entropy_forward_kernel, (rows,), logits_NV, labels_N, loss_N, lse_N, vocab,
               logits_NV.stride(0), ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
        launch(_cross_entropy_backward_kernel, (rows,), logits_NV, logits_NV, labels_N, lse_N, kept, unit,
               vocab, logits_NV.stride(0), logits_NV.stride(0), ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
    return logits_NV
