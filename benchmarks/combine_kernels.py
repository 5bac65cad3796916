"""The combine kernels at the expert-parallel all-gather dispatcher's sparsity, on one GPU.

    python benchmarks/combine_kernels.py
    python benchmarks/combine_kernels.py --cases deepseek_v3_slice --ep 2 4

Under the all-gather dispatcher at EP = G each rank combines all ``G*T`` gathered tokens, and
about ``K/G`` of each token's K slots hold a row on this rank (its experts); the rest point at no
row. This times, per MoE block shape (BENCHMARKS.md) and bf16:

* ``ep1``: T tokens with every slot held (one rank, dropless);
* ``epG``: ``G*T`` tokens, each slot held with probability ``1/G`` (the same rows in total),
  for the combine forward, its backward in one pass over all K slots, and its backward with the
  held slots packed ``ceil(K/G)`` at a time (``slots_per_pass``, what the dispatcher sets).

Correctness first: the packed backward's row gradients equal the one-pass backward's bit for
bit, and its weight gradients agree to fp32 rounding. Writes
``benchmarks/results/combine_kernels.json`` (``combine_kernels_<tag>.json`` with ``--tag``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_ms, write_results  # noqa: E402
from benchmarks.moe_block import CASES  # noqa: E402


def routing(tokens: int, k: int, ep: int, device: str = "cuda") -> tuple[torch.Tensor, int]:
    """``dest`` [tokens, k]: each slot held with probability 1/ep, the held slots spread over
    ``rows`` = their count (every row held once, in random order), the others the sentinel."""
    held = torch.rand(tokens, k, device=device) < 1.0 / ep
    rows = int(held.sum())  # host sync: the setup's row count
    dest = torch.full((tokens, k), rows, dtype=torch.long, device=device)
    dest[held] = torch.randperm(rows, device=device)
    return dest, rows


def run_case(name: str, ep: int, iters: int) -> dict:
    from lightning_moe.kernels.combine_triton import combine, combine_backward

    c = CASES[name]
    tokens, d, k = c["B"] * c["S"] * ep, c["D"], c["k"]
    torch.manual_seed(0)
    dest, rows = routing(tokens, k, ep)
    y = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(tokens, k, device="cuda")
    g = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    packed = None if ep == 1 else -(-k // ep)
    gy_one, gw_one = combine_backward(y, dest, w, g, rows, None, need_grad_w=True)
    out: dict = {"tokens": tokens, "rows": rows, "held_share": float((dest < rows).float().mean())}
    if packed is not None:
        gy, gw = combine_backward(y, dest, w, g, rows, None, need_grad_w=True, slots_per_pass=packed)
        out["packed_rows_identical"] = bool(torch.equal(gy, gy_one))
        out["packed_grad_w_max_rel"] = float(((gw - gw_one).abs().max() / gw_one.abs().max()))
        if not out["packed_rows_identical"] or out["packed_grad_w_max_rel"] > 1e-5:
            raise SystemExit(f"{name} EP={ep}: the packed backward disagrees: {out}")
    out["forward_ms"] = cuda_time_ms(lambda: combine(y, dest, w), iters=iters)[0]
    out["backward_one_pass_ms"] = cuda_time_ms(
        lambda: combine_backward(y, dest, w, g, rows, None, need_grad_w=True), iters=iters)[0]
    if packed is not None:
        out["slots_per_pass"] = packed
        out["backward_packed_ms"] = cuda_time_ms(
            lambda: combine_backward(y, dest, w, g, rows, None, need_grad_w=True, slots_per_pass=packed),
            iters=iters)[0]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b", "deepseek_v3_slice"], choices=list(CASES))
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tag", default=None, help="results file combine_kernels_<tag>.json")
    args = parser.parse_args(argv)
    results: dict = {}
    for name in args.cases:
        for ep in args.ep:
            r = results.setdefault(name, {})[f"ep{ep}"] = run_case(name, ep, args.iters)
            packed = f", packed {r['backward_packed_ms']:.3f} ms" if "backward_packed_ms" in r else ""
            print(f"{name:18s} EP={ep}: forward {r['forward_ms']:.3f} ms, backward {r['backward_one_pass_ms']:.3f} ms"
                  f"{packed} ({r['tokens']} tokens, {r['held_share']:.2f} of slots held)", flush=True)
    write_results("combine_kernels" if args.tag is None else f"combine_kernels_{args.tag}", {"results": results})


if __name__ == "__main__":
    main()
