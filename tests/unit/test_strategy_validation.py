"""Bad layouts fail in setup_environment before any process-group work."""

import lightning as L
import pytest
import torch.distributed as dist

from lightning_moe import MegatronMoEStrategy
from lightning_moe.models.lightning_module import MoELanguageModel


def _setup(strategy, devices=4, config="tiny"):
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    strategy._lightning_module = MoELanguageModel(config)
    strategy.setup_environment()
    return trainer


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(tensor_parallel_size=3), "divide|divisible"),
        (dict(expert_parallel_size=3), "divide|divisible"),
        (dict(expert_parallel_size=4, expert_tensor_parallel_size=2), "divide|divisible"),
        (dict(data_parallel_size=3), "data_parallel_size"),
        (dict(pipeline_parallel_size=3), "divide|divisible"),
        # tiny has 4 blocks: 4 stages x 2 virtual = 8 chunks cannot each hold one
        (dict(pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2),
         "8 pipeline chunks but the model has 4 blocks"),
        (dict(pipeline_parallel_size=2, context_parallel_size=3), "divide|divisible"),
        (dict(context_parallel_size=3), "context_parallel_size .* does not divide"),
    ],
)
def test_invalid_sizes_raise_before_process_groups(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        _setup(MegatronMoEStrategy(**kwargs))
    assert not dist.is_initialized()


def test_context_parallel_refuses_multi_head_latent_attention_before_process_groups():
    module = MoELanguageModel("tiny", overrides={"attention_type": "mla", "num_query_groups": None, "q_lora_rank": 16,
                                                 "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                                 "v_head_dim": 8})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MegatronMoEStrategy(context_parallel_size=2), logger=False)
    trainer.strategy._lightning_module = module
    with pytest.raises(ValueError, match="multi-head latent attention is not context-parallel"):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(expert_parallel_size=16), "num_experts"),  # tiny: 8 experts
        (dict(tensor_parallel_size=4), "num_query_groups"),  # tiny: 4 heads, 2 KV groups
        (dict(expert_tensor_parallel_size=16), "expert_ffn_hidden_size"),  # expert ffn 120 below
    ],
)
def test_model_constraints_checked_before_process_groups(kwargs, needle):
    module = MoELanguageModel("tiny", overrides={"moe": {"ffn_hidden_size": 120}})
    trainer = L.Trainer(accelerator="cpu", devices=16, strategy=MegatronMoEStrategy(**kwargs), logger=False)
    trainer.strategy._lightning_module = module
    with pytest.raises(ValueError, match=needle):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def test_bad_sharding_modes():
    with pytest.raises(ValueError, match="fsdp"):
        MegatronMoEStrategy(sharding="zero3")
    with pytest.raises(ValueError, match="alltoall"):
        MegatronMoEStrategy(token_dispatcher="deepep")
    with pytest.raises(ValueError, match="copy_engine"):
        MegatronMoEStrategy(dispatch_transport="nvlink")
