"""Registers and spills of the delayed-scaling cast kernels per launch shape and operand kind,
compiled offline for sm90 (no GPU needed: Triton's compiler and its bundled ``ptxas -v``).

Every pointer and integer argument is compiled as Triton specializes the block's launches (16-byte
aligned, divisible by 16): without those hints nothing is vectorized and the counts mean little
(with them, the counts match Nsight Compute's on the H200, ``ncu_s28_fp8_block.json``: 255 registers
for the plain, gathered and SwiGLU-backward casts, 128 for the SwiGLU one). The amax accumulator's
fold (`fp8_delayed_triton.AMAX_FOLD_ROWS`) is the library's per kind.

    python benchmarks/cast_registers.py

A spill-free launch shape is not necessarily faster (the tuned plain launch spills), but a kind
whose launch spills much more than the others is where `fp8_quant_tune.py --delayed-fused`
should look. Writes ``benchmarks/results/cast_registers.json``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.fp8_quant_tune import FUSED_CONFIGS  # noqa: E402
from lightning_moe.kernels import WGRAD_GROUP_ALIGN  # noqa: E402
from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402
from lightning_moe.kernels import swiglu_grad_cast_triton as sg  # noqa: E402

ARG_TYPES = dict(x_ptr="*bf16", offsets_ptr="*i32", scale_ptr="*fp32", q_row_ptr="*fp8e4nv", s_row_ptr="*fp32",
                 q_col_ptr="*fp8e4nv", s_col_ptr="*fp32", record_ptr="*fp32", R="i32", C="i32", G="i32",
                 stride_qc="i32", stride_qg="i32", src_ptr="*i64", T="i32", aligned_ends_ptr="*i32",
                 prob_ptr="*fp32")
# kind -> the constexprs the block's cast of that operand takes (both copies, amax recorded)
KINDS = {
    "plain": dict(GATHER=False, SWIGLU=False, ROW_PROBS=False, ALIGN=WGRAD_GROUP_ALIGN),
    "gather": dict(GATHER=True, SWIGLU=False, ROW_PROBS=False, ALIGN=WGRAD_GROUP_ALIGN),
    "swiglu": dict(GATHER=False, SWIGLU=True, ROW_PROBS=True, ALIGN=WGRAD_GROUP_ALIGN),
}


SWIGLU_GRAD_ARG_TYPES = dict(h_ptr="*bf16", g_ptr="*bf16", prob_ptr="*fp32", offsets_ptr="*i32", scale_ptr="*fp32",
                             q_row_ptr="*fp8e4nv", s_row_ptr="*fp32", q_col_ptr="*fp8e4nv", s_col_ptr="*fp32",
                             record_ptr="*fp32", partial_ptr="*fp32", R="i32", F="i32", G="i32", stride_qc="i32",
                             aligned_ends_ptr="*i32")


def registers(kind: str, block_r: int, block_c: int, warps: int) -> dict:
    """``ptxas -v``'s registers and spill bytes per thread for one launch shape."""
    amax_rows = fd.amax_rows(kind, block_r) if block_r % max(fd.AMAX_FOLD_ROWS.get(kind, 1), 1) == 0 else block_r
    if kind == "swiglu_grad":
        fn, types = sg._swiglu_grad_cast_kernel, SWIGLU_GRAD_ARG_TYPES
        const = dict(WEIGHTED=True, RECORD=True, BR=block_r, BC=block_c, ALIGN=WGRAD_GROUP_ALIGN, AMAX_ROWS=amax_rows)
    else:
        fn, types = fd._delayed_cast_kernel, ARG_TYPES
        const = dict(KINDS[kind], WRITE_ROW=True, WRITE_COL=True, RECORD=True, BR=block_r, BC=block_c, GROUP_AXIS=1,
                     AMAX_ROWS=amax_rows)
    signature = {name: "constexpr" if name in const else types[name] for name in fn.arg_names}
    # the launches' specialization: pointers 16-byte aligned, sizes and strides divisible by 16
    hints = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name not in const}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}, attrs=hints)
    options = {"num_warps": warps, **fd.register_cap(kind)}  # the library's cap for the kind, if any
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cast.ptx")
        Path(path).write_text(ptx)
        done = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "cast.o")],
                              capture_output=True, text=True, check=True)
    report = done.stderr + done.stdout
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"registers": int(regs.group(1)), "spill_store_bytes": int(spills.group(1)),
            "spill_load_bytes": int(spills.group(2))}


def main() -> None:
    results = {}
    for kind in [*KINDS, "swiglu_grad"]:
        rows = []
        for block_r, block_c, warps in FUSED_CONFIGS:
            row = {"BR": block_r, "BC": block_c, "warps": warps, **registers(kind, block_r, block_c, warps)}
            rows.append(row)
            print(kind, block_r, block_c, warps, row["registers"], "registers,", row["spill_store_bytes"],
                  "bytes spilled", "(library launch)" if (block_r, block_c, warps) == fd.TILE_SHAPES[kind] else "",
                  flush=True)
        results[kind] = rows
    write_results("cast_registers", {"results": results, "library_launch": dict(fd.TILE_SHAPES),
                                     "triton": triton.__version__, "target": "sm_90a"})


if __name__ == "__main__":
    main()
