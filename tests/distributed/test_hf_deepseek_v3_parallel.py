"""A DeepSeek-V3 checkpoint under MegatronMoEStrategy on 2 gloo ranks (TP=2, EP=2): each rank reads
its blocks (under TP the interleaved rotary rows of its own heads of q_b_proj), the parallel
model's logits equal transformers', and ``save_hf`` from the sharded model reloads in transformers."""

import pytest
import torch
from _launch import run_distributed

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def save_hf_model(path):
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, num_nextn_predict_layers=0,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            if "experts" in name or name.endswith("gate.weight"):
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn_like(buffer))
        logits = model(IDS).logits
    model.save_pretrained(path)
    return logits


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def _run(rank, world_size, hf_dir, out_dir, strategy_kwargs, want):
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models import MoELanguageModel

    report = {}

    class Check(Callback):
        def on_validation_end(self, trainer, module):
            with torch.no_grad():
                report["error"] = relative_error(module.eval()(IDS), want)
            report["sharded"] = sorted(n for n, p in module.model.named_parameters() if isinstance(p, DTensor))
            module.save_hf(out_dir)

    module = MoELanguageModel.from_hf(hf_dir, materialize=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MegatronMoEStrategy(print_layout=False, **strategy_kwargs),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Check()], use_distributed_sampler=False,
    )
    batch = {"input_ids": IDS, "labels": torch.roll(IDS, -1, dims=1)}
    trainer.validate(module, dataloaders=DataLoader([batch], batch_size=None), verbose=False)
    return report


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(expert_parallel_size=2)], ids=["tp2", "ep2"])
def test_parallel_import_and_export_match_transformers(tmp_path, layout):
    want = save_hf_model(tmp_path / "hf")
    reports = run_distributed(_run, 2, str(tmp_path / "hf"), str(tmp_path / "out"), layout, want, timeout=120)
    for report in reports:
        assert report["error"] < 1e-4, report
        sharded = "attention.q_b_proj" if "tensor_parallel_size" in layout else "experts.fc1_weight"
        assert any(sharded in name for name in report["sharded"]), report
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(reloaded(IDS).logits, want) < 1e-4
