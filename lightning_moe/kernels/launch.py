"""Triton launches without the JIT's per-call argument binding, for repeated calls.

``kernel[grid](*args)`` binds every argument to the kernel's signature, computes Triton's
specialization of each (dtype, 16-byte alignment of pointers, divisibility of integers), builds
a cache key from them and only then launches. For kernels of ~20 arguments that took 25 us per
launch in a tight loop on the H200 machine's host and 50-75 us inside an MoE layer's step
(``benchmarks/launch_overhead.py``), more than the GPU time of many of these memory-bound kernels;
an FP8 MoE layer makes ~30 such launches per training step.

`launch` keys each call on what can change Triton's choice of compiled kernel, conservatively:
every tensor argument by dtype and 16-byte alignment of its address (all Triton specializes a
pointer on), every other argument and option by its exact type and value (integers, bools,
constexprs, ``num_warps``...). The first call with a new key goes through ``kernel[grid]``, which
compiles or finds the kernel Triton would run, and that compiled kernel is kept for the key;
later calls with the same key launch it directly with the arguments in signature order, as
``JITFunction.run`` does after its lookup. A key never maps to a kernel compiled for different
specializations, since everything Triton specializes on is in the key (integers exactly, a
superset of their divisibility). The launch honours Triton's launch hooks (profilers).

Under Triton's interpreter (``TRITON_INTERPRET=1``), with ``LIGHTNING_MOE_FAST_TRITON_LAUNCH=0``,
for a grid given as a callable, or when the compiled kernel lacks the launcher this relies on
(another Triton version), every call takes the plain ``kernel[grid](...)`` path.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import torch

_MAX_ENTRIES = 4096  # distinct (kernel, argument) keys kept; shapes that vary a lot start over

_cache: dict[tuple, Optional["_CompiledLaunch"]] = {}
_signatures: dict[Any, Optional[list[tuple[str, Any]]]] = {}


def fast_launch_enabled() -> bool:
    """Whether `launch` may skip the JIT's binding (read at every call, so tests can flip it)."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and \
        os.environ.get("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "1") != "0"


def _device_and_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream's handle (what Triton launches on)."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _launch_hooks() -> tuple[Optional[Callable], Optional[Callable]]:
    """Triton's launch enter / exit hooks (set by profilers such as proton), or None."""
    try:
        from triton import knobs
    except ImportError:  # a Triton without knobs has no hooks to honour
        return None, None
    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook


def _arg_key(value: Any) -> Any:
    """What of ``value`` can change Triton's compiled kernel: a tensor's dtype and 16-byte
    alignment; for anything else its type and value (``True`` and ``1`` compile differently)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    return type(value), value


def _signature(kernel: Any) -> Optional[list[tuple[str, Any]]]:
    """``(name, default)`` of every parameter of ``kernel``'s Python function, in order
    (``inspect.Parameter.empty`` for none); None if it has no plain signature."""
    if kernel not in _signatures:
        try:
            parameters = inspect.signature(kernel.fn).parameters.values()
        except (AttributeError, TypeError, ValueError):
            _signatures[kernel] = None
        else:
            plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
            _signatures[kernel] = [(p.name, p.default) for p in parameters] if plain else None
    return _signatures[kernel]


class _CompiledLaunch:
    """A compiled kernel and how to lay out a call's arguments for its launcher."""

    __slots__ = ("compiled", "positional", "tail")

    def __init__(self, compiled: Any, positional: int, tail: list[tuple[str, Any]]) -> None:
        self.compiled = compiled
        self.positional = positional  # arguments passed by position
        self.tail = tail  # the other parameters: (name, default), in signature order

    @classmethod
    def of(cls, compiled: Any, kernel: Any, args: tuple, kwargs: dict) -> Optional["_CompiledLaunch"]:
        """None unless ``compiled`` has the launcher `__call__` uses and every parameter of
        ``kernel`` gets a value (then such calls keep the plain path)."""
        signature = _signature(kernel)
        needed = ("run", "function", "packed_metadata", "launch_metadata")
        if signature is None or not all(hasattr(compiled, name) for name in needed):
            return None
        tail = signature[len(args):]
        if any(name not in kwargs and default is inspect.Parameter.empty for name, default in tail):
            return None
        return cls(compiled, len(args), tail)

    def __call__(self, grid: tuple, args: tuple, kwargs: dict, stream: int) -> None:
        values = list(args)
        for name, default in self.tail:
            values.append(kwargs[name] if name in kwargs else default)
        grid_0 = grid[0]
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled = self.compiled
        enter, exit_ = _launch_hooks()
        metadata = compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, exit_, *values)


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, skipping the JIT's binding when an earlier call had
    the same key (see the module docstring). ``grid``: a tuple of 1-3 ints."""
    if not fast_launch_enabled() or callable(grid):
        kernel[grid](*args, **kwargs)
        return
    device, stream = _device_and_stream()
    key = (kernel, device, tuple(map(_arg_key, args)),
           tuple((name, _arg_key(value)) for name, value in kwargs.items()))
    entry = _cache.get(key, False)
    if entry is False:
        compiled = kernel[grid](*args, **kwargs)
        if len(_cache) >= _MAX_ENTRIES:
            _cache.clear()
        _cache[key] = _CompiledLaunch.of(compiled, kernel, args, kwargs)
    elif entry is None:
        kernel[grid](*args, **kwargs)
    else:
        entry(grid, args, kwargs, stream)


def clear_launch_cache() -> None:
    """Forget every kept kernel (the next call of each key takes ``kernel[grid]`` again)."""
    _cache.clear()
