"""DeepSeek's interleaved rotary rows <-> this package's rotate-half rows, as a tensor source.

DeepSeek's checkpoints rotate the pairs ``(2i, 2i + 1)`` of each head's rotary dims; the
reference decoder rotates ``(i, i + r/2)`` (`lightning_moe.models.mla.deinterleave_rope_rows`).
Permuting the rotary output rows of ``q_b_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa`` once
on import, and back on export, gives the same attention scores with no per-step cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

from lightning_moe.models.hf.reader import SafetensorsCheckpoint


@dataclass(frozen=True)
class InterleavedRope:
    """An HF ``[O, I]`` weight made of blocks of ``head_width`` rows (one per head) whose rows
    ``rope_offset .. rope_offset + rope_dim`` are interleaved in the checkpoint."""

    name: str
    head_width: int
    rope_offset: int
    rope_dim: int

    def _hf_rows(self, rows: range) -> list[int]:
        """For each of our rows, the HF row it comes from."""
        lo, hi = self.rope_offset, self.rope_offset + self.rope_dim
        half = self.rope_dim // 2
        out = []
        for row in rows:
            head, within = divmod(row, self.head_width)
            if lo <= within < hi:
                j = within - lo  # ours: [even pair members, odd pair members]
                within = lo + (2 * j if j < half else 2 * (j - half) + 1)
            out.append(head * self.head_width + within)
        return out

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        return {self.name: tuple(shape)}

    def read_into(self, checkpoint: SafetensorsCheckpoint, box: Sequence[slice], out: Tensor) -> None:
        # The HF rows of a box of ours lie in the same heads: read those heads' rows, then pick.
        rows = box[0]
        first = rows.start // self.head_width * self.head_width
        last = -(-rows.stop // self.head_width) * self.head_width
        block = checkpoint.read(self.name, (slice(first, last), *box[1:]))
        index = torch.tensor(self._hf_rows(range(rows.start, rows.stop))) - first
        out.copy_(block[index])

    def to_hf(self, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        hf_rows = torch.tensor(self._hf_rows(range(full.shape[0])))
        hf = torch.empty_like(full)
        hf[hf_rows] = full
        yield self.name, hf
