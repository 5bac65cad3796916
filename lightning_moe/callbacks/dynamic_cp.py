"""`DynamicContextParallel`: the context-parallel size of each sequence chosen per micro-batch.

With ``MegatronMoEStrategy(context_parallel_size=CP)`` every sequence is split over the CP group.
With variable lengths that wastes exchanges on short sequences and balances long ones badly.
This callback re-lays each micro-batch over the ``DP x CP`` ranks instead: the sequences of every
DP replica's micro-batch (the documents of packed rows, or the rows) are placed on aligned
sub-groups of ``1, 2, 4, ..., max_context_parallel_size`` ranks by
`lightning_moe.parallel.dynamic_cp.plan_micro_batch` (the largest per-rank cost of
:class:`~lightning_moe.parallel.dynamic_cp.CostModel` minimized under ``memory_limit_tokens``;
never worse than the static layout on that model). Each rank then runs its sequences' load-balanced
chunks through one forward; attention attends within each sequence (uneven shards,
`lightning_moe.parallel.context_parallel.TokenShards`): a rank alone runs causal SDPA per sequence,
a sub-group the ring's (or all-gather's) fp32 block attention per sequence, the kernel static CP
uses (the ring only on the visible half of each received block), so no score matrix spans two
sequences. The cost model counts what these compute
(:func:`~lightning_moe.parallel.dynamic_cp.attention_pairs`: ``L**2 / 2`` query-key pairs alone,
``L**2 (c + 1) / (2 c)`` over a ring of ``c``); its attention constant is one per pair,
calibrated on SDPA, so a group's fp32 blocks (slower per pair than SDPA's bf16 kernels on a GPU,
as under static CP) and the all-gather's full blocks (``L**2``) are under-counted. MoE layers route
whatever tokens the rank holds over the unchanged expert-parallel groups.

Loss and gradients: the returned loss is the token mean over the pool's labelled tokens, its
gradient that of the pool's token mean (`token_mean_over_group` over the DP x CP ranks, whose
gradients the strategy averages): the static layout's at DP = 1 and whenever the DP replicas'
micro-batches hold equal numbers of labelled tokens (otherwise every token weighs the same instead
of every replica).

Sub-groups (every aligned block of 2 .. max CP ranks) are made once at setup; per micro-batch the
DP replicas' batches are all-gathered over the DP group (when DP > 1) and one all-reduce of two
scalars makes the loss, as under static CP.

Router losses: ranks hold uneven shares of the replicas' micro-batches, so each router is told per
micro-batch the DP replica and row of each of its tokens (``TopKRouter.uneven_shares``, from the
plan): the aux loss counts experts per replica and the seq-aux loss per row (one all-reduce of
``[units, E]`` counts over DP x CP, in place of the static layout's over CP), each normalised by
the replica's (row's) tokens; the global aux loss and the z-loss normalise by one replica's tokens.
Each then equals the static layout's in value and gradient.

Supported: tensor and pipeline parallel size 1, dropless MoE with the all-to-all dispatcher,
attention with ``set_context_parallel`` (the reference decoder's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_moe.parallel.context_parallel import TokenShards
from lightning_moe.parallel.dynamic_cp import CostModel, Plan, aligned_blocks, is_power_of_two, plan_micro_batch
from lightning_moe.parallel.dynamic_cp_batch import find_sequences, rank_batch, rank_share
from lightning_moe.nn.router import UnevenShares
from lightning_moe.parallel.fsdp import moe_layers


class DynamicContextParallel(Callback):
    """Choose each sequence's context-parallel size per micro-batch (see the module doc).

    Args:
        memory_limit_tokens: the most tokens one rank may hold in a micro-batch (what fits its
            memory; the static layout holds ``B x S / CP``).
        max_context_parallel_size: the largest sub-group, a power of two dividing ``DP x CP``;
            None: the strategy's ``context_parallel_size``.
        cost_model: a :class:`CostModel`, or the path of a calibration JSON written by
            ``benchmarks/dynamic_cp_sim.py --calibrate``; None: ``CostModel()``'s defaults (a FLOP
            estimate, documented there). Stored in checkpoints with the callback's state.
        log_plan: log per step how many sequences ran at each CP size
            (``dynamic_cp/sequences_cp{c}``) and the modelled speed-up over static CP
            (``dynamic_cp/modelled_speedup``).

    Attributes: ``last_plan`` (:class:`~lightning_moe.parallel.dynamic_cp.Plan`) and
    ``last_tokens`` (tokens of the pool's micro-batch) after each training micro-batch.
    """

    def __init__(
        self,
        memory_limit_tokens: int,
        max_context_parallel_size: Optional[int] = None,
        cost_model: Union[CostModel, str, Path, None] = None,
        log_plan: bool = True,
    ) -> None:
        if not isinstance(memory_limit_tokens, int) or memory_limit_tokens < 1:
            raise ValueError(f"memory_limit_tokens must be a positive int, got {memory_limit_tokens!r}.")
        if max_context_parallel_size is not None and not is_power_of_two(max_context_parallel_size):
            raise ValueError(f"max_context_parallel_size={max_context_parallel_size} must be a power of two.")
        if cost_model is None:
            cost_model = CostModel()
        elif not isinstance(cost_model, CostModel):
            cost_model = CostModel.from_json(cost_model)
        self.memory_limit_tokens = memory_limit_tokens
        self.max_context_parallel_size = max_context_parallel_size
        self.cost_model = cost_model
        self.log_plan = log_plan
        self.last_plan: Optional[Plan] = None
        self.last_tokens = 0
        self._strategy: Any = None
        self._max_cp = 0
        self._groups: dict[tuple[int, int], Optional[dist.ProcessGroup]] = {}
        self._checked_model = False

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning_moe.strategies.megatron_moe import MegatronMoEStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, MegatronMoEStrategy):
            raise ValueError(
                f"DynamicContextParallel needs MegatronMoEStrategy(context_parallel_size=...), got "
                f"{type(strategy).__name__}."
            )
        layout = strategy.layout
        if layout.context_parallel_size == 1:
            raise ValueError(
                "DynamicContextParallel needs MegatronMoEStrategy(context_parallel_size > 1): that is the static "
                "layout it replaces per micro-batch (and makes the attention context-parallel)."
            )
        if layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1:
            raise ValueError(
                "DynamicContextParallel runs with tensor_parallel_size=1 and pipeline_parallel_size=1: set them to 1, "
                "or drop the callback (static context parallelism supports TP)."
            )
        pool = layout.data_parallel_size * layout.context_parallel_size
        max_cp = self.max_context_parallel_size or layout.context_parallel_size
        if pool % max_cp:
            raise ValueError(
                f"max_context_parallel_size={max_cp} must divide the DP x CP = {pool} ranks: choose a power of two "
                f"up to {pool} that divides it."
            )
        self._strategy, self._max_cp = strategy, max_cp
        if not self._groups:
            # Every sub-group a plan may use, made once, in the same order on every rank. With
            # TP = PP = 1 the pool of DP x CP ranks is the world and pool rank = global rank.
            for offset, size in aligned_blocks(pool, max_cp):
                group = dist.new_group(list(range(offset, offset + size)))
                self._groups[(offset, size)] = group
        strategy.sequence_sharder = self

    def _check_model(self, model: torch.nn.Module) -> None:
        """Refuse what the re-laid micro-batch would compute differently (before any collective)."""
        for layer in moe_layers(model):
            cfg = layer.config
            if cfg.expert_capacity_factor is not None:
                raise ValueError(
                    "DynamicContextParallel: expert capacity depends on the tokens per rank, which dynamic CP changes: "
                    "set expert_capacity_factor=None (dropless), or use static context parallelism."
                )
            dispatcher = self._strategy.token_dispatcher or cfg.token_dispatcher_type
            if self._strategy.layout.expert_parallel_size > 1 and dispatcher != "alltoall":
                raise ValueError(
                    f"DynamicContextParallel: the {dispatcher!r} dispatcher needs equal token counts per rank: use "
                    "token_dispatcher='alltoall'."
                )
        self._checked_model = True

    # ------------------------------------------------------------------ per micro-batch
    def shard(self, batch: Any) -> tuple[dict, Optional[dist.ProcessGroup]]:
        """This rank's re-laid micro-batch and the group whose token mean the loss is (the pool).

        Called by ``MegatronMoEStrategy`` in place of the static shard; hands each attention
        module this step's `TokenShards`.
        """
        strategy = self._strategy
        if not self._checked_model:
            self._check_model(strategy.model)
        if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
            raise ValueError(
                "DynamicContextParallel needs dict batches with 'input_ids' and 'labels' [B, S] (packed batches: "
                "also 'document_ids' and 'position_ids', as LMDataModule(pack_sequences=True) yields)."
            )
        layout = strategy.layout
        pool_batch = self._gather_replicas(batch, strategy._group("dp"))
        rows, seq_len = pool_batch["input_ids"].shape[:2]
        documents = pool_batch.get("document_ids")
        # Host sync: the plan is made on the host from the documents' lengths (one copy of the
        # [DP x B, S] ids per micro-batch).
        sequences = find_sequences(
            None if documents is None else documents.cpu(), rows, seq_len, rows // layout.data_parallel_size
        )
        plan = plan_micro_batch(
            sequences.lengths, sequences.replicas, layout.data_parallel_size * layout.context_parallel_size,
            layout.context_parallel_size, self._max_cp, self.cost_model, self.memory_limit_tokens,
        )
        share = rank_share(sequences, plan, dist.get_rank())
        positions = pool_batch.get("position_ids")
        if positions is None:
            if documents is not None:
                raise ValueError(
                    "a packed batch (document_ids) needs position_ids under context parallelism: add them in the data "
                    "module (LMDataModule does)."
                )
            positions = torch.arange(seq_len, device=pool_batch["input_ids"].device).expand(rows, seq_len)
        local = rank_batch(pool_batch, share, positions)
        device = local["input_ids"].device
        offset, size = plan.group_offsets[share.group], plan.group_sizes[share.group]
        shards = TokenShards(
            group=self._groups[(offset, size)] if size > 1 else None,
            index_BS=share.index_T.to(device).unsqueeze(0),
            max_tokens=share.max_tokens,
            sequence_tokens=share.sequence_tokens,
            first_chunk_tokens=share.first_chunk_tokens,
        )
        self._set_attention(shards)
        rows_per_replica = rows // layout.data_parallel_size
        row_T = share.flat_index_T // seq_len
        self._set_router_shares(UnevenShares(
            replica_T=(row_T // rows_per_replica).to(device), row_T=row_T.to(device),
            num_replicas=layout.data_parallel_size, rows_per_replica=rows_per_replica, row_tokens=seq_len,
            group=strategy._group("dp_cp"),
        ))
        self.last_plan, self.last_tokens = plan, rows * seq_len
        return local, strategy._group("dp_cp")

    @staticmethod
    def _gather_replicas(batch: dict, dp_group: Optional[dist.ProcessGroup]) -> dict:
        """Every DP replica's micro-batch stacked along dim 0 (replica order); unchanged at DP = 1."""
        if dp_group is None:
            return batch
        size = dist.get_world_size(dp_group)
        shape = torch.tensor(batch["input_ids"].shape[:2], device=batch["input_ids"].device)
        shapes = [torch.empty_like(shape) for _ in range(size)]
        dist.all_gather(shapes, shape, group=dp_group)
        if any(not torch.equal(s, shape) for s in shapes):  # host sync: two ints per replica
            raise ValueError(
                "DynamicContextParallel: the DP replicas' micro-batches differ in shape "
                f"({[s.tolist() for s in shapes]}): give every replica micro-batches of the same [B, S] "
                "(drop_last=True, a fixed sequence length)."
            )
        out = dict(batch)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                parts = [torch.empty_like(value) for _ in range(size)]
                dist.all_gather(parts, value.contiguous(), group=dp_group)
                out[key] = torch.cat(parts)
        return out

    def _attention_modules(self) -> list[torch.nn.Module]:
        model = self._strategy.model
        return [m for m in model.modules() if callable(getattr(m, "set_context_parallel", None))]

    def _set_attention(self, group: Any) -> None:
        for module in self._attention_modules():
            module.set_context_parallel(group, self._strategy.cp_comm_type)

    def _set_router_shares(self, shares: Optional[UnevenShares]) -> None:
        """Where each rank's tokens come from, for the routers' losses (None: the static layout)."""
        for layer in moe_layers(self._strategy.model):
            layer.router.uneven_shares = shares

    def _restore_static(self) -> None:
        """Validation and testing run the static layout (the strategy shards their batches)."""
        if self._strategy is not None and self._strategy.model is not None:
            self._set_attention(self._strategy.context_parallel_group)
            self._set_router_shares(None)

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        plan = self.last_plan
        if not self.log_plan or plan is None:
            return
        per_size = plan.sequences_per_cp_size()
        size = 1
        while size <= self._max_cp:
            pl_module.log(f"dynamic_cp/sequences_cp{size}", float(per_size.get(size, 0)), on_step=True, on_epoch=False)
            size *= 2
        speedup = plan.static_cost / plan.max_cost if plan.max_cost > 0 else 1.0
        pl_module.log("dynamic_cp/modelled_speedup", speedup, on_step=True, on_epoch=False)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_static()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_static()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_static()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None and getattr(self._strategy, "sequence_sharder", None) is self:
            self._strategy.sequence_sharder = None
            if self._strategy.model is not None:
                self._set_router_shares(None)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The settings the run planned with (the cost model's constants included), for the record: a
        resumed run plans with the settings it is given."""
        return {
            "memory_limit_tokens": self.memory_limit_tokens,
            "max_context_parallel_size": self.max_context_parallel_size,
            "cost_model": self.cost_model.to_dict(),
        }
