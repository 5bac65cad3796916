"""A stand-in quantization that takes deferred permutations on CPU, for testing the plumbing.

`GatheringGemm` (a `GroupedGemmQuantization`) plays the role of ``FP8GroupedGemm`` with the
native delayed casts: it accepts a `DeferredPermutation` (``takes_deferred_permutation``) and runs
``grouped_mm_gathered`` as the permutation followed by the plain grouped GEMM, in full precision.
A layer using it must train exactly as with the permutation carried out by the dispatcher;
``gathered`` counts the calls that took the deferred path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe.nn.experts import GroupedGemmQuantization
from lightning_moe.nn.permutation import PermutationPlan, permute


class GatheringGemm(GroupedGemmQuantization):
    def __init__(self) -> None:
        self.gathered = 0

    def takes_deferred_permutation(self, tokens_TK: Tensor) -> bool:
        return True

    def grouped_mm(self, x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor, projection: str = "") -> Tensor:
        return torch._grouped_mm(x_RK, w_EKN.to(x_RK.dtype), offs=offsets_E)

    def grouped_mm_gathered(self, tokens_TK: Tensor, plan: PermutationPlan, w_EKN: Tensor, offsets_E: Tensor,
                            projection: str = "") -> Tensor:
        self.gathered += 1
        return self.grouped_mm(permute(tokens_TK, plan), w_EKN, offsets_E, projection)
