"""The delayed FP8 tile cast (`kernels.fp8_delayed_triton.delayed_cast`) run on CPU under Triton's
interpreter, for one operand kind, the library's launch shape and the others given (rows x
columns x warps), against a reference launch of 16 x 16 tiles, whose tile edges fall everywhere the
tried shapes' do not. Run as a script: ``TRITON_INTERPRET=1`` must be set before Triton decorates
the kernels, so not inside the pytest process. ``python _interpreted_casts.py KIND [R,C,W ...]``
prints one line per shape and exits non-zero on the first mismatch.

Per kind (the GPU tests compare the float8 bytes with torch's own casts on the H200; the
interpreter's float8 conversion rounds ties away from zero and some small values wrongly in
Triton 3.6, so here bytes are compared between launches of the same interpreter only):
- plain: every output against the reference launch; scales, amax record and the transposed
  copy's layout (equal to the row copy transposed, nothing written past the last group) against
  the generic delayed quantizer;
- gather: the cast reading rows through the permutation against the plain cast of the gathered
  rows (zeros for the padding sentinel);
- swiglu: the cast computing the SwiGLU against the plain cast of the Triton SwiGLU's output, and
  with row probabilities against the reference launch;
- swiglu_grad (`kernels.swiglu_grad_cast_triton`): the cast computing the SwiGLU's backward, with
  and without row probabilities, against the plain cast of the Triton SwiGLU backward's output;
  the probabilities' gradient against that kernel's to fp32 rounding (another summation order).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402
from lightning_moe.precision import FP8Recipe  # noqa: E402
from lightning_moe.precision.delayed import DelayedState  # noqa: E402
from lightning_moe.precision.formats import E4M3  # noqa: E402
from lightning_moe.precision.operands import Layout, quantize_operand  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))  # the FP8 GPU tests' comparison
from _float8 import same_bits  # noqa: E402

# An empty group, unaligned ends, groups with and without history (0 and NaN: none), a tail.
OFFSETS = torch.tensor([40, 40, 173, 250, 288], dtype=torch.int32)
SCALES = torch.tensor([3.0, 0.0, 0.0, 0.5, float("nan")])
ROWS, COLS = 300, 72  # 72: a partial column block at every launch width tried
PADDED = 304


def _cast(x: torch.Tensor, cols: int = COLS, **kwargs) -> list[torch.Tensor]:
    """Row copy, row scales, column scales, transposed copy, amax record of one tile cast."""
    q_col, record = _outputs(cols)
    q, s_row, s_col = fd.delayed_cast(x, OFFSETS, SCALES, record, out_col=q_col, stride_out_col=PADDED, **kwargs)
    return [q, s_row, s_col, q_col, record]


def _outputs(cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed copy's buffer filled with a marker byte, and a zero amax record."""
    return torch.full((cols, PADDED), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.zeros(OFFSETS.numel())


def _grad_cast(h: torch.Tensor, g: torch.Tensor, probs: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`_cast`'s outputs of the fused SwiGLU-backward cast, and its probabilities' gradient."""
    from lightning_moe.kernels.swiglu_grad_cast_triton import delayed_swiglu_grad_cast

    q_col, record = _outputs(h.shape[1])
    q, s_row, s_col, grad_p = delayed_swiglu_grad_cast(h, g, probs, OFFSETS, SCALES, record, q_col, PADDED)
    return [q, s_row, s_col, q_col, record], grad_p


def _operand(seed: int, cols: int, rows: int = ROWS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    x[7, 3], x[8, 5] = float("nan"), float("inf")
    return x.to(torch.bfloat16)


def _check_plain_against_generic(out: list[torch.Tensor], x: torch.Tensor) -> list[str]:
    """Everything but the float8 bytes themselves against the generic delayed quantizer: the
    interpreter's float8 conversion rounds ties away from zero and subnormals wrongly (Triton 3.6),
    so its bytes are compared with another launch's (`check`), and with torch's on the GPU."""
    q, s_row, s_col, q_col, record = out
    end = int(OFFSETS[-1])
    state = DelayedState(torch.zeros(2, 3, OFFSETS.numel()), torch.zeros(3, OFFSETS.numel()))
    state.scale[0] = SCALES
    _, s_ref, row_axis, _ = quantize_operand(x, FP8Recipe("delayed", fmt="e4m3"), "input",
                                                 Layout(row_offsets=OFFSETS), state, True, E4M3)
    failures = []
    if not (torch.equal(s_row[:end], s_ref.reshape(-1)[row_axis.ids][:end]) and (s_row[end:] == 1).all()):
        failures.append("row scales")
    if not torch.equal(q_col.view(torch.uint8)[:, :end], q.view(torch.uint8)[:end].t()):
        failures.append("transposed copy")
    if not (q_col.view(torch.uint8)[:, end:] == 0x55).all():
        failures.append("transposed copy past the last group written")
    if not torch.equal(s_col, s_ref[:OFFSETS.numel(), 0][:, None].expand(OFFSETS.numel(), COLS)):
        failures.append("column scales")
    if not torch.equal(record, state.amax_history[0, 0]):
        failures.append("amax record")
    return failures


def _check_equal(out: list[torch.Tensor], ref: list[torch.Tensor]) -> list[str]:
    names = ["row copy", "row scales", "column scales", "transposed copy", "amax record"]
    return [name for name, a, b in zip(names, out, ref)
            if not (same_bits(a, b) if a.dtype == torch.float8_e4m3fn else torch.equal(a, b))]


REFERENCE_LAUNCH = (16, 16, 1)


@contextlib.contextmanager
def _launching(kind: str, shape: tuple[int, int, int]) -> Iterator[None]:
    library = fd.TILE_SHAPES[kind]
    fd.TILE_SHAPES[kind] = shape
    try:
        yield
    finally:
        fd.TILE_SHAPES[kind] = library


def _cast_with(kind: str, shape: tuple[int, int, int], x: torch.Tensor, **kwargs) -> list[torch.Tensor]:
    with _launching(kind, shape):
        return _cast(x, **kwargs)


def check(kind: str, shape: tuple[int, int, int]) -> list[str]:
    """Names of the outputs of ``kind``'s cast under launch ``shape`` that differ from the reference."""
    if kind == "plain":
        x = _operand(0, COLS)
        out = _cast_with(kind, shape, x)
        return _check_equal(out, _cast_with(kind, REFERENCE_LAUNCH, x)) + _check_plain_against_generic(out, x)
    if kind == "gather":
        tokens = _operand(1, COLS, rows=97)
        gather_rows = torch.randint(0, 98, (ROWS,), generator=torch.Generator().manual_seed(2))  # 97: padding
        gathered = torch.cat([tokens, tokens.new_zeros(1, COLS)])[gather_rows]
        return _check_equal(_cast_with(kind, shape, tokens, gather_rows=gather_rows),
                            _cast_with("plain", REFERENCE_LAUNCH, gathered))
    if kind == "swiglu":
        from lightning_moe.kernels.swiglu_triton import swiglu

        h = _operand(3, 2 * COLS)
        failures = _check_equal(_cast_with(kind, shape, h, swiglu=True),
                                _cast_with("plain", REFERENCE_LAUNCH, swiglu(h)))
        probs = torch.rand(ROWS, generator=torch.Generator().manual_seed(4))
        weighted = [_cast_with(kind, launch, h, swiglu=True, row_probs=probs) for launch in (shape, REFERENCE_LAUNCH)]
        return failures + [f"weighted {name}" for name in _check_equal(*weighted)]
    if kind == "swiglu_grad":
        from lightning_moe.kernels.swiglu_triton import swiglu_backward, weighted_swiglu_backward

        h, g = _operand(5, 2 * COLS), _operand(6, COLS)
        probs = torch.rand(ROWS, generator=torch.Generator().manual_seed(7))
        with _launching(kind, shape):
            fused, _ = _grad_cast(h, g, None)
            fused_weighted, grad_p = _grad_cast(h, g, probs)
        failures = _check_equal(fused, _cast_with("plain", REFERENCE_LAUNCH, swiglu_backward(h, g), cols=2 * COLS))
        grad_h, grad_p_ref = weighted_swiglu_backward(h, g, probs)
        failures += [f"weighted {name}" for name in _check_equal(
            fused_weighted, _cast_with("plain", REFERENCE_LAUNCH, grad_h, cols=2 * COLS))]
        finite = grad_p_ref.isfinite()  # rows 7 and 8 hold NaN and inf
        if not (torch.equal(finite, grad_p.isfinite())
                and torch.allclose(grad_p[finite], grad_p_ref[finite], rtol=1e-5, atol=1e-6)):
            failures.append("probabilities' gradient")
        return failures
    raise ValueError(f"unknown kind {kind!r}; one of {sorted(fd.TILE_SHAPES)}")


def main() -> None:
    kind, given = sys.argv[1], [tuple(int(v) for v in s.split(",")) for s in sys.argv[2:]]
    library = fd.TILE_SHAPES[kind]
    for shape in [library] + [shape for shape in given if shape != library]:
        failures = check(kind, shape)
        print(kind, shape, "(library launch)" if shape == library else "", failures or "equal", flush=True)
        if failures:
            sys.exit(1)


if __name__ == "__main__":
    main()
