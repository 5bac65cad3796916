"""ParallelLayout.build_meshes on 4 gloo ranks: every mesh group is the layout's rank group."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from _launch import DistributedTestError, run_distributed
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_moe.layout import DENSE_MESH_DIMS, EXPERT_MESH_DIMS, ParallelLayout

WORLD_SIZE = 4
# Mesh name -> the layout axis whose groups it must hold.
MESH_AXES = {
    **{d: d for d in DENSE_MESH_DIMS + EXPERT_MESH_DIMS},
    "dp_cp": "dp-cp",
    "cp_tp": "tp-cp",
    "ep_etp": "etp-ep",
    "edp_etp": "etp-edp",
    "stage": "tp-cp-dp",
    "world": "tp-cp-dp-pp",
}


def _group_ranks(mesh, dim=None):
    return dist.get_process_group_ranks(mesh.get_group(dim))


def _check_meshes(rank, world_size, sizes):
    layout = ParallelLayout(world_size=world_size, **sizes).build_meshes("cpu")
    dense, expert = layout.dense_mesh, layout.expert_mesh
    assert dense.mesh_dim_names == DENSE_MESH_DIMS and expert.mesh_dim_names == EXPERT_MESH_DIMS
    assert dense.shape == tuple(layout.size(d) for d in DENSE_MESH_DIMS)
    assert expert.shape == tuple(layout.size(d) for d in EXPERT_MESH_DIMS)
    # One root: DTensors, FSDP2 and DCP can mix parameters of both meshes.
    assert dense._get_root_mesh() is expert._get_root_mesh() is layout.mesh("world")

    for mesh, dims in ((dense, DENSE_MESH_DIMS), (expert, EXPERT_MESH_DIMS)):
        for dim in dims:
            assert _group_ranks(mesh, dim) == layout.group(dim, rank), dim
            assert mesh.get_local_rank(dim) == layout.rank_in_group(dim, rank), dim
    for name, axis in MESH_AXES.items():
        sub = layout.mesh(name)
        assert sub.ndim == 1 and sub.size() == layout.size(axis), name
        assert _group_ranks(sub) == layout.group(axis, rank), name
        assert sub.get_local_rank() == layout.rank_in_group(axis, rank), name

    # Sum 2**rank over the expert-parallel group: the result names exactly its members.
    t = torch.tensor([2**rank])
    dist.all_reduce(t, group=layout.mesh("ep").get_group())
    assert t.item() == sum(2**r for r in layout.group("ep", rank))

    # Experts as a DTensor: each EP rank holds its contiguous slice of the expert dimension.
    w_EF = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    w_dt = distribute_tensor(w_EF, layout.mesh("ep"), [Shard(0)])
    ep_rank, ep = layout.rank_in_group("ep", rank), layout.expert_parallel_size
    torch.testing.assert_close(w_dt.to_local(), w_EF.chunk(ep)[ep_rank])
    torch.testing.assert_close(w_dt.full_tensor(), w_EF)

    assert layout.build_meshes("cpu") is layout and layout.dense_mesh is dense  # idempotent
    return layout.coordinates(rank)


@pytest.mark.parametrize(
    "sizes",
    [
        {},  # DP4
        {"expert_parallel_size": 4},  # EP4 over DP4
        {"tensor_parallel_size": 2, "expert_parallel_size": 2},  # TP2 x DP2 / EP2 x EDP2
        {"expert_tensor_parallel_size": 2, "expert_parallel_size": 2},  # ETP2 x EP2, DP4
        {"context_parallel_size": 2, "expert_parallel_size": 4},  # CP2 x DP2 / EP4 (EP > DP)
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 2},
    ],
    ids=lambda sizes: "-".join(f"{k.split('_parallel')[0]}{v}" for k, v in sizes.items()) or "dp4",
)
def test_mesh_groups_match_layout_groups(sizes):
    coords = run_distributed(_check_meshes, WORLD_SIZE, sizes, timeout=30)
    layout = ParallelLayout(world_size=WORLD_SIZE, **sizes)
    assert coords == [layout.coordinates(r) for r in range(WORLD_SIZE)]


def _fsdp_over_both_meshes(rank, world_size):
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    layout = ParallelLayout(world_size=world_size, tensor_parallel_size=2, expert_parallel_size=2)
    layout.build_meshes("cpu")
    torch.manual_seed(0)
    model = nn.Module()
    model.dense = nn.Linear(8, 8)
    model.experts = nn.Module()
    w_EDF = torch.randn(4, 8, 8)
    model.experts.w_EDF = nn.Parameter(distribute_tensor(w_EDF, layout.mesh("ep"), [Shard(0)]))
    parallelize_module(model.dense, layout.mesh("tp"), ColwiseParallel())
    fully_shard(model.experts, mesh=layout.mesh("edp"))
    fully_shard(model.dense, mesh=layout.mesh("dp_cp"))
    x_TD = torch.randn(3, 8)
    loss = model.dense(x_TD).sum() + (x_TD @ model.experts.w_EDF.full_tensor()).sum()  # local TP shard
    loss.backward()
    meshes = {name: p.device_mesh.mesh_dim_names for name, p in model.named_parameters()}
    assert meshes == {"dense.weight": ("dp_cp", "tp"), "dense.bias": ("dp_cp", "tp"), "experts.w_EDF": ("edp", "ep")}
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    torch.testing.assert_close(model.experts.w_EDF.full_tensor(), w_EDF)


def test_fsdp2_composes_tp_and_ep_meshes():
    # The shared root lets FSDP2 concatenate its DP mesh with the TP / EP mesh of each DTensor.
    run_distributed(_fsdp_over_both_meshes, WORLD_SIZE, timeout=30)


def _build_with_wrong_world_size(rank, world_size):
    with pytest.raises(ValueError, match=f"world_size={world_size}"):
        ParallelLayout(world_size=2 * world_size).build_meshes("cpu")


def test_build_meshes_rejects_world_size_mismatch():
    run_distributed(_build_with_wrong_world_size, 2, timeout=30)


# ---- the launcher itself (other distributed tests rely on it)


def _sum_ranks(rank, world_size, factor):
    t = torch.tensor([float(rank) * factor])
    dist.all_reduce(t)
    return rank, os.environ["RANK"], int(os.environ["WORLD_SIZE"]), t.item()


def test_launcher_returns_results_by_rank():
    assert run_distributed(_sum_ranks, 3, 2.0, timeout=30) == [(r, str(r), 3, 6.0) for r in range(3)]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the other ranks block here until the launcher kills them


def _exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(60)
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "timeout", "match"),
    [
        (_fail_on_rank_one, 30, r"(?s)rank 1:.*ValueError: boom on purpose"),
        (_exit_on_rank_one, 30, "rank 1 exited with code 3 without a result"),
        (_hang_on_rank_zero, 1, r"did not finish within 1 s"),
    ],
)
def test_launcher_reports_failures_quickly(fn, timeout, match):
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=match):
        run_distributed(fn, 3, timeout=timeout)
    assert time.monotonic() - start < 8
