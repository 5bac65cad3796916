"""Splitting a model into pipeline chunks (no process group): balance, names, composition, refusals."""

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_moe import MegatronMoEStrategy
from lightning_moe.models.decoder import MoEDecoder, causal_lm_loss
from lightning_moe.models.lightning_module import MoELanguageModel
from lightning_moe.models.presets import get_preset
from lightning_moe.parallel.pipeline import balanced_split, find_splittable, plan_split, split_model


def test_balanced_split_minimizes_the_largest_chunk():
    assert balanced_split([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_split([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a heavy first chunk (embeddings) gets fewer blocks
    assert balanced_split([1, 1, 1, 1, 1, 1], 2, first_extra=2.0) == [(0, 2), (2, 6)]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4"):
        balanced_split([1, 1, 1], 4)


def _tiny(num_layers: int = 4, tied: bool = False) -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(get_preset("tiny", num_layers=num_layers, tie_word_embeddings=tied))


def test_plan_deals_chunks_round_robin_and_names_the_split():
    plan = plan_split(_tiny(4), num_stages=2, virtual_stages=2)
    assert plan.chunks == (("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",))
    assert plan.chunk_indices(0) == [0, 2] and plan.chunk_indices(1) == [1, 3]
    assert plan.layers_of(1) == {"layers.1", "layers.3"}
    assert plan.describe() == "stage 0: embed+layers.0, layers.2; stage 1: layers.1, layers.3+head"
    # embeddings and the output projection weigh: with 8 blocks over 2 stages, a balanced split
    assert sum(len(c) for c in plan_split(_tiny(8), 2, 1).chunks) == 8
    with pytest.raises(ValueError, match="at most 4"):
        plan_split(_tiny(4), 4, 2)
    manual = plan_split(_tiny(4), 2, 1, sizes=[1, 3])
    assert manual.chunks == (("layers.0",), ("layers.1", "layers.2", "layers.3"))
    with pytest.raises(ValueError, match="adding up to the model's 4 blocks"):
        plan_split(_tiny(4), 2, 1, sizes=[1, 2])


@pytest.mark.parametrize("tied", [False, True])
def test_pruned_stages_keep_the_parameter_names_and_compose_to_the_whole_loss(tied):
    whole = _tiny(4, tied)
    names = set(whole.state_dict())
    tokens = torch.randint(0, whole.config.vocab_size, (2, 9))
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :3] = -100
    expected = causal_lm_loss(whole(input_ids), labels) * (labels != -100).sum()
    plan = plan_split(whole, 2, 2)
    stages = []
    for rank in range(2):
        model = _tiny(4, tied)
        chunks = split_model(model, plan, rank)
        assert set(model.state_dict()) < names  # a subset, under the whole model's names
        stages.append((model, chunks))
    assert set(stages[0][0].state_dict()) | set(stages[1][0].state_dict()) == names
    # a tied embedding lives on the first stage (input) and the last (output projection)
    both = set(stages[0][0].state_dict()) & set(stages[1][0].state_dict())
    assert both == ({"embed_tokens.weight"} if tied else set())
    assert stages[0][0].pipeline_shared_parameters() == (["embed_tokens.weight"] if tied else [])
    x = input_ids
    for chunk_index in range(plan.num_chunks):  # chunk c runs on rank c % 2
        x = stages[chunk_index % 2][1][chunk_index // 2](x, labels)
    torch.testing.assert_close(x, expected)
    with pytest.raises(RuntimeError, match="holds one pipeline stage only"):
        stages[0][0](input_ids)


def test_find_splittable():
    assert find_splittable(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
    module = MoELanguageModel("tiny")
    module.configure_model()
    assert find_splittable(module) is module.model


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(pipeline_schedule="zero_bubble"), "pipeline_schedule"),
        (dict(virtual_pipeline_size=2), "interleaved_1f1b"),
        (dict(virtual_pipeline_size=0), "virtual_pipeline_size"),
        (dict(pipeline_parallel_size=4, pipeline_microbatches=2), "at least 4"),
        (dict(pipeline_microbatches=0), "pipeline_microbatches"),
        (dict(pipeline_parallel_size=2, pipeline_split_sizes=[4]), "give 2 positive block counts"),
        (dict(pipeline_parallel_size=2, pipeline_split_sizes=[0, 4]), "pipeline_split_sizes"),
    ],
)
def test_pipeline_options_are_checked_at_construction(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        MegatronMoEStrategy(**kwargs)


def test_split_sizes_checked_against_the_model_before_process_groups():
    strategy = MegatronMoEStrategy(pipeline_parallel_size=2, pipeline_split_sizes=[1, 2])
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy._lightning_module = MoELanguageModel("tiny")  # 4 blocks
    with pytest.raises(ValueError, match="adding up to the model's 4 blocks"):
        strategy.setup_environment()
    assert not dist.is_initialized()
