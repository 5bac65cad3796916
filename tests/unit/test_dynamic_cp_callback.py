"""DynamicContextParallel refuses what it cannot run, naming the fix, before any collective."""

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_moe import MegatronMoEStrategy, MoEConfig, MoELayer, ParallelLayout
from lightning_moe.callbacks import DynamicContextParallel
from lightning_moe.parallel.dynamic_cp import CALIBRATION_FORMAT, CostModel


def _trainer(world_size: int = 4, **sizes) -> SimpleNamespace:
    strategy = MegatronMoEStrategy(print_layout=False, **sizes)
    strategy._layout = ParallelLayout(world_size=world_size, **sizes)
    return SimpleNamespace(strategy=strategy)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="memory_limit_tokens must be a positive int"):
        DynamicContextParallel(memory_limit_tokens=0)
    with pytest.raises(ValueError, match="power of two"):
        DynamicContextParallel(memory_limit_tokens=512, max_context_parallel_size=3)


def test_cost_model_from_a_calibration_file_is_kept_in_the_state(tmp_path):
    path = tmp_path / "calibration.json"
    values = CostModel(linear_s_per_token=1e-5).to_dict()
    values.pop("source")
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "cost_model": values}))
    callback = DynamicContextParallel(memory_limit_tokens=512, cost_model=str(path))
    state = callback.state_dict()
    assert state["cost_model"]["linear_s_per_token"] == 1e-5 and state["cost_model"]["source"] == str(path)
    assert state["memory_limit_tokens"] == 512


@pytest.mark.parametrize(
    "sizes, match",
    [
        (dict(), "context_parallel_size > 1"),
        (dict(context_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size=1"),
    ],
)
def test_layouts_it_cannot_run_are_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        DynamicContextParallel(memory_limit_tokens=512).setup(_trainer(**sizes), None, "fit")


def test_max_cp_must_divide_the_pool_and_the_strategy_must_be_megatron():
    callback = DynamicContextParallel(memory_limit_tokens=512, max_context_parallel_size=8)
    with pytest.raises(ValueError, match="must divide the DP x CP = 4 ranks"):
        callback.setup(_trainer(context_parallel_size=4), None, "fit")
    with pytest.raises(ValueError, match="needs MegatronMoEStrategy"):
        callback.setup(SimpleNamespace(strategy=object()), None, "fit")


@pytest.mark.parametrize(
    "moe, strategy_sizes, match",
    [
        (dict(router_load_balancing_type="none", expert_capacity_factor=1.0, token_drop_policy="probs"), {},
         "expert_capacity_factor=None"),
        (dict(router_load_balancing_type="none", token_dispatcher_type="allgather"), dict(expert_parallel_size=2),
         "token_dispatcher='alltoall'"),
    ],
)
def test_routers_that_need_equal_token_counts_are_refused(moe, strategy_sizes, match):
    layer = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, router_topk=2, **moe))
    callback = DynamicContextParallel(memory_limit_tokens=512)
    trainer = _trainer(**{"context_parallel_size": 4, **strategy_sizes})
    callback._strategy = trainer.strategy
    with pytest.raises(ValueError, match=match):
        callback._check_model(torch.nn.Sequential(layer))


def test_an_expert_bias_router_is_accepted():
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, router_topk=2, router_load_balancing_type="none",
                    router_enable_expert_bias=True, router_score_function="sigmoid")
    callback = DynamicContextParallel(memory_limit_tokens=512)
    callback._strategy = _trainer(context_parallel_size=4, expert_parallel_size=2).strategy
    callback._check_model(torch.nn.Sequential(MoELayer(cfg)))
    assert callback._checked_model


@pytest.mark.parametrize("cp", [4, 2], ids=["dp1", "dp2"])
def test_every_load_balancing_loss_and_the_z_loss_are_accepted(cp):
    types, coeffs = ["aux_loss", "seq_aux_loss", "global_aux_loss"], [1e-2, 1e-2, 1e-2]
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, router_topk=2, router_load_balancing_type=types,
                    aux_loss_coeff=coeffs, z_loss_coeff=1e-3)
    callback = DynamicContextParallel(memory_limit_tokens=512)
    callback._strategy = _trainer(context_parallel_size=cp).strategy
    callback._check_model(torch.nn.Sequential(MoELayer(cfg)))
    assert callback._checked_model
