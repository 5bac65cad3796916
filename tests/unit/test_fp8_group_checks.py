"""Shape-only helpers of the native FP8 grouped GEMMs: the weights' row ends are made once per
shape, and the alignment check of the group ends runs once per offsets tensor and version."""

import pytest
import torch

from lightning_moe.precision import native_casts


def test_weight_row_ends_are_made_once_per_shape():
    w = torch.zeros(5, 12, 7)
    ends = native_casts.expert_row_ends(w)
    assert ends.dtype == torch.int32 and ends.tolist() == [12, 24, 36, 48, 60]
    assert native_casts.expert_row_ends(torch.ones(5, 12, 7)) is ends  # same shape: shared
    assert native_casts.expert_row_ends(torch.zeros(5, 16, 7)).tolist() == [16, 32, 48, 64, 80]


def test_alignment_check_once_per_offsets_version(monkeypatch):
    calls = []
    real = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a: (calls.append(1), real(*a)))
    offsets = torch.tensor([16, 48, 64], dtype=torch.int32)
    native_casts.assert_groups_aligned(offsets)
    native_casts.assert_groups_aligned(offsets)  # fc1's backward after fc2's: already checked
    assert len(calls) == 1
    offsets[1] = 40  # changed in place: checked again, and it fails
    with pytest.raises(RuntimeError):
        native_casts.assert_groups_aligned(offsets)
    assert len(calls) == 2
