"""Our Triton FP8 grouped GEMM (``kernels.fp8_grouped_gemm_triton``) against
``torch._scaled_grouped_mm`` on the MoE block's forward and data-gradient shapes, over a sweep
of tile configurations. Checks each configuration's output against torch's (relative error; 0.0
in every run so far: both accumulate each block on the tensor cores in the same order and scale
in fp32 the same way) and times both back to back.

    python benchmarks/fp8_grouped_tune.py [--cases qwen3_fc1 ...] [--overlap | --precise [--epilogue]] [--tag s19a]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_pipelined_ms, relative_error, write_results  # noqa: E402
from lightning_moe.nn.permutation import round_up  # noqa: E402

# (experts, total rows, K, O): rows are the routed assignments of the block's benchmark batch
# (B * S * top-k), split unevenly over the experts as a router would.
CASES = {
    "qwen3_fc1": (128, 131072, 2048, 1536),
    "qwen3_fc2": (128, 131072, 768, 2048),
    "qwen3_fc1_dgrad": (128, 131072, 1536, 2048),
    "qwen3_fc2_dgrad": (128, 131072, 2048, 768),
    "mixtral_fc1": (8, 16384, 4096, 28672),
    "mixtral_fc2": (8, 16384, 14336, 4096),
    "mixtral_fc1_dgrad": (8, 16384, 28672, 4096),
    "mixtral_fc2_dgrad": (8, 16384, 4096, 14336),
    "deepseek_fc1": (32, 65536, 7168, 4096),
    "deepseek_fc2": (32, 65536, 2048, 7168),
    # the training step's micro-batch (train_step.py: 2 x 4096 tokens, top-8): about 512 rows an expert
    "qwen3_step_fc1": (128, 65536, 2048, 1536),
    "qwen3_step_fc2": (128, 65536, 768, 2048),
}

# Weight gradients (experts, total rows, M, N): dw [E, M, N] = a [M, rows of e] @ b [N, rows of e]^T,
# the forward products' shapes (M = K, N = O). Earlier Triton kernels that read the 16-aligned
# layout and zeroed the next group's tokens in registers lost to torch's grouped kernel:
# fp8_grouped_tune_s19b/c.json (a loop over tiles, this script at 5b5a0ed) and s19f_wgrad.json
# (flattened, at 1f38f4e): 0.43-0.88x. These cases time `grouped_mm_wgrad` on the aligned group
# layout (WGRAD_GROUP_ALIGN) against torch's kernel on the 16-aligned layout it reads otherwise.
WGRAD_CASES = {f"{name}_wgrad": shape for name, shape in CASES.items() if not name.endswith("_dgrad")}

# (block_m, block_n, block_k, num_warps, num_stages). The forward kernel's variants measured
# before (fp8_grouped_tune_s19a/b/d.json): a loop over groups with a tile loop inside ("loop",
# s19a/b), the same single tile loop as now without the compiler's flattening ("flat", s19d).
CONFIGS = [
    (128, 256, 128, 8, 3),
    (128, 256, 128, 8, 4),
    (128, 256, 64, 8, 4),
    (128, 128, 128, 4, 4),
]
WGRAD_CONFIGS = CONFIGS + [(256, 128, 128, 8, 4)]
# The weight gradient's tiles stored by TMA (`grouped_mm_wgrad(tma_store=True)`), same tuple + "tma".
WGRAD_TMA_CONFIGS = [(128, 256, 128, 8, 3, "tma"), (128, 256, 128, 8, 4, "tma"), (128, 128, 128, 4, 4, "tma")]
# Ways to overlap a tile's epilogue with another tile's products (--overlap), same tuple + extras:
# "occ2", two persistent programs per multiprocessor (one warpgroup each, a tile small enough for
# two programs' registers and shared memory: while one stores, the other computes, as a
# ping-pong kernel's two consumer warpgroups do); "ws", the compiler's automatic warp
# specialization of the tile loop (a producer warp issuing the loads).
OVERLAP_CONFIGS = [
    (128, 128, 128, 4, 2, "occ2"),
    (128, 128, 128, 4, 3, "occ2"),
    (128, 128, 64, 4, 4, "occ2"),
    (64, 256, 128, 4, 2, "occ2"),
    (128, 256, 128, 8, 3, "ws"),
    (128, 256, 128, 8, 4, "ws"),
    (128, 128, 128, 4, 3, "ws", "occ2"),
]


# Split accumulation (``--precise``): the kernels keep a second fp32 copy of the tile in registers,
# so the fast path's 128 x 256 tile spills; the library's choice is
# ``fp8_grouped_gemm_triton.FPROP_PRECISE_TILES`` / ``WGRAD_FP32_OR_PRECISE_TILES``.
PRECISE_CONFIGS = [
    (128, 256, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 8, 3),
    (128, 128, 64, 8, 5),
    (128, 128, 128, 4, 4),
    (256, 128, 128, 8, 3),
    # two programs per multiprocessor (one's epilogue beside the other's products): small enough
    # tiles for two programs' registers (185 a thread, 4 warps) and shared memory (90 KB each)
    (64, 128, 128, 4, 3, "occ2"),
    # the compiler's warp specialization (a producer warp issuing the loads; compiles for sm90
    # without stack at these shapes)
    (128, 128, 128, 8, 3, "ws"),
    (256, 128, 128, 8, 3, "ws"),
]
# The weight gradient as the step runs it (``--precise``): split accumulation, fp32 tiles added
# into an fp32 ``.grad`` (``accumulate_into``), stored by TMA after a load and an add in registers
# ("tma"), by TMA's reduce-add ("tma", "reduce": `fp8_grouped_gemm_triton.TMA_REDUCE` on), or from
# registers. (fp8_grouped_tune_precise_reduce.json was written when the reduce-add was on by
# default: its "tma" entries are the reduce-add, its "tma_noreduce" the load and add.)
PRECISE_WGRAD_CONFIGS = [
    (128, 128, 128, 8, 4, "tma"),
    (128, 128, 128, 8, 4, "tma", "reduce"),
    (256, 128, 128, 8, 3, "tma", "reduce"),
    (128, 128, 128, 8, 3, "tma"),
    (128, 256, 128, 8, 3, "tma"),
    (128, 128, 128, 8, 4),
    # two programs per multiprocessor: the fp32 read-modify-write of one beside the other's products
    # (ptxas for sm90: 185 and 176 registers over 4 warps, 90 KB of shared memory each, no stack)
    (64, 128, 128, 4, 3, "tma", "occ2"),
    (128, 64, 128, 4, 3, "tma", "occ2"),
    (128, 128, 128, 8, 4, "tma", "ws"),
    # the old .grad values loaded before each tile's contraction (`WGRAD_PREFETCH_OLD`; ptxas for sm90:
    # 221 registers against 177 at 128 x 128 over 8 warps, no stack)
    (128, 128, 128, 8, 4, "tma", "prefetch"),
    (128, 128, 128, 8, 3, "tma", "prefetch"),
    (128, 128, 128, 8, 4, "prefetch"),
]

# The accumulating weight gradient's epilogue (``--epilogue``), beside the library's shape (the
# first): the tile stored whole through a whole tile of staging ("whole": one wait for the previous
# tile's reads instead of a second one between the halves), an expert's tiles dealt along the
# output's rows first ("cols"), and the first micro-batch's plain fp32 write ("write": no old values).
# (A PTX L2 prefetch of the old values of the tile one or two ahead lost at every shape, 9-29%,
# fp8_grouped_tune_epilogue.json, and was removed.)
EPILOGUE_WGRAD_CONFIGS = [
    (128, 128, 128, 8, 4, "tma", "prefetch"),
    (128, 128, 128, 8, 4, "tma", "prefetch", "whole"),
    (128, 128, 128, 8, 3, "tma", "prefetch", "whole"),
    (128, 128, 128, 8, 4, "tma", "prefetch", "whole", "cols"),
    (128, 128, 128, 8, 4, "tma", "prefetch", "cols"),
    (128, 128, 128, 8, 4, "tma", "whole"),
    (128, 128, 128, 8, 4, "tma", "reduce", "whole"),
    (128, 128, 128, 8, 4, "tma", "write"),
    (128, 128, 128, 8, 4, "tma", "whole", "write"),
]


# Resources per (kernel, configuration) as first compiled: a configuration a later case launches
# again (the same constexprs) compiles nothing new.
_RESOURCES: dict[tuple[str, str], dict] = {}


def _kernel_resources(name: str, keys: set) -> dict:
    """Shared memory, registers and spills of the kernel ``name`` among the launch-cache entries
    ``keys`` (those a configuration's first call compiled): what decides how many programs fit on
    a multiprocessor."""
    from lightning_moe.kernels import launch as launch_module

    for key in keys:
        compiled = getattr(launch_module._cache.get(key), "compiled", None)
        if compiled is not None and getattr(compiled, "name", "") == name:
            try:
                return {"shared_bytes": int(compiled.metadata.shared), "registers": int(compiled.n_regs),
                        "spills": int(compiled.n_spills), "warps": int(compiled.metadata.num_warps)}
            except (AttributeError, TypeError):  # another Triton's compiled-kernel object
                return {}
    return {}


def _sweep(case: dict, configs: list, run, ref: torch.Tensor, flops: float, iters: int, kernel: str) -> None:
    """Time ``run(block_m, block_n, block_k, num_warps, num_stages, extras)`` per configuration
    into ``case``, with its relative error against ``ref`` and the resources of ``kernel``."""
    from lightning_moe.kernels import launch as launch_module

    for bm, bn, bk, warps, stages, *extras in configs:
        key = f"{bm}x{bn}x{bk}_w{warps}_s{stages}" + "".join(f"_{s}" for s in extras)

        def ours() -> torch.Tensor:
            return run(bm, bn, bk, warps, stages, tuple(extras))

        compiled_before = set(launch_module._cache)
        try:
            out = ours()
            err = relative_error(out.float(), ref.float())
            ms = cuda_time_pipelined_ms(ours, iters=iters)
        except Exception as exc:  # a configuration the compiler or the GPU refuses
            case[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(f"  {key}: {case[key]['error']}", flush=True)
            continue
        resources = _kernel_resources(kernel, set(launch_module._cache) - compiled_before)
        if resources:
            _RESOURCES[(kernel, key)] = resources
        else:  # compiled by an earlier case with the same constexprs
            resources = _RESOURCES.get((kernel, key), {})
        case[key] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_torch": err, **resources}
        print(f"  {key}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err {err:.2e} {resources}", flush=True)


def _groups(experts: int, rows: int, align: int = 16, seed: int = 0) -> torch.Tensor:
    """int32 cumulative ends of ``experts`` groups of about ``rows / experts`` rows each (+-50%),
    each padded up to ``align`` rows."""
    g = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(experts, generator=g)
    sizes = (weights / weights.sum() * rows).floor().long()
    return round_up(sizes, align).cumsum(0).to(torch.int32)


def _aligned_copy(t_MR: torch.Tensor, ends: torch.Tensor, aligned_ends: torch.Tensor) -> torch.Tensor:
    """``t [M, R]`` (groups ending at ``ends``) in the aligned group layout (zeros in the gaps)."""
    out = torch.zeros(t_MR.shape[0], int(aligned_ends[-1]), dtype=t_MR.dtype, device=t_MR.device)
    start = aligned = 0
    for end, aligned_end in zip(ends.tolist(), aligned_ends.tolist()):
        out[:, aligned:aligned + end - start] = t_MR[:, start:end]
        start, aligned = end, aligned_end
    return out


def _launch_options(extras: tuple) -> dict:
    """The kernels' keyword arguments for a configuration's extras (see OVERLAP_CONFIGS)."""
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count if "occ2" in extras else None
    return {"programs": programs, "warp_specialize": "ws" in extras}


def wgrad_case(name: str, iters: int, overlap: bool, precise: bool = False, epilogue: bool = False) -> dict:
    from lightning_moe.kernels import fp8_grouped_gemm_triton as kernels
    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_wgrad
    from lightning_moe.precision.native_gemms import group_weight_gradient
    from lightning_moe.precision.native_casts import wgrad_aligned_ends

    experts, rows, m, n = WGRAD_CASES[name]
    ends = _groups(experts, rows).cuda()
    total = int(ends[-1])
    aligned_ends = wgrad_aligned_ends(ends)
    torch.manual_seed(0)
    a = torch.randn(m, round_up(total, 16), device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, round_up(total, 16), device="cuda").to(torch.float8_e4m3fn)
    sa = torch.rand(experts, m, device="cuda") + 0.5
    sb = torch.rand(experts, n, device="cuda") + 0.5
    a_aligned, b_aligned = _aligned_copy(a, ends, aligned_ends), _aligned_copy(b, ends, aligned_ends)
    flops = 2.0 * total * m * n

    def torch_mm() -> torch.Tensor:
        # bf16 out (torch's grouped kernel writes bf16 only): against ours' fp32 gradient in
        # --precise the relative error is bf16's rounding, about 1e-3, not a difference of sums
        return group_weight_gradient(a, sa, b, sb, ends, None, fast=not precise)

    ref = torch_mm()
    ms = cuda_time_pipelined_ms(torch_mm, iters=iters)
    case = {"shape_E_R_M_N": [experts, total, m, n], "aligned_columns": int(aligned_ends[-1]),
            "torch_scaled_grouped_mm": {"ms": ms, "tflops": flops / ms / 1e9}}
    print(f"{name}: torch {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)

    grad = torch.zeros(experts, m, n, device="cuda") if precise else None
    zeroed_for = set()

    def ours(bm: int, bn: int, bk: int, warps: int, stages: int, extras: tuple) -> torch.Tensor:
        operands = (a_aligned, sa, b_aligned, sb, aligned_ends)
        launch = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                      tma_store="tma" in extras, store_halves="whole" not in extras, columns_first="cols" in extras,
                      **_launch_options(extras))
        if not precise:
            return grouped_mm_wgrad(*operands, **launch)
        if "write" in extras:  # the first micro-batch's call: a new fp32 gradient
            return grouped_mm_wgrad(*operands, out_dtype=torch.float32, precise=True, **launch)
        # the step's call: split accumulation added into an fp32 .grad
        key = (bm, bn, bk, warps, stages, extras)
        if key not in zeroed_for:  # a configuration's first call (its error check) adds into zeros;
            zeroed_for.add(key)  # the timed calls keep adding, as micro-batches do (no memset timed)
            grad.zero_()
        reduce = kernels.TMA_REDUCE
        kernels.TMA_REDUCE = "reduce" in extras
        try:
            return grouped_mm_wgrad(*operands, out_dtype=torch.float32, precise=True, accumulate_into=grad,
                                    prefetch_old="prefetch" in extras, **launch)
        finally:
            kernels.TMA_REDUCE = reduce

    if precise:
        configs = EPILOGUE_WGRAD_CONFIGS if epilogue else PRECISE_WGRAD_CONFIGS
    elif overlap:
        configs = [(128, 256, 128, 8, 4), (128, 256, 128, 8, 4, "tma")] + OVERLAP_CONFIGS
    else:
        configs = WGRAD_CONFIGS + WGRAD_TMA_CONFIGS
    _sweep(case, configs, ours, ref, flops, iters, "_grouped_wgrad_kernel")
    return case


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=list(CASES) + list(WGRAD_CASES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tag", default="")
    parser.add_argument("--overlap", action="store_true",
                        help="sweep OVERLAP_CONFIGS (beside the library's configuration) instead")
    parser.add_argument("--precise", action="store_true",
                        help="split accumulation (the default recipe's gradient GEMMs) against torch's split "
                             "accumulation: PRECISE_CONFIGS, and the weight gradient added into an fp32 .grad")
    parser.add_argument("--epilogue", action="store_true",
                        help="with --precise: the weight gradient's epilogue variants (EPILOGUE_WGRAD_CONFIGS)")
    args = parser.parse_args()
    if args.epilogue and not args.precise:
        parser.error("--epilogue sweeps the accumulating weight gradient: add --precise")

    from lightning_moe.kernels.fp8_grouped_gemm_triton import grouped_mm_fprop
    from lightning_moe.precision.native_gemms import torch_group_gemm

    results = {}
    for name in args.cases:
        if name in WGRAD_CASES:
            results[name] = wgrad_case(name, args.iters, args.overlap, args.precise, args.epilogue)
            continue
        experts, rows, k, o = CASES[name]
        ends = _groups(experts, rows).cuda()
        total = int(ends[-1])
        torch.manual_seed(0)
        a = torch.randn(total, k, device="cuda").to(torch.float8_e4m3fn)
        b = (torch.randn(experts, o, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        sa = torch.rand(total, device="cuda") + 0.5
        sb = torch.rand(experts, o, device="cuda") + 0.5
        flops = 2.0 * total * k * o
        host_ends = ends.tolist()

        def torch_mm() -> torch.Tensor:
            return torch_group_gemm(a, sa, b, sb, ends, None, fast=not args.precise)

        def per_expert_mm() -> torch.Tensor:  # what the native backend runs for <= 32 experts without ours
            return torch_group_gemm(a, sa, b, sb, ends, host_ends, fast=not args.precise)

        ref = torch_mm()
        ms = cuda_time_pipelined_ms(torch_mm, iters=args.iters)
        case = {"shape_E_R_K_O": [experts, total, k, o],
                "torch_scaled_grouped_mm": {"ms": ms, "tflops": flops / ms / 1e9}}
        print(f"{name}: torch {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        if experts <= 32:
            ms = cuda_time_pipelined_ms(per_expert_mm, iters=args.iters)
            case["torch_scaled_mm_per_expert"] = {"ms": ms, "tflops": flops / ms / 1e9}
            print(f"  per-expert _scaled_mm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)

        def ours(bm: int, bn: int, bk: int, warps: int, stages: int, extras: tuple) -> torch.Tensor:
            return grouped_mm_fprop(a, sa, b, sb, ends, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                    num_stages=stages, precise=args.precise, **_launch_options(extras))

        if args.precise:
            configs = PRECISE_CONFIGS
        else:
            configs = [(128, 256, 128, 8, 4)] + OVERLAP_CONFIGS if args.overlap else CONFIGS
        _sweep(case, configs, ours, ref, flops, args.iters, "_grouped_fprop_kernel")
        results[name] = case
    write_results("fp8_grouped_tune" + (f"_{args.tag}" if args.tag else ""), {"cases": results})


if __name__ == "__main__":
    main()
