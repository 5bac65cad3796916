"""Training under FP8: convergence against bf16, the Lightning plugin, checkpoints with FP8
switched on/off, module selection, and AdamW with bf16 moments."""

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.precision import (
    AdamWBF16Moments,
    FP8GroupedGemm,
    FP8Linear,
    FP8Precision,
    configure_fp8,
)

VOCAB, EMBED, CONTEXT = 64, 32, 4


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class ToyExperts(nn.Module):
    """Stands in for GroupedExperts: fused expert weights and a ``quantization`` slot."""

    def __init__(self, experts: int, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.fc2_weight = nn.Parameter(torch.randn(experts, hidden, d) / hidden**0.5)
        self.quantization = None

    def forward(self, x_RD, offsets_E):
        if self.quantization is None:
            def mm(a, b, offs, projection):
                return torch._grouped_mm(a, b.to(a.dtype), offs=offs)
        else:
            mm = self.quantization.grouped_mm  # the projection names pick separate delayed scales
        return mm(F.relu(mm(x_RD, self.fc1_weight, offsets_E, "fc1")), self.fc2_weight, offsets_E, "fc2")


class MoEBlock(nn.Module):
    def __init__(self, d: int, hidden: int, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = ToyExperts(experts, d, hidden)

    def forward(self, h):
        x = self.norm(h)
        probs = self.router(x.float()).softmax(-1)
        top_p, top_e = probs.max(-1)
        order = torch.argsort(top_e, stable=True)
        offsets = torch.bincount(top_e, minlength=probs.shape[-1]).cumsum(0).to(torch.int32)
        y = torch.empty_like(x)
        y[order] = self.experts(x[order].contiguous(), offsets).to(y.dtype)
        return h + y * top_p[:, None].to(y.dtype)


class TinyLM(nn.Module):
    """Predicts the next token from the previous four (an MLP language model)."""

    def __init__(self, d: int = 64, hidden: int = 128, moe: bool = False, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.in_proj = nn.Linear(CONTEXT * EMBED, d)
        self.layers = nn.ModuleList([Block(d, hidden), MoEBlock(d, hidden) if moe else Block(d, hidden)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)
        if tie:
            self.out = nn.Linear(EMBED, VOCAB, bias=False)
            self.out.weight = self.embed.weight

    def forward(self, tokens):
        h = self.in_proj(self.embed(tokens).flatten(1))
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def batches(steps: int, batch: int = 64, seed: int = 0):
    """Next token = a fixed random function of the last two tokens, with 10% noise."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    for _ in range(steps):
        ctx = torch.randint(0, VOCAB, (batch, CONTEXT), generator=g)
        nxt = table[ctx[:, -1], ctx[:, -2] % 4]
        noisy = torch.rand(batch, generator=g) < 0.1
        yield ctx, torch.where(noisy, torch.randint(0, VOCAB, (batch,), generator=g), nxt)


def train(recipe=None, steps=300, optimizer=torch.optim.AdamW, autocast=True) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM()
    plugin = FP8Precision(recipe, device="cpu") if recipe else None
    if plugin:
        plugin.convert_module(model)
    opt = optimizer(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for ctx, nxt in batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(ctx).float(), nxt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if plugin:
            plugin.update_delayed_scaling()
        losses.append(loss.item())
    return losses


def _final(losses):
    return sum(losses[-25:]) / 25


@functools.cache
def _bf16_final() -> float:
    return _final(train(None))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_training_matches_bf16(recipe):
    losses = train(recipe)
    assert losses[0] > 4.0 and _final(losses) < 1.3  # it learned (chance level is ln 64 = 4.16)
    assert abs(_final(losses) - _bf16_final()) / _bf16_final() < 0.02


def test_bf16_moments_halve_state_and_track_fp32():
    def moment_bytes(opt):
        return sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))

    model = TinyLM()
    ref, ours = torch.optim.AdamW(model.parameters()), AdamWBF16Moments(model.parameters())
    model(torch.zeros(2, CONTEXT, dtype=torch.long)).sum().backward()
    ref.step()
    ours.step()
    assert moment_bytes(ours) * 2 == moment_bytes(ref)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in ours.state.values())

    fp32 = train(None, optimizer=torch.optim.AdamW, autocast=False)
    bf16 = train(None, optimizer=AdamWBF16Moments, autocast=False)
    windows = [(sum(fp32[i : i + 25]) / 25, sum(bf16[i : i + 25]) / 25) for i in range(0, 300, 25)]
    assert max(abs(b - a) / a for a, b in windows) < 0.01
    assert abs(_final(bf16) - _final(fp32)) / _final(fp32) < 0.01


def test_bf16_moments_step_math_and_loading_adamw_state():
    torch.manual_seed(1)
    p_ref, p_ours = nn.Parameter(torch.randn(32, 16)), nn.Parameter(torch.zeros(32, 16))
    p_ours.data.copy_(p_ref.data)
    ref = torch.optim.AdamW([p_ref], lr=1e-2, weight_decay=0.1)
    ours = AdamWBF16Moments([p_ours], lr=1e-2, weight_decay=0.1)
    grad = torch.randn(32, 16)
    p_ref.grad, p_ours.grad = grad.clone(), grad.clone()
    ref.step()
    ours.step()  # the first update uses the fp32 moments before they are stored in bf16
    assert torch.allclose(p_ref, p_ours, rtol=0, atol=1e-6)
    ours.load_state_dict(ref.state_dict())
    state = ours.state[p_ours]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_state_dict_identical_with_fp8_on_and_off(recipe):
    torch.manual_seed(0)
    plain = TinyLM(moe=True)
    fp8 = TinyLM(moe=True)
    fp8.load_state_dict(plain.state_dict())
    configure_fp8(fp8, recipe, "emulated")
    assert isinstance(fp8.in_proj, FP8Linear)
    a, b = plain.state_dict(), fp8.state_dict()
    assert list(a) == list(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    # save with FP8 on, resume with it off, and the other way round
    fp8(torch.zeros(4, CONTEXT, dtype=torch.long)).sum().backward()
    TinyLM(moe=True).load_state_dict(fp8.state_dict(), strict=True)
    fresh = TinyLM(moe=True)
    configure_fp8(fresh, recipe, "emulated")
    fresh.load_state_dict(plain.state_dict(), strict=True)
    # or switch a live model back to high precision in place
    FP8Linear.restore(fp8.in_proj)
    assert type(fp8.in_proj) is nn.Linear and list(fp8.in_proj.state_dict()) == ["weight", "bias"]


def test_module_selection():
    model = TinyLM(moe=True, tie=True)
    summary = configure_fp8(model, "tensorwise", "emulated")
    assert isinstance(model.in_proj, FP8Linear) and isinstance(model.layers[0].fc1, FP8Linear)
    assert type(model.lm_head) is nn.Linear and type(model.out) is nn.Linear  # output layers (named / tied)
    assert type(model.layers[1].router) is nn.Linear  # routers stay fp32
    assert isinstance(model.layers[1].experts.quantization, FP8GroupedGemm)
    assert type(model.embed) is nn.Embedding and type(model.norm) is nn.LayerNorm
    assert set(summary.kept) == {"layers.1.router", "lm_head", "out"} and summary.experts == ["layers.1.experts"]

    kept_ends = TinyLM(moe=True)
    configure_fp8(kept_ends, "tensorwise", "emulated", keep_high_precision_layers=1)
    assert type(kept_ends.layers[0].fc1) is nn.Linear and kept_ends.layers[1].experts.quantization is None
    assert isinstance(kept_ends.in_proj, FP8Linear)

    filtered = TinyLM()
    configure_fp8(filtered, "tensorwise", "emulated", module_filter=lambda name, m: "fc2" not in name)
    assert isinstance(filtered.layers[0].fc1, FP8Linear) and type(filtered.layers[0].fc2) is nn.Linear

    with pytest.raises(ValueError, match="module_filter"):
        configure_fp8(nn.Sequential(nn.Linear(4, 4)), "tensorwise", "emulated", keep_high_precision_layers=1)


class LitTiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM(moe=True)
        self.losses = []

    def training_step(self, batch, _):
        ctx, nxt = batch
        loss = F.cross_entropy(self.model(ctx).float(), nxt)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return AdamWBF16Moments(self.parameters(), lr=3e-3, weight_decay=0.0)


def test_lightning_fit_with_fp8_precision(tmp_path):
    data = torch.utils.data.DataLoader(list(batches(40, batch=64, seed=1)), batch_size=None)
    module = LitTiny()
    plugin = FP8Precision("delayed", device="cpu")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=40, plugins=[plugin], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(module, train_dataloaders=data)
    assert isinstance(module.model.in_proj, FP8Linear)
    assert (module.model.in_proj.fp8_scale > 0).all()  # delayed scales updated every optimizer step
    assert (module.model.layers[1].experts.quantization.fp8_scale > 0).all()
    assert sum(module.losses[-5:]) / 5 < module.losses[0] - 0.3
    assert plugin.backend_description().startswith("delayed (E4M3 fwd / E5M2 grads); linears: emulated")
    # the checkpoint holds the plain high-precision parameters: resume without FP8
    trainer.save_checkpoint(tmp_path / "fp8.ckpt")
    ckpt = torch.load(tmp_path / "fp8.ckpt", weights_only=True)
    plain = LitTiny()
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())


def test_real_moe_layer_and_linear_subclasses():
    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.nn.experts import GroupedExperts

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4, router_topk=2,
                    shared_expert_intermediate_size=64)
    layer = MoELayer(cfg)
    reference = MoELayer(cfg)
    reference.load_state_dict(layer.state_dict())
    summary = configure_fp8(layer, "blockwise", "emulated")
    assert isinstance(layer.experts, GroupedExperts) and isinstance(layer.experts.quantization, FP8GroupedGemm)
    fc1 = layer.shared_experts.linear_fc1
    assert isinstance(fc1, FP8Linear) and isinstance(fc1, type(reference.shared_experts.linear_fc1))
    assert summary.converted == ["shared_experts.linear_fc1", "shared_experts.linear_fc2"]
    assert list(layer.state_dict()) == list(reference.state_dict())
    fc1.reset_parameters()  # the model's own initialization survives the conversion
    assert abs(fc1.weight.std().item() - cfg.init_method_std) < 0.005

    fc1.weight.data.copy_(reference.shared_experts.linear_fc1.weight)
    x = torch.randn(2, 16, 64)
    y, y_ref = layer(x), reference(x)
    assert 0.005 < ((y - y_ref).norm() / y_ref.norm()).item() < 0.08
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in layer.parameters())


def test_configure_twice_is_idempotent():
    model = TinyLM(moe=True)
    first = configure_fp8(model, "tensorwise", "emulated")
    second = configure_fp8(model, "tensorwise", "emulated")
    assert second.converted == first.converted and second.kept == first.kept
    assert type(model.in_proj) is FP8Linear  # not wrapped twice


def test_fp8_kernels_get_their_expert_groups_padded(monkeypatch):
    """The FP8 kernels (cuBLAS per expert, torch's grouped kernel, TE) reject token groups that
    are not multiples of 16: converting an MoE layer for them pads its groups; the emulated
    backend (no kernel) leaves the layer as it is, except for NVFP4's Hadamard blocks."""
    from lightning_moe import MoEConfig, MoELayer
    from lightning_moe.precision import modules

    def layer(alignment=1):
        return MoELayer(MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=4, router_topk=2,
                                  expert_alignment=alignment))

    emulated = layer()
    assert configure_fp8(emulated, "rowwise", "emulated").expert_alignment is None
    assert emulated.config.expert_alignment == 1
    # emulated NVFP4: its weight gradient's 16-token Hadamard blocks need 16-token groups
    fp4 = layer()
    assert configure_fp8(fp4, "nvfp4", "emulated").expert_alignment == 16
    x_TD = torch.randn(21, 64, requires_grad=True)
    fp4(x_TD).sum().backward()
    assert fp4.experts.fc1_weight.grad.isfinite().all() and x_TD.grad.isfinite().all()

    # what configure_fp8 does when the experts run on a kernel backend ("torch" needs CUDA here)
    monkeypatch.setattr(modules, "_experts_backend", lambda *args: "torch")
    native = layer()
    summary = configure_fp8(native, "rowwise", "emulated")
    assert summary.experts_backend == "torch" and summary.expert_alignment == 16
    assert native.config.expert_alignment == 16 and native.dispatcher.cfg.expert_alignment == 16
    x_TD = torch.randn(21, 64)
    group_sizes = native.dispatcher.dispatch(x_TD, native.router(x_TD))[1]
    assert (group_sizes % 16 == 0).all() and group_sizes.sum() >= 21 * 2
    assert modules.pad_expert_groups(layer(32), 16) == 32  # a larger alignment stays
    assert modules.pad_expert_groups(nn.Sequential(nn.Linear(4, 4)), 16) == 16  # no MoE layer: nothing to do
