"""Calls of a captured module: their signature, sample inputs for the capture, and the replay binding.

A CUDA graph takes only tensors, at fixed shapes. A call ``module(*args, **kwargs)`` is described by
its `CallSignature`: per argument a tensor's shape, strides, dtype, device and ``requires_grad``,
or the value of a Python constant (None, bool, int, float, str), keyword arguments of value None
left out, plus the CUDA autocast state the call runs under. Two calls with the same signature
can replay the same graph; the graph's forward takes the call's tensors in order and rebuilds the
call around them with the constants (`bind_tensors`). Any other argument (a document mask of a
packed batch, a list) cannot enter a graph and is refused with the fix named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

_CONSTANTS = (type(None), bool, int, float, str)


class CallSignature(NamedTuple):
    positional: tuple  # per argument: ("tensor", shape, stride, dtype, device, requires_grad) or ("const", value)
    keywords: tuple  # ((name, entry), ...) sorted by name, None values left out
    autocast: tuple  # (enabled, dtype) of CUDA autocast


def _entry(value: Any, where: str, name: str) -> tuple:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, _CONSTANTS):
        return ("const", value)
    raise ValueError(
        f"CUDAGraphs: {where} was called with {name}={type(value).__name__}, which a CUDA graph cannot take as "
        "an input (graphs take tensors and Python constants). A packed batch's document mask is one such "
        "argument: train unpacked batches with CUDAGraphs, use scope='moe' (MoE layers take only their "
        "tokens), or leave that module out (modules=...)."
    )


def autocast_state() -> tuple:
    """CUDA autocast's (enabled, dtype) now."""
    enabled = torch.is_autocast_enabled("cuda")
    return (enabled, torch.get_autocast_dtype("cuda") if enabled else None)


def call_signature(args: tuple, kwargs: dict, where: str) -> tuple[CallSignature, tuple[Tensor, ...]]:
    """The signature of ``module(*args, **kwargs)`` and its tensors in graph order (positional
    first, then keywords by name). ``where`` names the module in errors."""
    positional = tuple(_entry(a, where, f"argument {i}") for i, a in enumerate(args))
    keywords = tuple((k, _entry(v, where, k)) for k, v in sorted(kwargs.items()) if v is not None)
    tensors = tuple(a for a in args if isinstance(a, Tensor))
    tensors += tuple(kwargs[k] for k, entry in keywords if entry[0] == "tensor")
    return CallSignature(positional, keywords, autocast_state()), tensors


def describe(signature: CallSignature) -> str:
    """The tensor shapes of a signature, for notices."""
    entries = list(signature.positional) + [e for _, e in signature.keywords]
    return ", ".join(f"{list(e[1])} {str(e[3]).replace('torch.', '')}" for e in entries if e[0] == "tensor")


def sample_tensors(signature: CallSignature, generator: torch.Generator) -> tuple[Tensor, ...]:
    """New tensors of the signature's layouts (the graph's input buffers): normal values for
    floating tensors, zeros for integer and boolean ones (valid indices); ``requires_grad`` as
    the call's."""
    out = []
    entries = list(signature.positional) + [e for _, e in signature.keywords]
    for entry in entries:
        if entry[0] != "tensor":
            continue
        _, shape, stride, dtype, device, requires_grad = entry
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        with torch.no_grad():
            if t.is_floating_point():
                t.copy_(torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype))
            else:
                t.zero_()
        out.append(t.requires_grad_(requires_grad))
    return tuple(out)


def bind_tensors(forward: Callable[..., Any], signature: CallSignature) -> Callable[..., Any]:
    """``forward`` as a function of the signature's tensors only (constants filled in)."""
    positional, keywords = signature.positional, signature.keywords

    def call(*tensors: Tensor) -> Any:
        it = iter(tensors)
        args = [next(it) if e[0] == "tensor" else e[1] for e in positional]
        kwargs = {k: next(it) if e[0] == "tensor" else e[1] for k, e in keywords}
        return forward(*args, **kwargs)

    return call
