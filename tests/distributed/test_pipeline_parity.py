"""Pipeline parallelism matches one process: losses, every gradient of the last step and the
final parameters (fp32, atol 1e-5, the tolerance of the other layout-parity tests).

The `_parity` model with 4 blocks (dense, then MoE with sigmoid routing, expert bias, aux loss
and z-loss) is split into 2 or 4 stages, folded with EP, ETP, TP, CP or FSDP inside the stages, or cut
into 2 x 2 interleaved chunks; each batch runs as the schedule's micro-batches. One case clips by the
global norm, which must span both stages. Every run trains with a MoEMonitor (its last window's
statistics are compared) and, after training, validates (forward only through the stages) on
the same batches.
"""

import functools

import pytest
import torch

from _launch import run_distributed
from _parity import tiny_config
from _pipeline_parity import train

STEPS = 3
CONFIG = {**tiny_config(), "num_layers": 4}
CONFIGS = {
    "untied": CONFIG,
    "tied": {**CONFIG, "tie_word_embeddings": True},
    "mla": {**CONFIG, "attention_type": "mla", "num_query_groups": None, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
}

# name: (world size, strategy kwargs, DP replicas, pipeline micro-batches, clip)
LAYOUTS = {
    "pp2": (2, dict(pipeline_parallel_size=2), 1, 2, None),
    "pp2_gpipe_split13": (2, dict(pipeline_parallel_size=2, pipeline_schedule="gpipe", pipeline_split_sizes=[1, 3]),
                          1, 2, None),
    "pp2_virtual2": (2, dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                             virtual_pipeline_size=2), 1, 2, None),
    "pp4": (4, dict(pipeline_parallel_size=4), 1, 4, None),
    "pp2_ep2": (4, dict(pipeline_parallel_size=2, expert_parallel_size=2), 2, 2, 0.05),
    "pp2_tp2": (4, dict(pipeline_parallel_size=2, tensor_parallel_size=2), 1, 2, None),
    "pp2_etp2": (4, dict(pipeline_parallel_size=2, expert_tensor_parallel_size=2), 2, 2, None),
    "pp2_cp2": (4, dict(pipeline_parallel_size=2, context_parallel_size=2), 1, 2, None),
    "pp2_dp2_fsdp": (4, dict(pipeline_parallel_size=2, sharding="fsdp", expert_sharding="fsdp"), 2, 2, None),
}


@functools.lru_cache(maxsize=None)
def reference(accumulate: int, clip, config_key: str = "untied"):
    return run_distributed(train, 1, {}, 1, STEPS, accumulate, CONFIGS[config_key], clip, 0.5, None, None, False,
                           True, 1, "cpu", "32-true", True, timeout=120)[0]


def _assert_matches(result: dict, ref: dict, dp_ranks: list[int]) -> None:
    losses = torch.from_numpy(result["rank_losses"])[dp_ranks].mean(0)
    torch.testing.assert_close(losses, torch.from_numpy(ref["rank_losses"][0]), rtol=0, atol=1e-5)
    for key in ("grads", "state"):
        assert result[key].keys() == ref[key].keys(), key
        for name, value in ref[key].items():
            torch.testing.assert_close(torch.from_numpy(result[key][name]), torch.from_numpy(value),
                                       rtol=0, atol=1e-5, msg=f"{key} {name}")


def _dp_ranks(world: int, kwargs: dict) -> list[int]:
    from _pipeline_parity import dp_rank_of

    first: dict[int, int] = {}
    for rank in range(world):
        first.setdefault(dp_rank_of(kwargs, rank, world), rank)
    return [first[i] for i in sorted(first)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_matches_one_process(layout):
    world, kwargs, dp, microbatches, clip = LAYOUTS[layout]
    result = run_distributed(train, world, kwargs, dp, STEPS, microbatches, CONFIG, clip, 0.5, None, None, False,
                             True, 1, "cpu", "32-true", True, timeout=180)[0]
    ref = reference(microbatches * dp, clip)
    # validation runs through the same stages (forward only): the token mean over every rank's batches
    assert result["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)
    # MoEMonitor: every stage's layers, counted over every micro-batch, on every rank
    assert result["monitor"].keys() == ref["monitor"].keys() and any("layers.3" in k for k in ref["monitor"])
    for key, value in ref["monitor"].items():
        assert result["monitor"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert ref["grads"] and any(name.endswith("router.weight") for name in ref["grads"])
    if clip is not None:  # the clip must bite, and the norm must include every stage
        assert ref["grad_norm"] > clip and result["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
    _assert_matches(result, ref, _dp_ranks(world, kwargs))


@pytest.mark.parametrize("world,kwargs,dp,clip", [
    (4, dict(pipeline_parallel_size=2), 2, 0.05),  # FSDP over DP2 inside each stage, clipped
    (2, dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2), 1, None),
])
def test_tied_embeddings_match_one_process(world, kwargs, dp, clip):
    """A tied embedding lives on the first stage (input) and the last (output projection): its
    gradient is the sum of both stages' (Megatron's embedding group), counted once in the norm."""
    result = run_distributed(train, world, kwargs, dp, STEPS, 2, CONFIGS["tied"], clip, 0.5, None, None, False, True,
                             1, "cpu", "32-true", True, timeout=180)[0]
    ref = reference(2 * dp, clip, "tied")
    assert "model.lm_head.weight" not in ref["state"]
    if clip is not None:
        assert ref["grad_norm"] > clip and result["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
    _assert_matches(result, ref, _dp_ranks(world, kwargs))
    assert result["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)


def test_multi_head_latent_attention_under_pipeline_and_tensor_parallelism():
    """DeepSeek's attention (MLA, its heads split by TP) through PP2 x TP2 equals one process."""
    kwargs = dict(pipeline_parallel_size=2, tensor_parallel_size=2)
    result = run_distributed(train, 4, kwargs, 1, STEPS, 2, CONFIGS["mla"], None, 0.5, None, None, False, True, 1,
                             "cpu", "32-true", True, timeout=180)[0]
    ref = reference(2, None, "mla")
    assert any("kv_a_proj_with_mqa" in name for name in ref["grads"])
    _assert_matches(result, ref, _dp_ranks(4, kwargs))


def test_manual_optimization_matches_one_process():
    """A training_step that zeroes, calls model.loss (the pipeline's forward and backward),
    manual_backward, clips and steps itself trains like one process with automatic optimization."""
    clip = 0.05
    result = run_distributed(train, 2, dict(pipeline_parallel_size=2), 1, STEPS, 2, CONFIG, clip, 0.5, None, None,
                             False, False, 1, "cpu", "32-true", False, None, True, timeout=180)[0]
    ref = reference(2, clip)
    assert ref["grad_norm"] > clip and result["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
    _assert_matches(result, ref, [0])


def test_pipeline_under_gradient_accumulation():
    """accumulate_grad_batches=2 over batches of 2 pipeline micro-batches equals 4 accumulated
    micro-batches in one process: the gradients of both batches add up, clipped by one norm."""
    clip = 0.05
    result = run_distributed(train, 2, dict(pipeline_parallel_size=2), 1, STEPS, 2, CONFIG, clip, 0.5, None, None,
                             False, False, 2, timeout=180)[0]
    ref = reference(4, clip)
    assert ref["grad_norm"] > clip and result["grad_norm"] == pytest.approx(ref["grad_norm"], abs=1e-5)
    _assert_matches(result, ref, [0])


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_resumes_across_pipeline_sizes(tmp_path, tied):
    """PP2 trains 2 steps and saves; PP1 (one process) and PP4 resume it for a third step, which
    equals the third step of an uninterrupted one-process run (losses, gradients, parameters). The
    PP2 run's consolidated export holds every stage's tensors. With a tied embedding both the first
    and the last stage save it (under one name).

    Every run takes a step's 4 micro-batches as one batch (the one-process runs unsplit): with
    the per-sequence aux loss the gradients do not depend on the micro-batch partition, and no
    run accumulates over batches (Lightning does not realign its accumulation counters when a run
    resumes in the middle of an epoch)."""
    base = CONFIGS["tied" if tied else "untied"]
    micro, config = 4, {**base, "moe": {**base["moe"], "router_load_balancing_type": "seq_aux_loss"}}
    saved, exported = str(tmp_path / "pp2"), str(tmp_path / "pp2_consolidated.pt")
    pp2 = run_distributed(train, 2, dict(pipeline_parallel_size=2), 1, 2, micro, config, None, 0.5, saved, None,
                          False, False, 1, "cpu", "32-true", False, exported, timeout=180)[0]
    # export_consolidated gathers both stages' tensors into rank 0's file
    consolidated = torch.load(exported, weights_only=True)
    assert consolidated.keys() == pp2["state"].keys()
    for name, value in pp2["state"].items():
        torch.testing.assert_close(consolidated[name].float(), torch.from_numpy(value), rtol=0, atol=0, msg=name)
    ref = run_distributed(train, 1, {}, 1, 3, micro, config, None, 0.5, None, None, True, timeout=120)[0]
    ref_last = {**ref, "rank_losses": ref["rank_losses"][:, 2:]}
    pp1 = run_distributed(train, 1, {}, 1, 1, micro, config, None, 0.5, None, saved, True, timeout=120)[0]
    _assert_matches(pp1, ref_last, [0])
    pp4 = run_distributed(train, 4, dict(pipeline_parallel_size=4), 1, 1, micro, config, None, 0.5, None, saved,
                          timeout=180)[0]
    _assert_matches(pp4, ref_last, [0])


def _validate(rank, world_size, strategy_kwargs):
    import lightning as L
    from torch.utils.data import DataLoader

    from _parity import MicroBatches, _module
    from lightning_moe import MegatronMoEStrategy

    torch.manual_seed(0)
    items = MicroBatches(4, seed=11)
    cat = [{k: torch.cat([items[i][k] for i in idx]) for k in ("input_ids", "labels")} for idx in ([0, 1], [2, 3])]
    batches = [cat[0], {k: v[:3] for k, v in cat[1].items()}]  # 4 sequences, then 3
    trainer = L.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        strategy=MegatronMoEStrategy(print_layout=False, **strategy_kwargs))
    return trainer.validate(_module(CONFIG, 0.5), DataLoader(batches, batch_size=None), verbose=False)[0]["val/loss"]


def test_validation_batches_the_micro_batches_do_not_divide():
    """A last validation batch of 3 sequences under pipeline_microbatches=2 runs as the most
    micro-batches that divide it; the loss equals one process's."""
    ref = run_distributed(_validate, 1, {}, timeout=120)[0]
    for kwargs in (dict(pipeline_parallel_size=2, pipeline_microbatches=2),
                   dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2,
                        pipeline_microbatches=2)):
        assert run_distributed(_validate, 2, kwargs, timeout=120) == [pytest.approx(ref, abs=1e-5)] * 2


@pytest.mark.parametrize("kwargs,dp,precision", [
    (dict(pipeline_parallel_size=2), 2, "bf16-mixed"),  # FSDP computes in bf16: bf16 between the stages
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), 1, "bf16-true"),  # bf16 weights, sequence shards
])
def test_bf16_stage_boundaries(kwargs, dp, precision):
    """The stages' hidden states are declared statically with the dense compute dtype: a wrong
    declaration fails the schedule's metadata check. bf16 training then stays near fp32's."""
    result = run_distributed(train, 4, kwargs, dp, STEPS, 2, CONFIG, None, 0.5, None, None, False, True, 1, "cpu",
                             precision, timeout=180)[0]
    ref = reference(2 * dp, None)
    losses = torch.from_numpy(result["rank_losses"])[_dp_ranks(4, kwargs)].mean(0)
    torch.testing.assert_close(losses, torch.from_numpy(ref["rank_losses"][0]), rtol=0, atol=3e-2)
    assert result["val_loss"] == pytest.approx(ref["val_loss"], abs=3e-2)


def _user_model_run(rank, world_size, strategy_kwargs, steps, microbatches):
    """A model of one's own with the split hook (no MoE): embedding, 4 residual MLP blocks, head."""
    import lightning as L
    from types import SimpleNamespace
    from torch import nn
    from torch.utils.data import DataLoader

    from _parity import MicroBatches, VOCAB
    from _pipeline_parity import PipelineBatches, full_grads
    from lightning_moe import MegatronMoEStrategy

    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Chunk(nn.Module):
        def __init__(self, embed, blocks, head):
            super().__init__()
            self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

        def forward(self, x, labels):
            h = self.embed(x) if self.embed is not None else x
            for block in self.blocks:
                h = block(h)
            if self.head is None:
                return h
            logits = self.head(h).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    class TinyLM(nn.Module):
        def __init__(self, dim=16):
            super().__init__()
            self.config = SimpleNamespace(hidden_size=dim)
            self.embed = nn.Embedding(VOCAB, dim)
            self.blocks = nn.ModuleDict({str(i): Block(dim) for i in range(4)})
            self.head = nn.Linear(dim, VOCAB)
            self.pipeline_runner = None

        def loss(self, input_ids, labels):
            if self.pipeline_runner is not None:
                return self.pipeline_runner(input_ids, labels=labels)
            return Chunk(self.embed, list(self.blocks.values()), self.head)(input_ids, labels) / labels.numel()

        def pipeline_layers(self):
            return [f"blocks.{i}" for i in self.blocks]

        def pipeline_edge_modules(self):
            return ["embed"], ["head"]

        def pipeline_prune(self, keep, first, last):
            for name in list(self.blocks):
                if f"blocks.{name}" not in keep:
                    del self.blocks[name]
            self.embed = self.embed if first else None
            self.head = self.head if last else None

        def pipeline_chunk(self, layer_names, first, last):
            return Chunk(self.embed if first else None, [self.get_submodule(n) for n in layer_names],
                         self.head if last else None)

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = TinyLM()

        def training_step(self, batch, batch_idx):
            return self.model.loss(batch["input_ids"], batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    pipelined = strategy_kwargs.get("pipeline_parallel_size", 1) > 1
    data = PipelineBatches(MicroBatches(64), microbatches, 1, 0)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0,
                        strategy=MegatronMoEStrategy(print_layout=False, **strategy_kwargs))
    module = Module()
    trainer.fit(module, DataLoader(data, batch_size=None, sampler=list(range(steps))))
    assert pipelined == (module.model.pipeline_runner is not None)
    return full_grads(trainer.strategy.model)


def test_a_model_of_ones_own_with_the_split_hook():
    """The documented split hook on a model that is not the reference decoder: PP2 and PP2 x 2
    virtual stages give the gradients of one process."""
    ref = run_distributed(_user_model_run, 1, {}, STEPS, 4, timeout=120)[0]
    for kwargs in (dict(pipeline_parallel_size=2, pipeline_microbatches=4),
                   dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2,
                        pipeline_microbatches=4)):
        result = run_distributed(_user_model_run, 2, kwargs, STEPS, 4, timeout=120)[0]
        assert result.keys() == ref.keys() and len(ref) == 11  # embedding, 4 x (weight, bias), head (weight, bias)
        for name, value in ref.items():
            torch.testing.assert_close(torch.from_numpy(result[name]), torch.from_numpy(value), rtol=0, atol=1e-5,
                                       msg=name)
