"""`CUDAGraphs`: capture parts of a LightningModule's training step in CUDA graphs, replay them after.

``Trainer(callbacks=[CUDAGraphs(scope="moe")])``: the module and its ``training_step`` stay as they
are. Fine-grained MoE and FP8 steps at small micro-batches are host-bound (the host issues the
kernels more slowly than the GPU runs them); a graph launches a module's whole forward, or
backward, at once.

How a fit runs with it:

1. ``setup`` refuses pipeline parallelism (``pipeline_parallel_size > 1``: several micro-batches
   in flight, while the graphs hold one micro-batch's activations). ``on_fit_start`` finds the
   modules of the scope (`lightning_moe.callbacks._graph_targets`), refuses what a graph cannot
   replay, naming the fix (recomputation of a part inside a captured module among it), and
   routes each module's ``forward`` through the callback. On a machine without CUDA the callback
   does nothing but say so once.
2. The first ``warmup_steps`` optimizer steps of the fit run eagerly; the callback records the
   signature (shapes, dtypes, autocast state) of every training call of the modules.
3. At the start of the next accumulation window the modules are captured together, at the
   signatures most warm-up micro-batches had (`lightning_moe.cuda_graphs.capture_modules`: one
   memory pool, in the order the step calls them), under the precision plugin's training context;
   from then on every training call with the recorded signature replays.

Training semantics stay those of the eager step (the GPU tests check 20 steps bit for bit):

- evaluation (validation, test, predict) and anything without gradients runs eagerly: the
  modules are in eval mode or gradients are off there;
- gradient accumulation: with ``accumulate_grad_batches > 1`` (or manual optimization) the first
  backward of a window copies each gradient out of the graph's buffer, the later ones add in
  place; with one micro-batch per step ``.grad`` is the graph's buffer itself (no copy), valid
  from the backward to the optimizer step. That buffer lies in the graphs' shared pool, whose
  memory the next step's forwards reuse (for temporaries, and, between the forwards and the
  backwards, for other captured modules' saved activations), so the callback sets such a
  ``.grad`` to None at the start of every training batch and before Lightning's ``zero_grad``:
  a ``zero_grad(set_to_none=False)`` then finds None there and zeroes nothing in the pool (the
  same values: the backward's gradient either way). Lightning's ``zero_grad`` of the module
  before a validation run leaves ``.grad`` None too, so after a validation run the next
  backward hands its buffer to ``.grad`` whatever ``set_to_none`` the step's ``zero_grad`` uses;
- FP8 delayed scaling: the graphs record amaxes into the modules' history in place and read the
  scales the once-per-step update writes in place; a warm-up step gives every state its scales
  before the capture. Expert-bias token counts, global aux-loss counts and the aux-loss
  gradients likewise run inside the graphs on the routers' own buffers; a change of a router's
  ``aux_loss_scale`` (baked into the backward graph) makes the callback capture again;
- `MoEMonitor` and the module's router-loss logging read ``MoELayer.last_stats`` and
  ``router.latest_losses``, which every replay sets to its own values;
- a training call whose signature differs from the capture's (the last, smaller batch of an
  epoch) runs eagerly, for that call only, with a one-line notice the first time per signature
  (``eager_calls`` counts them). Everything else that differs from the capture is refused;
- checkpoints: the graphs hold no state of their own. Every fit (a resume included) warms up for
  ``warmup_steps`` steps after its start and captures then; a checkpoint loaded into a running
  fit drops the graphs, and they are captured again after the warm-up.

The dropless all-to-all dispatcher (expert parallelism with ``token_dispatcher="alltoall"``) reads
its split sizes on the host, which a graph cannot replay. Inside the captured modules it runs its
static path instead (`lightning_moe.parallel.dispatchers`, Megatron-Core's
``--moe-expert-rank-capacity-factor``): sizes fixed by the token count, each rank's experts a buffer
of ``expert_rank_capacity_factor`` times the rows of a balanced dispatch. A dispatch that would
overflow its buffer sets a device flag instead; after the last backward of every accumulation
window the callback reads the flags (one host sync per optimizer step, all-reduced so that every
rank agrees) and, where one is set, runs the window again eagerly (dropless, with host-synced
sizes) from the state it started with: the module's buffers (router counts, FP8 amax histories)
are put back, the FP8 weight cache and the gradients cleared, and every micro-batch's
``training_step`` (from the RNG states that micro-batch started with) and backward run again,
before the gradients are reduced and the optimizer steps. No token is dropped and the step is the
eager one; ``reruns`` counts such windows, with a warning the first time (raise the factor where
they are frequent). The backward hooks do not run again for the rerun (they ran in the first
pass); the callback runs its hooks first among the callbacks, so that the window's last
``on_after_backward`` of the others and of the module sees the rerun's gradients. Values that
``training_step`` logs with ``on_epoch=True`` count a re-run micro-batch twice. Needs automatic
optimization and a ``training_step`` that takes batches (not ``dataloader_iter``).

Memory: the graphs keep their modules' activations, temporaries and gradient buffers in one
pool for good (about one eager step's activations of the captured modules); with gradient
accumulation the gradients of the captured parameters are held twice (``.grad`` and the graph's
buffer). Capturing synchronizes the device once. Dropped graphs (a loaded checkpoint, a capture
again, the end of the fit) release their pool at once (the reference cycle through each graphed
``forward`` is broken and collected).
"""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_moe.callbacks._graph_calls import (
    CallSignature,
    autocast_state,
    bind_tensors,
    call_signature,
    describe,
    sample_tensors,
)
from lightning_moe.callbacks._graph_targets import (
    ModuleSpec,
    check_targets,
    describe_targets,
    find_targets,
    normalize_scope,
    routed_method,
    static_dispatchers,
)
from lightning_moe.callbacks._layout import refuse_pipeline_parallelism
from lightning_moe.cuda_graphs import CapturedModules, capture_modules


@dataclass
class _Target:
    name: str
    module: nn.Module
    method: str  # what the callback routes: "forward", or "loss" (the reference network's whole step)
    forward: Callable[..., Any]  # that method before the callback routed it
    own_forward: bool  # it was an instance attribute (put back as such afterwards)


class CUDAGraphs(Callback):
    """Capture a LightningModule's modules in CUDA graphs after a warm-up, replay them afterwards.

    Args:
        scope: what to capture, as Megatron-Core's ``--cuda-graph-scope`` names it: ``"full"``
            (default: whole decoder layers), ``"attn"`` (attention), ``"moe"`` (MoE layers:
            router, dispatch, experts, combine), ``("attn", "moe")`` (both, norms and residuals
            eager) or ``"full_iteration"`` (the whole step's forward and backward: the reference
            network's ``loss``, embedding to cross-entropy; a user network's ``forward`` given by
            ``modules``; the optimizer step stays eager). The reference decoder's types are
            found by class (`lightning_moe.callbacks._graph_targets`).
        warmup_steps: eager optimizer steps at the start of every fit before the capture
            (default 3, as Megatron-Core's ``--cuda-graph-warmup-steps``; at least 1, which gives
            FP8 delayed scaling its first scales and compiles the kernels outside the capture).
        modules: more modules to capture: classes (every instance) or qualified-name patterns
            over the LightningModule's ``named_modules`` (``"model.blocks.*"``); for models
            outside this package. Default None: the scope's reference types only.
        num_warmup_iters: eager forward and backward passes on a side stream that
            `torch.cuda.make_graphed_callables` runs before capturing (default 3).
        expert_rank_capacity_factor: the dropless all-to-all dispatcher's static budget inside the
            graphs, in balanced dispatches' rows (default 1.25: its expert buffers are at most
            1.25 times those of a balanced eager dispatch; a window that overflows runs again
            eagerly). None: such dispatchers are refused, naming the fix.

    After the capture, ``captured`` lists the names of the captured modules and ``eager_calls``
    counts the training calls that ran eagerly because their shapes differed from the capture's;
    ``reruns`` counts the accumulation windows run again after a static all-to-all overflowed.
    """

    def __init__(self, scope: Union[str, Sequence[str]] = "full", warmup_steps: int = 3,
                 modules: Optional[Sequence[ModuleSpec]] = None, num_warmup_iters: int = 3,
                 expert_rank_capacity_factor: Optional[float] = 1.25) -> None:
        self.scopes = normalize_scope(scope)
        for name, value in (("warmup_steps", warmup_steps), ("num_warmup_iters", num_warmup_iters)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CUDAGraphs({name}={value!r}) must be an int >= 1 (FP8 delayed scaling needs one "
                                 "eager optimizer step before the capture).")
        factor = expert_rank_capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise ValueError(f"CUDAGraphs(expert_rank_capacity_factor={factor!r}) must be a number > 0 (1.25: expert "
                             "buffers of 1.25 balanced dispatches) or None (refuse the dropless all-to-all).")
        self.warmup_steps = warmup_steps
        self.modules = list(modules or [])
        self.num_warmup_iters = num_warmup_iters
        self.expert_rank_capacity_factor = None if factor is None else float(factor)
        self.captured: list[str] = []
        self.eager_calls = 0
        self.reruns = 0
        # the static all-to-all: its dispatchers, and the accumulation window a rerun replays
        self._static: list[Any] = []
        self._window: list[tuple[Any, int, tuple]] = []  # (batch, batch_idx, RNG states) per micro-batch
        self._snapshot: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        self._rerunning = False
        self._targets: list[_Target] = []
        self._graphs: Optional[CapturedModules] = None
        self._slots: dict[int, int] = {}  # target index -> position in the capture
        self._signatures: list[CallSignature] = []  # per position
        self._capture_key: tuple = ()
        self._calls: list[tuple[int, CallSignature]] = []  # this micro-batch's training calls
        # the training calls of every finished micro-batch so far -> how many micro-batches made them
        self._seen_calls: dict[tuple, int] = {}
        self._start_step: Optional[int] = None
        self._noticed: set = set()
        self._recomputed: set[str] = set()  # targets seen running inside a backward

    # ------------------------------------------------------------------ planning
    def plan(self, pl_module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The modules this callback captures in ``pl_module``, after its refusals (``ValueError``
        naming the fix for anything a graph cannot replay)."""
        targets = find_targets(pl_module, self.scopes, self.modules)
        check_targets(targets, pl_module, static_dispatch=self.expert_rank_capacity_factor is not None)
        return targets

    def layout_rows(self, model: nn.Module) -> dict[str, str]:
        """The layout table's row (`MegatronMoEStrategy` prints it): what will be captured."""
        scope = self.scopes[0] if len(self.scopes) == 1 else "+".join(self.scopes)
        if not any(p.is_cuda for p in model.parameters()):
            return {"CUDA graphs": f"scope {scope!r}: off (no CUDA device)"}
        try:
            targets = self.plan(model)
        except ValueError as error:  # raised on every rank at fit start; the table prints on rank 0 only
            return {"CUDA graphs": f"scope {scope!r}: refused ({str(error).split(': ', 1)[-1][:80]}...)"}
        return {"CUDA graphs": f"scope {scope!r}: {describe_targets(targets, self.scopes)}, captured after "
                               f"{self.warmup_steps} warm-up step{'s' if self.warmup_steps > 1 else ''}"}

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        refuse_pipeline_parallelism(trainer, "CUDAGraphs", "a pipeline schedule keeps several micro-batches in "
                                    "flight, and the graphs hold one micro-batch's activations")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._uses_cuda(trainer):
            rank_zero_info(f"CUDAGraphs: no CUDA device (training on {trainer.strategy.root_device.type}); "
                           "nothing is captured, every step runs eagerly.")
            return
        self._refuse_setup(trainer)
        targets = self.plan(pl_module)
        self._static = static_dispatchers(targets)
        if self._static:
            self._prepare_reruns(trainer, pl_module)
        self._install(targets)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._drop_graphs()
        self._start_step = trainer.global_step
        self._calls, self._seen_calls, self._recomputed = [], {}, set()
        self._window = []

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._targets:
            return
        self._release_graph_grads()  # the last step's gradients, before this step's forwards replay
        if self._calls:
            key = tuple(self._calls)
            self._seen_calls[key] = self._seen_calls.pop(key, 0) + 1  # re-inserted: the latest last
        self._calls = []
        window_start = batch_idx % max(1, trainer.accumulate_grad_batches) == 0
        if self._graphs is not None and self._capture_key != self._key(trainer):
            self._drop_graphs()  # a number the backward graphs baked in changed: capture again now
            self._capture(trainer)
        else:
            if self._start_step is None:  # a checkpoint was loaded: warm up again from here
                self._start_step = trainer.global_step
            warmed_up = trainer.global_step - self._start_step >= self.warmup_steps
            if self._graphs is None and warmed_up and window_start and self._seen_calls:
                self._capture(trainer)
        if self._static:
            self._track_window(pl_module, batch, batch_idx, window_start)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rerunning or not self._window or not self._window_ends(trainer):
            return
        if self._overflowed(trainer):
            self._rerun_window(trainer, pl_module)
        self._window = []

    @override
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._release_graph_grads()  # before an in-place zero_grad could write into the graphs' pool

    def _release_graph_grads(self) -> None:
        """``.grad = None`` where ``.grad`` is still a backward graph's gradient buffer (one
        micro-batch per step). The buffer is the graphs' pool memory, which the next forward
        replays reuse: a ``zero_grad(set_to_none=False)`` after the forwards (Lightning zeroes
        after ``training_step``) would zero other captured modules' saved activations there."""
        if self._graphs is not None and not self._graphs.accumulate_grads:
            self._graphs.clear_stale_grads()

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._drop_graphs()
        self._start_step = None  # set again at the next step (or by on_train_start): warm up after the load

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._uninstall()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall()  # also when the fit raised

    def _uses_cuda(self, trainer: Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    # ------------------------------------------------------------------ setup checks
    def _refuse_setup(self, trainer: Trainer) -> None:
        """Refusals that need the Trainer: Transformer Engine's FP8 and packed batches."""
        plugin = trainer.precision_plugin
        if getattr(plugin, "backend", None) == "te":
            raise ValueError(
                "CUDAGraphs with FP8Precision(backend='te'): Transformer Engine keeps its FP8 state outside the "
                "modules and graphs it with its own make_graphed_callables; use FP8Precision(backend='torch')."
            )
        datamodule = getattr(trainer, "datamodule", None)
        if getattr(datamodule, "pack_sequences", False) and self.scopes != ("moe",):
            raise ValueError(
                "CUDAGraphs: packed batches (pack_sequences=True) give attention a document mask per batch, which "
                "a CUDA graph cannot take as an input: use scope='moe', or pack_sequences=False."
            )

    # ------------------------------------------------------------------ routing the forwards
    def _install(self, targets: list[tuple[str, nn.Module]]) -> None:
        self._uninstall()
        for index, (name, module) in enumerate(targets):
            method = routed_method(module, self.scopes)
            own = method in module.__dict__
            self._targets.append(_Target(name, module, method, getattr(module, method), own))
            setattr(module, method, self._routed_forward(index))

    def _uninstall(self) -> None:
        self._drop_graphs()
        for target in self._targets:
            if target.own_forward:
                setattr(target.module, target.method, target.forward)
            else:
                target.module.__dict__.pop(target.method, None)
        self._targets = []

    def _routed_forward(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            target = self._targets[index]
            if not (target.module.training and torch.is_grad_enabled()) or self._rerunning:
                return target.forward(*args, **kwargs)  # evaluation, no gradients, a rerun: eager
            signature, tensors = call_signature(args, kwargs, target.name)
            if self._graphs is None:
                if torch._C._current_graph_task_id() != -1:  # called from inside a backward: recomputation
                    self._recomputed.add(target.name)
                self._calls.append((index, signature))
                return target.forward(*args, **kwargs)
            slot = self._slots.get(index)
            if slot is not None and self._signatures[slot] == signature:
                return self._graphs.replay(slot, *tensors)
            self._note_eager(target, slot, signature)
            return target.forward(*args, **kwargs)

        return forward

    def _note_eager(self, target: _Target, slot: Optional[int], signature: CallSignature) -> None:
        self.eager_calls += 1
        key = (target.name, signature)
        if key in self._noticed:
            return
        self._noticed.add(key)
        if slot is None:
            rank_zero_warn(f"CUDAGraphs: {target.name} was not called in the training step it was captured after; "
                           "it runs eagerly.")
            return
        captured = self._signatures[slot]
        what = "autocast" if captured.autocast != signature.autocast else "inputs"
        rank_zero_info(f"CUDAGraphs: {target.name} got {what} other than at its capture ({describe(signature)} against "
                       f"{describe(captured)}); this call runs eagerly (a last, smaller batch does).")

    # ------------------------------------------------------------------ capture
    def _key(self, trainer: Trainer) -> tuple:
        """The Python numbers the captured backward graphs bake in."""
        scales = tuple(getattr(getattr(m, "router", None), "aux_loss_scale", None)
                       for t in self._targets for m in t.module.modules() if hasattr(m, "dispatcher"))
        return (scales, trainer.accumulate_grad_batches)

    def _capture(self, trainer: Trainer) -> None:
        if self._recomputed:
            raise RuntimeError(
                f"CUDAGraphs: {', '.join(sorted(self._recomputed))} ran again inside the backward (activation "
                "checkpointing around it), so its forward would replay between backward graphs, out of the order "
                "of the capture: turn that recomputation off for the captured modules, or capture other modules."
            )
        # The calls most micro-batches made (the latest among equals): not an epoch's last, smaller batch.
        calls = list(max(reversed(self._seen_calls), key=self._seen_calls.get))
        order = [index for index, _ in calls]
        repeated = sorted({self._targets[i].name for i in order if order.count(i) > 1})
        if repeated:
            raise RuntimeError(
                f"CUDAGraphs: {', '.join(repeated)} ran more than once in one training micro-batch (shared weights, "
                "or recomputation under activation checkpointing); a graph replays once per module and step: leave "
                "those modules out (another scope, or modules=...), or do not recompute them."
            )
        missing = [t.name for i, t in enumerate(self._targets) if i not in order]
        if missing:
            rank_zero_warn(f"CUDAGraphs: {', '.join(missing)} did not run in a training step; not captured.")
        generator = torch.Generator().manual_seed(0)
        modules = [self._targets[i].module for i in order]
        forwards = [bind_tensors(self._targets[i].forward, sig) for i, sig in calls]
        # Sample values are drawn on the host and copied to the device (a sync, once per capture).
        samples = [sample_tensors(sig, generator) for _, sig in calls]
        accumulate = trainer.accumulate_grad_batches > 1 or not trainer.lightning_module.automatic_optimization
        with trainer.precision_plugin.train_step_context():
            state = autocast_state()
            if any(sig.autocast != state for _, sig in calls):
                raise RuntimeError(
                    f"CUDAGraphs: the training step ran its modules under autocast {calls[0][1].autocast}, the "
                    f"precision plugin's train_step_context gives {state}: capture needs the step's own state; "
                    "set autocast through the Trainer's precision, not inside training_step."
                )
            # The graphs record the all-to-all's static path; eager calls keep the host-synced one.
            for dispatcher in self._static:
                dispatcher.static_budget = self.expert_rank_capacity_factor
            try:
                self._graphs = capture_modules(modules, samples, self.num_warmup_iters, accumulate, forwards)
            finally:
                for dispatcher in self._static:
                    dispatcher.static_budget = None
            self._clear_overflow()  # the capture's warm-up passes ran on sample inputs
        self._slots = {index: slot for slot, index in enumerate(order)}
        self._signatures = [sig for _, sig in calls]
        self._capture_key = self._key(trainer)
        self.captured = [self._targets[i].name for i in order]
        captured = describe_targets([(t.name, t.module) for t in self._captured()], self.scopes)
        rank_zero_info(f"CUDAGraphs: captured {captured} at step {trainer.global_step}.")

    # ------------------------------------------------------------------ the static all-to-all's reruns
    def _prepare_reruns(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Refuse the steps a rerun cannot repeat, and run this callback's hooks first: its
        ``on_after_backward`` reruns a window before other callbacks see the window's gradients."""
        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

        if not pl_module.automatic_optimization:
            raise ValueError(
                "CUDAGraphs: the captured MoE layers dispatch by the dropless all-to-all, whose overflowing windows "
                "the callback runs again, which needs automatic optimization: use "
                "MegatronMoEStrategy(token_dispatcher='allgather') (sync-free and dropless), or automatic optimization."
            )
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            raise ValueError(
                "CUDAGraphs: a training_step that takes dataloader_iter cannot be run again after a static all-to-all "
                "overflow (its batches are not seen by the callback): take batches, or use "
                "MegatronMoEStrategy(token_dispatcher='allgather')."
            )
        if trainer.callbacks and trainer.callbacks[0] is not self:
            trainer.callbacks.remove(self)
            trainer.callbacks.insert(0, self)

    def _track_window(self, pl_module: LightningModule, batch: Any, batch_idx: int, window_start: bool) -> None:
        """Keep what a rerun of this window needs, while graphs are captured: at its start the
        module's buffers (router token counts, FP8 amax histories: the step's forwards update them in
        place), and each micro-batch's batch (a shallow copy of a container: a step may pop from it)
        and RNG states (other code draws between micro-batches: a data pipeline, other hooks)."""
        if window_start:
            self._window = []
            if self._graphs is None:
                return
            self._snapshot_buffers(pl_module)
        elif not self._window:
            return  # the window began before the capture: nothing captured ran in it
        kept = copy.copy(batch) if isinstance(batch, (dict, list)) else batch
        self._window.append((kept, batch_idx, _rng_states()))

    def _snapshot_buffers(self, pl_module: LightningModule) -> None:
        buffers = [b for b in pl_module.buffers() if b is not None]
        if self._snapshot is None or len(self._snapshot[0]) != len(buffers) or any(
                a is not b for a, b in zip(self._snapshot[0], buffers)):
            self._snapshot = (buffers, [torch.empty_like(b) for b in buffers])
        live, saved = self._snapshot
        if live:
            torch._foreach_copy_(saved, live)

    def _window_ends(self, trainer: Trainer) -> bool:
        """Whether the backward that just ran is the last of its accumulation window (the
        optimizer steps next)."""
        epoch_loop = trainer.fit_loop.epoch_loop
        should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
        if should_accumulate is not None:
            return not should_accumulate()
        return len(self._window) >= max(1, trainer.accumulate_grad_batches)

    def _overflowed(self, trainer: Trainer) -> bool:
        """Whether a static dispatch of this window overflowed on any rank (and the flags cleared).
        No flag yet (no static dispatch has run: before the first capture): False, no sync; every
        rank captures at the same step, so all ranks skip the all-reduce together."""
        flags = [d.overflow for d in self._static if d.overflow is not None]
        if not flags:
            return False
        flag = torch.stack(flags).amax().to(trainer.strategy.root_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # every rank reruns, or none
        self._clear_overflow()
        return bool(flag)  # host sync: once per optimizer step

    def _clear_overflow(self) -> None:
        for dispatcher in self._static:
            if dispatcher.overflow is not None:
                dispatcher.overflow.zero_()

    def _rerun_window(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """This window's micro-batches again, eagerly and from the state it started with (class
        docstring), before the gradients are reduced and the optimizer steps. The backward hooks
        (``on_before_backward`` / ``on_after_backward`` of callbacks and module) ran for every
        micro-batch in the first pass and do not run again; those of the window's last backward
        that come after this callback then see the rerun's gradients."""
        from lightning.pytorch.trainer import call

        self.reruns += 1
        if self.reruns == 1:
            rank_zero_warn(f"CUDAGraphs: a captured all-to-all dispatch exceeded its static budget "
                           f"(expert_rank_capacity_factor={self.expert_rank_capacity_factor}) at step "
                           f"{trainer.global_step}; the step runs again eagerly (dropless). Raise the factor if this "
                           "recurs (`reruns` counts them).")
        entry_rng = _rng_states()
        live, saved = self._snapshot
        if live:
            torch._foreach_copy_(live, saved)
        cache = getattr(trainer.precision_plugin, "weight_cache", None)
        if cache is not None:
            cache.clear()  # FP8 weights cast in the first pass: the rerun records their amaxes again
        for param in pl_module.parameters():
            param.grad = None
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        normalize = max(1, trainer.accumulate_grad_batches)
        epoch_loop = trainer.fit_loop.epoch_loop
        fx_name = pl_module._current_fx_name
        hooks = (call._call_callback_hooks, call._call_lightning_module_hook)

        def quiet(hook):
            def run(trainer_, name, *args, **kwargs):
                if name in ("on_before_backward", "on_after_backward"):
                    return None
                return hook(trainer_, name, *args, **kwargs)
            return run

        self._rerunning = True
        call._call_callback_hooks, call._call_lightning_module_hook = (quiet(h) for h in hooks)
        try:
            for batch, batch_idx, rng in self._window:
                _set_rng_states(rng)
                kwargs = epoch_loop._build_kwargs(OrderedDict(), batch, batch_idx)
                pl_module._current_fx_name = "training_step"  # its self.log calls count as the step's
                out = trainer.strategy.training_step(*kwargs.values())
                pl_module._current_fx_name = fx_name
                loss = out.get("loss") if isinstance(out, Mapping) else out
                if loss is None:
                    continue  # Lightning skips such a micro-batch's backward too
                if not isinstance(loss, torch.Tensor):
                    raise RuntimeError("CUDAGraphs: re-running a step needs training_step to return its loss, a dict "
                                       "with 'loss', or None.")
                trainer.strategy.backward(loss / normalize, optimizer)  # Lightning's scaling of an accumulated loss
        finally:
            call._call_callback_hooks, call._call_lightning_module_hook = hooks
            pl_module._current_fx_name = fx_name
            self._rerunning = False
            _set_rng_states(entry_rng)  # where the first pass left them: what eager steps would have drawn

    def _captured(self) -> list[_Target]:
        return [self._targets[i] for i in sorted(self._slots, key=self._slots.get)]

    def _drop_graphs(self) -> None:
        graphs = self._graphs
        self._graphs, self._slots, self._signatures = None, {}, []
        if graphs is None:
            return
        graphs.release()
        # make_graphed_callables sets each captured module's ``forward`` to a function whose closure
        # refers back to the module: a reference cycle, which would keep the graphs and their memory
        # pool until the cycle collector runs. Broken here, and collected now, so that the pool is
        # released before the next eager steps allocate.
        for proxy in getattr(graphs, "_proxies", ()):
            proxy.__dict__.pop("forward", None)
        del graphs
        gc.collect()


def _rng_states() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def _set_rng_states(states: tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
