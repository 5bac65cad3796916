"""Registers and spills of the delayed-scaling cast kernel per launch shape and operand kind,
compiled offline for sm90 (no GPU needed: Triton's compiler and its bundled ``ptxas -v``).

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


def registers(kind: str, block_r: int, block_c: int, warps: int) -> dict:
    """``ptxas -v``'s registers and spill bytes per thread for one launch shape."""
    fn = fd._delayed_cast_kernel
    const = dict(KINDS[kind], WRITE_ROW=True, WRITE_COL=True, RECORD=True, BR=block_r, BC=block_c, GROUP_AXIS=1)
    signature = {name: "constexpr" if name in const else ARG_TYPES[name] for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
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
    for kind in KINDS:
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
