"""Gradient reduction and one global-norm clipping across the dense and expert meshes.

The strategy sorts parameters into three classes, each with its own reduction (the derivation
is in README.md, "How gradients are reduced"):

- dense parameters (attention, norms, embeddings; TP-sharded ones are DTensors):
  average over DP x CP. FSDP does it; in "ddp" mode :func:`all_reduce_grads` does.
- MoE replicated parameters (router, shared experts): every rank of the stage routes a
  distinct slice of tokens (TP ranks split the sequence inside the MoE layer), so their
  gradient is the SUM over the stage's TP x DP x CP ranks divided by DP x CP.
- expert parameters (DTensors ``Shard(0)`` over EP): the all-to-all backward already brings
  every EP peer's contribution, so the correct gradient is the SUM over EDP divided by DP x CP
  (FSDP's EDP average times EDP / (DP x CP), Megatron's expert-gradient factor).

Under pipeline parallelism each stage holds distinct parameters: the global norm adds the
stages' sums of squares (max for the inf-norm) over the pipeline group.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def grads_of(params: Iterable[torch.nn.Parameter]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def all_reduce_grads(
    params: Iterable[torch.nn.Parameter], group: Optional[dist.ProcessGroup], scale: float = 1.0
) -> None:
    """Sum the local gradient shards over ``group`` (one flat buffer per dtype), then scale.

    One coalesced all-reduce per dtype instead of one per parameter. ``group=None`` or a
    group of one rank only scales.
    """
    grads = [_local(g) for g in grads_of(params)]
    if not grads:
        return
    if group is None or dist.get_world_size(group) == 1:
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for g in grads:
        by_dtype[(g.dtype, g.device)].append(g)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


@torch.no_grad()
def align_grad_placements(params: Iterable[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements.

    Under tensor/sequence parallelism DTensor leaves the gradient of a replicated parameter
    (e.g. a norm weight seeing a sequence shard) as ``Partial`` and that of a row-parallel
    embedding as ``Replicate``. The optimizer would redistribute them implicitly on every
    read (one all-reduce per read); doing it once here also makes the local shards the ones
    the global norm must count.
    """
    from torch.distributed.tensor import DTensor

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def scale_grads(params: Iterable[torch.nn.Parameter], factor: float | Tensor) -> None:
    """Multiply every gradient of ``params`` (local shards, in place) by ``factor``: a Python
    number (1.0 does nothing) or a device scalar (a clip coefficient: read on the device)."""
    grads = [_local(g) for g in grads_of(params)]
    if not grads:
        return
    if isinstance(factor, Tensor):
        torch._foreach_mul_(grads, factor.to(grads[0].device))
    elif factor != 1.0:
        torch._foreach_mul_(grads, factor)


def _shard_groups(t: Tensor) -> list[dist.ProcessGroup]:
    """Process groups over which a DTensor's local shards partition it (its Shard dims)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return []
    mesh = t.device_mesh
    # FSDP2 on top of TP/EP shards with `_StridedShard`, which is not a `Shard` subclass.
    return [
        mesh.get_group(i)
        for i, p in enumerate(t.placements)
        if isinstance(p, Shard) or type(p).__name__ == "_StridedShard"
    ]


@torch.no_grad()
def global_grad_norm(
    params: Iterable[torch.nn.Parameter],
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
) -> Tensor:
    """The norm of ALL gradients as one vector, whatever mesh each lives on.

    Local shards are reduced per (set of shard groups): sum of squares (or max for inf)
    over the groups across which a DTensor is sharded; replicated tensors are counted once.
    One all-reduce per distinct group set, not per parameter. ``pipeline_group``: the ranks
    holding the other pipeline stages (disjoint parameters), whose parts are added in one more
    all-reduce, which every rank of it joins even without gradients; ``device``: where the norm
    lives when this rank has none.
    """
    grads = grads_of(params)
    if not grads and pipeline_group is None:
        return torch.zeros(())
    device = _local(grads[0]).device if grads else (device or torch.device("cpu"))
    by_groups: dict[tuple, list[Tensor]] = defaultdict(list)
    group_objs: dict[tuple, list[dist.ProcessGroup]] = {}
    for g in grads:
        groups = _shard_groups(g)
        key = tuple(id(x) for x in groups)
        by_groups[key].append(_local(g))
        group_objs[key] = groups
    inf = math.isinf(norm_type)
    total = torch.zeros((), device=device, dtype=torch.float32)
    for key, locals_ in by_groups.items():
        norms = torch._foreach_norm([t.float() for t in locals_], norm_type)
        stacked = torch.stack([n.to(device) for n in norms])
        part = stacked.max() if inf else stacked.pow(norm_type).sum()
        for group in group_objs[key]:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, part) if inf else total + part
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pipeline_group)
    return total if inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_coefficient(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    exclude_from_norm: Iterable[torch.nn.Parameter] = (),
) -> tuple[Tensor, Tensor]:
    """(the global gradient norm, ``min(1, max_norm / norm)``) over ``params`` (every pipeline
    stage's with ``pipeline_group``; ``exclude_from_norm`` left out: a copy of a parameter another
    stage holds and counts), both on the device: no host sync."""
    skip = {id(p) for p in exclude_from_norm}
    total = global_grad_norm([p for p in params if id(p) not in skip], norm_type, pipeline_group, device)
    return total, (max_norm / (total + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grads_by_global_norm(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    exclude_from_norm: Iterable[torch.nn.Parameter] = (),
) -> Tensor:
    """Scale all gradients so their global norm (over every pipeline stage with
    ``pipeline_group``) is at most ``max_norm``; returns the norm. ``exclude_from_norm``: parameters
    scaled but not counted (a copy of a parameter another stage holds and counts).

    The clip coefficient is applied on the device (``clamp``), so clipping needs no host sync.
    """
    params = list(params)
    total, coeff = clip_coefficient(params, max_norm, norm_type, pipeline_group, device, exclude_from_norm)
    scale_grads(params, coeff)
    return total

