"""HF checkpoints under MegatronMoEStrategy on 2 gloo ranks (EP=2, TP=2 for every architecture, ETP=2):
each rank reads only the blocks it holds, the parallel model's logits equal transformers', and ``save_hf`` from the
sharded model writes a checkpoint transformers loads back to the same logits.

The module comes from ``from_hf(materialize=False)``: the strategy builds the decoder on the meta
device, shards it (experts over EP as DTensor ``Shard(0)``, dense layers over TP, FSDP2 over DP)
and materializes it; the module then reads the HF weights before validation starts.
"""

import json
from pathlib import Path

import pytest
import torch
from _launch import run_distributed

transformers = pytest.importorskip("transformers")

WORLD = 2
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2)
ARCHITECTURES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, pad_token_id=0, eos_token_id=1)),
}
IDS = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))


def save_hf_model(arch, path):
    config_name, model_name, kwargs = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **kwargs)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms at 1, biases at 0: make them matter
                param.add_(0.1 * torch.randn_like(param))
        logits = model(IDS).logits
    model.save_pretrained(path)
    return logits


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def _validate(module, strategy_kwargs, world_size, check, ckpt_path=None):
    """One validation run of ``module`` under MegatronMoEStrategy; ``check(module)`` runs after it."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy

    class Check(Callback):
        def on_validation_end(self, trainer, module):
            check(module.eval())

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MegatronMoEStrategy(print_layout=False, **strategy_kwargs),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Check()], use_distributed_sampler=False,
    )
    batch = {"input_ids": IDS, "labels": torch.roll(IDS, -1, dims=1)}
    trainer.validate(module, dataloaders=DataLoader([batch], batch_size=None), ckpt_path=ckpt_path, verbose=False)


def _import_check_export(rank, world_size, hf_dir, out_dir, strategy_kwargs, want):
    from torch.distributed.tensor import DTensor

    from lightning_moe.models import MoELanguageModel
    from lightning_moe.models.hf import SafetensorsCheckpoint, load_hf_weights
    from lightning_moe.models.hf.transfer import bytes_of

    report = {}

    @torch.no_grad()
    def check(module):
        report["error"] = relative_error(module(IDS), want)
        # read again into zeroed shards: the bytes this rank reads are its blocks only
        for param in module.model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).data.zero_()
        report["bytes_read"] = load_hf_weights(module.model, hf_dir, module.hf_source["model_type"])
        report["local_bytes"] = bytes_of(module.model)  # fp32 shards of an fp32 checkpoint
        report["error_reloaded"] = relative_error(module(IDS), want)
        report["sharded"] = sorted(n for n, p in module.model.named_parameters() if isinstance(p, DTensor))
        module.save_hf(out_dir)

    _validate(MoELanguageModel.from_hf(hf_dir, materialize=False), strategy_kwargs, world_size, check)
    with SafetensorsCheckpoint(hf_dir) as checkpoint:
        report["checkpoint_bytes"] = sum(
            checkpoint.dtype(n).itemsize * torch.Size(checkpoint.shape(n)).numel() for n in checkpoint.names()
        )
    return report


def _restore_converted(rank, world_size, ckpt_dir, strategy_kwargs, want):
    """A converted checkpoint restored by the strategy (``ckpt_path``; DCP reshards it)."""
    from lightning_moe.models import MoELanguageModel

    report = {}

    @torch.no_grad()
    def check(module):
        report["error"] = relative_error(module(IDS), want)

    meta = torch.load(Path(ckpt_dir) / "meta.pt", weights_only=True)
    _validate(MoELanguageModel(**meta["hyper_parameters"]), strategy_kwargs, world_size, check, ckpt_path=ckpt_dir)
    return report


CASES = [("qwen3_moe", "ep2"), ("qwen2_moe", "ep2"), ("mixtral", "ep2"), ("olmoe", "ep2"),
         ("qwen3_moe", "tp2"), ("qwen2_moe", "tp2"), ("mixtral", "tp2"), ("olmoe", "tp2"), ("qwen3_moe", "etp2")]
LAYOUTS = {"ep2": dict(expert_parallel_size=2), "tp2": dict(tensor_parallel_size=2),
           "etp2": dict(expert_tensor_parallel_size=2)}


@pytest.mark.parametrize("arch, layout", CASES)
def test_parallel_import_and_export_match_transformers(tmp_path, arch, layout):
    want = save_hf_model(arch, tmp_path / "hf")
    reports = run_distributed(_import_check_export, WORLD, str(tmp_path / "hf"), str(tmp_path / "out"),
                              LAYOUTS[layout], want, timeout=120)
    for report in reports:
        assert report["error"] < 1e-4 and report["error_reloaded"] < 1e-4, report
        if layout in ("ep2", "etp2"):
            assert any("experts.fc1_weight" in n for n in report["sharded"])
        else:
            assert any("attention.q_proj" in n for n in report["sharded"])
            if arch == "olmoe":  # the qk-norm over whole projections is split like the heads
                assert any("attention.q_norm" in n for n in report["sharded"]), report["sharded"]
        # A rank reads exactly its local blocks: experts split by EP, by ETP (FFN columns) or by
        # FSDP over EDP=2 (under TP=2), attention and vocabulary by TP, dense blocks by FSDP over
        # DP=2 (under EP=2 and ETP=2); only routers and shared experts are whole on both ranks.
        assert report["bytes_read"] == report["local_bytes"] < 0.7 * report["checkpoint_bytes"], report
    assert sum(r["bytes_read"] for r in reports) >= reports[0]["checkpoint_bytes"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == arch
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(IDS).logits, want) < 1e-4


def test_converted_checkpoint_loads_under_expert_parallelism(tmp_path):
    from lightning_moe.models.hf.convert import hf_to_checkpoint

    want = save_hf_model("qwen2_moe", tmp_path / "hf")
    hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
    reports = run_distributed(_restore_converted, WORLD, str(tmp_path / "ckpt"), LAYOUTS["ep2"], want, timeout=120)
    assert all(report["error"] < 1e-4 for report in reports), reports


def _first_training_loss(rank, world_size, hf_dir, strategy_kwargs):
    """The loss of the first training step of ``from_hf(materialize=False)`` under the strategy:
    the weights are read in ``on_fit_start``, before the step."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models import MoELanguageModel

    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MegatronMoEStrategy(print_layout=False, **strategy_kwargs),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()], use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    module = MoELanguageModel.from_hf(hf_dir, materialize=False, module_kwargs={"warmup_steps": 0})
    batch = {"input_ids": IDS, "labels": torch.roll(IDS, -1, dims=1)}
    trainer.fit(module, DataLoader([batch], batch_size=None))
    return losses[0]


def test_fit_starts_from_the_hf_weights(tmp_path):
    want = save_hf_model("mixtral", tmp_path / "hf")
    labels = torch.roll(IDS, -1, dims=1)
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, want.shape[-1]), labels.reshape(-1)).item()
    losses = run_distributed(_first_training_loss, WORLD, str(tmp_path / "hf"), LAYOUTS["ep2"], timeout=120)
    assert losses == pytest.approx([want_loss] * WORLD, rel=1e-5)


@pytest.mark.parametrize(
    "arch, strategy_kwargs",
    [
        # EP=2 x EDP=2: FSDP2 shards each rank's experts again (placements _StridedShard, Shard)
        ("qwen3_moe", dict(expert_parallel_size=2)),
        # TP=2 x DP=2 for dense layers, EP=2 x EDP=2 for experts
        ("mixtral", dict(expert_parallel_size=2, tensor_parallel_size=2)),
        # OLMoE's projection qk-norm: weight Shard(0) over TP, then FSDP2 over DP=2
        ("olmoe", dict(tensor_parallel_size=2)),
    ],
)
def test_four_ranks_read_their_nested_shards(tmp_path, arch, strategy_kwargs):
    want = save_hf_model(arch, tmp_path / "hf")
    reports = run_distributed(_import_check_export, 4, str(tmp_path / "hf"), str(tmp_path / "out"),
                              strategy_kwargs, want, timeout=120)
    for report in reports:
        assert report["error"] < 1e-4 and report["error_reloaded"] < 1e-4, report
        assert report["bytes_read"] == report["local_bytes"] < 0.45 * report["checkpoint_bytes"], report
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(IDS).logits, want) < 1e-4
