"""fc1 reading the permutation itself under the all-gather dispatcher (EP=2, and EP=2 x ETP=2 on
four ranks), on CPU processes over gloo with the Triton paths forced on under Triton's interpreter.
Run as a script with ``TRITON_INTERPRET=1``; prints one line per rank and case ending in "equal" and
exits non-zero on a mismatch.

Every rank runs the same sharded layer with `experts.GATHERED_FIRST_PROJECTION` on and off: the
dispatcher then hands the experts the gathered tokens and a plan whose buffer tail stays unwritten,
instead of the permuted rows. Output, input gradient and every parameter gradient are bit-equal,
and fc1 keeps one tensor of the buffer's size fewer for the backward.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))


def _rank(rank: int, world_size: int, etp: int) -> list[str]:
    from _interpreted_gathered_projection import saved_shapes
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.nn import experts as experts_module
    from lightning_moe.parallel.expert_parallel import expert_parallel_layer

    ep = world_size // etp
    mesh = (init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)) if etp == 1 else
            init_device_mesh("cpu", (ep, etp), mesh_dim_names=("ep", "etp")))
    lines = []
    for weighted in (True, False):
        experts_module.WEIGHTED_SWIGLU_COMBINE = weighted
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(hidden_size=32, ffn_hidden_size=24, num_experts=8, router_topk=2))
        expert_parallel_layer(layer, mesh, "allgather")
        x = torch.randn(10, 32, generator=torch.Generator().manual_seed(100 + rank))
        runs, buffer_sized = [], []
        for gathered in (True, False):
            experts_module.GATHERED_FIRST_PROJECTION = gathered
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            with saved_shapes() as shapes:
                y = layer(xi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in layer.parameters()]
            runs.append((y.detach(), xi.grad, grads))
            rows = 10 * world_size * 2  # the gathered tokens' assignments: the buffer's static rows
            buffer_sized.append(sum(1 for s in shapes if s == (rows, 32)))
        (y1, gx1, g1), (y0, gx0, g0) = runs
        same = torch.equal(y1, y0) and torch.equal(gx1, gx0) and all(torch.equal(a, b) for a, b in zip(g1, g0))
        fewer = buffer_sized[0] == buffer_sized[1] - 1
        lines.append(f"allgather etp={etp} rank={rank} weighted={weighted}: "
                     f"{'equal' if same and fewer else f'differs (same={same}, saved {buffer_sized})'}")
    return lines


def main() -> None:
    from _launch import run_distributed
    from _triton_on_cpu import force_triton_paths

    force_triton_paths()
    bad = False
    for world_size, etp in ((2, 1), (4, 2)):
        for lines in run_distributed(_rank, world_size, etp, timeout=600.0):
            for line in lines:
                print(line)
                bad |= not line.endswith("equal")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
