"""fc2's FP8 input cast inside fc1's grouped GEMM (``kernels.fp8_fc1_swiglu_triton``) against the two
kernels it replaces, `grouped_mm_fprop` then `delayed_cast(h, ..., swiglu=True)`, at the MoE block's
fc1 shapes: the weighted SwiGLU, the transposed copy in the weight-gradient kernel's aligned layout,
every group with a history scale (the steady state). Each launch's outputs are checked equal to the
pair's (``h``, both float8 copies, their scales, the amax record), and each is timed queued behind a
GPU spin (`cuda_time_ms` with ``lead_cycles``), so the host's allocations stay out of the figure.

    python benchmarks/fc1_swiglu_epilogue.py [--cases qwen3 mixtral deepseek] [--tag s31]

Under Nsight Compute (``--once``: each kernel once, untimed)::

    ncu --clock-control none -k regex:"_fprop_swiglu_cast_kernel|_grouped_fprop_kernel" --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
        --csv --page details python benchmarks/fc1_swiglu_epilogue.py --cases qwen3 --once > ncu.csv
    python benchmarks/ncu_summary.py ncu.csv --tag s31_fc1_swiglu

Writes ``benchmarks/results/fc1_swiglu_epilogue[_TAG].json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import QUEUED_LEAD_CYCLES, cuda_time_ms, write_results  # noqa: E402

# (experts, rows, K, F): fc1's product [rows, K] x [K, 2F] per expert, as `fp8_grouped_tune.py`'s *_fc1 cases.
CASES = {"qwen3": (128, 131072, 2048, 768), "mixtral": (8, 16384, 4096, 14336), "deepseek": (32, 65536, 7168, 2048)}
# (block_m, block_f, block_k, warps, stages, options); None stages: the library's choice by K. Options:
# "ptr" stores the transposed copy by pointers instead of TMA; "row" / "col" / "h" write only the row copy /
# only the transposed copy / neither (timing the epilogue's parts: their bytes are then not compared);
# "noprobs": no row probabilities; "gemm": no copies, no probabilities, no amax record (the SwiGLU is then
# dead code: the two-accumulator product and h's store alone).
LAUNCHES = [(128, 128, 128, 8, None, ""), (128, 128, 128, 8, None, "ptr"), (128, 128, 128, 8, None, "row"),
            (128, 128, 128, 8, None, "col"), (128, 128, 128, 8, None, "h"), (128, 128, 128, 8, None, "noprobs"),
            (128, 128, 128, 8, None, "gemm"), (128, 128, 64, 8, 4, "gemm")]
PARTS = {"": ("row", "col"), "ptr": ("row", "col"), "row": ("row",), "col": ("col",), "h": (),
         "noprobs": ("row", "col"), "gemm": ()}


def _operands(experts: int, rows: int, k: int, f: int) -> dict:
    from lightning_moe.nn.permutation import round_up
    from lightning_moe.precision.scaled_mm import _transposed_out, _wgrad_aligned_ends

    gen = torch.Generator("cuda").manual_seed(0)
    weights = torch.rand(experts, device="cuda", generator=gen) + 0.5
    sizes = round_up((weights / weights.sum() * rows * 0.98).long(), 16)
    ends = sizes.cumsum(0).to(torch.int32)
    return dict(a=torch.randn(rows, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
                sa=torch.rand(rows, device="cuda", generator=gen) * 0.01 + 0.01,
                b=torch.randn(experts, 2 * f, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
                sb=torch.rand(experts, 2 * f, device="cuda", generator=gen) * 0.01 + 0.01,
                ends=ends, scale=torch.rand(experts, device="cuda", generator=gen) * 8 + 1,
                probs=torch.rand(rows, device="cuda", generator=gen), aligned_ends=_wgrad_aligned_ends(ends),
                col=_transposed_out(torch.empty(rows, 1, device="cuda"), f, aligned_groups=experts))


def _pair(o: dict) -> tuple:
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    record = torch.zeros_like(o["scale"])
    h = grouped_mm_fprop(o["a"], o["sa"], o["b"], o["sb"], o["ends"])
    q, s_row, s_col = delayed_cast(h, o["ends"], o["scale"], record, out_col=o["col"],
                                   stride_out_col=o["col"].shape[1], swiglu=True, aligned_ends=o["aligned_ends"],
                                   row_probs=o["probs"])
    return h, q, s_row, s_col, record


def _fused(o: dict, launch: tuple) -> tuple:
    from lightning_moe.kernels.fp8_fc1_swiglu_triton import grouped_mm_fprop_swiglu_cast

    block_m, block_f, block_k, warps, stages, option = launch
    record = torch.zeros_like(o["scale"])
    h, q, s_row, s_col = grouped_mm_fprop_swiglu_cast(
        o["a"], o["sa"], o["b"], o["sb"], o["ends"], o["scale"], None if option == "gemm" else record, o["col"],
        aligned_ends=o["aligned_ends"], row_probs=None if option in ("gemm", "noprobs") else o["probs"],
        block_m=block_m, block_f=block_f, block_k=block_k, num_warps=warps, num_stages=stages,
        col_tma=False if option == "ptr" else None, parts=PARTS[option])
    return h, q, s_row, s_col, record


def _same(out: tuple, ref: tuple, col: torch.Tensor, col_ref: torch.Tensor, end: int) -> bool:
    h, q, s_row, s_col, record = out
    h_ref, q_ref, s_row_ref, s_col_ref, record_ref = ref
    return (torch.equal(h[:end].view(torch.int16), h_ref[:end].view(torch.int16))
            and torch.equal(q[:end].view(torch.uint8), q_ref[:end].view(torch.uint8))
            and torch.equal(col.view(torch.uint8), col_ref.view(torch.uint8))
            and torch.equal(s_row[:end], s_row_ref[:end]) and torch.equal(s_col, s_col_ref)
            and torch.equal(record, record_ref))


def once(name: str) -> None:
    """Each kernel once, untimed (for Nsight Compute): the pair, the GEMM at 128 x 128 tiles, each launch."""
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    o = _operands(*CASES[name])
    _pair(o)
    grouped_mm_fprop(o["a"], o["sa"], o["b"], o["sb"], o["ends"], block_n=128)
    for launch in LAUNCHES:
        _fused(o, launch)
    torch.cuda.synchronize()


def run_case(name: str, iters: int) -> dict:
    experts, rows, k, f = CASES[name]
    o = _operands(experts, rows, k, f)
    end = int(o["ends"][-1])  # host sync: the benchmark's own setup
    o["col"].view(torch.uint8).fill_(0)  # what no launch writes (past the last aligned end) compares equal
    ref = _pair(o)
    col_ref = o["col"].clone()
    pair_ms, _ = cuda_time_ms(lambda: _pair(o), warmup=5, iters=iters, lead_cycles=QUEUED_LEAD_CYCLES)
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop

    fprop_ms, _ = cuda_time_ms(lambda: grouped_mm_fprop(o["a"], o["sa"], o["b"], o["sb"], o["ends"]), warmup=5,
                               iters=iters, lead_cycles=QUEUED_LEAD_CYCLES)
    narrow_ms, _ = cuda_time_ms(lambda: grouped_mm_fprop(o["a"], o["sa"], o["b"], o["sb"], o["ends"], block_n=128),
                                warmup=5, iters=iters, lead_cycles=QUEUED_LEAD_CYCLES)
    row = {"case": name, "experts": experts, "rows": rows, "k": k, "f": f, "pair_ms": pair_ms, "fprop_ms": fprop_ms,
           "fprop_128x128_ms": narrow_ms, "launches": []}
    print(name, "fprop + swiglu cast", f"{pair_ms:.3f} ms, fprop alone {fprop_ms:.3f} ms (128 x 128 tiles "
          f"{narrow_ms:.3f})", flush=True)
    for launch in LAUNCHES:
        try:
            o["col"].view(torch.uint8).fill_(0)
            out = _fused(o, launch)
            same = _same(out, ref, o["col"], col_ref, end) if launch[-1] in ("", "ptr") else None
            del out
            ms, _ = cuda_time_ms(lambda: _fused(o, launch), warmup=5, iters=iters, lead_cycles=QUEUED_LEAD_CYCLES)
        except Exception as error:  # a launch that does not compile or fit: recorded, the others still run
            row["launches"].append({"launch": list(launch), "error": repr(error)[:300]})
            print(name, launch, "failed:", repr(error)[:200], flush=True)
            continue
        row["launches"].append({"launch": list(launch), "ms": ms, "same_bytes": same, "speedup": pair_ms / ms})
        print(name, launch, f"{ms:.3f} ms", {True: "equal", False: "DIFFERENT", None: "(part)"}[same],
              f"{pair_ms / ms:.2f}x", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--once", action="store_true", help="run each kernel once, untimed (under ncu), and exit")
    args = parser.parse_args()
    if args.once:
        for name in args.cases:
            once(name)
        return
    results = [run_case(name, args.iters) for name in args.cases]
    write_results("fc1_swiglu_epilogue" + (f"_{args.tag}" if args.tag else ""),
                  {"results": results, "launches": [list(launch) for launch in LAUNCHES]})


if __name__ == "__main__":
    main()
