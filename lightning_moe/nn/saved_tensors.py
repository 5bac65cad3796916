"""Where the tensors saved for backward live: recomputation and pluggable storage policies.

Plain PyTorch, shared by the memory tools of this package:

- `checkpoint(fn, *args)`: ``torch.utils.checkpoint`` without reentrance; inside it `recomputing()`
  is True while the backward re-runs ``fn``, so code with side effects (routing counters, FP8 amax
  histories) can leave its state as the original forward left it.
- `OutputRecompute`: runs a cheap function (a norm, an activation) so that its *output*, which the
  following GEMM saves for backward, is not kept: every saved tensor that is that output, a view of
  it or a dtype cast of it (autocast's cast before a GEMM) is stored as a recipe and recomputed
  when the backward first needs it (Megatron-Core's recompute of ``layernorm`` and ``moe_act``).
- `SavedTensorPolicy` / `saved_tensor_policy`: a policy claims saved tensors and stores them as it
  likes (activation offload to host memory does). torch uses one pair of saved-tensor hooks at a
  time (the innermost), so every policy active at a point is consulted by one dispatcher:
  recompute policies first (a recipe costs nothing), then the others, innermost first; an
  unclaimed tensor is saved as usual.
- `memory_region(module, name)`: names a part of a module's forward that is no submodule (the
  experts' ``expert_fc1`` GEMM and ``moe_act`` activation), so that a tool can attach a context
  to it through `set_region_context`.

Inside a `checkpoint` region (its forward and its recomputation) and during any backward no policy
is installed: checkpointing discards those tensors anyway, and its recomputation must save exactly
what its forward saved.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor, nn

_IN_CHECKPOINT: contextvars.ContextVar[int] = contextvars.ContextVar("lightning_moe_in_checkpoint", default=0)
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_moe_recomputing", default=False)
_POLICIES: contextvars.ContextVar[tuple["SavedTensorPolicy", ...]] = contextvars.ContextVar(
    "lightning_moe_saved_tensor_policies", default=()
)


def recomputing() -> bool:
    """Whether the code now running is a `checkpoint` region's recomputation during backward."""
    return _RECOMPUTING.get()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _checkpoint_phase(recompute: bool) -> Iterator[None]:
    depth = _IN_CHECKPOINT.set(_IN_CHECKPOINT.get() + 1)
    flag = _RECOMPUTING.set(recompute or _RECOMPUTING.get())
    try:
        yield
    finally:
        _RECOMPUTING.reset(flag)
        _IN_CHECKPOINT.reset(depth)


def _checkpoint_contexts() -> tuple[ContextManager, ContextManager]:
    return _checkpoint_phase(False), _checkpoint_phase(True)


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` keeping only its inputs for backward, recomputed there
    (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: autocast state and RNG states
    restored, so the recomputation saves the same values). `recomputing()` is True meanwhile."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=_checkpoint_contexts, **kwargs)


def policies_allowed() -> bool:
    """Whether a saved-tensor policy may be installed here: not inside a `checkpoint` region,
    not during backward (a recomputation) and only while autograd records."""
    return _IN_CHECKPOINT.get() == 0 and not in_backward() and torch.is_grad_enabled()


class SavedTensorPolicy(abc.ABC):
    """Stores some of the tensors autograd saves for backward in its own way.

    `pack` returns a payload for a tensor it claims (None: not claimed); `unpack` turns that payload
    back into a tensor with the same values, shape, strides and dtype. ``recomputes``: consulted
    before policies that are not (a recipe costs no copy)."""

    recomputes: bool = False

    @abc.abstractmethod
    def pack(self, tensor: Tensor) -> Optional[Any]:
        """The payload for a tensor this policy claims, None for one it leaves to autograd."""

    @abc.abstractmethod
    def unpack(self, payload: Any) -> Tensor:
        """The tensor ``pack`` took, from its payload."""


class _Packed:
    __slots__ = ("policy", "payload")

    def __init__(self, policy: SavedTensorPolicy, payload: Any) -> None:
        self.policy, self.payload = policy, payload


def _dispatch_pack(policies: tuple[SavedTensorPolicy, ...]) -> Callable[[Tensor], Any]:
    ordered = [p for p in reversed(policies) if p.recomputes] + [p for p in reversed(policies) if not p.recomputes]

    def pack(tensor: Tensor) -> Any:
        for policy in ordered:
            payload = policy.pack(tensor)
            if payload is not None:
                return _Packed(policy, payload)
        return tensor

    return pack


def _dispatch_unpack(packed: Any) -> Tensor:
    if isinstance(packed, _Packed):
        return packed.policy.unpack(packed.payload)
    return packed


@contextlib.contextmanager
def saved_tensor_policy(policy: SavedTensorPolicy) -> Iterator[bool]:
    """Consult ``policy`` (with the policies already active) for the tensors saved inside the
    block. Yields whether it is installed (not where `policies_allowed` is False)."""
    if not policies_allowed():
        yield False
        return
    stack = _POLICIES.get() + (policy,)
    token = _POLICIES.set(stack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_dispatch_pack(stack), _dispatch_unpack):
            yield True
    finally:
        _POLICIES.reset(token)


# autograd nodes of views, layout changes and dtype casts (autocast's, a compute-weight cache's, a
# DTensor's local view): a tensor made from a parameter by a chain of them is a copy of a weight
_WEIGHT_PASS_THROUGH = frozenset({
    "ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
    "TransposeBackward0", "PermuteBackward0", "AliasBackward0", "SliceBackward0", "SelectBackward0",
    "ExpandBackward0", "CloneBackward0", "_ToTorchTensorBackward", "_MasterWeightCastBackward",
})


def parameter_derived(tensor: Tensor, depth: int = 4) -> bool:
    """Whether ``tensor`` is a parameter, or made from one by views, transposes and dtype casts
    (autocast's, a compute-weight cache's): such tensors live with the weights (or are re-gathered
    by FSDP), so storing them elsewhere frees nothing. An op computing from a parameter (an
    embedding lookup) makes an activation, not a weight copy."""
    if isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad):
        return True
    base = tensor._base
    if base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return True
    node = tensor.grad_fn
    for _ in range(depth):
        if node is None or type(node).__name__ not in _WEIGHT_PASS_THROUGH:
            return False
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if type(node).__name__ == "AccumulateGrad":
            return True
    return False


_PASS_THROUGH = ("ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")


class _Recipe:
    """One `OutputRecompute.run` call: ``fn``, its inputs, and what the backward needs of it.

    ``fn`` runs in the forward with its autograd graph recorded as usual (so the backward sums
    gradients in the plain run's order, bit for bit), but every tensor it saves for its own
    backward (`pack_inside`) and every consumer's saved copy of its output (`OutputRecompute.pack`)
    becomes a claim on this recipe. The first claim the backward unpacks runs ``fn`` once more on
    the same inputs under the forward's autocast state (`_recompute`), capturing the tensors it
    saves in the order the forward saved them, and its output; every claim is served from that one
    run (Megatron-Core's output-discarding checkpoint; torch's checkpoint would run ``fn`` a
    second time for its own saved tensors). What the run made is dropped once every claim has
    been unpacked. ``fn`` must be deterministic and draw no random numbers (a norm, an activation)."""

    __slots__ = ("fn", "args", "needs_grad", "autocast", "out_meta", "claims", "saved_count", "inside", "result",
                 "tensor_ptrs", "stored_ptrs")

    def __init__(self, fn: Callable[..., Tensor], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.needs_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        self.autocast: Optional[tuple] = None
        self.out_meta: Optional[tuple] = None
        self.claims = 0
        self.saved_count = 0  # tensors ``fn`` saved in the forward, claimed or not (their order)
        self.inside: Optional[dict[int, Tensor]] = None  # recomputed saved tensors by their index
        self.result: Optional[Tensor] = None
        self.tensor_ptrs = {_storage_ptr(a) for a in args if isinstance(a, Tensor)}
        self.stored_ptrs: set[Optional[int]] = set()  # inputs that a storage policy holds (`run`)

    def run(self, storage: tuple["SavedTensorPolicy", ...] = ()) -> Tensor:
        """``fn(*args)`` in the forward, its own saved tensors claimed (no policy inside it).

        ``storage``: the policies that are not recomputations, active where ``fn`` runs (an
        activation offload of this part). They store the inputs the recomputation keeps, as they
        would store what ``fn`` saves in a plain run (Megatron-Core offloads a recomputed
        activation's input): an input a policy claims is held as its payload, not on the device,
        and ``fn``'s own saved copies of it are served from the recomputation."""
        stored = None
        if storage:
            pack = _dispatch_pack(storage)
            stored = tuple(pack(a) if isinstance(a, Tensor) and not parameter_derived(a) else a for a in self.args)
            self.stored_ptrs = {_storage_ptr(a) for a, s in zip(self.args, stored) if isinstance(s, _Packed)}
        with _checkpoint_phase(False), torch.autograd.graph.saved_tensors_hooks(self.pack_inside, self.unpack_inside):
            out = self.fn(*self.args)
        if self.stored_ptrs:
            self.args = stored  # the device inputs are no longer held here
        device = out.device.type
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.out_meta = (out.shape, out.stride(), out.dtype)
        return out

    def pack_inside(self, tensor: Tensor) -> Any:
        index = self.saved_count
        self.saved_count += 1
        # An input or a weight is kept as it is: it lives on outside ``fn`` anyway (unless a storage
        # policy holds that input: then this copy is recomputed from the stored one).
        ptr = _storage_ptr(tensor)
        if (ptr in self.tensor_ptrs and ptr not in self.stored_ptrs) or parameter_derived(tensor):
            return tensor
        self.claims += 1
        return (self, index)

    @staticmethod
    def unpack_inside(payload: Any) -> Tensor:
        if isinstance(payload, Tensor):
            return payload
        recipe, index = payload
        return recipe._serve(lambda: recipe.inside.pop(index))

    def output_claim(self) -> None:
        self.claims += 1

    def output(self) -> Tensor:
        """The recomputed output, for a consumer's saved copy."""
        return self._serve(lambda: self.result)

    def _serve(self, take: Callable[[], Tensor]) -> Tensor:
        if self.inside is None:
            self._recompute()
        try:
            return take()
        finally:
            self.claims -= 1
            if self.claims <= 0:
                self.inside, self.result = None, None  # a second backward (retain_graph) runs it again

    def _recompute(self) -> None:
        device, enabled, dtype = self.autocast
        captured: list[Tensor] = []

        def capture(tensor: Tensor) -> None:
            captured.append(tensor.detach())

        def refuse(_: Any) -> Tensor:
            raise RuntimeError("OutputRecompute: the recomputation's own graph is never run backward")

        args = tuple(_dispatch_unpack(a) for a in self.args)  # stored inputs come back (each once per run)
        inputs = tuple(a.detach().requires_grad_(grad) if isinstance(a, Tensor) else a
                       for a, grad in zip(args, self.needs_grad))
        # Like the checkpoint's recomputation: `recomputing()` is True, so code with side effects (FP8
        # amax records, router token counts) leaves its state as the forward left it. Recorded (grad
        # on) only so that the ops save what they saved in the forward.
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled), _checkpoint_phase(True), \
                torch.autograd.graph.saved_tensors_hooks(capture, refuse):
            result = self.fn(*inputs)
        if (result.shape, result.stride(), result.dtype) != self.out_meta or len(captured) != self.saved_count:
            raise RuntimeError(
                f"OutputRecompute: the recomputation made a {tuple(result.shape)} {result.stride()} {result.dtype} "
                f"output and saved {len(captured)} tensors; the forward made {tuple(self.out_meta[0])} "
                f"{self.out_meta[1]} {self.out_meta[2]} and saved {self.saved_count}: the recomputed function "
                "must be deterministic."
            )
        self.inside = dict(enumerate(captured))
        self.result = result.detach()


class OutputRecompute(SavedTensorPolicy):
    """Recompute the outputs of `run` instead of keeping them for backward.

    Use as a context around the output's consumers::

        with OutputRecompute() as outputs:
            n_BSD = outputs.run(norm, x_BSD)   # the norm's own saved tensors: its input only
            y_BSD = attention(n_BSD)           # n_BSD (or its autocast copies) saved as a recipe

    A saved tensor is claimed where it shares ``n_BSD``'s storage (a view of it), or is a dtype
    cast of it or of a reshape of it (autocast's cast before a GEMM). Its unpack recomputes
    ``fn(*args)`` once under the forward's autocast state and rebuilds the view or the cast,
    which reproduces the saved values bit for bit for a deterministic ``fn``; the tensors ``fn``
    saves for its own backward come from that same run (`_Recipe`), so ``fn`` runs once per
    backward, and only its inputs are kept from the forward. ``enabled=False``, or
    where `policies_allowed` is False (inside a checkpointed region, during a recomputation),
    `run` just calls ``fn``.
    """

    recomputes = True

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._outputs: list[tuple[Tensor, _Recipe]] = []
        self._installed = False
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "OutputRecompute":
        self._stack = contextlib.ExitStack()
        if self.enabled:
            self._installed = self._stack.enter_context(saved_tensor_policy(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._outputs.clear()  # the recipes live on in the payloads that claimed them
        self._installed = False

    def run(self, fn: Callable[..., Tensor], *args: Any) -> Tensor:
        if not self._installed:
            return fn(*args)
        recipe = _Recipe(fn, args)
        out = recipe.run(tuple(p for p in _POLICIES.get() if not p.recomputes))
        self._outputs.append((out, recipe))
        return out

    def pack(self, tensor: Tensor) -> Optional[Any]:
        for out, recipe in self._outputs:
            rebuild = _rebuild_from(tensor, out)
            if rebuild is not None:
                recipe.output_claim()
                return recipe, rebuild
        return None

    def unpack(self, payload: Any) -> Tensor:
        recipe, rebuild = payload
        return rebuild(recipe.output())


def _storage_ptr(t: Tensor) -> Optional[int]:
    """The address of ``t``'s memory (a DTensor's: its local shard's); None where it has none."""
    local = getattr(t, "_local_tensor", t)
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor subclass without storage of its own
        return None


def _rebuild_from(tensor: Tensor, out: Tensor) -> Optional[Callable[[Tensor], Tensor]]:
    """How to make ``tensor`` from a recomputed ``out``; None where it is not made from it."""
    if tensor.device != out.device:
        return None
    ptr = _storage_ptr(tensor)
    if ptr is not None and ptr == _storage_ptr(out):
        same_layout = (tensor.shape, tensor.stride(), tensor.dtype) == (out.shape, out.stride(), out.dtype)
        if type(tensor) is not type(out) or (type(out) is not Tensor and not same_layout):
            return None  # a subclass (DTensor) is rebuilt only as the output itself
        local, local_out = getattr(tensor, "_local_tensor", tensor), getattr(out, "_local_tensor", out)
        if same_layout and local.storage_offset() == local_out.storage_offset():
            return lambda result: result
        if tensor.dtype != out.dtype:
            return None
        size, stride, offset, base_offset = tensor.shape, tensor.stride(), tensor.storage_offset(), out.storage_offset()
        return lambda result: result.as_strided(size, stride, result.storage_offset() + offset - base_offset)
    node = tensor.grad_fn
    if node is None or out.grad_fn is None or type(node).__name__ != "ToCopyBackward0":
        return None
    if tensor.numel() != out.numel() or not (tensor.is_contiguous() and out.is_contiguous()):
        return None
    target = out.grad_fn
    for _ in range(3):
        inputs = [fn for fn, _ in node.next_functions if fn is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
        if node is target:
            shape, dtype = tensor.shape, tensor.dtype
            return lambda result: result.reshape(shape).to(dtype)
        if type(node).__name__ not in _PASS_THROUGH:
            return None
    return None


_REGION_CONTEXTS = "_lightning_moe_region_contexts"


def set_region_context(module: nn.Module, name: str, factory: Optional[Callable[[], ContextManager]]) -> None:
    """Enter ``factory()`` around the `memory_region` ``name`` of ``module`` (None removes it)."""
    contexts = module.__dict__.setdefault(_REGION_CONTEXTS, {})
    if factory is None:
        contexts.pop(name, None)
    else:
        contexts[name] = factory


def memory_region(module: nn.Module, name: str) -> ContextManager:
    """The context a tool attached to ``module``'s region ``name`` (`set_region_context`), or a
    null context."""
    factory = module.__dict__.get(_REGION_CONTEXTS, {}).get(name)
    return contextlib.nullcontext() if factory is None else factory()
