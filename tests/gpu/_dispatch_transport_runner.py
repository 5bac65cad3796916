"""Runs one bf16 MoE layer at EP=2 on two GPUs under the all-gather dispatcher with each
transport (NCCL, copy engine) and under the all-to-all dispatcher, and prints what the test
compares as JSON. A fresh process: CUDA must not be initialised before the workers spawn."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

VARIANTS = (("allgather", "nccl"), ("allgather", "copy_engine"), ("alltoall", "nccl"))


def run_variant(rank: int, dispatcher: str, transport: str, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_moe.nn.config import MoEConfig
    from lightning_moe.nn.moe_layer import MoELayer
    from lightning_moe.parallel.expert_parallel import expert_parallel_layer

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=384, num_experts=8, router_topk=2,
                    expert_backend="grouped_mm", dispatch_transport=transport)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)
    mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
    expert_parallel_layer(layer, mesh, dispatcher)
    out = {"describe": layer.dispatcher.describe(), "y": [], "x_grad": []}
    for step in range(steps):  # several steps: the symmetric workspace is reused across collectives
        g = torch.Generator(device="cuda").manual_seed(1000 * step + rank)
        x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        y = layer(x)
        y.backward(torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=g))
        out["y"].append(y.detach().float().cpu())
        out["x_grad"].append(x.grad.float().cpu())
    for name, p in layer.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        out[name] = grad.float().cpu()
    return out


def worker(rank: int, port: int, steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    runs = {f"{d}_{t}": run_variant(rank, d, t, steps) for d, t in VARIANTS}
    base, engine, a2a = runs["allgather_nccl"], runs["allgather_copy_engine"], runs["alltoall_nccl"]
    report = {"describe": {k: v["describe"] for k, v in runs.items()}, "identical": {}, "max_diff_vs_alltoall": {}}
    for key, value in base.items():
        if key == "describe":
            continue
        pairs = list(zip(value, engine[key], a2a[key])) if isinstance(value, list) else [(value, engine[key], a2a[key])]
        report["identical"][key] = all(torch.equal(a, b) for a, b, _ in pairs)
        report["max_diff_vs_alltoall"][key] = max(float((a - c).abs().max()) for a, _, c in pairs)
        report.setdefault("scale", {})[key] = max(float(c.abs().max()) for _, _, c in pairs)
    queue.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(29720, 3, queue), nprocs=2, join=True)
    reports = dict(queue.get() for _ in range(2))
    print("RESULT " + json.dumps(reports))


if __name__ == "__main__":
    main()
