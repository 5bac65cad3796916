"""The all-gather dispatcher's copy-engine transport on two GPUs (EP=2, bf16).

Both transports move the same bytes and reduce alike (NCCL's two-rank bf16 sum is one rounded
addition; the copy-engine path sums in fp32 and rounds once), so outputs and every gradient
must be bit-identical to the NCCL transport, over several steps that reuse the symmetric
workspace. Against the all-to-all dispatcher the token layout differs, so only bf16 closeness
is expected (2% of each tensor's largest magnitude).
"""

import pytest
import torch
from _runner_result import runner_result

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_copy_engine_transport_is_bit_identical_to_nccl():
    reports = runner_result("_dispatch_transport_runner.py", timeout=600)
    for rank, report in reports.items():
        print(rank, report)
        assert "copy engine" in report["describe"]["allgather_copy_engine"]
        assert all(report["identical"].values()), (rank, report["identical"])
        for key, diff in report["max_diff_vs_alltoall"].items():
            assert diff <= 0.02 * report["scale"][key] + 1e-6, (rank, key, diff, report["scale"][key])
