"""A dense linear's float8 transposes: the tiled byte transpose (`kernels.transpose_triton`, what
`native_gemms.TILED_FP8_TRANSPOSES` switches on) against torch's ``q.t().contiguous()``, at the
backward's operands of the benchmark models' dense layers, with their bytes compared.

Operands per model, at 8,192 tokens (the qwen3 and mixtral micro-batches of `train_step.py`): the
output gradients and inputs of the q, k, v and o projections (``[tokens, width]``) and their weights
(``[out, in]``). Each launch is timed queued behind a GPU spin (the host's allocations stay out).

    python benchmarks/fp8_transpose.py [--models qwen3 mixtral] [--results-dir DIR]

Writes ``benchmarks/results/fp8_transpose[_<tag>].json``: per operand, ms and TB/s of each way (read
plus written bytes) and whether the bytes are equal.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import QUEUED_LEAD_CYCLES, cuda_time_ms, write_results  # noqa: E402
from lightning_moe.kernels.transpose_triton import transpose_bytes  # noqa: E402
from lightning_moe.models.presets import get_preset  # noqa: E402

PRESETS = {"qwen3": "qwen3_30b_a3b", "mixtral": "mixtral_8x7b"}
TOKENS = 8192


def operands(model: str) -> dict[str, tuple[int, int]]:
    """name -> (rows, columns) of the float8 copies a dense attention backward transposes."""
    cfg = get_preset(PRESETS[model])
    hidden, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    return {"q output gradient": (TOKENS, q), "k/v output gradient": (TOKENS, kv), "o output gradient": (TOKENS, hidden),
            "q/k/v input": (TOKENS, hidden), "o input": (TOKENS, q), "q weight": (q, hidden),
            "k/v weight": (kv, hidden), "o weight": (hidden, q)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default: benchmarks/results)")
    args = parser.parse_args()
    results: dict = {}
    for model in args.models:
        rows_out = {}
        for name, (rows, cols) in operands(model).items():
            q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            equal = torch.equal(transpose_bytes(q).view(torch.uint8), q.view(torch.uint8).t())
            moved = 2 * rows * cols  # bytes read and written
            row = {"rows": rows, "cols": cols, "equal": equal}
            for way, fn in (("tiled", lambda: transpose_bytes(q)), ("torch", lambda: q.t().contiguous())):
                ms, _ = cuda_time_ms(fn, iters=args.iters, lead_cycles=QUEUED_LEAD_CYCLES)
                row[f"{way}_ms"], row[f"{way}_tbps"] = ms, moved / ms / 1e9
            rows_out[name] = row
            print(f"{model:8s} {name:20s} {rows}x{cols}: tiled {row['tiled_ms']:.4f} ms ({row['tiled_tbps']:.2f} TB/s), "
                  f"torch {row['torch_ms']:.4f} ms ({row['torch_tbps']:.2f} TB/s), bytes {'equal' if equal else 'DIFFER'}",
                  flush=True)
        results[model] = rows_out
    write_results("fp8_transpose" + (f"_{args.tag}" if args.tag else ""), {"results": results, "tokens": TOKENS},
                  results_dir=args.results_dir)


if __name__ == "__main__":
    main()
