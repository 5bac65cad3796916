"""Delayed scaling's update kernel (`kernels.delayed_update_triton.delayed_update`) run on CPU under
Triton's interpreter against the torch formulation (`precision.delayed._updated`): the new scales
and the rolled history bit for bit, for both amax algorithms, with and without a margin, on
histories holding zeros, infinities, NaNs, subnormal and huge amaxes, at group counts that leave a
partial column block and history lengths that leave a partial row chunk. Run as a script
(``TRITON_INTERPRET=1`` must be set before Triton decorates the kernel); prints one line per case
and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from lightning_moe.kernels.delayed_update_triton import delayed_update  # noqa: E402
from lightning_moe.precision.delayed import _updated  # noqa: E402
from lightning_moe.precision.recipes import ROLES, FP8Recipe  # noqa: E402


def _history(steps: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    history = torch.rand(steps, 3, groups, generator=gen) * torch.logspace(-3, 3, groups)
    history[:, 0, 0] = 0.0  # a group never seen: scale kept
    history[min(1, steps - 1), 1, 1] = float("inf")  # an overflowed amax in the history: scale kept
    history[0, 2, 2] = float("nan")  # a NaN amax in the current row: scale kept
    history[:, 2, 3] = 1e-40  # subnormal amax: fmt_max / amax overflows, clamped to FLT_MAX
    history[-1, 0, 4] = 3e38  # a huge amax from the oldest step
    scale = torch.rand(3, groups, generator=gen) + 0.5
    return history, scale


def main() -> None:
    failures = 0
    for steps, groups in [(5, 7), (33, 45), (1, 130)]:
        for algo in ("max", "most_recent"):
            for margin in (0, 3):
                recipe = FP8Recipe("delayed", margin=margin, amax_history_len=steps, amax_compute_algo=algo)
                history, scale = _history(steps, groups, seed=steps * groups + margin)
                before = history.clone(), scale.clone()
                expected_scale, expected_history = _updated(history, scale, recipe)
                got_scale, got_history = delayed_update(history, scale, tuple(recipe.format(r).max for r in ROLES),
                                                        margin, algo == "most_recent")
                pairs = [(got_scale, expected_scale), (got_history, expected_history), (history, before[0]),
                         (scale, before[1])]  # the inputs untouched; bits compared (NaN != NaN)
                same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs)
                print(f"update H={steps} G={groups} {algo} margin={margin}", "equal" if same else "DIFFERENT",
                      flush=True)
                failures += not same
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
