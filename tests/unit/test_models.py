"""Reference decoder, presets, parameter/FLOP accounting and the LightningModule, on CPU."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_moe.models import (
    ModelConfig,
    MoEDecoder,
    active_parameters,
    causal_lm_loss,
    get_preset,
    list_presets,
    model_flops_per_token,
    total_parameters,
)
from lightning_moe.models.decoder import DenseMLP
from lightning_moe.models.flops import forward_matmul_parameters
from lightning_moe.models.lightning_module import MoELanguageModel, parameter_groups, warmup_cosine_lr_factor
from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.moe_layer import MoELayer


def _tiny(**overrides):
    return get_preset("tiny", **{"num_layers": 2, **overrides})


def _rich_config():
    """Dense first block, then MoE blocks with every optional part: qk-norm, sigmoid routing with
    expert bias and groups, a gated shared expert."""
    return get_preset(
        "tiny",
        num_layers=3,
        first_k_dense_layers=1,
        qk_norm=True,
        moe={
            "router_score_function": "sigmoid",
            "router_enable_expert_bias": True,
            "router_num_groups": 4,
            "router_group_topk": 2,
            "shared_expert_intermediate_size": 64,
            "shared_expert_gate": True,
        },
    )


def _tokens(batch, seq, vocab=256, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg_fn", [_tiny, _rich_config, lambda: _tiny(moe=None, ffn_hidden_size=256)])
def test_forward_shapes_and_loss(cfg_fn):
    torch.manual_seed(0)
    cfg = cfg_fn()
    model = MoEDecoder(cfg)
    input_ids = _tokens(3, 17)
    logits = model(input_ids)
    assert logits.shape == (3, 17, cfg.vocab_size) and logits.dtype == torch.float32
    labels = torch.roll(input_ids, -1, dims=1)
    labels[:, -1] = -100
    loss = model.loss(input_ids, labels)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == total_parameters(cfg)


def test_loss_ignores_all_masked_batch_without_nan():
    logits = torch.randn(2, 4, 8, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((2, 4), -100))
    assert loss.item() == 0.0
    loss.backward()


def test_causal_masking():
    torch.manual_seed(0)
    model = MoEDecoder(_rich_config()).eval()
    input_ids = _tokens(2, 24)
    changed = input_ids.clone()
    changed[:, 12:] = _tokens(2, 12, seed=1)
    with torch.no_grad():
        a, b = model(input_ids), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_position_ids_default_and_batched():
    torch.manual_seed(0)
    model = MoEDecoder(_tiny()).eval()
    input_ids = _tokens(2, 10)
    with torch.no_grad():
        ref = model(input_ids)
        torch.testing.assert_close(model(input_ids, torch.arange(10)), ref)
        torch.testing.assert_close(model(input_ids, torch.arange(10).expand(2, 10)), ref)
        shifted = model(input_ids, torch.arange(10) + 5)
    assert not torch.allclose(shifted, ref)


def test_loss_decreases_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = MoEDecoder(_tiny())
    input_ids = _tokens(2, 32)
    labels = _tokens(2, 32, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model.loss(input_ids, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(256) - 0.5
    assert losses[-1] < 0.5 * losses[0], losses


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_meta_device_init_is_deterministic():
    cfg = _rich_config()
    torch.manual_seed(123)
    eager = MoEDecoder(cfg)
    torch.manual_seed(7)
    eager.init_weights()
    reference = _state(eager)

    for _ in range(2):
        with torch.device("meta"):
            model = MoEDecoder(cfg)
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        torch.manual_seed(7)
        model.init_weights()
        state = _state(model)
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)

    torch.manual_seed(8)
    model.init_weights()
    assert not torch.equal(model.embed_tokens.weight, reference["embed_tokens.weight"])
    # Router state is reset too (the expert bias buffer was uninitialised memory after to_empty).
    assert torch.count_nonzero(model.layers["1"].mlp.router.expert_bias) == 0


def test_init_scales():
    cfg = get_preset("tiny", num_layers=4, moe={"num_experts": 16})
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    std = cfg.init_method_std
    out_std = std / math.sqrt(2 * cfg.num_layers)
    assert model.embed_tokens.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.layers["0"].attention.q_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.layers["0"].attention.o_proj.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert model.layers["0"].mlp.experts.fc2_weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))


def test_tied_embeddings():
    cfg = _tiny(tie_word_embeddings=True)
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == total_parameters(cfg)
    assert total_parameters(cfg) == total_parameters(_tiny()) - cfg.vocab_size * cfg.hidden_size
    input_ids = _tokens(2, 8)
    logits = model(input_ids)
    torch.testing.assert_close(logits, model.hidden_states(input_ids) @ model.embed_tokens.weight.T)
    logits.sum().backward()
    # The gradient holds both the lookup rows and the output projection (every row).
    assert torch.count_nonzero(model.embed_tokens.weight.grad.abs().sum(dim=1)) == cfg.vocab_size
    with torch.device("meta"):
        meta = MoEDecoder(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert meta.output_weight() is meta.embed_tokens.weight


def test_first_k_dense_layers_and_layer_frequency():
    with torch.device("meta"):
        model = MoEDecoder(get_preset("deepseek_v3", num_layers=5))
    kinds = [type(layer.mlp) for layer in model.layers.values()]
    assert kinds == [DenseMLP] * 3 + [MoELayer] * 2
    assert model.layers["0"].mlp.gate_proj.weight.shape == (18432, 7168)
    assert model.layers["3"].mlp.shared_experts is not None
    assert len(list(model.moe_layers())) == 2

    cfg = _tiny(num_layers=5, first_k_dense_layers=1, moe_layer_freq=2)
    assert cfg.moe_layer_pattern == [False, False, True, False, True]
    cfg = _tiny(num_layers=3, moe_layer_freq=[0, 1, 1])
    assert cfg.moe_layer_pattern == [False, True, True]
    assert (cfg.num_dense_layers, cfg.num_moe_layers) == (1, 2)


# Published totals / active counts (embeddings included; DeepSeek-V3's without its MTP module).
PUBLISHED = {
    "qwen3_30b_a3b": (30.5e9, 3.3e9, 0.01, 0.03),
    "mixtral_8x7b": (46.7e9, 12.9e9, 0.01, 0.01),
    "deepseek_v3": (671e9, 37e9, 0.001, 0.02),
}


@pytest.mark.parametrize("name", list_presets())
def test_presets_build_on_meta_with_documented_parameter_counts(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = MoEDecoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == total_parameters(cfg)
    total, active = total_parameters(cfg), active_parameters(cfg)
    assert active < total
    if name in PUBLISHED:
        pub_total, pub_active, tol_total, tol_active = PUBLISHED[name]
        assert total == pytest.approx(pub_total, rel=tol_total)
        assert active == pytest.approx(pub_active, rel=tol_active)
    if name == "small":
        assert 100e6 <= total <= 300e6
    if name == "tiny":
        assert cfg.vocab_size == 256 and total < 3e6


def test_preset_overrides():
    cfg = get_preset("qwen3_30b_a3b", num_layers=2)
    assert cfg.num_layers == 2 and cfg.moe.num_experts == 128 and cfg.qk_norm
    full = get_preset("qwen3_30b_a3b")
    per_layer = (total_parameters(full) - total_parameters(cfg)) / 46
    assert total_parameters(cfg) == total_parameters(full) - 46 * per_layer
    cfg = get_preset("tiny", hidden_size=64, moe={"num_experts": 4})
    assert cfg.moe.hidden_size == 64 and cfg.moe.num_experts == 4 and cfg.moe.router_topk == 2
    assert get_preset("tiny", moe=None, ffn_hidden_size=64).moe is None
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        get_preset("tiny", num_experts=4)
    with pytest.raises(ValueError, match=r"'num_layer' \(did you mean 'num_layers'\?\)"):
        get_preset("tiny", num_layer=2)
    # a misspelled MoE field names the field and its likely spelling (not a bare TypeError)
    with pytest.raises(ValueError,
                       match=r"unknown MoEConfig field\(s\): 'router_top_k' \(did you mean 'router_topk'\?\)"):
        get_preset("tiny", moe={"router_top_k": 1})
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt5")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_attention_heads": 4, "num_query_groups": 3}, "multiple of num_query_groups"),
        ({"hidden_size": 100, "num_attention_heads": 3}, "set head_dim"),
        ({"head_dim": 7}, "even"),
        ({"moe": MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4)}, "make them equal"),
        ({"moe": None}, "set ffn_hidden_size"),
        ({"first_k_dense_layers": 5}, "first_k_dense_layers"),
        ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_config_validation_names_the_fix(kwargs, match):
    base = {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_layers": 4,
        "num_attention_heads": 4,
        "moe": {"ffn_hidden_size": 64, "num_experts": 4},
    }
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **kwargs})


def test_config_round_trips_through_plain_dict():
    cfg = _rich_config()
    data = cfg.to_dict()
    assert isinstance(data["moe"], dict)
    assert ModelConfig(**data) == cfg


def test_flops_match_counted_matmuls_and_parameters():
    # The loop expert backend runs plain matmuls, which FlopCounterMode counts exactly
    # (it does not count SDPA on CPU nor grouped GEMMs).
    cfg = get_preset(
        "tiny",
        num_layers=3,
        first_k_dense_layers=1,
        qk_norm=True,
        moe={"expert_backend": "loop", "shared_expert_intermediate_size": 64, "shared_expert_gate": True},
    )
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    batch, seq = 2, 32
    with FlopCounterMode(display=False) as counter:
        model(_tokens(batch, seq))
    counted_mm = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert counted_mm == 2 * forward_matmul_parameters(cfg) * batch * seq

    attention = 12 * cfg.num_layers * seq * cfg.num_attention_heads * cfg.head_dim
    assert model_flops_per_token(cfg, seq) == 6 * forward_matmul_parameters(cfg) + attention

    # Active = total minus the routed experts a token skips, from the built model's shapes.
    moe = next(model.moe_layers())
    expert_numel = (moe.experts.fc1_weight.numel() + moe.experts.fc2_weight.numel()) // cfg.moe.num_experts
    skipped = cfg.num_moe_layers * (cfg.moe.num_experts - cfg.moe.router_topk) * expert_numel
    assert active_parameters(cfg) == sum(p.numel() for p in model.parameters()) - skipped


def test_moe_flops_match_benchmark_formula():
    # BENCHMARKS.md counts an MoE block as 3 * (2*T*D*E + 3*2*T*k*D*F) (no shared experts).
    dense = get_preset("qwen3_30b_a3b", num_layers=1, moe=None)
    moe = get_preset("qwen3_30b_a3b", num_layers=1)
    D, F, E, k = 2048, 768, 128, 8
    diff = model_flops_per_token(moe, 4096) - model_flops_per_token(dense, 4096)
    assert diff == 3 * (2 * D * E + 3 * 2 * k * D * F) - 6 * 3 * D * dense.ffn_hidden_size


def test_parameter_groups_exclude_norms_router_and_gates():
    model = MoEDecoder(_rich_config())
    decay, no_decay = parameter_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert all("norm" in n or "router" in n or "gate_weight" in n for n in no_decay_names)
    assert "layers.1.mlp.router.weight" in no_decay_names
    assert "layers.1.mlp.shared_experts.gate_weight" in no_decay_names
    assert "layers.0.attention.q_norm.weight" in no_decay_names and "norm.weight" in no_decay_names
    assert {"embed_tokens.weight", "lm_head.weight", "layers.1.mlp.experts.fc1_weight"} <= decay_names
    assert len(decay_names) + len(no_decay_names) == len(names)


def test_warmup_cosine_schedule():
    f = lambda step: warmup_cosine_lr_factor(step, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert warmup_cosine_lr_factor(0, 0, 10, 0.0) == pytest.approx(1.0)


class _RandomTokens(Dataset):
    def __init__(self, n, seq):
        self.tokens = _tokens(n, seq + 1, seed=3)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def test_lightning_fit_logs_losses_and_lr(tmp_path):
    import csv

    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    module = MoELanguageModel("tiny", overrides={"num_layers": 2}, learning_rate=1e-3, warmup_steps=2)
    loader = DataLoader(_RandomTokens(8, 32), batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        limit_val_batches=2,
        val_check_interval=4,
        logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader, loader)
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/ppl", "train/lr", "train/aux_loss", "train/z_loss", "val/loss", "val/ppl"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert metrics["val/ppl"].item() == pytest.approx(math.exp(metrics["val/loss"].item()), rel=1e-5)
    assert trainer.global_step == 4
    assert all(moe.router.aux_loss_scale == 0.5 for moe in module.model.moe_layers())
    # The scheduler steps per optimizer step (warmup 2, cosine to step 4). Lightning writes the
    # metrics of steps 1 and 3; each written lr is the one that step used, not an older one.
    schedule = [1e-3 * warmup_cosine_lr_factor(step, 2, 4, 0.1) for step in range(5)]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        written = {int(row["step"]): float(row["train/lr"]) for row in csv.DictReader(f) if row.get("train/lr")}
    assert sorted(written) == [1, 3]
    assert all(lr == pytest.approx(schedule[step]) for step, lr in written.items())
    assert metrics["train/lr"].item() == pytest.approx(schedule[3])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(schedule[4])
    model = module.model
    module.configure_model()
    assert module.model is model


def test_lightning_fast_dev_run_and_config_forms():
    from lightning.pytorch import Trainer

    cfg = _tiny(num_layers=1)
    module = MoELanguageModel(cfg.to_dict(), overrides={"qk_norm": True}, max_steps=10)
    assert module.model_config.qk_norm and module.hparams["config"]["qk_norm"]
    loader = DataLoader(_RandomTokens(4, 16), batch_size=2)
    trainer = Trainer(
        accelerator="cpu", fast_dev_run=2, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, loader, loader)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert MoELanguageModel(cfg).model_config == cfg
    with pytest.raises(ValueError, match="min_lr_ratio"):
        MoELanguageModel("tiny", min_lr_ratio=2.0)


def test_bf16_clipping_with_a_fused_optimizer_through_the_strategy():
    """Lightning refuses to clip for optimizers that unscale gradients themselves (a GradScaler
    concern); under bf16 there is no scaler, so the strategy lets fused AdamW clip (the GPU
    training benchmark builds fused AdamW)."""
    from lightning.pytorch import Trainer

    from lightning_moe import MegatronMoEStrategy

    class FusedAdamW(MoELanguageModel):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    module = FusedAdamW("tiny", overrides={"num_layers": 1}, max_steps=2)
    loader = DataLoader(_RandomTokens(4, 16), batch_size=2)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=MegatronMoEStrategy(print_layout=False), precision="bf16-mixed",
        max_steps=2, gradient_clip_val=1e-3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module, loader)
    finally:  # the strategy initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 2
    assert trainer.strategy.last_grad_norm is not None and float(trainer.strategy.last_grad_norm) > 1e-3
