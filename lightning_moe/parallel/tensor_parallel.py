"""Tensor (and sequence) parallelism for dense layers, and the TP boundary of MoE layers.

Dense layers follow a plan the module provides (``tensor_parallel_plan(sequence_parallel)``,
torch ``ParallelStyle``s keyed by submodule path), applied with ``parallelize_module``.

MoE layers are not TP-sharded: the TP ranks of one DP replica split the tokens instead, so
each routes and dispatches a distinct ``1/TP`` of the sequence (Megatron's MoE under sequence
parallelism; with Parallel Folding the TP ranks are EP peers). Under sequence parallelism the
layer's input already is a sequence shard; without it the input is replicated, so the layer
takes its shard on the way in and all-gathers on the way out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import Tensor, nn

from lightning_moe.nn.moe_layer import MoELayer

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def find_plan_owner(root: nn.Module) -> Optional[nn.Module]:
    """The first submodule (pre-order) that defines ``tensor_parallel_plan``."""
    for module in root.modules():
        if callable(getattr(module, "tensor_parallel_plan", None)):
            return module
    return None


def apply_dense_tensor_parallel(root: nn.Module, tp_mesh, sequence_parallel: bool) -> Optional[nn.Module]:
    """Apply the owner's TP plan to its dense layers; returns the owner (None: no plan found)."""
    from torch.distributed.tensor.parallel import parallelize_module

    owner = find_plan_owner(root)
    if owner is None:
        return None
    plan = owner.tensor_parallel_plan(sequence_parallel=sequence_parallel)
    if plan:
        parallelize_module(owner, tp_mesh, plan)
    return owner


def sum_input_gradients_style() -> ParallelStyle:
    """A ``ParallelStyle`` for a parameter-free module whose input every TP rank holds whole but
    uses only in part: identity forward, gradient summed over the TP ranks in backward (Megatron's
    ``copy_to_tensor_model_parallel_region``). Multi-head latent attention puts it on its shared
    rotary key, which each rank's heads read without a column-parallel projection in between.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def sum_gradients(module: nn.Module, inputs: tuple, device_mesh) -> tuple:
        # from_local(Replicate) then to_local(grad_placements=Partial): the local gradient is
        # declared a partial sum, so from_local's backward all-reduces it into the replicated one.
        return tuple(
            DTensor.from_local(t, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            for t in inputs
        )

    class SumInputGradients(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, input_fn=sum_gradients)

    return SumInputGradients()


def sharded_norm_weight_style() -> ParallelStyle:
    """A ``ParallelStyle`` for a norm over a column-parallel projection's whole output (OLMoE's
    qk-norm, ``qk_norm_scope="projection"``): its ``[N]`` weight becomes a ``Shard(0)`` DTensor,
    split like the projection's output features (the heads), and its input and output stay this
    rank's local ``N / TP`` slice. The module computes the statistic with
    :func:`sum_over_tensor_parallel` (see ``lightning_moe.models.layers.ProjectionRMSNorm``).
    """
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def shard_weight(name: str, module: nn.Module, device_mesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(param_name, sharded)

    class ShardedNormWeight(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, partition_fn=shard_weight)

    return ShardedNormWeight()


def sum_over_tensor_parallel(local: Tensor, device_mesh) -> Tensor:
    """``local`` summed over the TP ranks of ``device_mesh`` (a plain tensor, the same on each).

    Forward and backward are both all-reduces: every rank uses the sum for its own slice only,
    so the sum's gradient on one rank is a partial share of the whole gradient, and each
    contribution to the sum receives all of it (Megatron's norm statistics under TP).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    # Partial -> Replicate: the forward all-reduce (its backward passes the gradient through).
    total = DTensor.from_local(local, device_mesh, [Partial()]).redistribute(device_mesh, [Replicate()]).to_local()
    # Replicate declared with a Partial gradient: the backward all-reduce (sum_input_gradients_style).
    return DTensor.from_local(total, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def apply_moe_token_split(layer: MoELayer, tp_mesh, sequence_parallel: bool) -> None:
    """Make ``layer`` compute on this TP rank's sequence shard (local tensors in and out)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    outer = Shard(1) if sequence_parallel else Replicate()
    style = PrepareModuleInputOutput(
        input_layouts=(outer,),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(outer,),
        use_local_output=True,
    )
    parallelize_module(layer, tp_mesh, style)
