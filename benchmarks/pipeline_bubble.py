"""The pipeline bubble of each schedule for the shipped presets, computed on paper (CPU, no GPU).

    python benchmarks/pipeline_bubble.py                         # every preset, PP 2..16
    python benchmarks/pipeline_bubble.py --presets deepseek_v3 --pp 8 16 --microbatches 1 2 4 8

For each preset the model is built on the meta device (no memory) and split as
`MegatronMoEStrategy` splits it (`lightning_moe.parallel.pipeline.plan_split`: contiguous chunks
balanced by parameter and FLOP count, ``PP x V`` chunks dealt round-robin). The time of a chunk
per micro-batch is taken proportional to its training FLOPs per token: 3 x 2 x its matrix weights
(routed experts at ``router_topk / num_experts``), plus its blocks' share of the attention score
FLOPs at ``max_seq_length``, plus the output projection on the last chunk. With ``M``
micro-batches per step, ``C_r`` the time of pipeline rank ``r`` per micro-batch (the sum of its
chunks) and ``c`` the slowest chunk:

* GPipe and 1F1B (same bubble; 1F1B holds at most ``P`` micro-batches' activations):
  ``T = (M + P - 1) x max_r C_r``;
* interleaved 1F1B with ``V`` chunks per rank: ``T = M x max_r C_r + (P - 1) x c`` (the warm-up
  and cool-down run in chunk units, Megatron-LM's ``(P - 1) / V`` reduction);

and the bubble is the idle share of device time, ``1 - M x mean_r C_r / T`` (imbalance between
stages included). ``ideal`` is the same for perfectly balanced stages: ``(P - 1) / (M + P - 1)``,
``(P - 1) / (V M + P - 1)``. Assumptions: no communication time, backward = 2 x forward on every
chunk, the embedding lookup free. Writes ``benchmarks/results/pipeline_bubble.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_moe.models.decoder import MoEDecoder  # noqa: E402
from lightning_moe.models.flops import attention_flops_per_token  # noqa: E402
from lightning_moe.models.presets import get_preset, list_presets  # noqa: E402
from lightning_moe.parallel.pipeline import module_costs, plan_split  # noqa: E402


def chunk_times(model: MoEDecoder, chunks: tuple[tuple[str, ...], ...]) -> list[float]:
    """Training FLOPs per token of each chunk (the time model of the module docstring)."""
    cfg = model.config
    attention = attention_flops_per_token(cfg, cfg.max_seq_length) / cfg.num_layers
    times = []
    for k, names in enumerate(chunks):
        flops = sum(module_costs(model.get_submodule(n))[1] + attention for n in names)
        if k == len(chunks) - 1:
            flops += sum(module_costs(model.get_submodule(n))[1] for n in model.pipeline_edge_modules()[1])
        times.append(3.0 * flops)
    return times


def bubble(times: list[float], pp: int, virtual: int, microbatches: int) -> float:
    rank_times = [sum(times[c] for c in range(r, len(times), pp)) for r in range(pp)]
    if virtual == 1:
        total = (microbatches + pp - 1) * max(rank_times)
    else:
        total = microbatches * max(rank_times) + (pp - 1) * max(times)
    return 1.0 - microbatches * (sum(rank_times) / pp) / total


def ideal(pp: int, virtual: int, microbatches: int) -> float:
    return (pp - 1) / (virtual * microbatches + pp - 1)


def rows_for(preset: str, pp_sizes: list[int], microbatch_factors: list[int], virtual_sizes: list[int]) -> list[dict]:
    with torch.device("meta"):
        model = MoEDecoder(get_preset(preset))
    layers = model.config.num_layers
    rows = []
    for pp in pp_sizes:
        for virtual in [1, *virtual_sizes]:
            if pp * virtual > layers:
                continue
            plan = plan_split(model, pp, virtual)
            times = chunk_times(model, plan.chunks)
            schedules = ("gpipe", "1f1b") if virtual == 1 else ("interleaved_1f1b",)
            for factor in microbatch_factors:
                m = factor * pp
                for schedule in schedules:
                    rows.append({
                        "preset": preset, "layers": layers, "pp": pp, "virtual": virtual, "schedule": schedule,
                        "microbatches": m, "bubble": round(bubble(times, pp, virtual, m), 4),
                        "ideal": round(ideal(pp, virtual, m), 4),
                        "blocks_per_chunk": [len(c) for c in plan.chunks],
                    })
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list_presets(), choices=list_presets())
    parser.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--virtual", nargs="+", type=int, default=[2, 4], help="virtual stages (interleaved)")
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8],
                        help="micro-batches per step as multiples of PP")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args(argv)
    rows = [row for preset in args.presets for row in rows_for(preset, args.pp, args.microbatches, args.virtual)]
    print(f"{'preset':>14} {'L':>3} {'PP':>3} {'V':>2} {'schedule':>16} {'M':>4} {'bubble':>7} {'ideal':>7}")
    for r in rows:
        print(f"{r['preset']:>14} {r['layers']:>3} {r['pp']:>3} {r['virtual']:>2} {r['schedule']:>16} "
              f"{r['microbatches']:>4} {r['bubble']:>7.3f} {r['ideal']:>7.3f}")
    from benchmarks._common import write_results

    path = write_results("pipeline_bubble", {"rows": rows}, results_dir=args.out)
    print(f"wrote {path}")
    return {"rows": rows, "path": str(path)}


if __name__ == "__main__":
    main()
