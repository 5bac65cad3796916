"""FP8 copies of weights made once per optimizer step and reused by every micro-batch.

With gradient accumulation the weights do not change between the micro-batches of one
optimizer step, yet each forward and backward would quantize them again (for the native
rowwise recipe: two layouts per weight, each a full read of the fp32 / bf16 weight). A
`FP8WeightCache` keeps the quantized operands (values and scales) of each weight and layout
until the weight changes: `FP8Precision` clears it after every optimizer step, and an entry
is also dropped when the weight's storage or in-place version counter moves (a manual
update outside the optimizer). Under FSDP the unsharded weight is re-gathered into new
storage for every forward, so entries do not survive and nothing is gained (nor lost). Memory: one extra byte per parameter and layout (two layouts
for most FP8 weights), plus the scales.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable
from contextlib import contextmanager
from typing import Any, Optional

from torch import Tensor


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
        stamp = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
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


_active: Optional[FP8WeightCache] = None


@contextmanager
def caching_fp8_weights(cache: Optional[FP8WeightCache]) -> Generator[None, None, None]:
    """Within this context the native FP8 GEMMs take their weight operands from ``cache``."""
    global _active
    previous, _active = _active, cache
    try:
        yield
    finally:
        _active = previous


def active_cache() -> Optional[FP8WeightCache]:
    """The cache of the enclosing `caching_fp8_weights` context (captured by each GEMM's forward
    so that its backward, which runs outside the context, uses the same one)."""
    return _active


def cached(cache: Optional[FP8WeightCache], owner: Optional[Hashable], weight: Tensor, layout: str,
           quantize: Callable[[], Any]) -> Any:
    """``quantize()`` through ``cache`` when there is one and the weight has an owner key."""
    return quantize() if cache is None or owner is None else cache.get(owner, weight, layout, quantize)
