"""Context parallelism under the gold test: CP layouts train to the same losses and parameters as
one process (fp32, atol 1e-5) with the parity model (a dense and an MoE block; sigmoid routing,
expert bias, aux and z losses), for both key/value exchanges (cp_comm_type)."""

import functools

import pytest
import torch

from _launch import run_distributed
from _parity import SEQ, as_tensors, dp_representatives, step_losses, tiny_config, train

STEPS = 3

LAYOUTS = {  # name: (world size, strategy kwargs)
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2_allgather": (2, dict(context_parallel_size=2, cp_comm_type="allgather")),
    "cp4": (4, dict(context_parallel_size=4)),
    "cp2_ep2": (2, dict(context_parallel_size=2, expert_parallel_size=2)),
    "tp2_cp2": (4, dict(tensor_parallel_size=2, context_parallel_size=2, cp_comm_type="allgather")),
    "cp2_dp2_fsdp": (4, dict(context_parallel_size=2, sharding="fsdp", expert_sharding="fsdp")),
}


def _dp(world: int, kwargs: dict) -> int:
    return world // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("context_parallel_size", 1))


@functools.lru_cache(maxsize=None)
def reference(dp: int, config_key: str):
    config = _configs()[config_key]
    return as_tensors(run_distributed(train, 1, {}, 1, STEPS, dp, config, None, timeout=120)[0])


def _configs() -> dict:
    return {"moe": tiny_config(), "seq_aux": tiny_config(router_load_balancing_type="seq_aux_loss")}


def _check(layout: str, config_key: str = "moe") -> None:
    world, kwargs = LAYOUTS[layout]
    dp = _dp(world, kwargs)
    result = as_tensors(run_distributed(train, world, kwargs, dp, STEPS, 1, _configs()[config_key], None, timeout=180)[0])
    ref = reference(dp, config_key)
    torch.testing.assert_close(step_losses(result, dp_representatives(kwargs, world)), ref["rank_losses"][0],
                               rtol=0, atol=1e-5)
    assert result["state"].keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(layout):
    assert SEQ % (2 * LAYOUTS[layout][1]["context_parallel_size"]) == 0
    _check(layout)


def test_sequence_aux_loss_spans_the_cp_group():
    # Megatron's seq aux loss with CP: per-sequence counts summed over the CP group
    _check("cp2", "seq_aux")
