"""`MegatronMoEStrategy`: Megatron-Core's MoE parallelism (Parallel Folding) as a Lightning Strategy."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe.layout import ParallelLayout
from lightning_moe.nn.compute_weights import ComputeWeightCache
from lightning_moe.parallel import checkpoint as ckpt
from lightning_moe.parallel import context_parallel as cp_attention
from lightning_moe.parallel import pipeline as pp_split
from lightning_moe.parallel.fsdp import (
    expert_params,
    mixed_precision_policy,
    moe_layers,
    moe_replicated_params,
    shard_dense,
    shard_experts,
)
from lightning_moe.parallel.gradients import (
    align_grad_placements,
    all_reduce_grads,
    scale_grads,
)
from lightning_moe.parallel.param_groups import GroupsByTensorKind, init_state_by_tensor_kind, mixes_tensor_kinds
from lightning_moe.parallel.tensor_parallel import apply_dense_tensor_parallel, apply_moe_token_split
from lightning_moe.precision import clipping as moe_precision
from lightning_moe.resume import record_mid_epoch_stop

ShardingMode = Literal["fsdp", "ddp"]


def precision_description(plugin: Any) -> str:
    """The precision in use, for the layout table: the plugin's own ``backend_description()``
    (FP8: recipe and backends) or its Lightning precision string ("32-true", "bf16-mixed", ...)."""
    describe = getattr(plugin, "backend_description", None)
    if callable(describe):
        return describe()
    precision = getattr(plugin, "precision", None)
    return str(precision) if precision is not None else type(plugin).__name__


class MegatronMoEStrategy(ModelParallelStrategy):
    """Expert, tensor and data parallelism with FSDP2 for an ordinary LightningModule with MoELayers.

    Attention/dense layers use the grid TP x CP x DP, MoE layers ETP x EP x EDP over the same
    ranks (Megatron-Core's Parallel Folding, rank order ``tp-cp-ep-dp-pp``).

    Args:
        tensor_parallel_size: TP for dense layers (needs the module's ``tensor_parallel_plan``).
        context_parallel_size: CP, each sequence split over this many ranks (load-balanced chunks
            ``i`` and ``2CP-1-i``; `lightning_moe.parallel.context_parallel`). The strategy shards the
            batch's sequence tensors and makes every attention with ``set_context_parallel`` attend
            across the CP group.
        pipeline_parallel_size: PP, the model split into this many stages by its blocks (balanced by
            parameter and FLOP count; embeddings on the first stage, final norm and output projection on
            the last), run by a torch pipeline schedule (`lightning_moe.parallel.pipeline`). Each stage
            is folded into its own TP x CP x DP and ETP x EP x EDP grids. The model needs the split hook
            (`lightning_moe.parallel.pipeline`; the reference `MoEDecoder` has it), and its training
            and validation steps compute the loss with ``model.loss(...)``: under PP that call runs
            the schedule (forward and backward in training) on the batch cut into
            ``pipeline_microbatches`` micro-batches and returns the batch's token-mean loss
            (detached; computed on the last stage, broadcast to every rank); Lightning's backward
            then only runs the hooks. ``accumulate_grad_batches`` still accumulates over batches.
        expert_parallel_size: EP, experts split over this many ranks (folded over TP x CP x DP).
        expert_tensor_parallel_size: ETP, each expert's weights split over this many ranks.
        data_parallel_size: "auto" (derived) or an explicit DP that must match the world size.
        cp_comm_type: how context-parallel attention exchanges keys/values (Megatron's
            ``cp_comm_type``): "p2p" (default; a ring of send/recv, one remote block per step merged
            by log-sum-exp; autograd keeps the received blocks for the backward) or "allgather"
            (every rank's keys/values gathered once, one attention).
        sharding: "fsdp" (FSDP2 over DP x CP) or "ddp" (replicated, all-reduced) for dense params.
        expert_sharding: "fsdp" (FSDP2 over EDP) or "ddp" for expert params.
        sequence_parallel: with TP > 1, keep activations between layers sharded over the sequence.
        token_dispatcher: "alltoall" | "allgather" | None (None: each layer's config decides).
        dispatch_transport: "nccl" | "copy_engine" | None: how the all-gather dispatcher moves
            rows (``MoEConfig.dispatch_transport``; None: each layer's config decides).
            "copy_engine" (peer copies, no NCCL kernel) needs CUDA GPUs of one host.
        reshard_after_forward: FSDP2 ``reshard_after_forward`` for transformer blocks and experts.
        cache_weight_casts: cast fp32 master weights to the compute dtype once per optimizer step,
            not in every micro-batch (`lightning_moe.nn.compute_weights.ComputeWeightCache`, for
            the weights taken through ``compute_weight``: the experts and the reference model's
            linears). The same gradients either way; the casts live from the first micro-batch of a
            step to its optimizer step, as the per-micro-batch casts that backward keeps do.
        accumulate_grads_in_place: with ``cache_weight_casts``, the micro-batches after the first
            of a window add each cast weight's bf16 gradient into its fp32 ``.grad`` in one pass
            (Megatron-Core's gradient-accumulation fusion: 10 bytes an element instead of 18). The
            same gradients. Parameters with ``register_hook`` hooks keep autograd's accumulation
            (their hooks see every gradient); post-accumulate-grad hooks run either way. Under
            `FP8Precision` the FP8 GEMMs' weight gradients take the same switch: added into the
            fp32 ``.grad`` by the weight-gradient GEMM itself (the Triton grouped kernel's epilogue)
            or right after it, with no ``AccumulateGrad`` add. None (default): on wherever
            ``cache_weight_casts`` is; True without it is refused.
        pipeline_schedule: "1f1b" (default; one stage per rank), "interleaved_1f1b" (with
            ``virtual_pipeline_size`` chunks per rank, Megatron's virtual stages) or "gpipe".
        virtual_pipeline_size: chunks per pipeline rank (default 1); > 1 needs "interleaved_1f1b".
            Rank ``r`` runs chunks ``r, r + PP, ...`` of the ``PP x V`` chunks.
        pipeline_microbatches: micro-batches each batch is cut into for the schedule (the
            micro-batches of one optimizer step, with ``accumulate_grad_batches=1``); None: PP.
            The batch size must be a multiple of it.
        pipeline_split_sizes: blocks per chunk, in chunk order (``PP x V`` positive counts adding up
            to the model's blocks), like Megatron's first/last-stage layer counts or torchtitan's
            split points; None (default): balanced by parameter and FLOP count.
        print_layout: print the layout/backends table once on rank 0.
        process_group_backend / timeout: passed to ``init_process_group``.

    Gradient clipping by norm takes one norm over the dense and expert meshes: the strategy runs
    with a `GlobalNormClipping` precision plugin (`lightning_moe.precision.clipping`). Lightning's
    stock plugins (what ``Trainer(precision=...)`` builds) are replaced by subclasses of them built
    with the same arguments; any other plugin must derive from `GlobalNormClipping` (`FP8Precision` does).
    """

    strategy_name = "megatron_moe"
    owns_router_updates = True  # expert-bias updates and router step state are handled here

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        data_parallel_size: Literal["auto"] | int = "auto",
        cp_comm_type: cp_attention.CPCommType = "p2p",
        sharding: ShardingMode = "fsdp",
        expert_sharding: ShardingMode = "fsdp",
        sequence_parallel: bool = True,
        token_dispatcher: Literal["alltoall", "allgather"] | None = None,
        dispatch_transport: Literal["nccl", "copy_engine"] | None = None,
        reshard_after_forward: bool = True,
        cache_weight_casts: bool = True,
        accumulate_grads_in_place: bool | None = None,
        pipeline_schedule: pp_split.PipelineSchedule = "1f1b",
        virtual_pipeline_size: int = 1,
        pipeline_microbatches: int | None = None,
        pipeline_split_sizes: list[int] | None = None,
        print_layout: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        for name, value in (("sharding", sharding), ("expert_sharding", expert_sharding)):
            if value not in ("fsdp", "ddp"):
                raise ValueError(f"{name}={value!r}: choose 'fsdp' or 'ddp'.")
        if cp_comm_type not in cp_attention.CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={cp_comm_type!r}: choose one of {cp_attention.CP_COMM_TYPES}.")
        if token_dispatcher not in (None, "alltoall", "allgather"):
            raise ValueError(f"token_dispatcher={token_dispatcher!r}: choose 'alltoall', 'allgather' or None.")
        if dispatch_transport not in (None, "nccl", "copy_engine"):
            raise ValueError(f"dispatch_transport={dispatch_transport!r}: choose 'nccl', 'copy_engine' or None.")
        self.sizes = {
            "tensor_parallel_size": tensor_parallel_size,
            "context_parallel_size": context_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "expert_parallel_size": expert_parallel_size,
            "expert_tensor_parallel_size": expert_tensor_parallel_size,
            "data_parallel_size": data_parallel_size,
        }
        self.cp_comm_type = cp_comm_type
        self.sharding = sharding
        self.expert_sharding = expert_sharding
        self.sequence_parallel = sequence_parallel
        self.token_dispatcher = token_dispatcher
        self.dispatch_transport = dispatch_transport
        self.reshard_after_forward = reshard_after_forward
        if accumulate_grads_in_place and not cache_weight_casts:
            raise ValueError("accumulate_grads_in_place=True adds gradients inside the cached weight casts: "
                             "set cache_weight_casts=True, or leave accumulate_grads_in_place at None.")
        self.cache_weight_casts = cache_weight_casts
        self._check_pipeline_options(pipeline_parallel_size, pipeline_schedule, virtual_pipeline_size,
                                     pipeline_microbatches)
        self.pipeline_schedule = pipeline_schedule
        self.virtual_pipeline_size = virtual_pipeline_size
        self.pipeline_microbatches = pipeline_microbatches or pipeline_parallel_size
        if pipeline_split_sizes is not None and isinstance(pipeline_parallel_size, int):
            pp_split.check_split_sizes(pipeline_split_sizes, pipeline_parallel_size * virtual_pipeline_size)
        self.pipeline_split_sizes = None if pipeline_split_sizes is None else list(pipeline_split_sizes)
        self._pipeline: pp_split.PipelineRunner | None = None
        self._pipeline_plan: pp_split.PipelinePlan | None = None
        self._pipeline_blocks: list[str] = []
        self._pipeline_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        self._pipeline_shared: list[str] = []  # parameter names held by the first and the last stage
        self._pipeline_shared_group: dist.ProcessGroup | None = None
        self._splittable: torch.nn.Module | None = None
        self.accumulate_grads_in_place = accumulate_grads_in_place
        self._weight_casts = ComputeWeightCache(
            accumulate_grads_in_place=cache_weight_casts and accumulate_grads_in_place is not False,
        )
        self.print_layout = print_layout
        self._layout: ParallelLayout | None = None
        self._parallelized = False
        self._dense_fsdp = False
        self._experts_fsdp = False
        # Parameters FSDP reduces itself (its units, plus what it was told to ignore); every other
        # parameter (e.g. on the LightningModule itself) is all-reduced by finalize_gradients.
        self._fsdp_managed: set[torch.nn.Parameter] = set()
        self._grads_finalized = False
        self._steps_by_tensor_kind: list[Optimizer] = []  # optimizers whose mixed groups step kind by kind
        self._crash_hook: Callable[[str], None] | None = None  # tests simulate crashes
        # Set by the DynamicContextParallel callback: shard(batch) -> (this rank's batch, loss group)
        # replaces the static CP shard of training batches.
        self.sequence_sharder: Any = None

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> moe_precision.GlobalNormClipping:
        plugin = self._precision_plugin
        if plugin is None:
            return moe_precision.Precision()
        assert isinstance(plugin, moe_precision.GlobalNormClipping)
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = (
            None if precision_plugin is None else moe_precision.with_global_norm_clipping(precision_plugin)
        )

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last clipped step (before clipping); None until then."""
        return self.precision_plugin.last_grad_norm

    # ------------------------------------------------------------------ layout and groups
    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout exists once the Trainer has set up the strategy (setup_environment).")
        return self._layout

    def _build_layout(self, world_size: int) -> ParallelLayout:
        """Validate sizes (and the module's constraints when it declares them), no collectives."""
        constraints: dict[str, Any] = {}
        declare = getattr(self.lightning_module, "parallel_constraints", None)
        if callable(declare):
            constraints = dict(declare())
        num_moe_layers = constraints.pop("num_moe_layers", None)
        context_parallel_attention = constraints.pop("context_parallel_attention", None)
        num_layers = constraints.pop("num_layers", None)
        layout = ParallelLayout(world_size=world_size, **self.sizes, **constraints)
        if layout.context_parallel_size > 1 and context_parallel_attention is False:
            raise ValueError(self._no_context_parallel_attention("the module declares attention without it"))
        if num_moe_layers == 0 and (layout.expert_parallel_size > 1 or layout.expert_tensor_parallel_size > 1):
            raise ValueError(
                f"expert_parallel_size={layout.expert_parallel_size}, expert_tensor_parallel_size="
                f"{layout.expert_tensor_parallel_size}, but the model has no MoE block (a dense model): set both to 1 "
                "(tensor parallelism and FSDP apply), or upcycle it first (lightning_moe.models.upcycle)."
            )
        if layout.pipeline_parallel_size > 1:
            self._check_pipeline_layout(layout, num_layers)
        return layout

    @staticmethod
    def _check_pipeline_options(pp: int, schedule: str, virtual: int, microbatches: int | None) -> None:
        if schedule not in pp_split.PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule={schedule!r}: choose one of {pp_split.PIPELINE_SCHEDULES}.")
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(f"virtual_pipeline_size={virtual!r} must be an int >= 1.")
        if virtual > 1 and schedule != "interleaved_1f1b":
            raise ValueError(f"virtual_pipeline_size={virtual} needs pipeline_schedule='interleaved_1f1b' "
                             f"(got {schedule!r}), or set virtual_pipeline_size=1.")
        if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                         or microbatches < 1):
            raise ValueError(f"pipeline_microbatches={microbatches!r} must be an int >= 1 or None (= PP).")
        if schedule == "1f1b" and microbatches is not None and isinstance(pp, int) and microbatches < pp:
            raise ValueError(f"pipeline_schedule='1f1b' needs pipeline_microbatches >= pipeline_parallel_size "
                             f"({microbatches} < {pp}): raise pipeline_microbatches to at least {pp}.")

    def _check_pipeline_layout(self, layout: ParallelLayout, num_layers: int | None) -> None:
        """Pipeline combinations refused before any collective, each naming the fix."""
        pp, virtual = layout.pipeline_parallel_size, self.virtual_pipeline_size
        if num_layers is not None and self.pipeline_split_sizes is not None:
            pp_split.check_split_sizes(self.pipeline_split_sizes, pp * virtual, num_layers)
        if num_layers is not None and pp * virtual > num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} x virtual_pipeline_size={virtual} = {pp * virtual} pipeline chunks but "
                f"the model has {num_layers} blocks: every chunk needs at least one block. Lower them so that "
                f"their product is at most {num_layers}."
            )

    @override
    def setup_environment(self) -> None:
        # Validate the layout before any process-group work: a bad size fails on every rank
        # with the same message instead of hanging in a collective.
        self._layout = self._build_layout(self.num_nodes * self.num_processes)
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self._layout.build_meshes(self.root_device.type)
        self._device_mesh = self._layout.dense_mesh
        self._data_parallel_size = self._layout.data_parallel_size
        self._tensor_parallel_size = self._layout.tensor_parallel_size
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _group(self, mesh_name: str) -> dist.ProcessGroup | None:
        mesh = self.layout.mesh(mesh_name)
        return mesh.get_group() if mesh.size() > 1 else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DP rank and size: TP/CP/EP peers of one DP replica read the same batch."""
        rank = dist.get_rank() if _distributed_is_initialized() else 0
        return {
            "num_replicas": self.layout.data_parallel_size,
            "rank": self.layout.rank_in_group("dp", rank),
        }

    # ------------------------------------------------------------------ parallelization
    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if not self._parallelized:
            self._parallelize(self.model, trainer)
            self._parallelized = True
        self._check_fp8_options()
        self._install_amax_reduction_groups()
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        for layer in moe_layers(self.model):
            layer.router.float()  # router weight and state stay fp32 under any precision (bf16-true too)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._avoid_mixed_foreach()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._pipeline is not None:
            self._check_pipeline_setup(trainer)
            # the global gradient norm sums every stage's share, a shared parameter counted once
            self.precision_plugin.pipeline_group = self.layout.mesh("pp").get_group()
            self.precision_plugin.pipeline_norm_skip = self._pipeline_norm_skip
        if self.print_layout and self.global_rank == 0:
            self.layout.print_summary(self.backend_summary())

    def _parallelize(self, model: torch.nn.Module, trainer: Any) -> None:
        layout = self.layout
        splittable, chunks = self._split_pipeline(model) if layout.pipeline_parallel_size > 1 else (None, [])
        layers = moe_layers(model)
        self._validate_model(model, layers)
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
        tp, cp = layout.tensor_parallel_size, layout.context_parallel_size
        stage_group = self._group("stage")
        if cp > 1:
            self._make_attention_context_parallel(model)
        for layer in layers:
            # Aux-loss gradients are injected per micro-batch; Lightning divides the task loss by
            # the accumulation count, so the aux losses get the same 1/N (Megatron's auto-scaler).
            layer.router.aux_loss_scale = self._aux_loss_scale(accumulate)
            # ranks holding slices of the same sequences (Megatron's tp-cp group): aux-loss counts
            layer.router.sequence_parallel_group = self._group("cp_tp") if tp * cp > 1 else None
            layer.router.global_aux_loss_group = stage_group
        if layout.expert_parallel_size > 1 or layout.expert_tensor_parallel_size > 1:
            from lightning_moe.parallel.expert_parallel import expert_parallel_layer

            ep_mesh = layout.expert_mesh["ep", "etp"] if layout.expert_tensor_parallel_size > 1 else layout.mesh("ep")
            for layer in layers:
                if self.dispatch_transport is not None:
                    layer.set_config(dataclasses.replace(layer.config, dispatch_transport=self.dispatch_transport))
                expert_parallel_layer(layer, ep_mesh, self.token_dispatcher or layer.config.token_dispatcher_type)
        if tp > 1:
            owner = apply_dense_tensor_parallel(model, layout.mesh("tp"), self.sequence_parallel)
            if owner is None:
                raise ValueError(
                    "tensor_parallel_size > 1 needs a module with a `tensor_parallel_plan(sequence_parallel)` "
                    "method returning torch ParallelStyles for its dense layers (the reference MoEDecoder has one)."
                )
            for layer in layers:
                apply_moe_token_split(layer, layout.mesh("tp"), self.sequence_parallel)
        precision = str(trainer.precision) if trainer is not None else "32-true"
        mp_policy = mixed_precision_policy(precision)
        if self.expert_sharding == "fsdp" and layers and layout.expert_data_parallel_size > 1:
            shard_experts(model, layout.mesh("edp"), mp_policy, self.reshard_after_forward)
            self._experts_fsdp = True
        if self.sharding == "fsdp" and layout.data_parallel_size * cp > 1:
            # FSDP over DP must not take the router/shared experts (reduced over the stage) nor
            # experts it does not shard over EDP (they live on the expert mesh).
            ignored = moe_replicated_params(model)
            if not self._experts_fsdp:
                ignored += expert_params(model)
            mesh = layout.mesh(self._dense_mesh_name)
            if chunks:  # the pipeline calls its chunks: they are the FSDP roots, around their blocks
                blocks = [splittable.get_submodule(name) for name in self._pipeline_blocks]
                wrapped = pp_split.shard_chunks(chunks, blocks, mesh, mp_policy, self.reshard_after_forward, ignored)
            else:
                wrapped = shard_dense(model, mesh, mp_policy, self.reshard_after_forward, ignored)
            self._dense_fsdp = True
            # The LightningModule itself is never wrapped: its own parameters (and any module
            # FSDP skipped) are all-reduced by finalize_gradients like in "ddp" mode.
            self._fsdp_managed = {p for module in wrapped for p in module.parameters()} | set(ignored)
        if chunks:
            self._pipeline = pp_split.PipelineRunner(
                chunks, self._pipeline_plan, layout.rank_in_group("pp", dist.get_rank()), layout.mesh("pp").get_group(),
                self.root_device, self.pipeline_schedule, self.pipeline_microbatches,
                hidden_size=int(splittable.config.hidden_size),
                seq_divisor=tp if tp > 1 and self.sequence_parallel else 1,
                boundary_dtype=self._pipeline_boundary_dtype(precision, mp_policy),
                token_group=self.context_parallel_group,
            )
            splittable.pipeline_runner = self._pipeline
            self._share_pipeline_parameters(splittable)

    def _share_pipeline_parameters(self, splittable: torch.nn.Module) -> None:
        """Parameters the first and the last stage both hold (a tied embedding): a group of the two
        ranks per pipeline, over which their gradients are summed (Megatron's embedding group)."""
        names = getattr(splittable, "pipeline_shared_parameters", None)
        self._pipeline_shared = list(names()) if callable(names) else []
        if not self._pipeline_shared:
            return
        rank = dist.get_rank()
        for ranks in self.layout.groups("pp"):
            pair = [ranks[0], ranks[-1]]
            group = dist.new_group(pair)  # collective: every rank creates every pair's group
            if rank in pair:
                self._pipeline_shared_group = group
        self._splittable = splittable

    def _pipeline_shared_params(self) -> list[torch.nn.Parameter]:
        if self._pipeline_shared_group is None:
            return []
        return [self._splittable.get_parameter(name) for name in self._pipeline_shared]

    def _pipeline_norm_skip(self) -> list[torch.nn.Parameter]:
        """The shared parameters' copies the gradient norm leaves out: the last stage's."""
        last = self.layout.rank_in_group("pp", dist.get_rank()) == self.layout.pipeline_parallel_size - 1
        return self._pipeline_shared_params() if last else []

    def _check_pipeline_setup(self, trainer: Any) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("pipeline_parallel_size > 1 with a GradScaler (precision='16-mixed') is not supported: "
                             "use precision='bf16-mixed' or '32-true', or pipeline_parallel_size=1.")

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other pipeline stages of this rank's replica (None without PP)."""
        return self.layout.mesh("pp").get_group() if self._pipeline is not None else None

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline stage (all ranks without PP; None: this rank alone)."""
        return self._group("stage")

    def _split_pipeline(self, model: torch.nn.Module) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
        """Prune the model to this rank's pipeline chunks (before any other parallelization) and
        return (the module with the split hook, this rank's chunks in stage order)."""
        layout = self.layout
        splittable = pp_split.find_splittable(model)
        if splittable is None:
            raise ValueError(
                "pipeline_parallel_size > 1 needs a model with the pipeline split hook (pipeline_layers, "
                "pipeline_edge_modules, pipeline_prune, pipeline_chunk; see lightning_moe.parallel.pipeline), which "
                "the reference MoEDecoder has: implement it in your model, or set pipeline_parallel_size=1."
            )
        plan = pp_split.plan_split(splittable, layout.pipeline_parallel_size, self.virtual_pipeline_size,
                                   self.pipeline_split_sizes)
        pp_rank = layout.rank_in_group("pp", dist.get_rank())
        self._pipeline_plan = plan
        self._pipeline_blocks = sorted(plan.layers_of(pp_rank), key=splittable.pipeline_layers().index)
        return splittable, pp_split.split_model(splittable, plan, pp_rank)

    def _pipeline_boundary_dtype(self, precision: str, mp_policy: Any) -> torch.dtype:
        """The dtype of the hidden states between stages: FSDP's compute dtype where it casts the
        dense parameters, else the parameters' dtype under this precision (fp32 masters under
        "32-true" and mixed precision)."""
        layout = self.layout
        if self.sharding == "fsdp" and layout.data_parallel_size > 1 and mp_policy.param_dtype is not None:
            return mp_policy.param_dtype
        return {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}.get(
            precision, torch.float32
        )

    @property
    def _dense_mesh_name(self) -> str:
        """Dense parameters are averaged (FSDP: sharded) over DP x CP: CP ranks hold distinct tokens."""
        return "dp_cp" if self.layout.context_parallel_size > 1 else "dp"

    def _aux_loss_scale(self, accumulate: int) -> float:
        """Gradient of the aux losses per unit: 1 / accumulation steps (Lightning's scaling of the
        task loss), times CP: each CP rank's aux loss is its share of the micro-batch's, while
        gradients are averaged over DP x CP like the task loss, whose CP ranks each hold a mean."""
        return self.layout.context_parallel_size / accumulate

    @property
    def context_parallel_group(self) -> dist.ProcessGroup | None:
        """The CP group this rank's sequences are split over (None without context parallelism)."""
        return self._group("cp")

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The ranks whose labelled tokens one training loss is the mean over: the CP group, or the
        DP x CP ranks sharing the micro-batches under DynamicContextParallel."""
        return self._group("dp_cp") if self.sequence_sharder is not None else self.context_parallel_group

    def _no_context_parallel_attention(self, found: str) -> str:
        return (
            f"context_parallel_size={self.sizes['context_parallel_size']} needs attention that attends across the "
            f"CP group: a module with set_context_parallel(group, comm_type) ({found}). Use the reference decoder's "
            "grouped-query attention (attention_type='gqa'; multi-head latent attention is not context-parallel "
            "yet), give your attention such a method calling "
            "lightning_moe.parallel.context_parallel.context_parallel_attention, or set context_parallel_size=1."
        )

    def _make_attention_context_parallel(self, model: torch.nn.Module) -> None:
        """Hand the CP group to every attention that can take it (``set_context_parallel(group,
        comm_type)``, as the reference decoder's `Attention`); refuse attention modules without it."""
        capable = [m for m in model.modules() if callable(getattr(m, "set_context_parallel", None))]
        # attention modules by name that cannot attend across the CP group (MLA, a user's own)
        others = sorted(
            {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention") and m not in capable}
        )
        if others or not capable:
            raise ValueError(
                self._no_context_parallel_attention(f"found {', '.join(others)} without it" if others else "found none")
            )
        group = self.context_parallel_group
        for module in capable:
            module.set_context_parallel(group, self.cp_comm_type)

    def _validate_model(self, model: torch.nn.Module, layers: list) -> None:
        layout = self.layout
        for layer in layers:
            cfg = layer.config
            if cfg.num_experts % layout.expert_parallel_size:
                raise ValueError(
                    f"expert_parallel_size={layout.expert_parallel_size} does not divide num_experts="
                    f"{cfg.num_experts}: choose an EP that divides the expert count."
                )
            if cfg.ffn_hidden_size % layout.expert_tensor_parallel_size:
                raise ValueError(
                    f"expert_tensor_parallel_size={layout.expert_tensor_parallel_size} does not divide the "
                    f"expert ffn_hidden_size={cfg.ffn_hidden_size}."
                )
        if (layout.expert_parallel_size > 1 or layout.expert_tensor_parallel_size > 1) and not layers:
            raise ValueError("expert_parallel_size > 1 but the module has no MoELayer: use EP=1.")

    def backend_summary(self) -> dict[str, str]:
        """Kernels and backends in use, for the layout table."""
        out: dict[str, str] = {}
        layers = moe_layers(self.model) if self.model is not None else []
        if layers:
            out["expert GEMM"] = layers[0].experts.backend
            out["token dispatch"] = layers[0].dispatcher.describe()
            if layers[0].config.expert_alignment > 1:
                out["expert groups"] = f"padded to {layers[0].config.expert_alignment} tokens"
        dp_cp = self.layout.data_parallel_size * self.layout.context_parallel_size
        out["dense params"] = f"{self.sharding} over DP x CP" if dp_cp > 1 else "replicated (DP=1)"
        if self.layout.context_parallel_size > 1:
            out["context parallel"] = f"{self.cp_comm_type}, load-balanced chunks"
        out["expert params"] = (
            f"{self.expert_sharding} over EDP" if self.layout.expert_data_parallel_size > 1 else "local (EDP=1)"
        )
        if self._pipeline is not None:
            plan = self._pipeline_plan
            out["pipeline"] = (f"{self.pipeline_schedule}, {plan.num_stages} stages x {plan.virtual_stages} virtual, "
                               f"{self.pipeline_microbatches} micro-batches per batch")
            out["pipeline split"] = plan.describe()
        out["process group"] = str(self._process_group_backend)
        out["precision"] = precision_description(self.precision_plugin)
        # Callbacks that change how the step runs name it here (CUDAGraphs: what it captures).
        trainer = getattr(self.lightning_module, "_trainer", None)
        for callback in getattr(trainer, "callbacks", None) or []:
            rows = getattr(callback, "layout_rows", None)
            if callable(rows) and self.model is not None:
                out.update(rows(self.model))
        return out

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_training_step(*args, **kwargs)
        if self.layout.context_parallel_size > 1:
            return self._context_parallel_training_step(*args, **kwargs)
        return self._training_step(*args, **kwargs)

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.cache_weight_casts:
            return super().training_step(*args, **kwargs)
        # The weight casts made here serve every micro-batch until the optimizer step (cleared there).
        with self._weight_casts.active():
            return super().training_step(*args, **kwargs)

    def _context_parallel_training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """The module's step on this rank's shard of the batch; its loss made the global token mean.

        The module computes its usual mean over its (local) labelled tokens. Its value is replaced
        by the mean over the CP group's tokens (what one process would get), and its gradient by
        that of ``CP x (sum of local token losses) / (tokens of the CP group)``, which gradients
        averaged over DP x CP turn into the gradient of the global token mean.
        """
        from lightning_moe.parallel.context_parallel import token_mean_over_group

        accumulate = max(1, int(getattr(self.lightning_module.trainer, "accumulate_grad_batches", 1)))
        for layer in moe_layers(self.model):
            layer.router.aux_loss_scale = self._aux_loss_scale(accumulate)  # the module may have reset it
        if self.sequence_sharder is not None:  # dynamic CP: sequences re-laid over DP x CP, the loss the pool's
            local, loss_group = self.sequence_sharder.shard(batch)
        else:
            local, loss_group = self._shard_batch(batch), self.context_parallel_group
        out = self._training_step(local, *args, **kwargs)
        labels = local.get("labels") if isinstance(local, dict) else None
        loss = out.get("loss") if isinstance(out, dict) else out
        if labels is None or not isinstance(loss, torch.Tensor):
            raise ValueError(
                "context_parallel_size > 1 needs a batch dict with 'labels' (-100 = ignored) and a training_step "
                "returning the token-mean loss (or a dict with 'loss'): the strategy makes it the global token mean."
            )
        loss = token_mean_over_group(loss, labels, loss_group)
        if isinstance(out, dict):
            return {**out, "loss": loss}
        return loss

    def _pipeline_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's step, whose ``model.loss(...)`` runs the pipeline schedule (forward and backward).

        Every pipeline micro-batch is a micro-batch of the optimizer step: its aux losses get
        ``1 / (accumulate x micro-batches)`` (x CP) as their gradient scale, like its share of the task loss.
        Under manual optimization the step zeroes, (manual-)backwards and steps itself: the
        gradients of ``model.loss`` are there when it calls ``optimizer.step()``.
        """
        runner = self._pipeline
        assert runner is not None
        if self.sequence_sharder is not None:
            raise ValueError("DynamicContextParallel with pipeline_parallel_size > 1 is not supported: remove the "
                             "callback (static context parallelism works with pipeline stages), or set "
                             "pipeline_parallel_size=1.")
        if self.layout.context_parallel_size > 1 and args:  # each CP rank runs its shard of the sequences
            args = (self._shard_batch(args[0]), *args[1:])
        accumulate = max(1, int(getattr(self.lightning_module.trainer, "accumulate_grad_batches", 1)))
        runner.accumulate = accumulate
        for layer in moe_layers(self.model):
            layer.router.aux_loss_scale = self._aux_loss_scale(accumulate) / runner.microbatches
        runs = runner.runs
        self._grads_finalized = False  # the schedule's backward makes new gradients to reduce
        if not self.lightning_module.automatic_optimization:
            return self._training_step(*args, **kwargs)
        trainer = self.lightning_module.trainer
        params = list(self.model.parameters())
        if trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0:
            # Lightning zeroes the gradients of a window's first batch after training_step, before its
            # backward; here the backward runs inside training_step, so they are zeroed before it.
            for p in params:
                p.grad = None
        out = self._training_step(*args, **kwargs)
        # Kept aside until `backward` (after Lightning's zero_grad), which puts them back.
        self._pipeline_grads = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        loss = out.get("loss") if isinstance(out, dict) else out
        if runner.runs != runs + 1 or not runner.last_run_trained:
            raise RuntimeError(
                "under pipeline_parallel_size > 1 a training_step computes its loss with exactly one "
                "model.loss(...) call with gradients enabled (it runs the pipeline schedule, forward and backward); "
                f"this one ran {runner.runs - runs}: compute the loss through model.loss, or set "
                "pipeline_parallel_size=1."
            )
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            raise RuntimeError(
                "under pipeline_parallel_size > 1 the backward runs inside model.loss(...); the training_step returned "
                "a loss with a gradient graph of its own, whose backward would not run: return the loss model.loss "
                "returned (add extra loss terms inside the model), or set pipeline_parallel_size=1."
            )
        return out

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule ran forward and backward inside training_step: only the hooks run here,
        # and the gradients it made come back.
        if closure_loss.requires_grad:  # manual_backward of a loss with a graph of its own
            raise RuntimeError(
                "under pipeline_parallel_size > 1 the backward runs inside model.loss(...); this loss has a gradient "
                "graph of its own, whose backward would not run: backward the loss model.loss returned (add extra "
                "loss terms inside the model), or set pipeline_parallel_size=1."
            )
        for p, grad in self._pipeline_grads:
            p.grad = grad
        self._pipeline_grads = []
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _shard_batch(self, batch: Any) -> Any:
        """This CP rank's load-balanced shard of the batch's sequence tensors (``[B, S, ...]``:
        ``cp_attention.SEQUENCE_KEYS``); ``position_ids`` are made global ``0..S-1`` first when absent."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ValueError(
                "context_parallel_size > 1 needs dict batches with 'input_ids' [B, S] (and 'labels'): the strategy "
                "shards their sequence dimension over the CP group."
            )
        layout = self.layout
        return cp_attention.shard_batch(
            batch, layout.context_parallel_size, layout.rank_in_group("cp", dist.get_rank())
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.layout.context_parallel_size > 1 and args:
            args = (self._shard_batch(args[0]), *args[1:])
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.layout.context_parallel_size > 1 and args:
            args = (self._shard_batch(args[0]), *args[1:])
        return super().test_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self._weight_casts.clear()  # a last window without its optimizer step leaves casts behind
        super().on_train_end()

    # ------------------------------------------------------------------ gradients
    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self._grads_finalized = False

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        with GroupsByTensorKind(optimizer) if self._steps_by_kind(optimizer) else contextlib.nullcontext() as groups:

            def closure_then_reduce() -> Any:
                result = closure()
                # Once per backward: several optimizers (or manual optimization) step on the same
                # gradients, which must be reduced and scaled exactly once.
                if not self._grads_finalized:
                    self.finalize_gradients()
                    self._grads_finalized = True
                if groups is not None:
                    groups.split()  # the step itself on groups of one tensor kind (`_avoid_mixed_foreach`)
                return result

            try:
                return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
            finally:
                self._weight_casts.clear()  # the weights changed: the next micro-batch casts them anew

    def finalize_gradients(self) -> None:
        """After the step's last backward: reduce what FSDP did not, scale experts, update biases."""
        model = self.model
        assert model is not None
        layout = self.layout
        dp_cp = layout.data_parallel_size * layout.context_parallel_size
        align_grad_placements(model.parameters())
        replicated = moe_replicated_params(model)
        # Router/shared experts: distinct tokens on every rank of the stage -> sum / (DP x CP).
        all_reduce_grads(replicated, self._group("stage"), scale=1.0 / dp_cp)
        if not self._dense_fsdp:
            excluded = set(replicated) | set(expert_params(model))
            dense = [p for p in model.parameters() if p not in excluded]
        else:
            # Looked up per step, not at wrap time: a precision plugin may swap modules outside
            # the FSDP units afterwards (e.g. nn.Linear -> te.Linear), whose new parameters
            # must still be reduced.
            dense = [p for p in model.parameters() if p not in self._fsdp_managed]
        all_reduce_grads(dense, self._group(self._dense_mesh_name), scale=1.0 / dp_cp)
        experts = expert_params(model)
        if self._experts_fsdp:
            scale_grads(experts, layout.expert_data_parallel_size / dp_cp)
        else:
            all_reduce_grads(experts, self._group("edp"), scale=1.0 / dp_cp)
        # a parameter two stages hold (tied embedding): the sum of both stages' gradients on both
        all_reduce_grads(self._pipeline_shared_params(), self._pipeline_shared_group)
        self._update_expert_bias(model)
        self._reset_router_step_state(model)

    def _update_expert_bias(self, model: torch.nn.Module) -> None:
        layers = [layer for layer in moe_layers(model) if layer.router.expert_bias is not None]
        if not layers:
            return
        counts = torch.stack([layer.router.local_tokens_per_expert for layer in layers])
        group = self._group("stage")  # ranks that routed distinct tokens: dp x cp x tp
        if group is not None:
            dist.all_reduce(counts, group=group)
        for layer, layer_counts in zip(layers, counts):
            layer.router.update_expert_bias(layer_counts)

    def _reset_router_step_state(self, model: torch.nn.Module) -> None:
        for layer in moe_layers(model):
            layer.router.reset_step_state()

    def _steps_by_kind(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s mixed param groups step kind by kind (`_avoid_mixed_foreach`)."""
        return any(optimizer is split for split in self._steps_by_tensor_kind)

    def _avoid_mixed_foreach(self) -> None:
        """Let foreach kernels step param groups that mix DTensors and plain tensors.

        torch's foreach optimizer kernels refuse a list holding both (expert DTensors next to the
        replicated router, say). Optimizers use them when ``foreach=True`` or, by default, when
        every parameter is on a device with foreach kernels (CUDA; not the CPU). A torch
        optimizer with such a group steps it kind by kind
        (`optimizer_step` runs it under
        :class:`~lightning_moe.parallel.param_groups.GroupsByTensorKind`: same update, groups,
        schedulers and checkpoints unchanged). Another optimizer's mixed group has ``foreach``
        turned off, with a warning that says how to keep it.
        """
        from torch.optim.optimizer import _default_to_fused_or_foreach


        def uses_foreach(group: dict[str, Any]) -> bool:
            if group.get("foreach") is None and not group.get("fused"):
                differentiable = bool(group.get("differentiable", False))
                return _default_to_fused_or_foreach(list(group["params"]), differentiable)[1]
            return bool(group.get("foreach"))

        self._steps_by_tensor_kind = []
        for optimizer in self.optimizers:
            mixed = [(i, g) for i, g in enumerate(optimizer.param_groups) if "foreach" in g and mixes_tensor_kinds(g)]
            if not any(uses_foreach(group) for _, group in mixed):
                continue  # no group would run foreach kernels on both kinds (e.g. the CPU default)
            if isinstance(optimizer, Optimizer):
                self._steps_by_tensor_kind.append(optimizer)
                continue
            for index, group in mixed:
                group["foreach"] = False
                name = f" ({group['name']!r})" if "name" in group else ""
                rank_zero_warn(
                    f"MegatronMoEStrategy: param group {index}{name} of {type(optimizer).__name__} mixes DTensor "
                    "(sharded) and plain parameters, which torch's foreach kernels cannot step together, so it "
                    "steps parameter by parameter (foreach=False). To keep foreach, give the optimizer the two kinds "
                    "in separate groups with the same hyperparameters "
                    "(`lightning_moe.parallel.param_groups.split_by_tensor_kind(groups)` in configure_optimizers), "
                    "or pass foreach=False yourself."
                )

    def _check_fp8_options(self) -> None:
        """FP8 weight caching keeps an unsharded FP8 copy of every weight until the optimizer
        step: under FSDP that undoes the sharding's memory savings (and the re-gathered weights'
        new storage means the copies are rarely reused), so the plugin's default (None) is turned
        off there and an explicit True refused. For the same reason, with FSDP-sharded
        experts ``FP8Recipe.quantize_weights_once`` left at its default (None) is turned off: it
        would hold an unsharded FP8 copy of each expert weight from its forward to its backward."""
        plugin = self.precision_plugin
        fsdp = self._dense_fsdp or self._experts_fsdp
        cache_asked = getattr(plugin, "cache_fp8_weights", None)
        if fsdp and getattr(plugin, "weight_cache", None) is not None and cache_asked is None:
            plugin.weight_cache = None  # the default: on where it saves work, off where it would undo FSDP's sharding
        if getattr(plugin, "weight_cache", None) is not None and fsdp:
            raise ValueError(
                "FP8Precision(cache_fp8_weights=True) cannot be combined with FSDP sharding (it would keep an "
                "unsharded FP8 copy of every weight on every rank): use sharding='ddp' and expert_sharding='ddp', "
                "or cache_fp8_weights=False."
            )
        from lightning_moe.precision.recipes import FP8Recipe

        recipe = getattr(plugin, "recipe", None)
        if self._experts_fsdp and isinstance(recipe, FP8Recipe) and recipe.graph_weight_casts:
            raise ValueError(
                "FP8Recipe(graph_weight_casts=True) graphs the casts of whole expert weights, which FSDP-sharded "
                "experts gather only inside their own forward: use expert_sharding='ddp', or graph_weight_casts=False."
            )
        if self._experts_fsdp and isinstance(recipe, FP8Recipe) and recipe.quantize_weights_once is None:
            plugin.recipe = dataclasses.replace(recipe, quantize_weights_once=False)

    def _install_amax_reduction_groups(self) -> None:
        """Delayed FP8 scaling reduces amaxes over the ranks holding the same tensor: dense layers
        over the stage (TP x CP x DP), experts over the ranks holding the same experts (ETP x
        EDP); without expert parallelism those are the same ranks (one collective). A group the
        user gave the plugin must match (the plugin raises otherwise)."""
        install = getattr(self.precision_plugin, "install_amax_reduction_groups", None)
        if not callable(install):
            return
        layout = self.layout
        dense = layout.mesh("stage").get_group()
        experts = dense if layout.expert_parallel_size == 1 else layout.mesh("edp_etp").get_group()
        install(dense, experts)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("MegatronMoEStrategy.save_checkpoint does not take storage_options.")
        path = Path(self.broadcast(str(filepath)))
        if self.lightning_module is not None:  # any module's checkpoint (see lightning_moe.resume)
            record_mid_epoch_stop(self.lightning_module.trainer, checkpoint)
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for idx, state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{idx}"] = state
        meta = dict(checkpoint)
        meta["lightning_moe_layout"] = repr(self.layout)
        ckpt.save_distributed(sharded, meta, path, crash_hook=self._crash_hook)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = ckpt.resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        assert self.model is not None
        options = StateDictOptions(strict=self.lightning_module.strict_loading)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []  # validate/test/predict: weights only
        saved = ckpt.saved_prefixes(path)
        for idx in range(len(optimizers)):
            if f"optimizer_{idx}" not in saved:
                raise KeyError(
                    f"{path} holds no state for optimizer {idx} (a weights-only checkpoint, or fewer "
                    "optimizers than now): resume from a full checkpoint, or load the weights with "
                    "trainer.validate/test(ckpt_path=...) and start a new fit."
                )
        sharded: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for idx, optimizer in enumerate(optimizers):
            if self._steps_by_kind(optimizer):
                # the state dict's template needs the optimizer's state: made by a step (of zero
                # gradients), which for mixed groups must run kind by kind
                init_state_by_tensor_kind(optimizer)
            # checkpoints written before optimizer states were saved flattened load as they were
            nested = ckpt.nested_optimizer_groups(path, f"optimizer_{idx}")
            flat = StateDictOptions(flatten_optimizer_state_dict=not nested)
            sharded[f"optimizer_{idx}"] = get_optimizer_state_dict(self.model, optimizer, options=flat)
        meta = ckpt.load_distributed(sharded, path, weights_only=True if weights_only is None else weights_only)
        set_model_state_dict(self.model, sharded["state_dict"], options=options)
        for idx, optimizer in enumerate(optimizers):
            nested = ckpt.nested_optimizer_groups(path, f"optimizer_{idx}")
            set_optimizer_state_dict(self.model, optimizer, sharded[f"optimizer_{idx}"],
                                     options=dataclasses.replace(options, flatten_optimizer_state_dict=not nested))
        return meta

    def export_consolidated(self, path: str | Path) -> None:
        """Write the full (unsharded) model state dict to one file, atomically, from rank 0 (under
        pipeline parallelism every stage's tensors, gathered to rank 0 over its pipeline group)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.model is not None
        if self._pipeline is None:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            # Every rank gathers its stage's full tensors (cpu_offload would keep them on global rank 0
            # only, which holds one stage); rank 0's pipeline group then sends them to rank 0.
            stage = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            stage = {name: value.detach().cpu() if torch.is_tensor(value) else value for name, value in stage.items()}
            state = {}
            group = self.layout.mesh("pp").get_group()
            if 0 in dist.get_process_group_ranks(group):
                parts: list[Any] | None = [None] * dist.get_world_size(group) if self.global_rank == 0 else None
                dist.gather_object(stage, parts, dst=0, group=group)
                for part in parts or []:
                    state.update(part)
        ckpt.save_consolidated(state, Path(path))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        if self._steps_by_kind(optimizer):
            init_state_by_tensor_kind(optimizer)  # as in `load_checkpoint` (a save before the first step)
        # Flattened: every hyperparameter keyed by its parameter's name, so the state loads into any
        # pipeline split (nested param groups would list the saving rank's stage only).
        return get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Megatron-Core MoE parallelism (lightning_moe)")
