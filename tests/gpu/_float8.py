"""Comparisons of float8 tensors shared by the FP8 GPU tests."""

import torch


def same_bits(q: torch.Tensor, q_ref: torch.Tensor) -> bool:
    """Same float8 bits, NaN positions compared as NaN (its payload is not the point)."""
    nan, nan_ref = torch.isnan(q.float()), torch.isnan(q_ref.float())
    return torch.equal(nan, nan_ref) and torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan_ref])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
