"""Context parallelism is not a parameter sharding: a checkpoint saved under CP2 (dense parameters
and Adam states FSDP-sharded over DP x CP) resumes in one process, and one saved by one process
resumes under CP2, each with the loss curve of the uninterrupted run."""

import torch

from _launch import run_distributed
from test_strategy_checkpoint import SAVE_AT, STEPS, _global, run

CP2 = dict(context_parallel_size=2)


def test_cp2_checkpoint_resumes_in_one_process(tmp_path):
    losses = run_distributed(run, 2, CP2, 1, STEPS, str(tmp_path), None, None, timeout=120)[0]
    uninterrupted = _global(losses, CP2, 2)
    resumed = run_distributed(run, 1, {}, 1, STEPS, None, str(tmp_path / f"step{SAVE_AT}"), None, timeout=120)[0]
    torch.testing.assert_close(_global(resumed, {}, 1), uninterrupted[SAVE_AT:], rtol=0, atol=1e-5)


def test_one_process_checkpoint_resumes_under_cp2(tmp_path):
    losses = run_distributed(run, 1, {}, 1, STEPS, str(tmp_path), None, None, timeout=120)[0]
    uninterrupted = _global(losses, {}, 1)
    resumed = run_distributed(run, 2, CP2, 1, STEPS, None, str(tmp_path / f"step{SAVE_AT}"), None, timeout=120)[0]
    torch.testing.assert_close(_global(resumed, CP2, 2), uninterrupted[SAVE_AT:], rtol=0, atol=1e-5)
