"""The host side of the FP8 weight-gradient kernel's aligned group layout (``precision.scaled_mm``):
the aligned ends, the transposed copy's buffer bound, and the backward's check that a saved
(possibly recomputed) copy is in the layout its forward chose. The kernels themselves are GPU
tests (``tests/gpu/test_fp8_grouped_triton_gpu.py``)."""

import pytest
import torch

from lightning_moe.kernels import WGRAD_GROUP_ALIGN
from lightning_moe.precision import native_casts, scaled_mm


def _offsets(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def test_aligned_ends_round_each_group_up():
    ends = native_casts.wgrad_aligned_ends(_offsets(0, 48, 48, 352, 688))
    assert WGRAD_GROUP_ALIGN == 128
    assert ends.dtype == torch.int32 and ends.tolist() == [0, 128, 128, 512, 896]


def test_aligned_ends_are_kept_per_offsets_version():
    offsets = _offsets(16, 32)
    first = native_casts.wgrad_aligned_ends(offsets)
    assert native_casts.wgrad_aligned_ends(offsets) is first
    offsets.add_(16)  # an in-place update bumps the version: made again from the new values
    assert native_casts.wgrad_aligned_ends(offsets).tolist() == [128, 256]


@pytest.mark.parametrize("sizes", [[16] * 40, [0, 48, 0, 304, 336], [1024, 0, 16, 112, 128, 144]])
def test_the_buffer_holds_every_aligned_group(sizes):
    """The bound ``round_up(R, 16) + G * 112`` covers the last aligned end for groups of whole
    16-row runs, exactly when every group has 16 rows."""
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows = int(offsets[-1]) + 5  # rows past the last group (the tail): no transposed copy
    t = torch.zeros(rows, 8)
    buffer = native_casts.transposed_out(t, aligned_groups=len(sizes))
    last = int(native_casts.wgrad_aligned_ends(offsets)[-1])
    assert buffer.dtype == torch.float8_e4m3fn and buffer.shape[0] == 8
    assert last <= buffer.shape[1]
    if set(sizes) == {16}:
        assert last == buffer.shape[1] - 16  # the tail's 5 rows pad the plain width by 16


@pytest.mark.parametrize("aligned", [True, False])
def test_the_backward_checks_the_saved_copys_layout(aligned):
    offsets = _offsets(0, 48, 48, 352, 688)
    t = torch.zeros(700, 8)
    plain = native_casts.transposed_out(t)
    wide = native_casts.transposed_out(t, aligned_groups=5)
    saved, other = (wide, plain) if aligned else (plain, wide)
    ends = scaled_mm._saved_wgrad_layout(saved, offsets, 700, aligned)
    assert (ends.tolist() == [0, 128, 128, 512, 896]) if aligned else ends is None
    with pytest.raises(RuntimeError, match="keep it fixed during a step"):
        scaled_mm._saved_wgrad_layout(other, offsets, 700, aligned)
