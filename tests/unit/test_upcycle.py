"""Upcycling: the upcycled model's step-0 logits equal the dense model's; it trains; the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_moe.models import MoEDecoder, ModelConfig, upcycle
from lightning_moe.models.decoder import DenseMLP
from lightning_moe.models.upcycle import upcycle_mlp, upcycled_config
from lightning_moe.nn import MoELayer


def _dense_model(seed: int = 0, **overrides) -> MoEDecoder:
    torch.manual_seed(seed)
    fields = dict(vocab_size=97, hidden_size=32, num_layers=3, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, max_seq_length=64)
    fields.update(overrides)
    return MoEDecoder(ModelConfig(**fields))


def _tokens(batch: int = 2, seq: int = 16, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "num_experts, topk, granularity, fields",
    [
        (4, 2, 1, {}),  # softmax over the top-2 logits, every expert a copy
        (8, 2, 1, {"router_score_function": "sigmoid"}),
        (8, 2, 2, {}),  # granular: blocks of 2 half-width experts, one block per token
        (12, 6, 3, {"router_topk_scaling_factor": 2.5}),  # two blocks per token, scaled probabilities
        (8, 4, 2, {"router_num_groups": 2, "router_group_topk": 1}),
        (8, 2, 2, {"shared_expert_intermediate_size": 16, "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}),
        (8, 4, 4, {"router_score_function": "sigmoid", "router_enable_expert_bias": True}),
        (8, 1, 1, {"router_score_function": "sigmoid", "router_topk_renormalize": True}),  # one weight, 1
        (8, 2, 2, {"router_pre_softmax": True, "router_topk_renormalize": True}),
    ],
)
def test_upcycled_logits_equal_the_dense_model(num_experts, topk, granularity, fields):
    dense = _dense_model()
    moe = upcycle(copy.deepcopy(dense), num_experts=num_experts, router_topk=topk, granularity=granularity, **fields)
    assert sum(1 for _ in moe.moe_layers()) == 3
    assert moe.config.moe_layer_pattern == [True] * 3 and moe.config.moe.num_experts == num_experts
    ids = _tokens()
    for mode in ("eval", "train"):
        getattr(dense, mode)()
        getattr(moe, mode)()
        torch.testing.assert_close(moe(ids), dense(ids), rtol=1e-5, atol=2e-6)


def test_granular_experts_are_the_dense_shards_and_blocks_share_router_rows():
    dense = DenseMLP(8, 12, init_std=0.02, output_init_std=0.01)
    cfg = upcycled_config(dense, num_experts=6, router_topk=3, granularity=3)
    layer = upcycle_mlp(dense, cfg, granularity=3)
    assert cfg.ffn_hidden_size == 4
    fc1, fc2 = layer.experts.fc1_weight, layer.experts.fc2_weight
    for e in range(6):
        cols = slice(4 * (e % 3), 4 * (e % 3) + 4)
        torch.testing.assert_close(fc1[e, :, 0, :], dense.gate_proj.weight[cols].T, rtol=0, atol=0)
        torch.testing.assert_close(fc1[e, :, 1, :], dense.up_proj.weight[cols].T, rtol=0, atol=0)
        torch.testing.assert_close(fc2[e], 3.0 * dense.down_proj.weight[:, cols].T, rtol=0, atol=0)
        torch.testing.assert_close(layer.router.weight[e], layer.router.weight[3 * (e // 3)], rtol=0, atol=0)
    assert not torch.equal(layer.router.weight[0], layer.router.weight[3])
    x = torch.randn(5, 7, 8)
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("granularity", [1, 2])
def test_the_upcycled_model_trains_and_its_experts_diverge(granularity):
    model = upcycle(_dense_model(seed=3), num_experts=4, router_topk=2, granularity=granularity,
                    aux_loss_coeff=1e-2)
    ids = _tokens(batch=4, seq=32, seed=5)
    labels = torch.roll(ids, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model.loss(ids, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    layer = next(model.moe_layers())
    fc1 = layer.experts.fc1_weight.detach()
    # experts that started equal (the same shard in every block) no longer are
    assert not torch.allclose(fc1[0], fc1[granularity], atol=1e-6)
    router = layer.router.weight.detach()
    assert not torch.allclose(router[0], router[1], atol=1e-7)  # block-mates (granular) drift apart too


def test_a_lightning_module_gets_its_config_and_hyperparameters_updated():
    from lightning_moe.models import MoELanguageModel

    module = MoELanguageModel(dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   ffn_hidden_size=48))
    with pytest.raises(ValueError, match="configure_model"):
        upcycle(module, num_experts=4, router_topk=2)
    module.configure_model()
    upcycle(module, num_experts=4, router_topk=2, layers=[1])
    assert isinstance(module.model.layers["1"].mlp, MoELayer)
    assert isinstance(module.model.layers["0"].mlp, DenseMLP)
    assert module.model_config.moe_layer_pattern == [False, True]
    assert module.hparams_initial["config"]["moe_layer_freq"] == [0, 1]  # what loggers write
    rebuilt = MoELanguageModel(module.hparams["config"])
    rebuilt.configure_model()
    rebuilt.model.load_state_dict(module.model.state_dict())  # the same parameter names and shapes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=8, router_topk=3, granularity=2), "multiple of granularity"),
        (dict(num_experts=8, router_topk=2, router_pre_softmax=True), "router_pre_softmax"),
        (dict(num_experts=8, router_topk=1, router_score_function="sigmoid"), "sigmoid"),
        (dict(num_experts=8, router_topk=2, router_score_function="sigmoid", router_topk_renormalize=False),
         "router_topk_renormalize=True"),
        (dict(num_experts=8, router_topk=2, expert_capacity_factor=1.0), "expert_capacity_factor"),
        (dict(num_experts=8, router_topk=4, granularity=4, router_num_groups=4, router_group_topk=2), "groups"),
    ],
)
def test_settings_that_cannot_be_exact_are_refused_unless_opted_out(kwargs, message):
    with pytest.raises(ValueError, match=message):
        upcycle(_dense_model(), **kwargs)
    upcycle(_dense_model(), exact=False, **kwargs)  # built anyway when asked


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=10, router_topk=5, granularity=5), "must divide the dense ffn_hidden_size"),
        (dict(num_experts=4, router_topk=2, granularity=0), "int >= 1"),
        (dict(num_experts=9, router_topk=2, granularity=2), "multiple of granularity"),
        (dict(num_experts=4, router_topk=2, ffn_hidden_size=8), "follow from the dense MLP"),
        (dict(num_experts=4, router_topk=2, router_top_k=2), "did you mean 'router_topk'"),
        (dict(num_experts=4, router_topk=2, layers=[7]), "do not exist"),
    ],
)
def test_invalid_arguments_fail_early(kwargs, message):
    with pytest.raises(ValueError, match=message):
        upcycle(_dense_model(), **kwargs)


def test_an_moe_model_with_no_dense_layer_is_refused():
    model = upcycle(_dense_model(), num_experts=4, router_topk=2)
    with pytest.raises(ValueError, match="no dense"):
        upcycle(model, num_experts=4, router_topk=2)


def test_an_upcycled_lightning_module_fits_and_keeps_its_weights(tmp_path):
    from lightning.pytorch import Trainer

    from lightning_moe.models import MoELanguageModel

    module = MoELanguageModel(dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   ffn_hidden_size=48, max_seq_length=16), learning_rate=1e-5, warmup_steps=1)
    module.configure_model()
    dense = copy.deepcopy(module.model)
    upcycle(module, num_experts=4, router_topk=2, granularity=2)
    ids = _tokens(batch=8, seq=17, seed=4)
    data = [{"input_ids": ids[i : i + 2, :-1], "labels": ids[i : i + 2, 1:]} for i in range(0, 8, 2)]
    torch.testing.assert_close(module.model(data[0]["input_ids"]), dense(data[0]["input_ids"]), rtol=1e-5, atol=2e-6)
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    layer = module.model.layers["0"].mlp
    assert isinstance(layer, MoELayer) and trainer.global_step == 4
    # trained from the upcycled weights (not re-initialised): still close to the dense model's output
    logits = module.model(data[0]["input_ids"])
    assert (logits - dense(data[0]["input_ids"])).abs().max() < 0.02
    trainer.save_checkpoint(tmp_path / "upcycled.ckpt")
    restored = MoELanguageModel.load_from_checkpoint(tmp_path / "upcycled.ckpt", weights_only=True)
    assert restored.model_config.moe_layer_pattern == [True, True]
    torch.testing.assert_close(restored.model(data[0]["input_ids"]), logits, rtol=0, atol=0)


def test_an_upcycled_model_exports_to_transformers_with_the_dense_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_moe.models import MoELanguageModel

    torch.manual_seed(0)
    module = MoELanguageModel(dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=48, max_seq_length=16, qk_norm=True))
    module.configure_model()
    ids = _tokens(seq=10)
    with torch.no_grad():
        want = module.model(ids)
    upcycle(module, num_experts=4, router_topk=2, granularity=2)
    module.save_hf(tmp_path / "hf")  # Qwen3-MoE: softmax then top-k renormalised, as the upcycled router
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.model_type == "qwen3_moe"
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=2e-6)
