"""Pipeline parallelism: splitting a model into stages and running torch's pipeline schedules.

A model is split by its repeated blocks. It declares the split through a small hook (the
reference :class:`~lightning_moe.models.decoder.MoEDecoder` implements it)::

    pipeline_layers() -> list[str]
        the block names in execution order (paths under the model, e.g. "layers.0"); every
        pipeline chunk holds a contiguous, non-empty run of them.
    pipeline_edge_modules() -> tuple[list[str], list[str]]
        the modules the first chunk (embeddings) and the last chunk (final norm, output
        projection) hold besides blocks; counted in the balance.
    pipeline_prune(keep: set[str], first: bool, last: bool) -> None
        drop every block not in ``keep``, and the first / last chunk's modules on a rank
        that holds no first / last chunk. Parameter names (fqns) must stay those of the whole
        model, so distributed checkpoints reshard across pipeline sizes.
    pipeline_chunk(layer_names: list[str], first: bool, last: bool) -> nn.Module
        a module running those blocks: ``forward(x, labels, **kwargs)`` where ``x`` is the
        step's first positional input on the first chunk and the previous chunk's output
        ``[B, S, D]`` otherwise; every other tensor keyword (``labels`` included) reaches every
        chunk, split into the same micro-batches. The last chunk returns the fp32 SUM of its
        micro-batch's token losses (0-dim); the others their output hidden states.
    pipeline_runner: attribute, set by the strategy
        the model's loss entry point calls ``self.pipeline_runner(x, labels=labels, **kwargs)``
        when it is set, which runs the schedule and returns the loss.
    pipeline_shared_parameters() -> list[str] (optional)
        names of parameters the first and the last chunk both hold (a tied embedding, kept by
        ``pipeline_prune`` on both stages): their gradients are summed between those two stages
        and counted once in the gradient norm.

The split balances the chunks by parameter and FLOP count (:func:`balanced_split`): each block
costs its share of all parameters plus its share of the FLOPs per token (matrix products, with
routed experts counted at ``router_topk / num_experts`` of their weights, what a token uses).
With ``V`` virtual stages the ``P x V`` chunks are dealt round-robin: rank ``r`` runs chunks
``r, r + P, ...`` (torch's interleaved schedules expect that order).

The loss: every micro-batch's loss is ``(sum of its token losses) / (labelled tokens of the
whole batch x accumulate_grad_batches)``, so the micro-batches' gradients add up to the gradient
of the batch's token mean, divided as Lightning divides an accumulated loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.parallel.fsdp import shard_blocks_then_roots

PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "gpipe"]
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "gpipe")
_HOOK = ("pipeline_layers", "pipeline_edge_modules", "pipeline_prune", "pipeline_chunk")
IGNORE_INDEX = -100


def find_splittable(root: nn.Module) -> Optional[nn.Module]:
    """The first submodule (pre-order) implementing the split hook, or None."""
    for module in root.modules():
        if all(callable(getattr(module, name, None)) for name in _HOOK):
            return module
    return None


# ---------------------------------------------------------------------------------------- costs
def module_costs(module: nn.Module) -> tuple[float, float]:
    """(parameters, forward FLOPs per token) of ``module``: 2 FLOPs per weight element of a
    matrix product; routed experts at ``router_topk / num_experts`` of their weights; embedding
    tables (a lookup) none."""
    params = sum(p.numel() for p in module.parameters())
    expert_ids: dict[int, float] = {}
    for layer in module.modules():
        if isinstance(layer, MoELayer) and isinstance(layer.experts, GroupedExperts):
            share = layer.config.router_topk / layer.config.num_experts
            expert_ids.update({id(p): share for p in layer.experts.parameters()})
    embedding_ids = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    flops = 0.0
    for p in module.parameters():
        if p.ndim >= 2 and id(p) not in embedding_ids:
            flops += 2.0 * p.numel() * expert_ids.get(id(p), 1.0)
    return float(params), flops


def balanced_split(costs: Sequence[float], num_chunks: int, first_extra: float = 0.0, last_extra: float = 0.0
                   ) -> list[tuple[int, int]]:
    """Contiguous, non-empty ranges ``[start, end)`` of ``costs`` for ``num_chunks`` chunks,
    minimizing the largest chunk cost (the first chunk also carries ``first_extra``, the last
    ``last_extra``). Exact dynamic programme over split points."""
    n = len(costs)
    if not 1 <= num_chunks <= n:
        raise ValueError(f"cannot split {n} blocks into {num_chunks} non-empty chunks.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def chunk_cost(k: int, start: int, end: int) -> float:
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == num_chunks - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    inf = float("inf")
    # best[k][e]: the smallest max cost of chunks 0..k covering blocks [0, e); cut[k][e]: chunk k's start
    best = [[inf] * (n + 1) for _ in range(num_chunks)]
    cut = [[0] * (n + 1) for _ in range(num_chunks)]
    for e in range(1, n + 1):
        best[0][e] = chunk_cost(0, 0, e)
    for k in range(1, num_chunks):
        for e in range(k + 1, n + 1):
            for s in range(k, e):
                value = max(best[k - 1][s], chunk_cost(k, s, e))
                if value < best[k][e] - 1e-12:
                    best[k][e], cut[k][e] = value, s
    ranges, end = [], n
    for k in range(num_chunks - 1, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    ranges.append((0, end))
    return ranges[::-1]


@dataclass(frozen=True)
class PipelinePlan:
    """Which blocks each of the ``P x V`` chunks runs; chunk ``c`` lives on pipeline rank ``c % P``."""

    num_stages: int
    virtual_stages: int
    chunks: tuple[tuple[str, ...], ...]
    chunk_costs: tuple[float, ...] = field(default=())

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunk_indices(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank, self.num_chunks, self.num_stages))

    def layers_of(self, pp_rank: int) -> set[str]:
        return {name for c in self.chunk_indices(pp_rank) for name in self.chunks[c]}

    def describe(self) -> str:
        """``rank r: a-b, c-d`` per pipeline rank (block names of each chunk's ends)."""
        parts = []
        for r in range(self.num_stages):
            spans = []
            for c in self.chunk_indices(r):
                names = self.chunks[c]
                span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
                spans.append(("embed+" if c == 0 else "") + span + ("+head" if c == self.num_chunks - 1 else ""))
            parts.append(f"stage {r}: {', '.join(spans)}")
        return "; ".join(parts)


def check_split_sizes(sizes: Sequence[int], num_chunks: int, num_blocks: Optional[int] = None) -> None:
    """``sizes`` (blocks per chunk) must give each of the ``num_chunks`` chunks at least one block
    (and add up to ``num_blocks`` when known); raises ``ValueError`` naming the fix."""
    if (len(sizes) != num_chunks or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
            or (num_blocks is not None and sum(sizes) != num_blocks)):
        blocks = f" adding up to the model's {num_blocks} blocks" if num_blocks is not None else ""
        raise ValueError(
            f"pipeline_split_sizes={list(sizes)}: give {num_chunks} positive block counts (one per chunk, "
            f"pipeline_parallel_size x virtual_pipeline_size, in chunk order){blocks}, or None for a balanced split."
        )


def plan_split(model: nn.Module, num_stages: int, virtual_stages: int,
               sizes: Optional[Sequence[int]] = None) -> PipelinePlan:
    """Balance the model's blocks over ``num_stages x virtual_stages`` chunks, or cut them into
    ``sizes`` blocks per chunk (in chunk order) when given (no collective)."""
    names = list(model.pipeline_layers())
    chunks = num_stages * virtual_stages
    if len(names) < chunks:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} x virtual_pipeline_size={virtual_stages} = {chunks} pipeline "
            f"chunks but the model has {len(names)} blocks: every chunk needs at least one block. Lower "
            f"pipeline_parallel_size or virtual_pipeline_size so that their product is at most {len(names)}."
        )
    first_names, last_names = model.pipeline_edge_modules()
    blocks = [module_costs(model.get_submodule(n)) for n in names]
    first = [module_costs(model.get_submodule(n)) for n in first_names]
    last = [module_costs(model.get_submodule(n)) for n in last_names]
    total_params = sum(c[0] for c in blocks + first + last) or 1.0
    total_flops = sum(c[1] for c in blocks + first + last) or 1.0

    def cost(items: list[tuple[float, float]]) -> float:
        return sum(p / total_params + f / total_flops for p, f in items)

    if sizes is None:
        ranges = balanced_split([cost([b]) for b in blocks], chunks, cost(first), cost(last))
    else:
        check_split_sizes(sizes, chunks, len(names))
        ends = [sum(sizes[: k + 1]) for k in range(chunks)]
        ranges = list(zip([0, *ends[:-1]], ends))
    costs = tuple(cost(blocks[s:e]) + (cost(first) if k == 0 else 0.0) + (cost(last) if k == chunks - 1 else 0.0)
                  for k, (s, e) in enumerate(ranges))
    return PipelinePlan(num_stages, virtual_stages, tuple(tuple(names[s:e]) for s, e in ranges), costs)


def split_model(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> list[nn.Module]:
    """Prune ``model`` to what ``pp_rank`` holds and return its chunks, in stage order."""
    indices = plan.chunk_indices(pp_rank)
    model.pipeline_prune(plan.layers_of(pp_rank), 0 in indices, plan.num_chunks - 1 in indices)
    return [model.pipeline_chunk(list(plan.chunks[c]), c == 0, c == plan.num_chunks - 1) for c in indices]


def shard_chunks(chunks: Sequence[nn.Module], blocks: Sequence[nn.Module], mesh: Any, mp_policy: Any,
                 reshard_after_forward: bool, ignored: Sequence[nn.Parameter]) -> list[nn.Module]:
    """FSDP2 over ``mesh`` for each block, then each chunk (its embeddings / norm / head): the
    chunks are what the pipeline calls, so they are the FSDP roots (as torchtitan shards model
    chunks). Returns the wrapped modules."""
    return shard_blocks_then_roots(blocks, chunks, mesh, mp_policy, reshard_after_forward, ignored)


# ------------------------------------------------------------------------------------ schedules
@dataclass
class _Compiled:
    schedule: Any
    boundary: tuple[tuple[int, ...], torch.dtype]  # the hidden states the stages exchange: shape, dtype


class PipelineRunner:
    """Runs one batch through this rank's chunks with a torch pipeline schedule.

    ``runner(x, labels=labels, **kwargs)`` splits the batch into ``microbatches`` micro-batches
    (dim 0), runs the schedule (forward and backward when gradients are enabled, forward only
    otherwise: validation batches, whose last may be smaller, are cut into the most micro-batches
    up to ``microbatches`` that divide them, run by GPipe or the interleaved schedule) and returns
    the batch's token-mean loss on every rank (computed on the last stage, broadcast over the
    pipeline group). The stages' boundary tensors are declared statically: ``[B / microbatches,
    S / seq_divisor, hidden]`` of ``boundary_dtype``, so no metadata forward runs (it would count
    router tokens and accumulate gradients); a chunk returning anything else raises.

    ``token_group`` (context parallelism): the ranks holding the other shards of the batch's
    sequences. The loss is then the token mean over the group's labelled tokens: each rank's
    micro-batch loss is ``CP x (its token-loss sum) / (the group's labelled tokens)``, whose
    gradients averaged over DP x CP are those of the global mean, and the returned value is the
    group's mean (one scalar all-reduce of the token count and one of the loss).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        plan: PipelinePlan,
        pp_rank: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        schedule: PipelineSchedule,
        microbatches: int,
        hidden_size: int,
        seq_divisor: int = 1,
        boundary_dtype: torch.dtype = torch.float32,
        token_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.chunks = list(chunks)
        self.plan = plan
        self.pp_rank = pp_rank
        self.pp_group = pp_group
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.hidden_size = hidden_size
        self.seq_divisor = seq_divisor
        self.boundary_dtype = boundary_dtype
        self.token_group = token_group
        self.accumulate = 1
        self.runs = 0  # schedule steps taken (the strategy checks one ran per training_step)
        self.last_run_trained = False
        self._compiled: dict[tuple, _Compiled] = {}
        self._divisor: Optional[Tensor] = None
        ranks = dist.get_process_group_ranks(pp_group)
        self._last_rank = ranks[(plan.num_chunks - 1) % plan.num_stages]
        self.holds_last = (plan.num_chunks - 1) in plan.chunk_indices(pp_rank)
        self._boundary: Optional[tuple[tuple[int, ...], torch.dtype]] = None  # declared by `_compile`
        for chunk, index in zip(self.chunks, plan.chunk_indices(pp_rank)):
            if index != plan.num_chunks - 1:
                chunk.register_forward_hook(self._check_boundary)

    def _check_boundary(self, chunk: nn.Module, args: Any, output: Any) -> None:
        """A chunk's output must be what the next stage's receive buffer was declared as (torch
        checks only under TORCH_DISTRIBUTED_DEBUG=DETAIL; a mismatch would be received as other
        bytes). Shapes and dtypes are host metadata: no sync."""
        if self._boundary is None or not torch.is_tensor(output):
            return
        shape, dtype = self._boundary
        if tuple(output.shape) != shape or output.dtype != dtype:
            raise RuntimeError(
                f"a pipeline chunk returned {output.dtype} {tuple(output.shape)}, but the stages were declared to "
                f"exchange {dtype} {shape} ([micro-batch, sequence / TP under sequence parallelism, hidden]): the "
                "chunk must return hidden states of the dense layers' compute dtype (a model of your own: cast its "
                "output to that dtype)."
            )

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        return output / self._divisor

    def _compile(self, x: Tensor, labels: Tensor, training: bool) -> _Compiled:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        batch, seq = labels.shape[:2]
        microbatches = self.microbatches if training else self._eval_microbatches(batch)
        micro = batch // microbatches
        key = (training, tuple(x.shape), x.dtype, tuple(labels.shape))
        if key in self._compiled:
            return self._compiled[key]
        hidden = torch.empty(micro, seq // self.seq_divisor, self.hidden_size, dtype=self.boundary_dtype,
                             device="meta", requires_grad=training)
        first_input = torch.empty(micro, *x.shape[1:], dtype=x.dtype, device="meta")
        loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=training)
        stages = []
        for chunk, index in zip(self.chunks, self.plan.chunk_indices(self.pp_rank)):
            first, last = index == 0, index == self.plan.num_chunks - 1
            stages.append(PipelineStage(
                chunk, index, self.plan.num_chunks, self.device,
                input_args=(first_input if first else hidden,), output_args=(loss if last else hidden,),
                group=self.pp_group,
            ))
        kwargs = dict(n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        if self.schedule_name == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, **kwargs)
        elif self.schedule_name == "1f1b" and training:
            schedule = Schedule1F1B(stages[0], **kwargs)
        else:
            schedule = ScheduleGPipe(stages[0], **kwargs)
        self._compiled[key] = _Compiled(schedule, (tuple(hidden.shape), self.boundary_dtype))
        return self._compiled[key]

    def _eval_microbatches(self, batch: int) -> int:
        """The most micro-batches, up to ``microbatches``, that divide ``batch`` (and, for the
        interleaved schedule, split evenly into its rounds of ``P`` micro-batches)."""
        for m in range(min(self.microbatches, batch), 0, -1):
            rounds = max(1, m // self.plan.num_stages)
            if batch % m == 0 and (self.schedule_name != "interleaved_1f1b" or m % rounds == 0):
                return m
        return 1

    def __call__(self, x: Tensor, *, labels: Tensor, **kwargs: Any) -> Tensor:
        batch = labels.shape[0]
        training = torch.is_grad_enabled()
        if training and batch % self.microbatches:
            raise ValueError(
                f"a batch of {batch} sequences does not split into pipeline_microbatches={self.microbatches} "
                f"equal micro-batches: make the batch size a multiple of {self.microbatches}."
            )
        self.last_run_trained = training
        compiled = self._compile(x, labels, training)
        self._boundary = compiled.boundary
        tensor_kwargs = {k: v for k, v in kwargs.items() if v is not None}
        for name, value in tensor_kwargs.items():
            if not isinstance(value, Tensor) or value.shape[0] != batch:
                raise ValueError(f"pipeline inputs are split into micro-batches on dim 0: {name!r} must be a "
                                 f"[B, ...] tensor with B={batch}.")
        tokens = (labels != IGNORE_INDEX).sum().float()
        shards = 1
        if self.token_group is not None:
            dist.all_reduce(tokens, group=self.token_group)
            shards = dist.get_world_size(self.token_group)
        accumulate = self.accumulate if training else 1
        self._divisor = tokens.clamp(min=1) / shards * accumulate
        losses: list[Tensor] = []
        args = (x,) if 0 in self.plan.chunk_indices(self.pp_rank) else ()
        if training:
            compiled.schedule.step(*args, target=labels, losses=losses, return_outputs=False, labels=labels,
                                   **tensor_kwargs)
        else:
            compiled.schedule.eval(*args, target=labels, losses=losses, return_outputs=False, labels=labels,
                                   **tensor_kwargs)
        self.runs += 1
        if self.holds_last:
            value = torch.stack([v.detach().float() for v in losses]).sum() * accumulate
        else:
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        # The loss exists on the last stage only: one scalar broadcast over the pipeline group.
        dist.broadcast(value, src=self._last_rank, group=self.pp_group)
        if self.token_group is not None:  # each shard's part of the group's mean
            dist.all_reduce(value, group=self.token_group)
            value = value / shards
        return value
