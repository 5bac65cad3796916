"""FP8 copies of weights made once per optimizer step and reused by every micro-batch.

With gradient accumulation the weights do not change between the micro-batches of one
optimizer step, yet each forward and backward would quantize them again (for the native
rowwise recipe: two layouts per weight, each a full read of the fp32 / bf16 weight). A
`FP8WeightCache` keeps the quantized operands (values and scales) of each weight and layout
until the weight changes:

- `FP8Precision` clears it after every optimizer step;
- only training passes fill or read it (grad mode on, not inference mode, not under CUDA-graph
  capture): validation with swapped-in weights (EMA callbacks write through ``.data``, which
  no version counter sees) never leaves an entry behind;
- an entry is also dropped when the weight's storage or in-place version counter moves (an
  in-place update outside the optimizer; writes through ``.data`` are not seen, nor a
  parameter replaced between two micro-batches by a new tensor that lands at the same
  address: replace parameters only between optimizer steps).

Memory: one extra byte per parameter and layout (two layouts for most FP8 weights), plus the
scales, held until the optimizer step. With FSDP that would be an unsharded copy of every
weight on every rank, so `MegatronMoEStrategy` refuses the combination.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Generator, Hashable
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_moe.nn.experts import local_tensor


def caching_allowed(weight: Tensor) -> bool:
    """A training pass on an ordinary tensor: the only place where entries are made or used."""
    return (
        torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not weight.is_inference()
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


class FP8WeightCache:
    """Quantized weight operands keyed by (owner, layout).

    The owner key names the weight for its whole life (``(id(module), projection)``), not its
    storage: under FSDP one layer's unsharded weight can be freed and another layer's
    allocated at the same address. An entry is used only while the weight still has the
    storage, shape, dtype and in-place version counter it was quantized from.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, str], tuple[tuple, Any]] = {}
        self.hits = 0
        self.misses = 0

    def get(self, owner: Hashable, weight: Tensor, layout: str, quantize: Callable[[], Any]) -> Any:
        """``quantize()``'s result for this weight and layout, computed at most once per weight state."""
        # the local shard's address: a DTensor reports 0 for itself
        stamp = (local_tensor(weight).data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
        entry = self._entries.get((owner, layout))
        if entry is not None and entry[0] == stamp:
            self.hits += 1
            return entry[1]
        self.misses += 1
        value = quantize()
        self._entries[(owner, layout)] = (stamp, value)
        return value

    def clear(self) -> None:
        """Forget every entry (after an optimizer step)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_ACTIVE: contextvars.ContextVar[Optional[FP8WeightCache]] = contextvars.ContextVar(
    "lightning_moe_fp8_weight_cache", default=None
)


@contextmanager
def caching_fp8_weights(cache: Optional[FP8WeightCache]) -> Generator[None, None, None]:
    """Within this context the native FP8 GEMMs take their weight operands from ``cache``
    (None: no caching, e.g. for evaluation inside a caching training context)."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_cache() -> Optional[FP8WeightCache]:
    """The cache of the enclosing `caching_fp8_weights` context."""
    return _ACTIVE.get()


def training_cache(weight: Tensor) -> Optional[FP8WeightCache]:
    """The active cache if this call is a training pass on ``weight`` (see `caching_allowed`),
    else None. Decided where the GEMM is called (inside an autograd Function's forward grad
    mode is always off); the Function keeps it for its backward."""
    cache = _ACTIVE.get()
    return cache if cache is not None and caching_allowed(weight) else None


def cached(cache: Optional[FP8WeightCache], owner: Optional[Hashable], weight: Tensor, layout: str,
           quantize: Callable[[], Any]) -> Any:
    """``quantize()`` through ``cache`` when there is one and the weight has an owner key."""
    return quantize() if cache is None or owner is None else cache.get(owner, weight, layout, quantize)
