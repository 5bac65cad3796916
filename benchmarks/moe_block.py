"""MoE block benchmark (BENCHMARKS.md): router + dispatch + SwiGLU experts + combine, fwd+bwd.

    python benchmarks/moe_block.py                       # all three shapes, bf16, native experts
    python benchmarks/moe_block.py --backend te          # Transformer Engine GroupedLinear experts
    python benchmarks/moe_block.py --cases qwen3_30b_a3b --profile
    python benchmarks/moe_block.py --precision fp8       # the fastest FP8 setup measured here (below)
    python benchmarks/moe_block.py --precision rowwise --cache-weights --accumulate 4  # one optimizer step's window
    python benchmarks/moe_block.py --precision fp8 --master-weights fp32  # parameters as bf16-mixed trains them

Checks correctness first (the block as timed, bf16 or FP8, vs an fp32 copy of the same weights
running the per-expert loop backend: relative errors of output, input and weight gradients; a
run whose errors exceed `error_bound` stops there), then times forward + backward with CUDA
events (median of --iters runs after warm-up, each started on an idle GPU) on random inputs, and
also the mean of --iters runs issued back to back (``pipelined_ms``: the CPU runs ahead as in a
training loop, so a run's launch latency is hidden unless it syncs) and the median of --iters runs one
at a time, each queued behind a GPU spin (``queued_ms``: no wait for the host, which has issued the
step before the spin ends; see `_common.cuda_time_ms`), and writes
``benchmarks/results/moe_block_<tag>.json``.
With ``--accumulate N`` the timed unit is the window of one optimizer step under gradient
accumulation: N forward + backward passes whose weight gradients accumulate, starting from fresh
gradients and (FP8 with ``--cache-weights``) an empty FP8 weight cache, as right after an optimizer
step; so the first micro-batch quantizes the weights and the others reuse them. Times and FLOPs
are per window. What FP8Precision runs once per optimizer step (delayed scaling's amax-history
update) ends every timed window.
With ``--master-weights fp32`` the experts keep fp32 parameters and every step runs under bf16
autocast, as ``Trainer(precision="bf16-mixed")`` (or FP8Precision) trains them: the bf16 block then
casts its weights to bf16 in the step and the FP8 block casts fp32 to FP8, and the weight
gradients arrive in fp32. The default (bf16 parameters) times the block on weights cast before it.
With ``--cuda-graph`` the block's forward and backward are captured once each in CUDA graphs
(`lightning_moe.cuda_graphs.capture_moe_layer`, after warm-up steps) and every timed step replays them: the
GPU's time for the block without the host's launch cost, for bf16 and FP8 alike. Before timing, a
replay on new data is compared with an eager step on the same data and scales (``graph_rel_diff``).
FLOPs (fwd+bwd = 3 x fwd), T = B*S: ``3 * (2*T*D*E + 3 * 2*T*k*D*F)``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    QUEUED_LEAD_CYCLES,
    cuda_time_ms,
    cuda_time_pipelined_ms,
    relative_error,
    write_results,
)
from benchmarks._profile import print_profile, profile_step  # noqa: E402
from lightning_moe.nn import MoEConfig, MoELayer  # noqa: E402

CASES = {
    "qwen3_30b_a3b": dict(D=2048, F=768, E=128, k=8, B=4, S=4096),
    "mixtral_8x7b": dict(D=4096, F=14336, E=8, k=2, B=2, S=4096),
    "deepseek_v3_slice": dict(D=7168, F=2048, E=32, k=8, B=2, S=4096),
}


def block_flops(c: dict) -> float:
    t = c["B"] * c["S"]
    return 3 * (2 * t * c["D"] * c["E"] + 3 * 2 * t * c["k"] * c["D"] * c["F"])


def build_layer(c: dict, backend: str, dtype: torch.dtype, alignment: int = 1,
                router_logits_gemm: str = "fp32") -> MoELayer:
    """The block on the GPU with its experts' parameters in ``dtype`` (fp32: master weights)."""
    cfg = MoEConfig(
        hidden_size=c["D"], ffn_hidden_size=c["F"], num_experts=c["E"], router_topk=c["k"],
        router_score_function="softmax", expert_backend=backend, expert_alignment=alignment,
        router_logits_gemm=router_logits_gemm,
    )
    layer = MoELayer(cfg).cuda()
    layer.experts.to(dtype)  # router stays fp32 by design
    return layer


def bf16_mixed_context():
    """What ``Trainer(precision="bf16-mixed")`` runs each step in (a fresh context per call)."""
    return torch.autocast("cuda", dtype=torch.bfloat16)


# ``--precision fp8``: the FP8 configuration that runs the block fastest on Hopper without
# Transformer Engine (NOTES.md, fifth pass): native delayed scaling (one read per operand) with
# Hopper's fast accumulation in all three GEMMs (the GPU tests bound fast accumulation's
# gradients within 1% of split accumulation; its 300-step curve is within 2% of bf16), and fc1's
# output gradient cast inside fc2's backward (``FP8Recipe.fuse_swiglu_backward``, opt-in: that
# gradient then bypasses autograd; ``--fuse-swiglu-backward off`` times the library default).
FP8_DEFAULT = ("delayed", ["fprop", "dgrad", "wgrad"])


def expert_alignment(precision: str) -> int:
    """Token-group padding the FP8 grouped GEMMs need (torch and TE kernels): 1 for bf16."""
    if precision == "bf16":
        return 1
    from lightning_moe.precision.recipes import FP8Recipe  # lazily: optional feature

    return FP8Recipe.of(precision).alignment


def apply_precision(layer: MoELayer, precision: str, cache_weights: bool = False,
                    fast_accumulation: Optional[list[str]] = None, graph_weight_casts: bool = False,
                    fuse_swiglu_backward: bool = False):
    """bf16: nothing to do. Otherwise ``precision`` is an FP8 recipe name ("tensorwise",
    "rowwise", "blockwise", "delayed", ...): convert the experts with the FP8 plugin. Returns the
    plugin's forward context (a factory: each ``with`` needs a fresh one), its FP8 weight cache
    (None without one) and what the plugin runs once per optimizer step besides clearing that
    cache (delayed scaling's amax-history update; None for other recipes)."""
    if precision == "bf16":
        return contextlib.nullcontext, None, None
    from lightning_moe.precision import FP8Precision, FP8Recipe, update_delayed_scaling  # lazily: optional
    from lightning_moe.precision.modules import fp8_modules

    recipe = FP8Recipe(precision, fast_accumulation=None if fast_accumulation is None else tuple(fast_accumulation),
                       graph_weight_casts=graph_weight_casts, fuse_swiglu_backward=fuse_swiglu_backward)
    plugin = FP8Precision(recipe=recipe, backend="auto", cache_fp8_weights=cache_weights)
    plugin.convert_module(layer)
    if recipe.name != "delayed":
        return plugin.forward_context, plugin.weight_cache, None
    delayed_modules = fp8_modules(layer)

    def optimizer_step_work() -> None:
        update_delayed_scaling(delayed_modules, recipe)  # as FP8Precision.optimizer_step

    return plugin.forward_context, plugin.weight_cache, optimizer_step_work


def fp32_reference(layer: MoELayer) -> MoELayer:
    """An fp32 copy of ``layer`` on the per-expert loop backend, made before any precision
    plugin converts ``layer``."""
    ref = copy.deepcopy(layer).float()
    ref.experts.backend = "loop"
    return ref


def check_correctness(layer: MoELayer, ref: MoELayer, c: dict, tokens: int, context) -> dict:
    """``layer`` as benchmarked (bf16, or FP8 inside the plugin's ``context()``) against ``ref``
    on ``tokens`` tokens: relative errors of the output, the input gradient and fc1's weight
    gradient."""
    x = torch.randn(tokens, c["D"], device="cuda")
    g = torch.randn(tokens, c["D"], device="cuda")
    x_lp = x.to(torch.bfloat16).requires_grad_(True)
    with context():
        y = layer(x_lp)
    y.backward(g.to(torch.bfloat16))  # outside autocast, as a training loop runs it
    x_ref = x_lp.detach().float().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(g)
    return {
        "rel_err_out": relative_error(y.float(), y_ref),
        "rel_err_dx": relative_error(x_lp.grad.float(), x_ref.grad),
        "rel_err_dw_fc1": relative_error(layer.experts.fc1_weight.grad.float(), ref.experts.fc1_weight.grad),
    }


def _worse(a: float, b: float) -> float:
    """The larger error, NaN if either is (Python's ``max`` drops a NaN in second place)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def error_bound(precision: str) -> float:
    """Largest relative error the correctness check accepts: bf16 rounding, or the quantization
    error of FP8 (e4m3 rounds by up to 2^-4 per element; the block chains 3 GEMMs) or FP4."""
    return 3e-2 if precision == "bf16" else 0.3 if precision == "nvfp4" else 0.15


def _eager_step(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, context) -> list[torch.Tensor]:
    """One forward (inside ``context()``) + backward (outside) from fresh gradients: copies of the
    output and of every gradient."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    with context():
        y = layer(x)
    y.backward(dy)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]


def capture_and_check(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor, optimizer_step_work,
                      accumulate: int, context) -> dict:
    """``--cuda-graph``: capture ``layer`` (forward and backward) on ``x``'s shape, after eager
    steps that compile the kernels and, for delayed scaling, give every state its scales. Then a
    replay on new data must match an eager step on the same data at the same scales (no
    delayed-scaling update in between): the largest relative difference over the output and every
    gradient is returned, and a graph that replays stale data (a difference of order 1) stops the
    run. ``context``: the timed forward context (autocast with its cache off), entered for each
    forward and for the capture."""
    from lightning_moe.cuda_graphs import capture_moe_layer

    for _ in range(2):
        _eager_step(layer, x, dy, context)
        if optimizer_step_work is not None:
            optimizer_step_work()
    x_new, dy_new = torch.randn_like(x), torch.randn_like(dy)
    with torch.no_grad():
        x_keep, dy_keep = x.clone(), dy.clone()
        x.copy_(x_new)
        dy.copy_(dy_new)
    eager = _eager_step(layer, x, dy, context)
    with torch.no_grad():
        x.copy_(x_keep)  # capture on other values than the check's
    with context():
        capture_moe_layer(layer, x, accumulate_grads=accumulate > 1)
    with torch.no_grad():
        x.copy_(x_new)
    replayed = _eager_step(layer, x, dy, context)
    with torch.no_grad():
        x.copy_(x_keep)
        dy.copy_(dy_keep)
    diff = max(relative_error(r.float(), e.float()) for r, e in zip(replayed, eager))
    if not diff <= 1e-2:  # also catches NaN
        raise SystemExit(f"the CUDA-graphed block differs from the eager one by {diff:.3e} (relative); not timing it")
    return {"graph_rel_diff": diff}


def graph_context(context):
    """``context`` with bf16 autocast's weight cache off, which CUDA-graph capture requires (each
    weight is cast once per step either way; autocast stays off where ``context`` leaves it off)."""

    @contextlib.contextmanager
    def entered():
        with context():
            if torch.is_autocast_enabled("cuda"):
                with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
                    yield
            else:
                yield

    return entered


def run_case(name: str, c: dict, args) -> dict:
    torch.manual_seed(0)
    master_fp32 = args.master_weights == "fp32"
    layer = build_layer(c, args.backend, torch.float32 if master_fp32 else torch.bfloat16,
                        expert_alignment(args.precision), args.router_logits)
    reference = fp32_reference(layer)
    context, weight_cache, optimizer_step_work = apply_precision(layer, args.precision, args.cache_weights,
                                                                 args.fast_accumulation, args.graph_weight_casts,
                                                                 args.fuse_swiglu_backward == "on")
    if master_fp32 and args.precision == "bf16":
        context = bf16_mixed_context  # FP8Precision's context is bf16 autocast already
    tokens = min(4096, c["B"] * c["S"])
    correctness = check_correctness(layer, reference, c, tokens, context)
    if optimizer_step_work is not None:
        # Delayed scaling's first step takes current amaxes; what is timed runs on history
        # scales, so update them as an optimizer step does and check again (the worse is kept).
        optimizer_step_work()
        layer.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        again = check_correctness(layer, reference, c, tokens, context)
        correctness = {key: _worse(value, again[key]) for key, value in correctness.items()}
    del reference
    worst = max(correctness.values())
    if not worst <= error_bound(args.precision):  # also catches NaN
        raise SystemExit(f"{name}: {args.precision} block is wrong, relative errors {correctness} "
                         f"(bound {error_bound(args.precision)}); not timing it")
    if weight_cache is not None:
        weight_cache.clear()  # timing starts from an empty cache, as after an optimizer step
    layer.zero_grad(set_to_none=True)
    x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        # Fresh gradients each window, as after optimizer.zero_grad(set_to_none=True); the FP8
        # weight cache starts empty, as after the optimizer step that clears it.
        layer.zero_grad(set_to_none=True)
        if weight_cache is not None and args.accumulate > 1:
            weight_cache.clear()
        for _ in range(args.accumulate):
            x.grad = None
            with context():  # the forward only: a training loop calls backward outside autocast
                y = layer(x)
            y.backward(dy)
        if optimizer_step_work is not None:
            optimizer_step_work()

    graph_check = {}
    if args.cuda_graph:
        context = graph_context(context)
        graph_check = capture_and_check(layer, x, dy, optimizer_step_work, args.accumulate, context)

    torch.cuda.reset_peak_memory_stats()
    # wall-clock bounds of the two timings, to line them up with clock and power samples taken beside
    # the run (nvidia-smi): the host syncs after each, so they bound the GPU's work
    started = time.time()
    median_ms, times = cuda_time_ms(step, warmup=args.warmup, iters=args.iters)
    one_at_a_time_done = time.time()
    pipelined_ms = cuda_time_pipelined_ms(step, warmup=1, iters=args.iters)
    back_to_back_done = time.time()
    # one step at a time again, each queued behind a GPU spin: no wait for the host
    queued_ms, _ = cuda_time_ms(step, warmup=0, iters=args.iters, lead_cycles=args.queued_lead_cycles)
    phases_unix = {"one_at_a_time": [started, one_at_a_time_done], "back_to_back": [one_at_a_time_done,
                                                                                  back_to_back_done],
                   "queued": [back_to_back_done, time.time()]}
    profile = profile_step(step) if args.profile else None
    flops = block_flops(c) * args.accumulate
    result = {
        "shape": c,
        "accumulate": args.accumulate,
        "backend": layer.experts.backend,
        "precision": args.precision,
        "fast_accumulation": args.fast_accumulation,
        "cache_weights": args.cache_weights,
        "graph_weight_casts": args.graph_weight_casts,
        "fuse_swiglu_backward": args.fuse_swiglu_backward == "on",
        "cuda_graph": args.cuda_graph,
        **graph_check,
        "master_weights": args.master_weights,
        "router_logits_gemm": args.router_logits,
        "median_ms": median_ms,
        "min_ms": min(times),
        "tflops": flops / (median_ms * 1e-3) / 1e12,
        "pipelined_ms": pipelined_ms,
        "queued_ms": queued_ms,
        "queued_lead_cycles": args.queued_lead_cycles,
        "phases_unix": phases_unix,
        "pipelined_tflops": flops / (pipelined_ms * 1e-3) / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "flops": flops,
        **correctness,
    }
    if profile is not None:
        result["profile"] = profile
    del layer, x, dy
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backend", default="grouped_mm", choices=["grouped_mm", "te", "loop"])
    parser.add_argument("--precision", default="bf16",
                        help='"bf16", an FP8 recipe name (e.g. "tensorwise"), or "fp8": delayed scaling with '
                             'fast accumulation in every GEMM unless --fast-accumulation says otherwise')
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--fast-accumulation", nargs="*", default=None, choices=["fprop", "dgrad", "wgrad"],
                        help="FP8Recipe.fast_accumulation (default: the recipe's, fprop only for tensorwise, "
                             "rowwise and delayed)")
    parser.add_argument("--cache-weights", action="store_true",
                        help="FP8Precision(cache_fp8_weights=True). With --accumulate 1 the cache is never "
                             "cleared, so every timed step reuses FP8 weights quantized in warm-up (the later "
                             "micro-batches of a window); with --accumulate N > 1 each window starts empty")
    parser.add_argument("--graph-weight-casts", action="store_true",
                        help="FP8Recipe(graph_weight_casts=True): each forward replays a CUDA graph of the expert "
                             "weights' casts instead of launching them (rowwise and delayed recipes)")
    parser.add_argument("--fuse-swiglu-backward", choices=["on", "off"], default=None,
                        help="FP8Recipe(fuse_swiglu_backward=...) (delayed recipe): default on with --precision fp8, "
                             "off otherwise (the library's default)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the whole block (forward and backward) in CUDA graphs and time their replays "
                             "(capture_moe_layer): the block's GPU time without the host's launch cost")
    parser.add_argument("--master-weights", default="bf16", choices=["bf16", "fp32"],
                        help="dtype of the experts' parameters: bf16 (default, weights cast before the block) or fp32 "
                             "(master weights under bf16 autocast, as bf16-mixed training runs the block)")
    parser.add_argument("--router-logits", default="fp32", choices=["fp32", "bf16x3"],
                        help="MoEConfig.router_logits_gemm: the router's fp32 logits by fp32 products (default) or by "
                             "exact bf16 splits of its weight on the tensor cores")
    parser.add_argument("--queued-lead-cycles", type=int, default=QUEUED_LEAD_CYCLES,
                        help="GPU clock cycles of the spin each queued step waits behind (queued_ms; ~2 ms)")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches per timed window (one optimizer step under gradient accumulation)")
    parser.add_argument("--tag", default=None,
                        help="suffix of the results file (default: backend, precision and the options that change "
                             "what is timed)")
    args = parser.parse_args(argv)
    default_tag = "_".join([args.backend, args.precision]
                           + (["fast-" + "-".join(args.fast_accumulation)] if args.fast_accumulation else [])
                           + (["cached"] if args.cache_weights else [])
                           + (["graphed"] if args.graph_weight_casts else [])
                           + (["cudagraph"] if args.cuda_graph else [])
                           + (["fp32master"] if args.master_weights == "fp32" else [])
                           + (["bf16x3router"] if args.router_logits == "bf16x3" else [])
                           + ([f"x{args.accumulate}"] if args.accumulate > 1 else []))
    if args.fuse_swiglu_backward is None:
        args.fuse_swiglu_backward = "on" if args.precision == "fp8" else "off"
    elif args.fuse_swiglu_backward == "off" and args.precision == "fp8":
        default_tag += "_unfused-swiglu-backward"
    if args.precision == "fp8":
        args.precision = FP8_DEFAULT[0]
        if args.fast_accumulation is None:
            args.fast_accumulation = FP8_DEFAULT[1]
    if args.accumulate < 1:
        parser.error(f"--accumulate must be >= 1, got {args.accumulate}")
    if not torch.cuda.is_available():
        raise SystemExit("moe_block.py needs a CUDA GPU")
    results = {}
    for name in args.cases:
        results[name] = run_case(name, CASES[name], args)
        r = results[name]
        print(
            f"{name:20s} {r['backend']:10s} {args.precision:6s} x{args.accumulate} {r['median_ms']:8.2f} ms "
            f"{r['tflops']:7.1f} TFLOP/s (back to back {r['pipelined_ms']:.2f} ms, {r['pipelined_tflops']:.1f}; "
            f"queued {r['queued_ms']:.2f} ms) peak {r['peak_gib']:6.1f} GiB  "
            f"err out {r['rel_err_out']:.2e} dx {r['rel_err_dx']:.2e}",
            flush=True,
        )
        if "profile" in r:
            print_profile(r["profile"])
    tag = args.tag or default_tag
    path = write_results(f"moe_block_{tag}", {"cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
