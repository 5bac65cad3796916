"""How much of a memory-bound cast hides under a compute-bound weight-gradient product when the
two run on separate streams, at the qwen3 block's shapes (one H200).

The FP8 block's backward runs its kernels one after another: fc2's weight gradient (tensor cores)
and then the SwiGLU-backward gradient cast (HBM), although neither needs the other. Our grouped
GEMMs are persistent (one program per multiprocessor, which fills its registers), so a kernel
launched beside one gets multiprocessors only where the GEMM leaves some free. This probe times:

- each kernel alone; the GEMM with fewer programs (``--programs``);
- both one after the other (what the block does now);
- both at once: the GEMM on a side stream (high priority, so its programs are dispatched before the
  cast's blocks when both wait) with P programs, the cast on the current stream, in both launch
  orders.

    python benchmarks/overlap_probe.py [--programs 132 116 100 84] [--iters 20] [--tag s28]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_pipelined_ms, write_results  # noqa: E402
from benchmarks.fp8_grouped_tune import _groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, nargs="*", default=[132, 116, 100, 84, 68])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad
    from lightning_moe.kernels.swiglu_grad_cast_triton import delayed_swiglu_grad_cast
    from lightning_moe.precision.native_casts import transposed_out, wgrad_aligned_ends

    experts, rows, ffn, hidden = 128, 131072, 768, 2048
    ends = _groups(experts, rows).cuda()
    total = int(ends[-1])
    aligned = wgrad_aligned_ends(ends)
    width = int(aligned[-1])
    torch.manual_seed(0)
    # fc2's weight gradient: a [F, width] (the SwiGLU output, transposed) and dy [D, width].
    a_FR = torch.randn(ffn, width, device="cuda").to(torch.float8_e4m3fn)
    dy_DR = torch.randn(hidden, width, device="cuda").to(torch.float8_e4m3fn)
    sa, sd = torch.rand(experts, ffn, device="cuda") + 0.5, torch.rand(experts, hidden, device="cuda") + 0.5
    # The SwiGLU-backward cast: h [R, 2F], g [R, F], probabilities, fc1's delayed scales.
    h = torch.randn(total, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(total, ffn, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(total, device="cuda")
    scale = torch.full((experts,), 64.0, device="cuda")
    record = torch.zeros(experts, device="cuda")
    out_col = transposed_out(h, rows=total, aligned_groups=experts)

    def gemm(programs: int) -> torch.Tensor:
        # tiles stored from registers, as the library did when this probe first ran (s28)
        return grouped_mm_wgrad(dy_DR, sd, a_FR, sa, aligned, programs=programs)

    def cast() -> None:
        delayed_swiglu_grad_cast(h, g, probs, ends, scale, record, out_col, out_col.shape[1], aligned)

    side = torch.cuda.Stream(priority=-1)  # a high priority (torch clamps it to the device's range)

    def together(programs: int, gemm_first: bool) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        if not gemm_first:
            cast()
        with torch.cuda.stream(side):
            gemm(programs)
        if gemm_first:
            cast()
        main.wait_stream(side)

    results: dict = {"shape": {"experts": experts, "rows": total, "ffn": ffn, "hidden": hidden}}
    ref = gemm(args.programs[0])
    results["cast_alone_ms"] = cuda_time_pipelined_ms(cast, iters=args.iters)
    print(f"cast alone {results['cast_alone_ms']:.3f} ms", flush=True)
    for programs in args.programs:
        assert torch.equal(gemm(programs), ref), "the product's bits depend on the program count"
        alone = cuda_time_pipelined_ms(lambda: gemm(programs), iters=args.iters)
        serial = cuda_time_pipelined_ms(lambda: (gemm(programs), cast()), iters=args.iters)
        first = cuda_time_pipelined_ms(lambda: together(programs, True), iters=args.iters)
        last = cuda_time_pipelined_ms(lambda: together(programs, False), iters=args.iters)
        results[f"programs_{programs}"] = {"gemm_alone_ms": alone, "serial_ms": serial,
                                           "together_gemm_launched_first_ms": first,
                                           "together_cast_launched_first_ms": last}
        print(f"programs {programs}: gemm {alone:.3f}, serial {serial:.3f}, together (gemm first) {first:.3f}, "
              f"(cast first) {last:.3f} ms", flush=True)
    write_results("overlap_probe" + (f"_{args.tag}" if args.tag else ""), results)


if __name__ == "__main__":
    main()
