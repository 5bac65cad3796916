"""A whole `MoELayer` (forward and backward) captured in CUDA graphs.

Fine-grained MoE blocks launch many small kernels: at the qwen3_30b_a3b shape the FP8 block's
host issues its forward more slowly than the GPU runs it, so a step started on an idle GPU waits
for the host. `capture_moe_layer` records the layer's forward and backward once each with
`torch.cuda.make_graphed_callables`; every later call replays two graphs, one launch each.

That is possible because the layer never reads a device value on the host: routing, the
permutation plan, the expert groups' padding and the FP8 casts are all sized by static shapes.
What does read one is refused with the fix named: the all-to-all dispatcher's dropless path
(its split sizes are host integers), FSDP-sharded submodules (their all-gathers run from hooks).

What a graph freezes, and so what the caller must keep fixed after the capture:
- the input's shape and dtype, and which inputs require gradients;
- the parameters themselves (in-place optimizer updates are fine; replacing a parameter is not);
- host-side choices made at capture: autocast on or off for the forward (the graph's forward
  keeps that state whatever the state at later calls; the backward is captured without autocast,
  as a training loop calls backward outside it), FP8 amax recording on (training), the recipe,
  the dispatcher. A delayed-scaling state must have had one `update_delayed_scaling`
  before the capture (a state without scales casts with an extra amax pass, which the graph would
  keep forever), and that update keeps running outside the graph, in place, once per step.
- the capture itself leaves no trace: the layer's buffers (FP8 amax histories and scales) hold
  afterwards what they held before it, and ``.grad`` is untouched.
- no autograd graph of an earlier step alive at the capture (a kept loss or output): its leaves'
  AccumulateGrad nodes would tie the captured backward to the stream that step ran on (an error
  that says so is raised).
- one micro-batch in flight: the outputs and the tensors saved for backward live in the graph's
  memory, so the next forward overwrites them. Run each forward's backward before the next
  forward (no pipelining of several micro-batches through one captured layer).

Gradients: the backward graph writes every parameter's gradient into a buffer of its own, and
autograd hands that buffer to ``.grad`` when ``.grad`` is None (no copy). The next replay would
then overwrite ``.grad`` before adding to it. So a parameter whose ``.grad`` still holds such a
buffer at the next backward raises, unless ``accumulate_grads=True``, which copies the gradient
out of the graph's buffer at the first backward after ``.grad`` was cleared (one copy of every
gradient per accumulation window; later micro-batches add in place). An input that is a leaf
tensor gets the graph's buffer as its ``.grad`` likewise; clear it before the next backward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from lightning_moe._capture import collector_held_off
from lightning_moe.nn.compute_weights import uncached_weights


def _check_capturable(layer: nn.Module, sample_x: Tensor) -> None:
    """Raise, naming the fix, for what a CUDA graph of ``layer`` could not replay correctly."""
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise ValueError(
            "capture_moe_layer under autocast needs its weight cache off: capture inside "
            "torch.autocast('cuda', dtype=..., cache_enabled=False)"
        )
    if getattr(getattr(layer, "dispatcher", None), "syncs_host", False):
        raise ValueError(
            f"{type(layer.dispatcher).__name__} reads its split sizes on the host (dropless all-to-all), "
            "which a CUDA graph cannot replay: set MoEConfig(expert_capacity_factor=..., "
            "pad_expert_input_to_capacity=True) or use the all-gather dispatcher"
        )
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in layer.modules()):
        raise ValueError("capture_moe_layer cannot capture FSDP-sharded modules (their all-gathers run "
                         "from hooks); capture a layer without expert or dense sharding")
    if not layer.training:
        raise ValueError("capture_moe_layer captures a training step (forward and backward): call layer.train()")
    _check_fp8_state(layer)
    if not sample_x.is_cuda or any(not p.is_cuda for p in layer.parameters()):
        raise ValueError("capture_moe_layer needs the layer and its input on a CUDA device")


def _check_fp8_state(layer: nn.Module) -> None:
    """FP8 delayed scaling: the scales must exist (see the module docstring) and amaxes be recorded."""
    from lightning_moe.precision.delayed import delayed_state, recording_amax
    from lightning_moe.precision.modules import fp8_modules

    modules = fp8_modules(layer)
    if not modules:
        return
    if not recording_amax():
        raise ValueError("capture_moe_layer with amax recording paused would freeze an evaluation step: "
                         "capture outside amax_recording_paused()")
    for module in modules:
        state = delayed_state(module)
        if state is None or state.fresh:
            raise ValueError(
                f"{type(module).__name__} has no delayed-scaling scales yet: run one training step and "
                "update_delayed_scaling (what FP8Precision does at each optimizer step) before capturing"
            )


def _guard_gradient(param: nn.Parameter, accumulate_grads: bool) -> None:
    """Keep ``param.grad`` from aliasing the backward graph's gradient buffer (module docstring)."""

    def hook(grad: Tensor) -> Tensor:
        current = param.grad
        if current is None:
            return grad.clone() if accumulate_grads else grad
        if current.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
            raise RuntimeError(
                "a captured MoE layer's backward ran while .grad still held the previous backward's gradient "
                "(the graph's buffer, just overwritten): clear gradients between backwards "
                "(optimizer.zero_grad(set_to_none=True)) or capture with accumulate_grads=True"
            )
        return grad

    param.register_hook(hook)


class _ForwardUnderAutocast(nn.Module):
    """``layer``'s own forward inside the autocast state of the capture, so that the capture can
    run with autocast off around it: torch captures the backward under the caller's thread-local
    state, and autocast on there would run the backward's matmuls in bf16 too (the router's fp32
    products, among others), unlike a training loop, which calls backward outside autocast."""

    def __init__(self, layer: nn.Module, forward, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer  # registers the parameters make_graphed_callables takes gradients for
        self._layer_forward = forward  # the unwrapped bound method: ``layer(x)`` would recurse
        self._dtype = dtype

    @property
    def training(self) -> bool:
        # make_graphed_callables replays only in the mode of the capture: the layer's mode decides.
        layer = self._modules.get("layer") if "_modules" in self.__dict__ else None
        return True if layer is None else layer.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # follows the layer (nn.Module.__init__ and train() set it)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cuda", dtype=self._dtype, cache_enabled=False):
            return self._layer_forward(x)


def _capture(layer: nn.Module, sample_x: Tensor, num_warmup_iters: int) -> nn.Module:
    """`torch.cuda.make_graphed_callables` on ``layer``, the backward captured without autocast
    (`_ForwardUnderAutocast`), with its most common failure explained. When the backward's
    capture fails, torch leaves its capture stream current (``torch.cuda.graph``'s exit raises
    before restoring it): the caller's stream is put back before raising."""
    stream = torch.cuda.current_stream()
    autocast = torch.is_autocast_enabled("cuda")
    target = _ForwardUnderAutocast(layer, layer.forward, torch.get_autocast_dtype("cuda")) if autocast else layer
    try:
        # An earlier captured layer may be garbage (a reference cycle): no collection mid-capture.
        with torch.autocast("cuda", enabled=False) if autocast else contextlib.nullcontext(), collector_held_off():
            graphed = torch.cuda.make_graphed_callables(target, (sample_x,), num_warmup_iters=num_warmup_iters)
        layer.forward = graphed.forward  # replays in training mode, else the (wrapped) eager forward
        return layer
    except RuntimeError as error:  # torch.AcceleratorError is a RuntimeError
        torch.cuda.set_stream(stream)
        if "captur" not in str(error):
            raise
        raise RuntimeError(
            "capturing the MoE layer's backward failed. The usual cause: an autograd graph of an earlier "
            "eager step is still alive (a loss or an output kept in a variable), so the leaves' AccumulateGrad "
            "nodes stay tied to the stream that step ran on, which the capture cannot wait on. Drop those "
            "references (del loss, output) before capture_moe_layer, or run the eager steps on a side stream. "
            f"CUDA said: {error}" + (f" (after: {error.__context__})" if error.__context__ else "")
        ) from error


def capture_moe_layer(layer: nn.Module, sample_x: Tensor, num_warmup_iters: int = 3,
                      accumulate_grads: bool = False) -> nn.Module:
    """Capture ``layer``'s forward and backward in CUDA graphs; later calls replay them.

    ``sample_x``: an input of the shape, dtype and ``requires_grad`` every later call will use
    ([B, S, D] or [T, D]); its values do not matter. ``num_warmup_iters``: eager forward and
    backward passes on a side stream before the capture, as `torch.cuda.make_graphed_callables`
    needs (they record FP8 amaxes like any training step, and leave ``.grad`` untouched).
    Returns ``layer`` itself, whose ``forward`` now copies its input into the graph's input
    buffer and replays; its output is the graph's output buffer (see the module docstring for
    what that implies). Autocast, when on at the capture, is part of the graph's forward (its
    dtype, cache off) whatever the state at later calls; the backward is captured without it, as
    a training loop calls backward outside autocast.
    ``accumulate_grads``: gradients are accumulated over several backwards (gradient
    accumulation) without clearing ``.grad`` between them (see the module docstring).
    """
    _check_capturable(layer, sample_x)
    # The warm-up passes run the backward on uninitialized output gradients (torch's choice), so
    # they would record garbage FP8 amaxes (and count tokens into any counting buffer): every
    # buffer gets its values from before the capture back, in place (the graphs keep its address).
    buffers = list(layer.buffers())
    with torch.no_grad():
        before = [b.clone() for b in buffers]
    try:
        # The graphs cast the weights themselves at every replay: a weight cast kept outside them
        # (an active ComputeWeightCache) would freeze the weights of the capture.
        with uncached_weights():
            graphed = _capture(layer, sample_x, num_warmup_iters)
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                buffer.copy_(value)
    for param in layer.parameters():
        _guard_gradient(param, accumulate_grads)
    return graphed
