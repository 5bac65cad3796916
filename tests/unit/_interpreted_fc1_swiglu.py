"""fc1's FP8 grouped GEMM with fc2's input cast in its epilogue
(`kernels.fp8_fc1_swiglu_triton.grouped_mm_fprop_swiglu_cast`) run on CPU under Triton's
interpreter, against the two kernels it replaces: `grouped_mm_fprop` then `delayed_cast(h, ...,
swiglu=True)`. Groups: one without tokens, one without a history scale (0), one with a NaN scale,
one with a scale, rows past the last end; the transposed copy in the plain and in the weight-gradient
kernel's aligned layout (stored by pointers, and by TMA with a gap past the last tile to zero), with
and without row probabilities, a partial column block. Run as a
script with ``TRITON_INTERPRET=1`` (see `_interpreted_casts.py`); prints one line per case and
exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402
from lightning_moe.kernels.fp8_fc1_swiglu_triton import grouped_mm_fprop_swiglu_cast  # noqa: E402
from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop  # noqa: E402
from lightning_moe.precision.scaled_mm import _transposed_out, _wgrad_aligned_ends  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from _float8 import same_bits  # noqa: E402

ENDS = torch.tensor([48, 48, 160, 224], dtype=torch.int32)  # 16-row ends (the aligned layout needs them)
SCALES = torch.tensor([3.0, 0.0, 0.0, float("nan")])  # group 1 empty; groups 2 and 3 have no scale
ROWS, K, F = 240, 64, 40  # 16 rows past the last end; 40 columns: a partial block of 32
# 32-row tiles: the TMA-stored transposed copy leaves a gap past a group's last tile to zero
LAUNCH = dict(block_m=32, block_f=32, block_k=32, num_warps=4, num_stages=2, programs=3)


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(ROWS, K, generator=gen) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(ENDS.numel(), 2 * F, K, generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(ROWS, generator=gen) * 0.1 + 0.01
    sb = torch.rand(ENDS.numel(), 2 * F, generator=gen) * 0.1 + 0.01
    sa[5] = float("inf")  # a non-finite row of h: NaN and inf in the SwiGLU's input
    return a, sa, b, sb


def check(aligned: bool, col_tma: bool, weighted: bool, scales: torch.Tensor) -> list[str]:
    a, sa, b, sb = _inputs(int(aligned) + 2 * int(weighted))
    probs = torch.rand(ROWS, generator=torch.Generator().manual_seed(9)) if weighted else None
    aligned_ends = _wgrad_aligned_ends(ENDS) if aligned else None
    groups = ENDS.numel() if aligned else 0
    end = int(ENDS[-1])

    h_ref = grouped_mm_fprop(a, sa, b, sb, ENDS, block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2,
                             programs=3)
    col_ref = _transposed_out(h_ref, F, aligned_groups=groups)
    col_ref.view(torch.uint8).fill_(0x55)  # what neither writes stays the marker in both
    record_ref = torch.zeros(ENDS.numel())
    q_ref, s_row_ref, s_col_ref = fd.delayed_cast(h_ref, ENDS, scales, record_ref, out_col=col_ref,
                                                  stride_out_col=col_ref.shape[1], swiglu=True,
                                                  aligned_ends=aligned_ends, row_probs=probs)

    col = torch.full_like(col_ref.view(torch.uint8), 0x55).view(torch.float8_e4m3fn)
    record = torch.zeros(ENDS.numel())
    h, q, s_row, s_col = grouped_mm_fprop_swiglu_cast(a, sa, b, sb, ENDS, scales, record, col,
                                                      aligned_ends=aligned_ends, row_probs=probs, col_tma=col_tma,
                                                      **LAUNCH)
    failures = []
    if not torch.equal(h[:end].view(torch.int16), h_ref[:end].view(torch.int16)):
        failures.append("h")
    if not same_bits(q[:end], q_ref[:end]):
        failures.append("row copy")
    if not torch.equal(s_row[:end], s_row_ref[:end]):
        failures.append("row scales")
    if not torch.equal(s_col, s_col_ref):
        failures.append("column scales")
    if not same_bits(col, col_ref):
        failures.append("transposed copy")
    if not torch.equal(record, record_ref):
        failures.append("amax record")
    return failures


def main() -> None:
    for aligned, col_tma in [(False, False), (True, False), (True, True)]:
        for weighted in (False, True):
            for name, scales in [("mixed scales", SCALES), ("all scales", torch.tensor([3.0, 0.5, 0.25, 2.0]))]:
                failures = check(aligned, col_tma, weighted, scales)
                label = f"fc1 swiglu aligned={aligned} col_tma={col_tma} weighted={weighted} {name}"
                print(label, "DIFFERENT: " + ", ".join(failures) if failures else "equal", flush=True)
                if failures:
                    sys.exit(1)


if __name__ == "__main__":
    main()
