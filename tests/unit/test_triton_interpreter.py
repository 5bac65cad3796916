"""The delayed FP8 tile cast under Triton's interpreter on CPU (`_interpreted_casts.py`): the
library's launch shape and others against a 16 x 16 reference launch and against the plain cast,
per operand kind (and the fused SwiGLU-backward cast against the backward then the cast), and the FP8
weight-gradient kernel's TMA-stored tiles against its plain stores and its in-place accumulation into
an fp32 gradient against autograd's adds (`_interpreted_wgrad.py`), the
cross-entropy kernels against autograd and the previous formulation's gradient bits
(`_interpreted_cross_entropy.py`), the chunked linear + cross-entropy through those kernels against
its eager path (`_interpreted_linear_cross_entropy.py`), the per-head norm + rotary
kernel against the eager formulation, alone and in a decoder (`_interpreted_rotary.py`), the weighted
SwiGLU alone and as the MoE layer's combine (`_interpreted_weighted_swiglu.py`), fc1 reading the
permutation itself, alone and under the all-gather dispatcher on gloo processes
(`_interpreted_gathered_projection.py`, `_interpreted_gathered_allgather.py`), the delayed dense linear's backward
operands and the transposed copies made by its forward (`_interpreted_dense_backward.py`), and delayed
scaling's update kernel against the torch update (`_interpreted_scale_update.py`). Where
Triton is not installed these skip; CI installs it (see ``.ci/run``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _skip_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "needs Triton: pip install triton==3.6.0 'numpy<2.3'"
    numpy_version = tuple(int(v) for v in importlib.metadata.version("numpy").split(".")[:2])
    if numpy_version >= (2, 3):
        # Triton 3.6's interpreter converts 1-element arrays to Python scalars, which numpy 2.4
        # refuses ("only 0-dimensional arrays can be converted"); 2.2 is known to work.
        return f"Triton's interpreter needs numpy < 2.3, found {importlib.metadata.version('numpy')}"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")

OTHER_SHAPES = ["128,64,4", "64,32,4", "32,128,4"]  # besides the library's (rows, columns, warps)


def _interpreted(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` (beside this file) run with ``args`` under Triton's interpreter, this checkout first
    on the path."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *args], env=env,
                          capture_output=True, text=True, timeout=500)


def _equal_lines(result: subprocess.CompletedProcess, prefix: str, count: int) -> None:
    """The script ran, and printed ``count`` lines starting with ``prefix``, each ending in "equal"."""
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == count and all(line.endswith("equal") for line in lines), result.stdout


@pytest.mark.parametrize("kind", ["plain", "gather", "swiglu", "swiglu_grad"])
def test_delayed_cast_launch_shapes_write_the_same_bytes(kind):
    result = _interpreted("_interpreted_casts.py", kind, *OTHER_SHAPES)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(kind)]
    # one line per distinct shape: the library's first, then the others
    assert len(lines) in (len(OTHER_SHAPES), len(OTHER_SHAPES) + 1), result.stdout
    assert all(line.endswith("equal") for line in lines), result.stdout
    assert "(library launch)" in lines[0], result.stdout


def test_weight_gradient_tiles_stored_by_tma_match_the_plain_stores():
    result = _interpreted("_interpreted_wgrad.py")
    _equal_lines(result, "wgrad tma", 3)
    # the gradient added into an existing fp32 one by the kernel: the bits of autograd's adds (four of
    # the cases with the old values prefetched, `fp8_grouped_gemm_triton.WGRAD_PREFETCH_OLD`, two of
    # them with the tile stored whole, one of those with the tiles dealt along the rows first)
    _equal_lines(result, "wgrad accumulate", 7)


def test_cross_entropy_kernel_matches_autograd():
    # 5 cases x grad_loss 1, 0.125, 0.3
    _equal_lines(_interpreted("_interpreted_cross_entropy.py"), "cross_entropy", 15)


def test_chunked_linear_cross_entropy_through_the_kernels_matches_the_eager_path():
    # nn.linear_cross_entropy on its GPU path (the kernels write each chunk's gradient over its logits)
    _equal_lines(_interpreted("_interpreted_linear_cross_entropy.py"), "linear_cross_entropy", 3)


def test_norm_rotary_kernel_matches_the_eager_formulation():
    _equal_lines(_interpreted("_interpreted_rotary.py", "kernel"), "rotary", 6)


def test_decoder_with_the_fused_norm_rotary_matches_the_eager_decoder():
    _equal_lines(_interpreted("_interpreted_rotary.py", "model"), "model", 4)


def test_weighted_swiglu_kernel_matches_the_eager_formulation():
    _equal_lines(_interpreted("_interpreted_weighted_swiglu.py", "kernel"), "kernel", 12)


def test_moe_layer_with_the_probabilities_in_the_swiglu_matches_the_weighted_combine():
    _equal_lines(_interpreted("_interpreted_weighted_swiglu.py", "layer"), "layer", 6)


def test_moe_layer_with_fc1_gathering_the_permutation_is_bit_equal_and_keeps_less():
    _equal_lines(_interpreted("_interpreted_gathered_projection.py"), "gathered", 8)


def test_all_gather_dispatch_with_fc1_gathering_the_permutation_is_bit_equal_and_keeps_less():
    _equal_lines(_interpreted("_interpreted_gathered_allgather.py"), "allgather", 12)


def test_dense_delayed_casts_match_the_generic_quantizer():
    # 56 lines of operands (the input's both-layout cast; the gradient's in row runs and not, with and
    # without its scale), 40 of the transposed copies' training (`scaled_mm.DENSE_TRANSPOSED_COPIES`,
    # with and without the experiments, and with the tiled transposes of
    # `native_gemms.TILED_FP8_TRANSPOSES`), 16 of the tiled transpose alone
    _equal_lines(_interpreted("_interpreted_dense_backward.py"), "dense", 112)


def test_delayed_scaling_update_kernel_matches_the_torch_update():
    _equal_lines(_interpreted("_interpreted_scale_update.py"), "update", 12)
