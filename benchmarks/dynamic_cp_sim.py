"""Dynamic vs static context parallelism, simulated past the machine from a one-GPU calibration.

    python benchmarks/dynamic_cp_sim.py --calibrate                 # one CUDA GPU: writes the calibration
    python benchmarks/dynamic_cp_sim.py --calibration benchmarks/results/dynamic_cp_calibration.json
    python benchmarks/dynamic_cp_sim.py --uncalibrated              # the CostModel() FLOP-estimate defaults

``--calibrate`` (one CUDA GPU; ``--device cpu`` checks the pipeline on the host) times the forward
and backward of ``--layers`` blocks of the ``--preset`` model (bf16 autocast, fp32 weights, the
reference decoder: FlashAttention through SDPA, grouped experts) on one sequence of each of
``--lengths`` tokens, fits
``t(L) = a L^2 / 2 + b L + c`` by least squares and scales ``a`` and ``b`` from the timed blocks to
the preset's ``--target-layers`` blocks: the `CostModel`'s attention and linear constants (the
output head is outside both). The CP exchange constants are not timed on one GPU: they follow from
the keys/values each ring step moves (``3 x`` a layer's keys and values per token and layer over
forward and backward) at ``--link-gbps`` and ``--exchange-latency-us`` per step and layer, both
written into the file. Writes ``--out`` (default ``benchmarks/results/dynamic_cp_calibration.json``),
which `DynamicContextParallel(cost_model=path)` and the simulation read.

Simulation (CPU, no GPU needed): for each of ``--gpus`` (8 .. 64), DP = GPUs / CP replicas each
draw a micro-batch of ``CP x --tokens-per-gpu`` tokens of documents whose lengths follow a
lognormal (``--median``, ``--sigma``; clipped to ``--min-len`` .. ``--max-len``, the last document
cut to fill the micro-batch as sequence packing does). The static layout runs every replica's
micro-batch over its CP group; the dynamic plan (`lightning_moe.parallel.dynamic_cp`, the callback's
planner, ``--memory-slack`` x the static tokens per GPU as the limit) places the documents on
sub-groups of 1 .. CP GPUs. A step takes as long as its slowest GPU on the cost model; the report
is the mean dynamic / static step-time ratio over ``--steps`` steps, with the documents run at each
CP size. Writes ``benchmarks/results/dynamic_cp_sim.json`` (``--out``). A simulation: the cost
model's terms and no overlap of exchange and compute are its assumptions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (package not installed)

from lightning_moe.parallel.dynamic_cp import CALIBRATION_FORMAT, CostModel, plan_micro_batch  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_CALIBRATION = RESULTS_DIR / "dynamic_cp_calibration.json"


# ---------------------------------------------------------------------- calibration
def fit_compute_constants(lengths: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``(a, b, c)`` of ``t(L) = a L^2 / 2 + b L + c`` (``a`` and ``b`` kept >= 0)."""
    lengths_L = np.asarray(lengths, dtype=np.float64)
    design = np.stack([lengths_L**2 / 2, lengths_L, np.ones_like(lengths_L)], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=np.float64), rcond=None)
    return max(float(a), 0.0), max(float(b), 0.0), float(c)


def exchange_constants(kv_bytes_per_token_layer: int, layers: int, link_bytes_per_s: float,
                       latency_s: float) -> tuple[float, float]:
    """``(cp_s_per_token, cp_s_per_exchange)``: each ring step moves a token's keys and values once
    forward and its keys, values and their gradients backward (3x) in every layer."""
    return 3 * kv_bytes_per_token_layer * layers / link_bytes_per_s, 3 * latency_s * layers


def time_blocks(cfg, lengths: Sequence[int], device: str, warmup: int, iters: int) -> list[float]:
    """Seconds of one forward and backward of ``cfg``'s blocks (bf16 autocast, fp32 weights) on one
    sequence of each length: CUDA events on a GPU, the host clock on CPU (a plumbing check only)."""
    import statistics
    import time

    import torch

    from benchmarks._common import cuda_time_ms
    from lightning_moe.models.decoder import MoEDecoder

    torch.manual_seed(0)
    model = MoEDecoder(cfg).to(device)
    model.init_weights()
    seconds = []
    for length in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device=device)

        def step(ids: torch.Tensor = ids) -> None:
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                hidden = model.hidden_states(ids)
            hidden.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        if torch.device(device).type == "cuda":
            seconds.append(cuda_time_ms(step, warmup=warmup, iters=iters)[0] / 1e3)
        else:
            for _ in range(warmup):
                step()
            runs = []
            for _ in range(iters):
                start = time.perf_counter()
                step()
                runs.append(time.perf_counter() - start)
            seconds.append(statistics.median(runs))
        print(f"L={length:6d}: {seconds[-1] * 1e3:9.3f} ms for {cfg.num_layers} blocks", flush=True)
    return seconds


def calibrate(args: argparse.Namespace) -> dict:
    """Time the blocks (on one CUDA GPU unless ``--device cpu``) and return the calibration document."""
    import torch

    from benchmarks._common import metadata
    from lightning_moe.models import get_preset

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--calibrate times the model on a CUDA GPU; simulate on CPU with --calibration FILE")
    cfg = get_preset(args.preset, num_layers=args.layers, max_seq_length=max(args.lengths))
    target_layers = args.target_layers or get_preset(args.preset).num_layers
    seconds = time_blocks(cfg, args.lengths, args.device, args.warmup, args.iters)
    a, b, c = fit_compute_constants(args.lengths, seconds)
    scale = target_layers / args.layers
    kv_bytes = 2 * cfg.num_query_groups * cfg.head_dim * 2  # keys and values, bf16
    cp_token, cp_exchange = exchange_constants(kv_bytes, target_layers, args.link_gbps * 1e9,
                                               args.exchange_latency_us * 1e-6)
    fitted = [a * n * n / 2 + b * n + c for n in args.lengths]
    return {
        "format": CALIBRATION_FORMAT,
        "meta": metadata(),
        "cost_model": {
            "attention_s_per_token_pair": a * scale,
            "linear_s_per_token": b * scale,
            "cp_s_per_token": cp_token,
            "cp_s_per_exchange": cp_exchange,
        },
        "measured": {
            "preset": args.preset, "timed_layers": args.layers, "target_layers": target_layers,
            "lengths": list(args.lengths), "seconds": seconds, "fit_intercept_s": c,
            "fit_relative_error": [abs(f - s) / s for f, s in zip(fitted, seconds)],
        },
        "assumed": {"link_gbps": args.link_gbps, "exchange_latency_us": args.exchange_latency_us,
                    "kv_bytes_per_token_layer": kv_bytes},
    }


# ---------------------------------------------------------------------- simulation
def draw_micro_batch(rng: np.random.Generator, budget: int, median: float, sigma: float, min_len: int,
                     max_len: int) -> list[int]:
    """Document lengths filling ``budget`` tokens exactly (the last one cut to fit)."""
    lengths, left = [], budget
    while left:
        n = int(np.clip(round(rng.lognormal(math.log(median), sigma)), min_len, max_len))
        n = min(n, left)
        lengths.append(n)
        left -= n
    return lengths


def simulate(cost: CostModel, gpus: Sequence[int], cp: int, tokens_per_gpu: int, memory_slack: float, steps: int,
             seed: int, median: float, sigma: float, min_len: int, max_len: int) -> list[dict]:
    """One row per GPU count: the mean dynamic / static step-time ratio and the plans' CP sizes."""
    rows = []
    memory_limit = int(tokens_per_gpu * memory_slack)
    for count in gpus:
        if count % cp:
            raise SystemExit(f"--gpus {count} is not a multiple of --cp {cp}")
        rng = np.random.default_rng(seed)
        dynamic_s = static_s = 0.0
        per_size: dict[int, int] = {}
        documents = 0
        for _ in range(steps):
            lengths, replicas = [], []
            for replica in range(count // cp):
                drawn = draw_micro_batch(rng, cp * tokens_per_gpu, median, sigma, min_len, max_len)
                lengths += drawn
                replicas += [replica] * len(drawn)
            plan = plan_micro_batch(lengths, replicas, count, cp, cp, cost, memory_limit)
            dynamic_s += plan.max_cost
            static_s += plan.static_cost
            documents += len(lengths)
            for size, n in plan.sequences_per_cp_size().items():
                per_size[size] = per_size.get(size, 0) + n
        rows.append({
            "gpus": count, "dp": count // cp, "cp": cp,
            "static_step_s": static_s / steps, "dynamic_step_s": dynamic_s / steps,
            "dynamic_over_static": dynamic_s / static_s,
            "documents_per_step": documents / steps,
            "documents_per_cp_size": {str(k): v / steps for k, v in sorted(per_size.items())},
        })
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="time the model on one CUDA GPU, write --out")
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION,
                        help="calibration JSON to simulate with")
    parser.add_argument("--uncalibrated", action="store_true",
                        help="simulate with CostModel()'s FLOP-estimate defaults instead of a calibration")
    parser.add_argument("--out", type=Path, default=None, help="output JSON (default: benchmarks/results/...)")
    cal = parser.add_argument_group("calibration")
    cal.add_argument("--preset", default="qwen3_30b_a3b")
    cal.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cpu: time on the host (checks the pipeline; not a calibration to plan with)")
    cal.add_argument("--layers", type=int, default=2, help="blocks timed")
    cal.add_argument("--target-layers", type=int, default=None, help="blocks of the modelled model (preset's)")
    cal.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    cal.add_argument("--warmup", type=int, default=3)
    cal.add_argument("--iters", type=int, default=10)
    cal.add_argument("--link-gbps", type=float, default=150.0, help="CP ring bandwidth per GPU, GB/s (assumed)")
    cal.add_argument("--exchange-latency-us", type=float, default=20.0, help="per ring step and layer (assumed)")
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    sim.add_argument("--cp", type=int, default=8, help="static CP size (and the dynamic maximum)")
    sim.add_argument("--tokens-per-gpu", type=int, default=8192, help="static layout's tokens per GPU per micro-batch")
    sim.add_argument("--memory-slack", type=float, default=1.25, help="dynamic limit = slack x tokens per GPU")
    sim.add_argument("--steps", type=int, default=20)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--median", type=float, default=2048.0, help="lognormal median document length")
    sim.add_argument("--sigma", type=float, default=1.5, help="lognormal sigma (of the log length)")
    sim.add_argument("--min-len", type=int, default=16)
    sim.add_argument("--max-len", type=int, default=65536)
    args = parser.parse_args(argv)

    if args.calibrate:
        out = args.out or DEFAULT_CALIBRATION
        document = calibrate(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2))
        print(json.dumps(document["cost_model"], indent=2))
        print(f"wrote {out}")
        return
    if args.cp * args.tokens_per_gpu < args.max_len:
        raise SystemExit(f"--cp {args.cp} x --tokens-per-gpu {args.tokens_per_gpu} must hold a --max-len "
                         f"{args.max_len} document (static CP is sized for the longest)")
    cost = CostModel() if args.uncalibrated else CostModel.from_json(args.calibration)
    source = "CostModel() defaults (FLOP estimate, not measured)" if args.uncalibrated else str(args.calibration)
    rows = simulate(cost, args.gpus, args.cp, args.tokens_per_gpu, args.memory_slack, args.steps, args.seed,
                    args.median, args.sigma, args.min_len, args.max_len)
    print(f"cost model: {source}")
    print(f"{'GPUs':>5} {'DP':>3} {'CP':>3} {'docs/step':>9} {'static s':>9} {'dynamic s':>9} {'dyn/static':>10}"
          "  docs per CP size")
    for r in rows:
        print(f"{r['gpus']:5d} {r['dp']:3d} {r['cp']:3d} {r['documents_per_step']:9.1f} {r['static_step_s']:9.4f} "
              f"{r['dynamic_step_s']:9.4f} {r['dynamic_over_static']:10.3f}  {r['documents_per_cp_size']}")
    out = args.out or RESULTS_DIR / "dynamic_cp_sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from benchmarks._common import metadata

    out.write_text(json.dumps({
        "meta": metadata(),
        "simulation": True, "calibration": source, "cost_model": cost.to_dict(),
        "arguments": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
