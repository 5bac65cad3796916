"""Triton launches without the JIT's per-call argument binding, for repeated calls; and
`on_launch_stream`, which runs the enclosed launches on a side stream.

``kernel[grid](*args)`` binds every argument to the kernel's signature, computes Triton's
specialization of each (dtype, 16-byte alignment of pointers, divisibility of integers), builds
a cache key from them and only then launches. For kernels of ~20 arguments that took 25 us per
launch in a tight loop on the H200 machine's host and 50-75 us inside an MoE layer's step
(``benchmarks/launch_overhead.py``), more than the GPU time of many of these memory-bound kernels;
an FP8 MoE layer makes ~30 such launches per training step.

`launch` keys each call on what can change Triton's choice of compiled kernel, conservatively:

- every tensor argument by dtype and 16-byte alignment of its address (all Triton specializes a
  pointer on);
- every integer of a runtime parameter by what Triton specializes it on: equal to 1, divisible
  by 16, and the range that picks its type (i32, u32, i64, u64), so row counts that change from
  step to step still find the kept kernel;
- every constexpr, bool, float, None, string or dtype argument and every option (``num_warps``...)
  exactly;
- the kernel's and Triton's compilation settings (``debug``, instrumentation mode).

The first call with a new key goes through ``kernel[grid]``, which compiles or finds the kernel
Triton would run, and that compiled kernel is kept for the key; later calls with the same key
launch it directly with the arguments in signature order, as ``JITFunction.run`` does after its
lookup. The launch honours Triton's launch hooks (profilers). Triton's check that the globals a
kernel reads have not changed since it was compiled is not repeated: ours read constants only.

The direct launch relies on how Triton's compiled kernels take their arguments, which is not a
public API: it runs only on the Triton versions it was tested with (`TESTED_TRITON_VERSIONS`; the GPU
tests compare layer steps with and without it bit for bit). Every call takes the plain
``kernel[grid](...)`` path on other Triton versions, under Triton's interpreter
(``TRITON_INTERPRET=1``), with ``LIGHTNING_MOE_FAST_TRITON_LAUNCH=0`` (the escape hatch should a
tested Triton still misbehave), while ``torch.compile`` traces, for a grid given as a callable, for a kernel with pre-run hooks, for an argument of
another kind (a tuple, a tensor wrapper), or when the compiled kernel lacks the launcher this
relies on (another Triton version).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

_MAX_ENTRIES = 4096  # keys kept; beyond that (say, ever new constexpr values) start over

_cache: dict[tuple, Optional["_CompiledLaunch"]] = {}
# id(kernel) -> (kernel, signature): the reference keeps the id from being reused while keyed.
_signatures: dict[int, tuple[Any, Optional[list[tuple[str, Any, bool]]], tuple[bool, ...]]] = {}


# Triton releases (major.minor) whose compiled-kernel launcher `launch` was checked against.
TESTED_TRITON_VERSIONS: tuple[str, ...] = ("3.5", "3.6")


@functools.lru_cache(maxsize=None)
def triton_version_tested() -> bool:
    """Whether the installed Triton is one of `TESTED_TRITON_VERSIONS` (checked once)."""
    import triton

    return ".".join(triton.__version__.split(".")[:2]) in TESTED_TRITON_VERSIONS


def fast_launch_enabled() -> bool:
    """Whether `launch` may skip the JIT's binding (read at every call, so tests can flip it)."""
    return (os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and os.environ.get("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "1") != "0"
            and triton_version_tested())


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream's handle (what Triton launches on)."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


@functools.lru_cache(maxsize=None)
def _knobs() -> Any:
    """Triton's runtime settings module (None for a Triton without it), imported once."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


def _launch_hooks() -> tuple[Optional[Callable], Optional[Callable]]:
    """Triton's launch enter / exit hooks (set by profilers such as proton), or None."""
    knobs = _knobs()
    if knobs is None:  # a Triton without knobs has no hooks to honour
        return None, None
    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _compilation_state(kernel: Any) -> tuple:
    """The kernel's and Triton's settings that ``JITFunction.run`` folds into its options."""
    knobs = _knobs()
    if knobs is None:
        return (getattr(kernel, "debug", None),)
    return (getattr(kernel, "debug", None), knobs.runtime.debug,
            getattr(knobs.compilation, "instrumentation_mode", None))


def _active(hook: Optional[Callable]) -> Optional[Callable]:
    """``hook``, or None when it calls nothing: Triton 3.6 keeps its launch hooks as ``HookChain``
    objects that are never None, an empty chain calling nothing."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


class _Unkeyable(Exception):
    """An argument of a kind `launch` does not key: the call takes the plain path."""


_EXACT = (bool, str, type(None), torch.dtype)


def _int_class(value: int) -> tuple:
    """What Triton specializes an integer argument on: ``== 1``, divisibility by 16, and the
    range that picks its type (i32, u32, i64, u64)."""
    if -2**31 <= value < 2**31:
        width = 0
    elif 0 <= value < 2**32:
        width = 1
    elif -2**63 <= value < 2**63:
        width = 2
    else:
        width = 3
    return int, value == 1, value % 16 == 0, width


def _arg_key(value: Any, exact: bool) -> Any:
    """What of ``value`` can change Triton's compiled kernel: a tensor's dtype and 16-byte
    alignment; an integer's specialization (its value when ``exact``: constexprs, options);
    type and value for other scalars (``True`` and ``1`` compile differently; a float by its
    bits, so NaN keys equal). Raises `_Unkeyable` for anything else."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    kind = type(value)
    if kind.__name__ == "TensorDescriptor" and kind.__module__ == "triton.tools.tensor_descriptor":
        # A host-side TMA descriptor (not Gluon's, which also specializes on a layout): the
        # launcher builds the hardware descriptor from it at every launch; the kernel is
        # specialized on its base's dtype and its box. Keyed more strictly: also the base's
        # alignment, every size and stride as an integer argument, the padding and rounding.
        return (kind, value.base.dtype, value.base.data_ptr() % 16 == 0, tuple(value.block_shape),
                tuple(_int_class(int(v)) for v in (*value.shape, *value.strides)),
                getattr(value, "padding", "zero"), getattr(value, "round_f32_to_tf32", False))
    if kind is int:
        return (int, value) if exact else _int_class(value)
    if kind is float:
        return float, value.hex()
    if isinstance(value, _EXACT) or kind.__module__.startswith("triton"):  # triton dtypes, constexpr
        try:
            hash(value)
        except TypeError:
            raise _Unkeyable from None
        return kind, value
    raise _Unkeyable


def _described(kernel: Any) -> tuple[Optional[list[tuple[str, Any, bool]]], tuple[bool, ...]]:
    """``(name, default, is_constexpr)`` of every parameter of ``kernel``'s Python function, in
    order (``inspect.Parameter.empty``: no default; every parameter counts as a constexpr, keyed
    exactly, when the kernel does not say), None if it has no plain signature; and the
    constexpr flags as a tuple (for `_call_key`). Worked out at the first call and kept."""
    entry = _signatures.get(id(kernel))
    if entry is None:
        try:
            parameters = list(inspect.signature(kernel.fn).parameters.values())
        except (AttributeError, TypeError, ValueError):
            entry = (kernel, None, ())
        else:
            plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
            declared = getattr(kernel, "params", None)
            if declared is not None and len(declared) == len(parameters):
                constexpr = [bool(getattr(d, "is_constexpr", True)) for d in declared]
            else:
                constexpr = [True] * len(parameters)
            described = [(p.name, p.default, c) for p, c in zip(parameters, constexpr)]
            entry = (kernel, described, tuple(constexpr)) if plain else (kernel, None, ())
        _signatures[id(kernel)] = entry
    return entry[1], entry[2]


_Tensor = torch.Tensor
_PLAIN_EXACT = frozenset((bool, int, str, type(None)))  # keyed by value and type as they are


def _call_key(args: tuple, constexpr: tuple[bool, ...], kwargs: dict) -> tuple:
    """The key of a call (see the module docstring), as `_arg_key` would make it, written out
    for the common kinds because it runs at every launch:

    - a tensor adds its dtype and alignment as two entries of their own (only a tensor adds a
      bare dtype, always followed by its alignment; every other kind adds one tuple);
    - a runtime integer in int32's range adds ``(== 1, divisible by 16)`` (other integers take
      `_int_class`, whose tuples start with ``int``);
    - keyword arguments that are all bools, ints, strings or None are keyed by their items and
      their types (``True`` and ``1`` compile differently), others one by one.
    """
    key: list = []
    add = key.append
    for value, exact in zip(args, constexpr):
        kind = type(value)
        if kind is int and not exact and -2**31 <= value < 2**31:
            add((value == 1, value % 16 == 0))
        elif kind is _Tensor or isinstance(value, _Tensor):
            add(value.dtype)
            add(value.data_ptr() % 16 == 0)
        else:
            add(_arg_key(value, exact))
    types = tuple(map(type, kwargs.values()))
    if _PLAIN_EXACT.issuperset(types):
        named: tuple = ("plain", tuple(kwargs.items()), types)
    else:
        named = ("keyed", *((name, _arg_key(value, True)) for name, value in kwargs.items()))
    return tuple(key), named


class _CompiledLaunch:
    """A compiled kernel and how to lay out a call's arguments for its launcher."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled: Any, tail: list[tuple[str, Any]]) -> None:
        self.compiled = compiled
        self.tail = tail  # the parameters after the positional arguments: (name, default), in order

    @classmethod
    def of(cls, compiled: Any, signature: list[tuple[str, Any, bool]], args: tuple,
           kwargs: dict) -> Optional["_CompiledLaunch"]:
        """None unless ``compiled`` has the launcher `__call__` uses and every parameter gets a
        value (then such calls keep the plain path)."""
        needed = ("run", "function", "packed_metadata", "launch_metadata")
        if not all(hasattr(compiled, name) for name in needed):
            return None
        tail = [(name, default) for name, default, _ in signature[len(args):]]
        if any(name not in kwargs and default is inspect.Parameter.empty for name, default in tail):
            return None
        return cls(compiled, tail)

    def __call__(self, grid: tuple, args: tuple, kwargs: dict, stream: int) -> None:
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        if grid_0 * grid_1 * grid_2 == 0:  # nothing to run (a call that only compiles and loads)
            return
        values = list(args)
        for name, default in self.tail:
            values.append(kwargs[name] if name in kwargs else default)
        compiled = self.compiled
        enter, exit_ = _launch_hooks()
        enter, exit_ = _active(enter), _active(exit_)
        # The metadata is only the hooks' argument: without a hook it is never read (the launcher
        # skips None hooks), so neither it nor the hooks' calls are made.
        metadata = None if enter is None and exit_ is None else compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, exit_, *values)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function whose every host call goes
    through its JIT wrapper (about 5 us, several per launch)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (0 for 0, like Triton's), without its wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, skipping the JIT's binding when an earlier call had
    the same key (see the module docstring). ``grid``: a tuple of 1-3 ints."""
    # Under torch.compile the plain launch is what dynamo knows how to trace.
    if not fast_launch_enabled() or callable(grid) or torch.compiler.is_compiling():
        kernel[grid](*args, **kwargs)
        return
    signature, constexpr = _described(kernel)
    if signature is None or getattr(kernel, "pre_run_hooks", None) or len(args) > len(signature):
        kernel[grid](*args, **kwargs)
        return
    device, stream = _device_and_stream()
    try:
        key = (id(kernel), device, _compilation_state(kernel), *_call_key(args, constexpr, kwargs))
    except _Unkeyable:
        kernel[grid](*args, **kwargs)
        return
    entry = _cache.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **kwargs)
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        _cache[key] = _CompiledLaunch.of(compiled, signature, args, kwargs)
    elif entry is None:
        kernel[grid](*args, **kwargs)
    else:
        entry(grid, args, kwargs, stream)


def clear_launch_cache() -> None:
    """Forget every kept kernel (the next call of each key takes ``kernel[grid]`` again)."""
    _cache.clear()


@contextlib.contextmanager
def on_launch_stream(stream: Optional[torch.cuda.Stream], *used: Optional[torch.Tensor]) -> Iterator[None]:
    """Launch the enclosed kernels on ``stream`` (None: the current one), after the current
    stream's work so far (the outputs were just allocated there, possibly in memory it freed).
    ``used``: the tensors those kernels read or write (None entries skipped). Their memory
    belongs to the current stream's pool; each is marked as used on ``stream``, so the
    allocator hands it out again only after ``stream`` is done with it, even if the caller
    drops it first (a temporary such as the group offsets)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in used:
        if t is not None:
            t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield
