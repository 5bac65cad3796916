"""Expert parallelism (EP) and expert tensor parallelism (ETP) for a `MoELayer`.

Weight layout. The grouped weights stay DTensors with their global shapes, so optimizers, FSDP2
and distributed checkpoints see one logical tensor whatever the layout:

=============  ================  ============================  ===============================
parameter      global shape      placements over ("ep",)       over ("ep", "etp")
=============  ================  ============================  ===============================
fc1_weight     [E, D, 2, F]      Shard(0)                      Shard(0), Shard(3)  (SwiGLU)
               [E, D, F]         Shard(0)                      Shard(0), Shard(2)  (other)
fc2_weight     [E, F, D]         Shard(0)                      Shard(0), Shard(1)
=============  ================  ============================  ===============================

EP rank ``r`` holds experts ``[r*E/EP, (r+1)*E/EP)``. ETP rank ``t`` holds FFN slice
``[t*F/ETP, (t+1)*F/ETP)`` of each of them: those columns of fc1 (for SwiGLU, of the gate and
of the up projection alike, since they have their own axis) and rows of fc2, so its expert
output is a partial sum that the dispatcher reduces over the ETP group. Every placement is a
plain ``Shard``: checkpoints save and reshard across EP/ETP layouts like any DTensor.

Gradients: the dispatchers' backward brings every EP x ETP peer's tokens into each expert shard's
gradient, so expert gradients are complete for the block and must be reduced (averaged with the
strategy's factor) over the expert data-parallel group only. The router and shared experts stay
replicated, plain parameters whose gradients depend on the local tokens only, like dense ones.
"""

from __future__ import annotations

from typing import Literal, Optional

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher

DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}


def expert_placements(with_etp: bool, gated: bool) -> tuple[tuple[Placement, ...], tuple[Placement, ...]]:
    """Placements of ``(fc1_weight, fc2_weight)`` over ``("ep",)`` or ``("ep", "etp")``."""
    if not with_etp:
        return (Shard(0),), (Shard(0),)
    return (Shard(0), Shard(3 if gated else 2)), (Shard(0), Shard(1))


def shard_experts_for_etp(
    fc1: Tensor, fc2_EFD: Tensor, etp_rank: int, etp_size: int, gated: bool
) -> tuple[Tensor, Tensor]:
    """ETP rank ``etp_rank``'s slices of full (or EP-local) expert weights.

    fc1 ``[E, D, 2, F]`` (SwiGLU) or ``[E, D, F]`` -> the same with ``F/ETP``; fc2 ``[E, F, D]``
    -> ``[E, F/ETP, D]``. Equal to the local tensors of :func:`expert_placements`.
    """
    ffn = fc2_EFD.shape[1]
    if ffn % etp_size:
        raise ValueError(
            f"ffn_hidden_size={ffn} is not divisible by expert_tensor_parallel_size={etp_size}: "
            "choose an ETP size dividing the expert FFN size."
        )
    width = ffn // etp_size
    cols = slice(etp_rank * width, (etp_rank + 1) * width)
    return fc1[..., cols], fc2_EFD[:, cols]


def _distribute(param: nn.Parameter, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> nn.Parameter:
    # Rank 0's values are scattered, so every rank ends with slices of the same weights; a meta
    # parameter stays meta (local meta shards) for the strategy to materialise and initialise.
    tensor = distribute_tensor(param.detach(), mesh, placements)
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


def expert_parallel_layer(
    layer: MoELayer,
    mesh: DeviceMesh,
    dispatcher: Optional[Literal["alltoall", "allgather"]] = None,
) -> MoELayer:
    """Shard ``layer``'s experts over ``mesh`` and install an expert-parallel dispatcher, in place.

    Args:
        layer: a `MoELayer` with full (replicated, identical on every rank) expert weights.
        mesh: 1-D ``("ep",)`` or 2-D ``("ep", "etp")`` DeviceMesh, e.g. ``layout.expert_mesh["ep",
            "etp"]``; dim 0 splits the experts, dim 1 (if any) each expert's FFN dimension.
        dispatcher: "alltoall" or "allgather"; None uses ``layer.config.token_dispatcher_type``.

    Returns the same layer. The router and shared experts are left replicated.
    """
    cfg = layer.config
    kind = cfg.token_dispatcher_type if dispatcher is None else dispatcher
    if kind not in DISPATCHERS:
        raise ValueError(
            f"dispatcher {kind!r} is not available for expert parallelism here; use one of {sorted(DISPATCHERS)}."
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"expert_parallel_layer needs a 1-D (ep) or 2-D (ep, etp) mesh, got {mesh.ndim} dims.")
    experts = layer.experts
    if isinstance(experts.fc1_weight, DTensor):
        raise TypeError("the layer's experts are already distributed; call expert_parallel_layer once per layer.")
    ep_size = mesh.size(0)
    etp_size = mesh.size(1) if mesh.ndim == 2 else 1
    if cfg.num_experts % ep_size:
        raise ValueError(
            f"num_experts={cfg.num_experts} is not divisible by the expert-parallel size {ep_size}: "
            "choose expert_parallel_size dividing num_experts."
        )
    if cfg.ffn_hidden_size % etp_size:
        raise ValueError(
            f"ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by expert_tensor_parallel_size={etp_size}: "
            "choose an ETP size dividing the expert FFN size."
        )
    fc1_placements, fc2_placements = expert_placements(mesh.ndim == 2, cfg.is_gated)
    experts.fc1_weight = _distribute(experts.fc1_weight, mesh, fc1_placements)
    experts.fc2_weight = _distribute(experts.fc2_weight, mesh, fc2_placements)
    etp_group = mesh.get_group(1) if mesh.ndim == 2 else None
    layer.set_dispatcher(DISPATCHERS[kind](cfg, mesh.get_group(0), etp_group))
    return layer
