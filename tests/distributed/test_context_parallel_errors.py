"""Context-parallel layouts that cannot run fail on every rank with the fix named: attention
without ``set_context_parallel`` (multi-head latent attention), a sequence length that does not
cut into 2 x CP chunks, an unknown ``cp_comm_type``."""

import pytest
import torch
from torch.utils.data import DataLoader

from _launch import DistributedTestError, run_distributed
from _parity import tiny_config

MLA = dict(attention_type="mla", num_query_groups=None, q_lora_rank=16, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


def _fit(rank, world_size, config, seq):
    import lightning as L

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel

    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 2, seq + 1))
    data = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_checkpointing=False,
        strategy=MegatronMoEStrategy(context_parallel_size=world_size, print_layout=False),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )

    class UserModule(MoELanguageModel):
        """A module that declares nothing about its attention: found when the strategy parallelizes it."""

        def parallel_constraints(self):
            return {k: v for k, v in super().parallel_constraints().items() if k != "context_parallel_attention"}

    trainer.fit(UserModule(config, max_steps=2), DataLoader(data, batch_size=None))


def test_attention_without_context_parallel_support_is_refused():
    # (the reference module declares MLA: refused before process groups, tests/unit/test_strategy_validation.py)
    with pytest.raises(DistributedTestError, match="MultiHeadLatentAttention without it"):
        run_distributed(_fit, 2, {**tiny_config(), **MLA}, 16, timeout=60)


def test_sequence_length_not_divisible_by_twice_cp_names_the_fix():
    with pytest.raises(DistributedTestError, match="sequence length 10 is not divisible by 2 x context_parallel_size"):
        run_distributed(_fit, 2, tiny_config(), 10, timeout=60)


def test_unknown_comm_type():
    from lightning_moe import MegatronMoEStrategy

    with pytest.raises(ValueError, match="cp_comm_type='a2a'"):
        MegatronMoEStrategy(context_parallel_size=2, cp_comm_type="a2a")
