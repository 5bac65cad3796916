"""The all-gather dispatcher's copy-engine and NVLink transports on two GPUs (EP=2, bf16).

All transports move the same bytes and reduce alike (NCCL's two-rank bf16 sum is one rounded
addition; the copy-engine path sums in fp32 and rounds once; the NVLink path's combine adds the
peer's rounded partial to its own rounded partial in fp32 and rounds once), so outputs and every
gradient must be bit-identical to the NCCL transport, over several steps that reuse the symmetric
workspace. Against the all-to-all dispatcher the token layout differs, so only bf16 closeness
is expected (2% of each tensor's largest magnitude).
"""

import pytest
import torch
from _runner_result import runner_result

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_symmetric_memory_transports_are_bit_identical_to_nccl():
    reports = runner_result("_dispatch_transport_runner.py", timeout=600)
    for rank, report in reports.items():
        print(rank, report)
        assert "copy engine" in report["describe"]["allgather_copy_engine"]
        assert "nvlink" in report["describe"]["allgather_nvlink"]
        for transport in ("copy_engine", "nvlink"):
            assert all(report["identical"][transport].values()), (rank, transport, report["identical"][transport])
        for key, diff in report["max_diff_vs_alltoall"].items():
            assert diff <= 0.02 * report["scale"][key] + 1e-6, (rank, key, diff, report["scale"][key])
