"""What the expert-parallel all-to-all costs on this machine, and whether it can hide behind GEMMs.

    python benchmarks/ep_comm_probe.py            # needs 2 GPUs

Measures, between two GPUs of one host:
  * the link (``nvidia-smi topo -m``, peer access) and NCCL's transport;
  * NCCL ``all_to_all_single`` bandwidth for the payload of one MoE block dispatch;
  * a grouped GEMM of the qwen3 EP=2 expert shape alone, the all-to-all alone, and both at once
    (all-to-all issued first or second): whether NCCL's kernels find SMs beside the GEMM;
  * the same with a copy-engine transfer (a peer write into symmetric memory), which needs no SMs.
Writes ``benchmarks/results/ep_comm_probe.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def timed(fn, iters: int = 10) -> float:
    """Median wall ms of ``fn`` on this rank, both ranks started together (barrier) each time."""
    times = []
    for i in range(iters + 3):
        dist.barrier()
        torch.cuda.synchronize()  # host sync: both ranks start from an idle GPU
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()  # host sync: read the timing
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def worker(rank: int, world: int, port: int, mib: int, only_a2a: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    out: dict = {"peer_access": torch.cuda.can_device_access_peer(rank, 1 - rank)}
    peer = 1 - rank
    numel = mib * 2**20 // 2  # bf16 elements sent to the peer
    send = torch.randn(2 * numel, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def a2a():
        dist.all_to_all_single(recv, send)

    # qwen3 EP=2 expert fc1: 64 local experts x 2048 rows, K=2048 -> N=1536 (gate+up)
    E, rows, K, N = 64, 2048, 2048, 1536
    a = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows

    def gemm():
        for _ in range(4):
            torch._grouped_mm(a, w, offs=offs)

    comm = torch.cuda.Stream()

    def a2a_then_gemm():
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            a2a()
        gemm()
        torch.cuda.current_stream().wait_stream(comm)

    def gemm_then_a2a():
        comm.wait_stream(torch.cuda.current_stream())
        gemm()
        with torch.cuda.stream(comm):
            a2a()
        torch.cuda.current_stream().wait_stream(comm)

    out["a2a_mib_to_peer"] = mib
    out["a2a_ms"] = timed(a2a)
    out["a2a_gb_s_per_direction"] = mib * 2**20 / (out["a2a_ms"] * 1e-3) / 1e9
    if only_a2a:
        if rank == 0:
            queue.put(out)
        dist.barrier()
        dist.destroy_process_group()
        return
    out["gemm_ms"] = timed(gemm)
    out["a2a_issued_first_with_gemm_ms"] = timed(a2a_then_gemm)
    out["gemm_issued_first_with_a2a_ms"] = timed(gemm_then_a2a)

    carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if carveout is not None:
        for sms in (8, 16, 32):
            carveout(sms)
            out[f"gemm_ms_carveout{sms}"] = timed(gemm)
            out[f"a2a_issued_first_with_gemm_ms_carveout{sms}"] = timed(a2a_then_gemm)
        carveout(None)

    # copy engine: write straight into the peer's symmetric buffer (no SMs, no NCCL kernel)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        remote = handle.get_buffer(peer, (numel,), torch.bfloat16)
        src = send[:numel]

        def ce_copy():
            remote.copy_(src)
            handle.barrier()

        def ce_then_gemm():
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                remote.copy_(src)
            gemm()
            torch.cuda.current_stream().wait_stream(comm)
            handle.barrier()

        out["ce_copy_ms"] = timed(ce_copy)
        out["ce_gb_s"] = mib * 2**20 / (out["ce_copy_ms"] * 1e-3) / 1e9
        out["ce_issued_first_with_gemm_ms"] = timed(ce_then_gemm)
        # the peer's write landed: my buffer holds the peer's source
        ce_copy()
        torch.cuda.synchronize()  # host sync: compare once, outside the timings
        sums = [torch.zeros((), device="cuda") for _ in range(world)]
        dist.all_gather(sums, src.float().sum())
        out["ce_write_landed"] = bool(torch.isclose(buf.float().sum(), sums[peer]).item())
    except Exception as error:  # report, don't hide: the JSON records why CE was not measured
        out["ce_error"] = f"{type(error).__name__}: {error}"[:400]

    if rank == 0:
        out["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB each rank sends to its peer")
    parser.add_argument("--tag", default="ep_comm_probe")
    parser.add_argument("--only-a2a", action="store_true", help="just the NCCL all-to-all bandwidth")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("ep_comm_probe needs 2 GPUs")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(2, 29650, args.mib, args.only_a2a, queue), nprocs=2, join=True)
    out = queue.get()
    for key, value in out.items():
        if key != "topology":
            print(f"{key:45s} {value}")
    print(out.get("topology", ""))
    write_results(args.tag, {"results": out, "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL")}})


if __name__ == "__main__":
    main()
