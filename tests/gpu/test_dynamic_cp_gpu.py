"""DynamicContextParallel on two GPUs (NCCL, fp32): the packed batches of the CPU parity test (documents
of 16 to 512 tokens) give the losses and parameters of static CP2 and of one GPU. On two ranks the cost
model runs every document alone on a GPU in both steps (a CP2 ring computes 3/4 of a sequence's L^2 pairs
and no imbalance here outweighs that): this checks the per-sequence SDPA path against static CP2; the
ring path of a sub-group runs in the CPU tests. Tolerance 1e-4: the GPU's
attention and GEMM kernels sum in other orders than the CPU's (the CPU tests hold 1e-5)."""

import pytest
import torch
from _runner_result import runner_result

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dynamic_cp2_matches_static_cp2_and_one_gpu():
    out = runner_result("_dynamic_cp_runner.py", timeout=1200)
    assert out["dynamic"]["plans"] == [{"1": 5}, {"1": 6}]
    for run in ("dynamic", "static"):
        torch.testing.assert_close(torch.tensor(out[run]["losses"]), torch.tensor(out["ref"]["losses"]),
                                   rtol=0, atol=1e-4)
        for name, value in out["ref"]["state"].items():
            torch.testing.assert_close(torch.tensor(out[run]["state"][name]), torch.tensor(value), rtol=0, atol=1e-4,
                                       msg=f"{run}: {name}")
