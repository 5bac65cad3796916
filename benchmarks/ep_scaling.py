"""Expert-parallel scaling of the MoE block: per-GPU throughput at EP = 1, 2, ... (same tokens per GPU).

    python benchmarks/ep_scaling.py --ep 1 2                      # needs 2 GPUs for EP=2
    python benchmarks/ep_scaling.py --ep 1 2 4 8 --cases qwen3_30b_a3b
    python benchmarks/ep_scaling.py --ep 1 2 --dispatchers alltoall allgather --transports nccl copy_engine

Each EP size runs in its own set of processes (one per GPU, NCCL): every GPU holds E/EP
experts and routes the block's full token count (B x S of BENCHMARKS.md), so per-GPU work is
constant and a perfect scaling keeps per-GPU TFLOP/s. Two timings: the median of steps that
each start on an idle GPU (the CPU's launch time is exposed), and the mean of steps issued back
to back, as a training loop issues them (the CPU runs ahead unless the step syncs, as the
all-to-all dispatcher does once per layer to read its split sizes). The dispatcher (all-to-all by default;
all-gather with the NCCL or copy-engine transport) moves tokens; the share of step time spent
in NCCL kernels and the time of peer copies come from a profiled step. Correctness first:
at EP > 1 the block's output on every rank equals the EP=1 block (same weights, same tokens)
within bf16 tolerance. Writes ``benchmarks/results/ep_scaling.json`` (``ep_scaling_<tag>.json``
with ``--tag``).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_ms, cuda_time_pipelined_ms, relative_error, write_results  # noqa: E402
from benchmarks._profile import profile_step, save_trace  # noqa: E402
from benchmarks.moe_block import CASES, block_flops, build_layer  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def worker(
    rank: int, world: int, port: int, cases: list[str], iters: int, variant: dict, queue, trace_dir: str | None = None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_moe.parallel.expert_parallel import expert_parallel_layer

    out = {}
    for name in cases:
        if variant.get("watchdog"):  # a case that hangs dumps every thread's stack and ends the run
            faulthandler.dump_traceback_later(variant["watchdog"], exit=True)
        c = CASES[name]
        torch.manual_seed(0)
        layer = build_layer(c, "grouped_mm", torch.bfloat16)
        layer.set_config(dataclasses.replace(
            layer.config, dispatch_chunks=variant["chunks"], dispatch_transport=variant["transport"]
        ))
        reference = None
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(c["B"], c["S"], c["D"], device="cuda", dtype=torch.bfloat16, generator=g)
        if world > 1:
            with torch.no_grad():
                reference = layer(x[:1, :1024]).float()  # full layer (all experts) on this rank's tokens
            mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("ep",))
            expert_parallel_layer(layer, mesh, variant["dispatcher"])
        err = None
        if reference is not None:
            with torch.no_grad():
                err = relative_error(layer(x[:1, :1024]).float(), reference)
        x.requires_grad_(True)
        dy = torch.randn_like(x)

        def step():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(dy)

        torch.cuda.reset_peak_memory_stats()
        median_ms, _ = cuda_time_ms(step, warmup=5, iters=iters)
        pipelined_ms = cuda_time_pipelined_ms(step, warmup=2, iters=iters)
        prof = profile_step(step, top_kernels=16)
        if trace_dir is not None:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            save_trace(step, str(Path(trace_dir) / f"{variant['tag']}_{name}_{variant['key']}_rank{rank}.json.gz"))
        times = [torch.zeros(2, device="cuda") for _ in range(world)]
        dist.all_gather(times, torch.tensor([median_ms, pipelined_ms], device="cuda"))
        # The step ends when the slowest rank ends (host sync: read the gathered times).
        slowest, slowest_pipelined = torch.stack(times).max(0).values.tolist()
        out[name] = {
            "ep": world,
            "dispatcher": variant["dispatcher"] if world > 1 else "local",
            "dispatch_transport": variant["transport"],
            "dispatch_chunks": variant["chunks"],
            "median_ms_slowest_rank": slowest,
            "per_gpu_tflops": block_flops(c) / (slowest * 1e-3) / 1e12,
            "pipelined_ms_slowest_rank": slowest_pipelined,
            "pipelined_per_gpu_tflops": block_flops(c) / (slowest_pipelined * 1e-3) / 1e12,
            "peer_copy_ms_rank0": prof["peer_copy_ms"],
            "nccl_share": prof["nccl_share"],
            "kernel_ms_rank0": prof["kernel_ms"],
            "wall_ms_rank0": prof["wall_ms"],
            "top_kernels_rank0": prof["kernels"],
            "idle_gaps_rank0": prof["idle_gaps"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "rel_err_vs_ep1": err,
        }
        faulthandler.cancel_dump_traceback_later()
        layer = x = dy = step = None  # free this case's tensors before the next one
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", default=["qwen3_30b_a3b", "deepseek_v3_slice"], choices=list(CASES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1],
                        help="MoEConfig.dispatch_chunks values to run at EP > 1 (all-to-all pipelining)")
    parser.add_argument("--dispatchers", nargs="+", default=["alltoall"], choices=["alltoall", "allgather"],
                        help="token dispatchers to run at EP > 1")
    parser.add_argument("--transports", nargs="+", default=["nccl"], choices=["nccl", "copy_engine"],
                        help="MoEConfig.dispatch_transport values for the all-gather dispatcher")
    parser.add_argument("--tag", default=None, help="results file ep_scaling_<tag>.json (default ep_scaling.json)")
    parser.add_argument("--trace-dir", default=None,
                        help="write a gzipped Chrome trace of 3 back-to-back steps per case, variant and rank here")
    parser.add_argument("--watchdog", type=float, default=0.0,
                        help="seconds a case may take on a rank before that rank prints every thread's Python "
                             "stack and exits; the variant is then recorded as hung and the next one runs (0: off)")
    args = parser.parse_args(argv)
    available = torch.cuda.device_count()
    results = {}
    ctx = mp.get_context("spawn")
    runs = []
    for ep in args.ep:
        if ep == 1:
            runs.append((1, dict(dispatcher="alltoall", transport="nccl", chunks=1), "ep1"))
            continue
        for dispatcher in args.dispatchers:
            # all-to-all: NCCL only, optionally pipelined; all-gather: never chunked, any transport
            for transport in (["nccl"] if dispatcher == "alltoall" else args.transports):
                for chunks in (args.chunks if dispatcher == "alltoall" else [1]):
                    key = f"ep{ep}" + ("" if dispatcher == "alltoall" else f"_{dispatcher}")
                    key += "" if transport == "nccl" else f"_{transport}"
                    key += "" if chunks == 1 else f"_chunks{chunks}"
                    runs.append((ep, dict(dispatcher=dispatcher, transport=transport, chunks=chunks), key))
    for i, (ep, variant, key) in enumerate(runs):
        if ep > available:
            print(f"EP={ep}: skipped, {available} GPU(s) here")
            continue
        queue = ctx.Queue()
        variant = {**variant, "key": key, "tag": args.tag or "untagged", "watchdog": args.watchdog}
        try:
            mp.spawn(worker, args=(ep, 29500 + i, args.cases, args.iters, variant, queue, args.trace_dir),
                     nprocs=ep, join=True)
        except mp.ProcessExitedException as error:  # the watchdog ended a rank: the stacks are on stderr
            print(f"{key}: a rank exited ({error}); recorded as hung", flush=True)
            results.setdefault("hung", []).append(key)
            continue
        results[key] = queue.get()
        for name, r in results[key].items():
            err = "" if r["rel_err_vs_ep1"] is None else f" err vs EP1 {r['rel_err_vs_ep1']:.2e}"
            print(f"{key:28s} {name:18s} {r['median_ms_slowest_rank']:8.2f} ms "
                  f"{r['per_gpu_tflops']:7.1f} TFLOP/s/GPU (back to back {r['pipelined_ms_slowest_rank']:.2f} ms "
                  f"{r['pipelined_per_gpu_tflops']:.1f}) NCCL share {r['nccl_share']*100:5.1f}% "
                  f"peer copies {r['peer_copy_ms_rank0']:.2f} ms kernels {r['kernel_ms_rank0']:.2f} ms{err}",
                  flush=True)
            for row in r["top_kernels_rank0"]:
                print(f"      {row['cuda_ms']:7.2f} ms x{row['calls']:<4d} {row['name']}")
    if "ep1" in results:
        for key, per_case in results.items():
            if key == "hung":
                continue
            for name, r in per_case.items():
                r["vs_ep1"] = r["per_gpu_tflops"] / results["ep1"][name]["per_gpu_tflops"]
                r["pipelined_vs_ep1"] = r["pipelined_per_gpu_tflops"] / results["ep1"][name]["pipelined_per_gpu_tflops"]
    write_results("ep_scaling" if args.tag is None else f"ep_scaling_{args.tag}", {"results": results})


if __name__ == "__main__":
    main()
