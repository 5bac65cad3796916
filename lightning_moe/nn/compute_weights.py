"""Weights in the GEMMs' dtype: fp32 master weights cast for bf16 products, once per optimizer step.

Mixed-precision training keeps fp32 parameters (the optimizer's main weights) and multiplies in
bf16. Autocast casts every weight in every forward, so gradient accumulation over N micro-batches
casts the whole model N times between two optimizer steps whose weights do not change.
`ComputeWeightCache` keeps each weight's cast while it is active, so the N micro-batches of one
optimizer step share one cast, as Megatron-Core's optimizer makes the bf16 model weights once per
step from its fp32 main weights:

    cache = ComputeWeightCache()
    for step in range(steps):
        for micro_batch in window:
            with cache.active(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(micro_batch)
            loss.backward()
        optimizer.step()
        cache.clear()  # after every update of the weights

``MegatronMoEStrategy`` does this around the training steps it runs. Every micro-batch's graph
runs through the same cast node, whose backward keeps nothing, so each backward widens its own
gradient into the fp32 ``.grad`` as before: the gradients are the same bits as with a cast per
micro-batch. A weight changed in place (its version moved) is cast again; the cache only serves
autograd-recorded leaves (no-grad evaluation casts as before).

``ComputeWeightCache(accumulate_grads_in_place=True)`` goes one step further, as Megatron-Core's
gradient-accumulation fusion does: once a parameter has a ``.grad``, the cast's backward adds the
bf16 gradient into it in one pass (read 2 + 4 bytes, write 4, per element) instead of widening it
to a new fp32 tensor that autograd's ``AccumulateGrad`` then adds (read 2, write 4, then read 8,
write 4). The same bits; autograd then carries no gradient to the parameter, so a parameter
with a ``register_hook`` hook (which must see every gradient) keeps autograd's accumulation;
``register_post_accumulate_grad_hook`` hooks run either way and see the updated ``.grad``. One
case it cannot tell apart: ``torch.autograd.grad(loss, inputs=[param])`` through a cached cast
while the parameter already has a ``.grad`` adds into that ``.grad`` and returns None for it; take
such gradients (a gradient penalty, say) with ``accumulate_grads_in_place=False``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.kernels import accumulate_widened_, use_triton, widened

_active: Optional["ComputeWeightCache"] = None


class ComputeWeightCache:
    """The compute-dtype copies of master weights made while `active`, kept until `clear`."""

    def __init__(self, accumulate_grads_in_place: bool = False) -> None:
        """``accumulate_grads_in_place``: the casts' backward adds each bf16 weight gradient into
        the parameter's existing fp32 ``.grad`` itself, bypassing ``AccumulateGrad`` (module
        docstring). Applies to fp32 -> bf16 casts of a parameter or of a contiguous view of all of it."""
        self.accumulate_grads_in_place = accumulate_grads_in_place
        # (id(parameter), shape, dtype) -> (parameter, its version at the cast, the cast)
        self._casts: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[Tensor, int, Tensor]] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator["ComputeWeightCache"]:
        """`compute_weight` serves and records casts in this cache inside the block."""
        global _active
        previous, _active = _active, self
        try:
            yield self
        finally:
            _active = previous

    def clear(self) -> None:
        """Forget every cast (after an optimizer step: the next forward casts the new weights)."""
        self._casts.clear()

    def __len__(self) -> int:
        return len(self._casts)

    def cast(self, w: Tensor, dtype: torch.dtype, source: Tensor) -> Tensor:
        """``w`` (``source`` or derived from it) in ``dtype``: kept from an earlier call while
        ``source`` is the same tensor in the same version."""
        key = (id(source), tuple(w.shape), dtype)
        kept = self._casts.get(key)
        if kept is not None and kept[0] is source and kept[1] == source._version:
            return kept[2]
        into = source if self.accumulate_grads_in_place and _covers(w, source) else None
        copy = _cast(w, dtype, accumulate_into=into)
        self._casts[key] = (source, source._version, copy)
        return copy


@contextlib.contextmanager
def uncached_weights() -> Iterator[None]:
    """No `ComputeWeightCache` serves inside the block (CUDA-graph capture: the graph must cast the
    weights it replays with)."""
    global _active
    previous, _active = _active, None
    try:
        yield
    finally:
        _active = previous


class _MasterWeightCast(torch.autograd.Function):
    """fp32 master weight -> bf16 for the GEMM; the bf16 gradient widened back by
    `kernels.widened` (torch's bf16 -> fp32 copy runs at about half the bandwidth). The same
    values as ``w.to(torch.bfloat16)`` and its autograd for a defined gradient (None stays None);
    first order only, as the GEMMs that consume it. Its backward keeps no tensors, so several
    backward passes may run through one node (`ComputeWeightCache`).

    ``accumulate_into``: a parameter that ``w`` covers element for element (`_covers`); while it
    has an fp32 ``.grad``, the backward adds the gradient there (`kernels.accumulate_widened_`)
    and hands autograd none."""

    @staticmethod
    def forward(ctx, w_fp32: Tensor, accumulate_into: tuple[Optional[Tensor]] = (None,)) -> Tensor:
        ctx.set_materialize_grads(False)  # no gradient must stay None, not become fp32 zeros
        # In a tuple, so that autograd does not take the parameter for a second input (an edge to
        # its AccumulateGrad); a reference, not a saved tensor, so the node stays reusable.
        (ctx.accumulate_into,) = accumulate_into
        return w_fp32.to(torch.bfloat16)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_bf16: Optional[Tensor]) -> tuple[Optional[Tensor], None]:
        if grad_bf16 is None:
            return None, None
        main_grad = accumulation_grad(ctx.accumulate_into, grad_bf16.numel())
        if main_grad is not None:
            accumulate_widened_(main_grad, grad_bf16.contiguous())
            return None, None
        return widened(grad_bf16, torch.float32), None


def accumulation_grad(param: Optional[Tensor], numel: int) -> Optional[Tensor]:
    """The fp32 ``.grad`` of ``param`` that a backward may add a gradient of ``numel`` elements into
    itself, handing autograd none (Megatron-Core's gradient-accumulation fusion), or None: ``param``
    is None, has ``register_hook`` hooks (they must see every gradient), has no ``.grad`` yet (the
    first micro-batch of a window: autograd takes the fresh gradient as it is), or a ``.grad`` that
    is not a plain contiguous fp32 tensor of ``numel`` elements. The one test of `_MasterWeightCast`
    and of the FP8 GEMMs' weight gradients (which the precision package runs)."""
    main_grad = None if param is None or _has_gradient_hooks(param) else param.grad
    if (main_grad is not None and type(main_grad) is Tensor and main_grad.dtype == torch.float32
            and main_grad.is_contiguous() and main_grad.numel() == numel):
        return main_grad
    return None


def in_place_accumulation_target(w: Tensor) -> Optional[Tensor]:
    """The parameter into whose fp32 ``.grad`` a GEMM's backward may add ``w``'s gradient itself
    (then checked per backward by `accumulation_grad`), or None. Decided in the forward, as
    `ComputeWeightCache.cast` decides for the bf16 casts, and under the same switch: a
    `ComputeWeightCache` with ``accumulate_grads_in_place`` active (``MegatronMoEStrategy``'s
    training steps), grad mode on, and ``w`` an fp32 leaf that requires grad, or a contiguous view
    of all of one in the same element order (`_covers`: the grouped experts' ``fc1_matrix``).
    Tensor subclasses (DTensor shards) are not taken. Used by GEMMs that produce the weight gradient
    themselves (the FP8 ones) instead of a cast node."""
    if (_active is None or not _active.accumulate_grads_in_place or not torch.is_grad_enabled()
            or type(w.data) is not Tensor):
        return None
    param = w if w.is_leaf else w._base
    if param is None or not param.is_leaf or not param.requires_grad or param.dtype != torch.float32:
        return None
    return param if _covers(w, param) else None


def _has_gradient_hooks(param: Tensor) -> bool:
    """Whether ``param.register_hook`` hooks are registered (they must receive every micro-batch's
    gradient, so the accumulation stays autograd's). Tensor keeps them in ``_backward_hooks``;
    where a torch version does not, no parameter is taken to have hooks."""
    return bool(getattr(param, "_backward_hooks", None))


def _covers(w: Tensor, param: Tensor) -> bool:
    """``w`` is ``param`` or a contiguous view of all of it in the same element order."""
    if w is param:
        return True
    return (type(w) is Tensor and type(param.data) is Tensor and w.is_contiguous() and param.is_contiguous()
            and w.numel() == param.numel() and w.data_ptr() == param.data_ptr())


def _cast(w: Tensor, dtype: torch.dtype, accumulate_into: Optional[Tensor] = None) -> Tensor:
    # Our widening kernel takes plain CUDA tensors; tensor subclasses (DTensor weights under tensor
    # parallelism) take their own ``to``. In-place accumulation runs on any device (a torch add
    # off the GPU), so that CPU runs take the same path.
    if (w.dtype == torch.float32 and dtype == torch.bfloat16 and type(w.data) is Tensor
            and (use_triton(w) or accumulate_into is not None)):
        return _MasterWeightCast.apply(w, (accumulate_into,))
    return w.to(dtype)


def compute_weight(w: Tensor, dtype: torch.dtype, source: Optional[Tensor] = None) -> Tensor:
    """``w`` in the GEMM's ``dtype`` (autograd-tracked): from the active `ComputeWeightCache` for a
    weight that autograd records, else cast now. An fp32 master weight going to bf16 on CUDA
    with Triton (bf16-mixed training) takes `_MasterWeightCast`; everything else ``w.to``. Tensor
    subclasses (DTensor) are cast as they are.

    ``source``: the parameter ``w`` was derived from (a view of it, a DTensor's local shard) by
    operations whose backward keeps no tensors, so that every micro-batch's backward can run
    through them; the cache keys and checks its entry on it. Default: ``w`` itself, cached only if
    it is a leaf."""
    if w.dtype == dtype:
        return w
    source = w if source is None else source
    if _active is not None and source.is_leaf and source.requires_grad and torch.is_grad_enabled():
        return _active.cast(w, dtype, source)
    if w.requires_grad and torch.is_grad_enabled():
        return _cast(w, dtype)
    return w.to(dtype)


def autocast_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear on ``x`` multiplies in: autocast's for ``x``'s device when it is on (the
    cast `compute_weight` makes in its place), else ``x``'s own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class CachedCastLinear(nn.Linear):
    """``nn.Linear`` whose weight reaches the product through `compute_weight`: under autocast the
    same values as autocast's own cast, made once per optimizer step while a `ComputeWeightCache`
    is active. The same module as ``nn.Linear`` otherwise (FP8 conversion treats it as one)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, compute_weight(self.weight, autocast_dtype(x)), self.bias)
