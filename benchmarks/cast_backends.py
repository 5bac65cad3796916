"""The delayed cast's two tile kernels on the FP8 block's operands (H200): the CUDA C kernel
(`kernels/fp8_cast_cuda`, ``LIGHTNING_MOE_CAST_CUDA``) against the Triton one, each as the library
calls it (`fp8_delayed_triton.delayed_cast`), with their bytes compared.

Operands per benchmark shape (`fp8_quant_tune.FUSED_SHAPES`):

- ``gather``: fc1's input, the tokens ``[T, D]`` read through the permutation into ``R`` expert rows (each
  token routed to ``top_k`` random experts, rows sorted by expert, each group padded to 16 rows with
  padding rows), both copies, the aligned group layout (what the block's forward and the fc2 output
  gradient's cast do);
- ``plain``: an ``[R, D]`` operand in ``R / groups``-row groups, both copies, the aligned layout;
- ``fc1 weight`` / ``fc2 weight``: the expert weights ``[E, D, 2F]`` / ``[E, F, D]`` into both layouts.

Each launch is timed queued behind a GPU spin (the host's allocations stay out, as in a CUDA graph), two
interleaved rounds, the better kept; beside them a torch bf16 copy of the plain operand (the same bytes
read, twice as many written as one float8 copy: the two copies' bytes).

    python benchmarks/cast_backends.py [--models qwen3 mixtral deepseek]

Writes ``benchmarks/results/cast_backends[_<tag>].json``: per model and operand, ms and TB/s of both kernels and
whether every output's bytes are equal.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import QUEUED_LEAD_CYCLES, cuda_time_ms, write_results  # noqa: E402
from benchmarks.fp8_quant_tune import FUSED_SHAPES  # noqa: E402
from lightning_moe.kernels import fp8_cast_cuda  # noqa: E402
from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402
from lightning_moe.precision.native_casts import transposed_width, weight_as_groups, wgrad_aligned_ends  # noqa: E402

TOP_K = {"qwen3": 8, "mixtral": 2, "deepseek": 8}


def routed_rows(tokens: int, groups: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ``[R]`` token of each expert row, ``tokens`` for a padding row; int32 ``[groups]`` ends):
    ``top_k`` distinct random experts per token, rows by expert then token, groups padded to 16 rows."""
    experts = torch.rand(tokens, groups, device="cuda", generator=gen).topk(top_k, dim=1).indices
    key = (experts * tokens + torch.arange(tokens, device="cuda")[:, None]).flatten().sort().values
    counts = torch.bincount(key // tokens, minlength=groups)
    padded = (counts + 15) // 16 * 16
    ends = torch.cumsum(padded, 0)
    src = torch.full((int(ends[-1]),), tokens, device="cuda", dtype=torch.int64)
    starts = ends - padded
    position = starts.repeat_interleave(counts) + (torch.arange(key.numel(), device="cuda")
                                                    - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts))
    src[position] = key % tokens
    return src, ends.to(torch.int32)


def activation_cast(x, src, ends, scale, record):
    aligned = wgrad_aligned_ends(ends)
    width = transposed_width(x.shape[0] if src is None else src.numel(), ends.numel())
    q_col = torch.empty(x.shape[1], width, device="cuda", dtype=torch.float8_e4m3fn)

    def cast():
        q, s_row, s_col = fd.delayed_cast(x, ends, scale, record, out_col=q_col, stride_out_col=width,
                                          gather_rows=src, aligned_ends=aligned)
        return [q, s_row, s_col, q_col]
    return cast


def weight_cast(w, scale, record):
    def cast():
        rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w)
        q, s_row, s_col = fd.delayed_cast(rows, ends, scale, record, out_col=q_ENK, stride_out_col=stride_col,
                                          stride_out_group=stride_group)
        return [q, s_row, s_col, q_ENK]
    return cast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(FUSED_SHAPES), choices=sorted(FUSED_SHAPES))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tag", default="", help="suffix of the results file")
    parser.add_argument("--launches", nargs="+", default=[f"{fp8_cast_cuda.MIN_BLOCKS}x{fp8_cast_cuda.WARPS_ACROSS}"],
                        help="the CUDA kernel's launches timed, each BLOCKSxACROSS: its register cap as blocks per "
                             "multiprocessor (`fp8_cast_cuda.MIN_BLOCKS`) and its warps side by side in columns "
                             "(`WARPS_ACROSS`)")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    out = {}
    for model in args.models:
        shape = FUSED_SHAPES[model]
        groups, d, f, tokens = shape["groups"], shape["D"], shape["F"], shape["tokens"]
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        src, gather_ends = routed_rows(tokens, groups, TOP_K[model], gen)
        plain = torch.randn(groups * shape["rows"], d, device="cuda", dtype=torch.bfloat16, generator=gen)
        plain_ends = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * shape["rows"]
        w1 = torch.randn(groups, d, 2 * f, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        w2 = torch.randn(groups, f, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        scale = torch.full((groups,), 4.0, device="cuda")
        record = torch.zeros(groups, device="cuda")
        operands = {  # name: (cast, bytes read, bytes written)
            "gather": (activation_cast(x, src, gather_ends, scale, record), 2 * x.numel(), 2 * src.numel() * d),
            "plain": (activation_cast(plain, None, plain_ends, scale, record), 2 * plain.numel(), 2 * plain.numel()),
            "fc1 weight": (weight_cast(w1, scale, record), 2 * w1.numel(), 2 * w1.numel()),
            "fc2 weight": (weight_cast(w2, scale, record), 2 * w2.numel(), 2 * w2.numel()),
        }
        copy = torch.empty_like(plain)
        results = {"torch bf16 copy (plain)": {"ms": None, "bytes": 4 * plain.numel()}}
        equal = {}
        default_launch = fp8_cast_cuda.MIN_BLOCKS, fp8_cast_cuda.WARPS_ACROSS
        kernels = [(f"cuda {launch}", True, tuple(int(n) for n in launch.split("x"))) for launch in args.launches]
        kernels.append(("triton", False, None))

        def use(on: bool, launch) -> None:
            fp8_cast_cuda.CUDA_CASTS = on
            if launch is not None:
                fp8_cast_cuda.MIN_BLOCKS, fp8_cast_cuda.WARPS_ACROSS = launch

        for name, (cast, _, _) in operands.items():
            outputs = {}
            for kernel, on, launch in kernels:
                use(on, launch)
                outputs[kernel] = [t.clone() for t in cast()]
            reference = outputs["triton"]
            for kernel, _, _ in kernels[:-1]:
                equal[f"{name} {kernel}"] = all(
                    torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                b.view(torch.uint8) if b.element_size() == 1 else b)
                    for a, b in zip(outputs[kernel], reference))
        cuda_time_ms(lambda: copy.copy_(plain), warmup=50, iters=50)  # clocks up before the first timing
        for _ in range(2):
            ms, _ = cuda_time_ms(lambda: copy.copy_(plain), warmup=3, iters=args.iters, lead_cycles=QUEUED_LEAD_CYCLES)
            entry = results["torch bf16 copy (plain)"]
            entry["ms"] = ms if entry["ms"] is None else min(ms, entry["ms"])
            for name, (cast, read, written) in operands.items():
                for kernel, on, launch in kernels:
                    use(on, launch)
                    ms, _ = cuda_time_ms(cast, warmup=3, iters=args.iters, lead_cycles=QUEUED_LEAD_CYCLES)
                    entry = results.setdefault(f"{name} {kernel}", {"bytes": read + written, "ms": ms})
                    entry["ms"] = min(ms, entry["ms"])
        use(True, default_launch)
        for name, entry in results.items():
            entry["tb_s"] = entry["bytes"] / entry["ms"] / 1e9
            if name in equal:
                entry["bytes_equal"] = equal[name]
            print(f"{model:8s} {name:28s} {entry['ms']:.3f} ms {entry['tb_s']:.2f} TB/s {entry.get('bytes_equal', '')}",
                  flush=True)
        out[model] = {"shape": shape, "top_k": TOP_K[model], "expert_rows": int(src.numel()), "results": results}
    write_results("cast_backends" + (f"_{args.tag}" if args.tag else ""), out)


if __name__ == "__main__":
    main()
