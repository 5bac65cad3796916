"""Modules (forward and backward) captured in CUDA graphs: `capture_modules`, `capture_moe_layer`.

Fine-grained MoE blocks launch many small kernels: at the qwen3_30b_a3b shape the FP8 block's
host issues its forward more slowly than the GPU runs it, so a step started on an idle GPU waits
for the host. `capture_modules` records the forward and backward of several modules with
`torch.cuda.make_graphed_callables`, all in one memory pool, in the order a training step runs
them (forwards first to last, backwards last to first); every later call replays one graph
forward and one backward per module. `capture_moe_layer` does this for one `MoELayer` and makes
its ``forward`` replay. The `lightning_moe.callbacks.CUDAGraphs` callback drives `capture_modules`
under a Lightning ``Trainer``.

That is possible because the captured code never reads a device value on the host: routing, the
permutation plan, the expert groups' padding and the FP8 casts are all sized by static shapes.
What does read one is refused with the fix named: the all-to-all dispatcher's dropless path
(its split sizes are host integers), FSDP-sharded submodules (their all-gathers run from hooks).

What a graph freezes, and so what the caller must keep fixed after the capture:
- the inputs' shapes, strides and dtypes, and which inputs require gradients;
- the parameters themselves (in-place optimizer updates are fine; replacing a parameter is not);
- host-side choices made at capture: autocast on or off for the forward (the graph's forward
  keeps that state whatever the state at later calls; the backward is captured without autocast,
  as a training loop calls backward outside it), FP8 amax recording on (training), the recipe,
  the dispatcher, Python numbers read in the forward (a router's ``aux_loss_scale``). A
  delayed-scaling state must have had one `update_delayed_scaling` before the capture (a state
  without scales casts with an extra amax pass, which the graph would keep forever), and that
  update keeps running outside the graph, in place, once per step.
- the capture itself leaves no trace: the modules' buffers (FP8 amax histories and scales, router
  token counts) hold afterwards what they held before it, ``.grad`` is untouched, and the CUDA
  random generator is where it was.
- attributes a forward assigns (``MoELayer.last_stats``, ``router.latest_losses``) are set again
  after every replay to the objects the capture made, whose tensors the replay refreshes: readers
  such as `MoEMonitor` see each replay's values, also after an eager forward (evaluation) in between.
- no autograd graph of an earlier step alive at the capture (a kept loss or output): its leaves'
  AccumulateGrad nodes would tie the captured backward to the stream that step ran on (an error
  that says so is raised).
- one micro-batch in flight: the outputs and the tensors saved for backward live in the graphs'
  memory, so the next forward overwrites them. Run each forward's backward before the next
  forward, and call the modules in the order of the capture (no pipelining of several
  micro-batches, no module called twice in one step).

Gradients: the backward graph writes every parameter's gradient into a buffer of its own, and
autograd hands that buffer to ``.grad`` when ``.grad`` is None (no copy). The next replay would
then overwrite ``.grad`` before adding to it. So a parameter whose ``.grad`` still holds such a
buffer at the next backward raises, unless ``accumulate_grads=True``, which copies the gradient
out of the graph's buffer at the first backward after ``.grad`` was cleared (one copy of every
gradient per accumulation window; later micro-batches add in place). The buffer handed to
``.grad`` is memory of the graphs' shared pool, which `torch.cuda.make_graphed_callables` gives
out again in the order of the capture: the next forwards' temporaries may lie there, and so may,
between the forwards and the backwards, another captured module's saved activations (the
backward graph of module i allocates its gradient buffers where module j > i kept activations,
freed once j's backward was captured). Such a ``.grad`` holds the gradient from its backward
until the next forward replays, and must never be written in place after that:
`CapturedModules.clear_stale_grads` sets it back to None; call it after the optimizer step and
before the next forward, so that a loop that zeroes gradients in place
(``zero_grad(set_to_none=False)``) finds None there (zeroing it after the forwards corrupts the
activations the backward graphs then read). An input that is a leaf tensor gets the graph's
buffer as its ``.grad`` likewise; clear it before the next forward.

Memory: cuBLAS keeps a workspace per (handle, stream) for good (on Hopper 32 MiB for cuBLAS and
as much for cuBLASLt). The capture's warm-up runs on a stream of its own and the capture on
another, so each would keep one more workspace; `capture_modules` drops the cached workspaces
before and after the capture (as torch's inductor does around its graphs): the capture stream's
then lies in the graphs' pool, which the graphs' GEMMs use as scratch, the warm-up stream's is
freed, and the training stream's is allocated again at its next GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_moe._capture import collector_held_off
from lightning_moe.nn.compute_weights import uncached_weights
from lightning_moe.nn.experts import local_tensor


def _check_capturable(module: nn.Module, sample_args: Sequence[Any]) -> None:
    """Raise, naming the fix, for what a CUDA graph of ``module`` could not replay correctly."""
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise ValueError(
            "a CUDA-graph capture under autocast needs its weight cache off: capture inside "
            "torch.autocast('cuda', dtype=..., cache_enabled=False)"
        )
    for layer in module.modules():
        dispatcher = getattr(layer, "dispatcher", None)
        # a dispatcher on its static path (`AllToAllDispatcher.static_budget`) reads nothing on the host
        if getattr(dispatcher, "syncs_host", False) and getattr(dispatcher, "static_budget", None) is None:
            raise ValueError(
                f"{type(dispatcher).__name__} reads its split sizes on the host (dropless all-to-all), which a "
                "CUDA graph cannot replay: set its static_budget (CUDAGraphs does), use the all-gather dispatcher "
                "(MegatronMoEStrategy(token_dispatcher='allgather')), or set MoEConfig(expert_capacity_factor=..., "
                "pad_expert_input_to_capacity=True)"
            )
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError("a CUDA graph cannot capture FSDP-sharded modules (their all-gathers run from hooks); "
                         "capture a module without expert or dense sharding (sharding='ddp', expert_sharding='ddp')")
    if not module.training:
        raise ValueError("a CUDA-graph capture records a training step (forward and backward): call layer.train() "
                         f"on the captured {type(module).__name__}")
    _check_fp8_state(module)
    tensors = [t for t in sample_args if isinstance(t, Tensor)]
    if not tensors or any(not t.is_cuda for t in tensors) or any(not p.is_cuda for p in module.parameters()):
        raise ValueError(f"capturing {type(module).__name__} needs the module and its inputs on a CUDA device")


def _check_fp8_state(module: nn.Module) -> None:
    """FP8 delayed scaling: the scales must exist (see the module docstring) and amaxes be recorded."""
    from lightning_moe.precision.delayed import delayed_state, recording_amax
    from lightning_moe.precision.modules import fp8_modules

    modules = fp8_modules(module)
    if not modules:
        return
    if not recording_amax():
        raise ValueError("a CUDA-graph capture with amax recording paused would freeze an evaluation step: "
                         "capture outside amax_recording_paused()")
    for fp8 in modules:
        state = delayed_state(fp8)
        if state is None or state.fresh:
            raise ValueError(
                f"{type(fp8).__name__} has no delayed-scaling scales yet: run one training step and "
                "update_delayed_scaling (what FP8Precision does at each optimizer step) before capturing"
            )


def _storage(t: Tensor) -> int:
    """The address of the storage under ``t`` (a DTensor's local shard)."""
    return local_tensor(t).untyped_storage().data_ptr()


class _GradientGuard:
    """Keeps ``.grad`` from aliasing the backward graphs' gradient buffers (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], accumulate_grads: bool) -> None:
        self.params = list(params)
        self.accumulate_grads = accumulate_grads
        self._handed: dict[int, int] = {}  # id(param) -> storage of the graph buffer handed to .grad
        self._handles = [p.register_hook(self._hook_for(p)) for p in self.params]

    def _hook_for(self, param: nn.Parameter) -> Callable[[Tensor], Tensor]:
        def hook(grad: Tensor) -> Tensor:
            current = param.grad
            if current is None:
                if self.accumulate_grads:
                    return grad.clone()
                self._handed[id(param)] = _storage(grad)
                return grad
            if _storage(current) == _storage(grad):
                raise RuntimeError(
                    "a captured module's backward ran while .grad still held the previous backward's gradient "
                    "(the graph's buffer, just overwritten): clear gradients between backwards "
                    "(optimizer.zero_grad(set_to_none=True)) or capture with accumulate_grads=True"
                )
            return grad

        return hook

    def clear_stale_grads(self) -> None:
        """``.grad = None`` where ``.grad`` is still a graph's buffer (see the module docstring)."""
        for param in self.params:
            grad = param.grad
            if grad is not None and self._handed.get(id(param)) == _storage(grad):
                param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _ForwardUnderAutocast(nn.Module):
    """What `make_graphed_callables` captures for one module: ``forward`` (the module's own,
    unwrapped) called with the graph's tensors, inside the autocast state of the capture when
    ``dtype`` is given, so that the capture can run with autocast off around it: torch captures
    the backward under the caller's thread-local state, and autocast on there would run the
    backward's matmuls in bf16 too (the router's fp32 products, among others), unlike a training
    loop, which calls backward outside autocast. The module is registered as a submodule, so its
    parameters are the ones `make_graphed_callables` takes gradients for."""

    def __init__(self, layer: nn.Module, forward: Callable[..., Any], dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.layer = layer
        self._layer_forward = forward  # the unwrapped forward: ``layer(x)`` could recurse
        self._dtype = dtype

    @property
    def training(self) -> bool:
        # make_graphed_callables replays only in the mode of the capture: the module's mode decides.
        layer = self._modules.get("layer") if "_modules" in self.__dict__ else None
        return True if layer is None else layer.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # follows the layer (nn.Module.__init__ and train() set it)

    def forward(self, *args: Tensor) -> Any:
        if self._dtype is None:
            return self._layer_forward(*args)
        with torch.autocast("cuda", dtype=self._dtype, cache_enabled=False):
            return self._layer_forward(*args)


def _holds_tensor(value: Any) -> bool:
    """Whether an attribute value carries tensors a replay refreshes (a tensor, a container or a
    dataclass of them)."""
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(isinstance(v, Tensor) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, Tensor) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(isinstance(getattr(value, f.name), Tensor) for f in dataclasses.fields(value))
    return False


_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "training", "forward"}


def _attributes(modules: Sequence[nn.Module]) -> dict[tuple[int, str], tuple[nn.Module, Any]]:
    """Every plain attribute of every submodule (identity of the value kept, for `_assigned`)."""
    out = {}
    for root in modules:
        for m in root.modules():
            for name, value in vars(m).items():
                if name not in _MODULE_INTERNALS:
                    out[(id(m), name)] = (m, value)
    return out


def _assigned(before: dict, after: dict) -> list[tuple[nn.Module, str, Any]]:
    """The tensor-holding attributes the capture assigned (new objects, or new names)."""
    return [(m, key[1], value) for key, (m, value) in after.items()
            if _holds_tensor(value) and (key not in before or before[key][1] is not value)]


class CapturedModules:
    """The graphs of `capture_modules`: ``replay(i, *tensors)`` runs module ``i``'s forward graph
    (its backward graph runs in autograd's backward), in training mode, and sets the attributes
    its capture assigned in module ``i``'s submodules; in evaluation mode the module's forward
    runs eagerly, under the autocast state of the capture. `release` removes the gradient hooks;
    the graphs go with the last reference to this object."""

    def __init__(self, modules: list[nn.Module], proxies: list[nn.Module], assigned: list[list],
                 guard: _GradientGuard) -> None:
        self.modules = modules
        self._proxies = proxies
        self._assigned = assigned
        self._guard = guard

    def replay(self, index: int, *tensors: Tensor) -> Any:
        out = self._proxies[index].forward(*tensors)
        if self.modules[index].training:
            for module, name, value in self._assigned[index]:
                setattr(module, name, value)
        return out

    def forward_of(self, index: int) -> Callable[..., Any]:
        """Module ``index``'s forward that replays (a callable for ``module.forward``)."""
        return lambda *tensors: self.replay(index, *tensors)

    @property
    def accumulate_grads(self) -> bool:
        return self._guard.accumulate_grads

    def clear_stale_grads(self) -> None:
        """Set ``.grad`` to None where it still is a graph's gradient buffer: call it after the
        optimizer step has read the gradients and before the next forward (before any in-place
        ``zero_grad``; see the module docstring)."""
        self._guard.clear_stale_grads()

    def release(self) -> None:
        self._guard.remove()


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (each is allocated again at its stream's next
    GEMM). A workspace allocated during a capture is the graph's pool memory, which the pool keeps
    for the graph's GEMMs after the cache lets it go."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


# torch's make_graphed_callables keeps its last warm-up pass's outputs and parameter gradients
# referenced (local variables) through the capture, which then allocates the graphs' own: for a
# whole-step capture, every gradient twice at the capture's peak. True (default): the warm-up
# passes run here instead (`warm_up`: the same passes on a side stream, their results dropped, the
# cache emptied) and torch's are skipped. Measured on an H100 (qwen3 shape, 4 layers, whole-step
# capture at micro-batch 1): bf16 peak 58.2 GiB against torch's warm-up 69.8 GiB; FP8 62.9 GiB
# where torch's warm-up ran out of memory. Benchmarks comparing the two set it False.
OWN_WARMUP = True


def warm_up(proxies: Sequence[nn.Module], sample_args: Sequence[tuple], num_warmup_iters: int,
            allow_unused_input: bool = True) -> None:
    """The passes `torch.cuda.make_graphed_callables` runs before capturing (forward, then the
    gradients of the outputs with respect to the tensor inputs and the parameters, not
    accumulated into ``.grad``), on a side stream where CUDA is in use, keeping nothing."""
    stream = torch.cuda.Stream() if torch.cuda.is_available() and any(
        p.is_cuda for m in proxies for p in m.parameters()) else None
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    if stream is not None:
        torch.cuda.synchronize()
    with context:
        for module, args in zip(proxies, sample_args):
            surface = tuple(a for a in args if isinstance(a, Tensor) and a.requires_grad)
            surface += tuple(p for p in module.parameters() if p.requires_grad)
            for _ in range(num_warmup_iters):
                outputs = [o for o in torch.utils._pytree.tree_leaves(module(*args))
                           if isinstance(o, Tensor) and o.requires_grad]
                if outputs:
                    torch.autograd.grad(outputs, surface, grad_outputs=[torch.empty_like(o) for o in outputs],
                                        only_inputs=True, allow_unused=allow_unused_input)
                del outputs  # nothing of a warm-up pass outlives it
    if stream is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the side stream's blocks, which the graphs' private pool cannot use


def _capture(proxies: list[nn.Module], sample_args: list[tuple], num_warmup_iters: int) -> None:
    """`torch.cuda.make_graphed_callables` on ``proxies`` (one pool, their order), autocast off
    around it (`_ForwardUnderAutocast`), with its most common failure explained. When a capture
    fails, torch leaves its capture stream current (``torch.cuda.graph``'s exit raises before
    restoring it): the caller's stream is put back before raising."""
    stream = torch.cuda.current_stream()
    autocast = torch.is_autocast_enabled("cuda")
    try:
        # An earlier captured module may be garbage (a reference cycle): no collection mid-capture.
        with torch.autocast("cuda", enabled=False) if autocast else contextlib.nullcontext(), collector_held_off():
            # allow_unused_input: a parameter no output depends on gets no gradient (None), as eagerly.
            if OWN_WARMUP:
                warm_up(proxies, sample_args, num_warmup_iters)
                num_warmup_iters = 0
            _clear_cublas_workspaces()  # the capture stream's workspace is then allocated in the graphs' pool
            torch.cuda.make_graphed_callables(tuple(proxies), tuple(sample_args), num_warmup_iters=num_warmup_iters,
                                              allow_unused_input=True)
            _clear_cublas_workspaces()  # the warm-up stream's and the capture stream's (module docstring)
    except RuntimeError as error:  # torch.AcceleratorError is a RuntimeError
        torch.cuda.set_stream(stream)
        if "captur" not in str(error):
            raise
        if "seed" in str(error) or "rng" in str(error).lower():
            raise RuntimeError(
                "capturing a module failed reading the CUDA random generator's state, which a capture cannot "
                "do: activation recomputation (torch.utils.checkpoint) inside a captured module saves that state. "
                f"Turn recomputation off for the captured modules, or capture others. CUDA said: {error}"
            ) from error
        raise RuntimeError(
            "capturing a module's backward failed. The usual cause: an autograd graph of an earlier "
            "eager step is still alive (a loss or an output kept in a variable), so the leaves' AccumulateGrad "
            "nodes stay tied to the stream that step ran on, which the capture cannot wait on. Drop those "
            "references (del loss, output) before the capture, or run the eager steps on a side stream. "
            f"CUDA said: {error}" + (f" (after: {error.__context__})" if error.__context__ else "")
        ) from error


def capture_modules(modules: Sequence[nn.Module], sample_args: Sequence[tuple], num_warmup_iters: int = 3,
                    accumulate_grads: bool = False,
                    forwards: Optional[Sequence[Callable[..., Any]]] = None) -> CapturedModules:
    """Capture the forward and backward of each of ``modules`` in CUDA graphs sharing one pool.

    ``modules``: in the order a training step calls them (each once). ``sample_args[i]``: tensors
    of the shapes, strides, dtypes and ``requires_grad`` every later call of module ``i`` will
    pass; their values do not matter and they become the graph's input buffers.
    ``forwards[i]``: what module ``i``'s graph runs, called with ``*sample_args[i]`` (default: the
    module's ``forward``); a caller that replaced ``module.forward`` passes the original here.
    ``num_warmup_iters``: eager forward and backward passes on a side stream before the capture,
    as `torch.cuda.make_graphed_callables` needs (every buffer gets its values back afterwards).
    ``accumulate_grads``: gradients are accumulated over several backwards (gradient
    accumulation) without clearing ``.grad`` between them (see the module docstring).
    Autocast, when on at the capture, is part of the graphs' forwards (its dtype, cache off); the
    backwards are captured without it. Returns the `CapturedModules`; nothing replays until the
    caller calls ``replay`` (or installs `CapturedModules.forward_of`).
    """
    modules, sample_args = list(modules), [tuple(a) for a in sample_args]
    forwards = [m.forward for m in modules] if forwards is None else list(forwards)
    if not (len(modules) == len(sample_args) == len(forwards)) or not modules:
        raise ValueError("capture_modules takes one tuple of sample args and one forward per module (at least one)")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("capture_modules: a module is listed twice (a graph replays once per step and module)")
    for module, args in zip(modules, sample_args):
        _check_capturable(module, args)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    proxies = [_ForwardUnderAutocast(m, f, dtype) for m, f in zip(modules, forwards)]
    # The warm-up passes run the backward on uninitialized output gradients (torch's choice), so
    # they would record garbage FP8 amaxes (and count tokens into any counting buffer): every
    # buffer gets its values from before the capture back, in place (the graphs keep its address).
    buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
    with torch.no_grad():
        before = [b.clone() for b in buffers]
    rng = torch.cuda.get_rng_state()  # host-side generator state (seed and offset): no device sync
    attributes = [_attributes([m]) for m in modules]
    try:
        # The graphs cast the weights themselves at every replay: a weight cast kept outside them
        # (an active ComputeWeightCache) would freeze the weights of the capture.
        with uncached_weights():
            _capture(proxies, sample_args, num_warmup_iters)
    finally:
        torch.cuda.set_rng_state(rng)
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                buffer.copy_(value)
    assigned = [_assigned(before, _attributes([m])) for m, before in zip(modules, attributes)]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    return CapturedModules(modules, proxies, assigned, _GradientGuard(params, accumulate_grads))


def capture_moe_layer(layer: nn.Module, sample_x: Tensor, num_warmup_iters: int = 3,
                      accumulate_grads: bool = False) -> nn.Module:
    """Capture ``layer``'s forward and backward in CUDA graphs; later calls replay them.

    ``sample_x``: an input of the shape, dtype and ``requires_grad`` every later call will use
    ([B, S, D] or [T, D]); its values do not matter. ``num_warmup_iters``: as `capture_modules`.
    Returns ``layer`` itself, whose ``forward`` now copies its input into the graph's input
    buffer and replays in training mode (in evaluation mode it runs eagerly); its output is the
    graph's output buffer (see the module docstring for what that implies). Autocast, when on at
    the capture, is part of the graph's forward (its dtype, cache off) whatever the state at later
    calls; the backward is captured without it, as a training loop calls backward outside autocast.
    ``accumulate_grads``: gradients are accumulated over several backwards (gradient
    accumulation) without clearing ``.grad`` between them (see the module docstring).
    """
    captured = capture_modules([layer], [(sample_x,)], num_warmup_iters, accumulate_grads, [layer.forward])
    layer.forward = captured.forward_of(0)
    return layer
