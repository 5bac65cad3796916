"""Upcycling dense HF checkpoints (CPU, fp32): ``upcycle(from_hf(dense_dir), ...)`` gives transformers'
dense logits at step 0, trains, and ``save_hf`` writes the MoE family of the dense one (Qwen3 ->
Qwen3-MoE, Llama -> Mixtral, Qwen2 with a gated shared expert -> Qwen2-MoE), which transformers
loads to the upcycled model's logits; what no MoE family expresses is refused, naming it."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_moe.models import MoELanguageModel, upcycle  # noqa: E402
from _hf_checks import relative_error  # noqa: E402

TOKEN_IDS = dict(bos_token_id=3, eos_token_id=4, pad_token_id=5)  # not any family's defaults
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **TOKEN_IDS)
DENSE = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
IDS = torch.randint(0, COMMON["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(1))


def save_dense(family, path):
    """A tiny random transformers model of ``family`` saved at ``path``; returns its logits on IDS."""
    config_name, model_name = DENSE[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms at 1, biases at 0: make them matter
                param.add_(0.1 * torch.randn_like(param))
        logits = model(IDS).logits
    model.save_pretrained(path)
    return logits


def train(module, steps=4):
    """A few AdamW steps of the module's own loss on IDS; returns the losses."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    inputs, labels = IDS[:, :-1], IDS[:, 1:]
    losses = []
    for _ in range(steps):
        loss = module.model.loss(inputs, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "family, exported, kwargs",
    [
        ("qwen3", "qwen3_moe", dict(num_experts=4, router_topk=2, granularity=2)),
        ("llama", "mixtral", dict(num_experts=4, router_topk=2, granularity=1)),
        ("qwen2", "qwen2_moe", dict(num_experts=6, router_topk=3, granularity=3, shared_expert_intermediate_size=16,
                                    shared_expert_gate=True)),
    ],
)
def test_upcycled_hf_model_equals_the_dense_one_trains_and_exports(tmp_path, family, exported, kwargs):
    want = save_dense(family, tmp_path / "dense")
    module = upcycle(MoELanguageModel.from_hf(tmp_path / "dense"), **kwargs)
    assert module.model_config.num_moe_layers == 2
    with torch.no_grad():
        assert relative_error(module.eval()(IDS), want) < 1e-4
    module.save_hf(tmp_path / "step0")
    config = json.loads((tmp_path / "step0" / "config.json").read_text())
    assert config["model_type"] == exported and TOKEN_IDS.items() <= config.items()  # the dense model's ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "step0").eval()
    with torch.no_grad():
        assert relative_error(hf(IDS).logits, want) < 1e-4

    losses = train(module.train())
    assert losses[-1] < losses[0], losses
    module.save_hf(tmp_path / "trained")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    with torch.no_grad():
        got = module.eval()(IDS)
        assert relative_error(got, want) > 1e-3  # it did train
        assert relative_error(hf(IDS).logits, got) < 1e-4


def test_upcycled_qwen3_keeps_its_dense_blocks_in_qwen3_moe(tmp_path):
    want = save_dense("qwen3", tmp_path / "dense")
    module = upcycle(MoELanguageModel.from_hf(tmp_path / "dense"), num_experts=4, router_topk=2, layers=[1])
    module.save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(hf(IDS).logits, want) < 1e-4


def test_what_no_moe_family_expresses_is_refused(tmp_path):
    save_dense("qwen2", tmp_path / "qwen2")
    module = upcycle(MoELanguageModel.from_hf(tmp_path / "qwen2"), num_experts=4, router_topk=2)
    # q/k/v biases without Qwen2-MoE's gated shared expert
    with pytest.raises(ValueError, match="qwen2_moe: no gated shared expert"):
        module.save_hf(tmp_path / "out")
    save_dense("llama", tmp_path / "llama")
    module = upcycle(MoELanguageModel.from_hf(tmp_path / "llama"), num_experts=4, router_topk=2, layers=[0])
    # Mixtral has no dense blocks, Qwen3-MoE has qk-norm
    with pytest.raises(ValueError, match="mixtral: dense blocks"):
        module.save_hf(tmp_path / "out")



def test_a_checkpoint_of_the_upcycled_module_still_exports_the_moe_family_with_the_token_ids(tmp_path):
    import lightning as L

    save_dense("llama", tmp_path / "dense")
    module = upcycle(MoELanguageModel.from_hf(tmp_path / "dense", module_kwargs=dict(warmup_steps=1)),
                     num_experts=4, router_topk=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    data = [{"input_ids": IDS[i : i + 2, :-1], "labels": IDS[i : i + 2, 1:]} for i in (0, 2)]
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    trainer.save_checkpoint(tmp_path / "upcycled.ckpt")
    restored = MoELanguageModel.load_from_checkpoint(tmp_path / "upcycled.ckpt", weights_only=True)
    restored.save_hf(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and TOKEN_IDS.items() <= config.items()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert relative_error(hf(IDS).logits, restored.eval()(IDS)) < 1e-4
