"""FSDP2 for expert parameters (over EDP) and dense parameters (over DP x CP).

Order (DESIGN.md): each MoE layer's experts over the EDP mesh first, then each transformer
block (every child of an ``nn.ModuleList`` / ``nn.ModuleDict``) over the dense DP x CP mesh, then the remaining
top-level children of the LightningModule. The LightningModule itself is never wrapped
(Lightning calls ``training_step``, not ``forward``). Router and shared-expert parameters are
left out of FSDP (``ignored_params``): they are reduced by the strategy over the ranks that
routed distinct tokens (see ``lightning_moe.parallel.gradients``).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.nn.moe_layer import MoELayer


def moe_layers(root: nn.Module) -> list[MoELayer]:
    return [m for m in root.modules() if isinstance(m, MoELayer)]


def moe_replicated_params(root: nn.Module) -> list[nn.Parameter]:
    """Router weights and shared-expert parameters of every MoE layer."""
    params: list[nn.Parameter] = []
    for layer in moe_layers(root):
        params.extend(layer.router.parameters())
        if layer.shared_experts is not None:
            params.extend(layer.shared_experts.parameters())
    return params


def expert_params(root: nn.Module) -> list[nn.Parameter]:
    return [p for layer in moe_layers(root) for p in layer.experts.parameters()]


def mixed_precision_policy(precision: str):
    """FSDP2 policy for a Lightning precision string: bf16 compute, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision in ("bf16-mixed", "bf16-true", "bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in ("16-mixed", "16-true", "16"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_experts(root: nn.Module, edp_mesh, mp_policy, reshard_after_forward: bool) -> None:
    """``fully_shard`` every MoE layer's experts over the EDP mesh.

    The local expert weight is ``[E/EP, ...]``; it is sharded on dim 0 when that divides by
    EDP, otherwise on dim 1 (like torchtitan when EDP exceeds the local expert count).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    edp = edp_mesh.size()

    def placement(param: nn.Parameter):
        local = param.to_local() if hasattr(param, "to_local") else param
        return Shard(0) if local.shape[0] % edp == 0 else Shard(1)

    for layer in moe_layers(root):
        fully_shard(
            layer.experts,
            mesh=edp_mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement,
        )
        if isinstance(layer.experts, GroupedExperts):  # its fused combine depends on the input cast
            layer.experts.declare_fsdp_input_cast(mp_policy.param_dtype if mp_policy.cast_forward_inputs else None)


def _blocks(root: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            blocks.extend(module.children())
    return blocks


def shard_dense(
    root: nn.Module,
    dp_mesh,
    mp_policy,
    reshard_after_forward: bool,
    ignored: Iterable[nn.Parameter],
) -> list[nn.Module]:
    """``fully_shard`` transformer blocks, then the LightningModule's top-level children."""
    return shard_blocks_then_roots(_blocks(root), list(root.children()), dp_mesh, mp_policy, reshard_after_forward,
                                   ignored)


def shard_blocks_then_roots(
    blocks: Iterable[nn.Module],
    roots: Iterable[nn.Module],
    mesh,
    mp_policy,
    reshard_after_forward: bool,
    ignored: Iterable[nn.Parameter],
) -> list[nn.Module]:
    """``fully_shard`` each block (``reshard_after_forward``), then each root around them, kept
    unsharded after its forward (the roots' own modules gather last and are needed first in
    backward). A module whose parameters are all ``ignored`` is left alone. Returns the wrapped
    modules."""
    from torch.distributed.fsdp import fully_shard

    ignored_set = set(ignored)
    wrapped: list[nn.Module] = []

    def wrap(module: nn.Module, reshard: bool) -> None:
        own = set(module.parameters())
        if not (own - ignored_set):
            return
        fully_shard(
            module,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard,
            ignored_params=own & ignored_set or None,
        )
        wrapped.append(module)

    for block in blocks:
        wrap(block, reshard_after_forward)
    for root in roots:
        wrap(root, False)
    return wrapped


def is_fsdp_managed(module: Optional[nn.Module]) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
