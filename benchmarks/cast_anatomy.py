"""Where the delayed cast's time goes: its tile kernel at the library's launch on one operand, with
each output switched on and off, beside copies of the same bytes (H200).

The FP8 block's plain cast (fc2's output gradient at a benchmark shape, both copies and the amax
record) is timed as the library launches it, then with the row copy alone, the transposed copy
alone, and neither (the loads and the amax only); ``torch`` copies of the operand (bf16 to bf16,
and to float8 through ``.to``) give the ceilings for the same reads and writes. (Triton's software
pipelining, ``num_stages`` on the body's loop, leaves these pointer loads as they are: the same PTX.)

    python benchmarks/cast_anatomy.py [--model qwen3]

Writes ``benchmarks/results/cast_anatomy_<model>.json``: per variant ms, bytes moved and TB/s. With
``--once`` every variant is launched once, untimed, in the order printed, for Nsight Compute's warp
stall reasons (a reference launch of the library's cast comes first)::

    ncu --clock-control none -k regex:"_delayed_cast_kernel" --section WarpStateStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio --section SpeedOfLight \
        --section Occupancy --csv --page details python3 benchmarks/cast_anatomy.py --once > ncu.csv
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import QUEUED_LEAD_CYCLES, cuda_time_ms, write_results  # noqa: E402
from benchmarks.fp8_quant_tune import FUSED_SHAPES  # noqa: E402
from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402
from lightning_moe.kernels.fp8_quant_triton import _column_layout  # noqa: E402
from lightning_moe.kernels.launch import cdiv, launch  # noqa: E402


def tile_cast(x, offsets, scale, record, q_row, s_row, q_col, s_col, write_row: bool, write_col: bool,
              aligned_ends) -> None:
    """The library's plain tile launch (`fp8_delayed_triton._launch_delayed_cast`) with the copies chosen."""
    rows, cols = x.shape
    groups = offsets.numel()
    block_r, block_c, warps = fd.TILE_SHAPES["plain"]
    align, ends = _column_layout(aligned_ends, scale)
    launch(fd._delayed_cast_kernel, (cdiv(cols, block_c), groups + 1 if write_row else groups),
           x, offsets, scale, q_row, s_row, q_col, s_col, record, rows, cols, groups, rows, 0, scale, 0, ends, scale,
           WRITE_ROW=write_row, WRITE_COL=write_col, RECORD=True, SWIGLU=False, BR=block_r, BC=block_c, GROUP_AXIS=1,
           GATHER=False, ALIGN=align, ROW_PROBS=False, AMAX_ROWS=fd.amax_rows("plain", block_r),
           num_warps=warps, **fd.register_cap("plain"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3", choices=sorted(FUSED_SHAPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--once", action="store_true",
                        help="launch each variant once, untimed (for Nsight Compute; see the module docstring)")
    args = parser.parse_args()
    shape = FUSED_SHAPES[args.model]
    groups, total, d = shape["groups"], shape["groups"] * shape["rows"], shape["D"]
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(total, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * shape["rows"]
    scale = torch.full((groups,), 4.0, device="cuda")
    record = torch.zeros(groups, device="cuda")
    q_row = torch.empty(total, d, device="cuda", dtype=torch.float8_e4m3fn)
    s_row = torch.empty(total, device="cuda")
    q_col = torch.empty(d, total, device="cuda", dtype=torch.float8_e4m3fn)
    s_col = torch.empty(groups, d, device="cuda")
    copy_bf16 = torch.empty_like(x)
    copy_fp8 = torch.empty_like(q_row)
    n = x.numel()
    variants = {
        # name: (launch, bytes moved)
        "both copies (library)": (lambda: tile_cast(x, offsets, scale, record, q_row, s_row, q_col, s_col, True, True,
                                                    offsets), 4 * n),
        "row copy alone": (lambda: tile_cast(x, offsets, scale, record, q_row, s_row, q_col, s_col, True, False, None),
                           3 * n),
        "transposed copy alone": (lambda: tile_cast(x, offsets, scale, record, q_row, s_row, q_col, s_col, False, True,
                                                    offsets), 3 * n),
        "loads and amax alone": (lambda: tile_cast(x, offsets, scale, record, q_row, s_row, q_col, s_col, False,
                                                   False, None), 2 * n),
        "torch bf16 copy": (lambda: copy_bf16.copy_(x), 4 * n),
        "torch float8 copy": (lambda: copy_fp8.copy_(x), 3 * n),
    }
    if args.once:
        for name, (fn, _) in variants.items():
            print("launching", name, flush=True)
            fn()
        torch.cuda.synchronize()
        return
    # the first timed launch of a run pays for clocks ramping up: warm the GPU on the copy first
    cuda_time_ms(lambda: copy_bf16.copy_(x), warmup=50, iters=50)
    results = {}
    for rounds in range(2):  # twice, interleaved: the better of two is kept
        for name, (fn, nbytes) in variants.items():
            # each launch queued behind a GPU spin: the library path's host work (allocating the
            # outputs) stays out of the kernel's time, as in a CUDA graph
            ms, _ = cuda_time_ms(fn, warmup=3, iters=args.iters, lead_cycles=QUEUED_LEAD_CYCLES)
            best = min(ms, results.get(name, {}).get("ms", ms))
            results[name] = {"ms": best, "bytes": nbytes, "tb_s": nbytes / best / 1e9}
    for name, r in results.items():
        print(f"{args.model:8s} {name:36s} {r['ms']:.3f} ms {r['tb_s']:.2f} TB/s", flush=True)
    write_results(f"cast_anatomy_{args.model}", {"shape": shape, "launch": fd.TILE_SHAPES["plain"],
                                                  "amax_rows": fd.amax_rows("plain", fd.TILE_SHAPES["plain"][0]),
                                                  "results": results})


if __name__ == "__main__":
    main()
