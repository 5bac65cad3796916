"""EP=2 on two GPUs (NCCL, bf16-mixed) against one GPU: same per-step losses and parameters.

Tolerance (documented in README.md): bf16 autocast changes rounding with the token layout
(grouped GEMM tiles, all-to-all order), so losses agree to 2e-2 absolute (~0.5% of ~4.1) and
parameters to 5e-3 absolute after 5 SGD steps; the fp32 CPU parity tests hold 1e-5.
The expert bias moves by +-rate per step on the sign of (mean load - load): a one-token
difference in bf16 routing can flip that sign for an expert near the mean, and from then on
the routings differ, so bias entries may differ by up to 2 * rate * steps (seen: 5 of 8
entries one step apart after 5 steps). Exact expert-bias parity is asserted in fp32 by the
CPU parity tests; here the bias must have moved, on a multiple of the rate, within that bound.
"""

import pytest
import torch
from _runner_result import runner_result

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ep2_bf16_matches_one_gpu():
    out = runner_result("_ep2_runner.py", timeout=900)
    for run in ("ep2", "ep2_allgather_copy_engine"):  # the strategy's default, and the copy-engine all-gather
        _check_against_one_gpu(out[run], out["ref"], run)


def _check_against_one_gpu(run, ref, label):
    ep2_losses = torch.tensor(run["losses"]).mean(0)
    ref_losses = torch.tensor(ref["losses"])[0]
    print(label, "losses", ep2_losses.tolist(), "1-GPU losses", ref_losses.tolist())
    torch.testing.assert_close(ep2_losses, ref_losses, rtol=0, atol=2e-2)
    rate, steps = 1e-2, 5  # tiny_config's router_bias_update_rate, steps trained
    for name, value in ref["state"].items():
        got, want = torch.tensor(run["state"][name]), torch.tensor(value)
        if name.endswith("expert_bias"):
            assert (got - want).abs().max() <= 2 * rate * steps + 1e-6, name
            assert got.abs().max() > 0, f"{name} never moved under EP=2"
            steps_taken = got / rate  # every update is +-rate
            torch.testing.assert_close(steps_taken, steps_taken.round(), rtol=0, atol=1e-3, msg=name)
            continue
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3, msg=name)
