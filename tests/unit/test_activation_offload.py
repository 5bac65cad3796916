"""`ActivationOffload` on CPU: the tensors the named parts save go to separate host tensors and
come back in backward; gradients equal the plain run's bit for bit, alone, combined and with
recomputation; host copies are released after use (no growth over 50 optimizer steps of a
Lightning fit with gradient accumulation); parameters, their casts and small tensors stay; FP8
tensors travel as their bytes; the refusals."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_moe.callbacks import ActivationOffload
from lightning_moe.callbacks.activation_offload import OFFLOAD_MODULES
from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset
from lightning_moe.models.decoder import DenseMLP
from lightning_moe.models.recompute import RECOMPUTE_MODULES

MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
       "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3}


def _config(**overrides):
    return get_preset("tiny", **{"num_layers": 3, "first_k_dense_layers": 1, "qk_norm": True, "moe": MOE,
                                 **overrides})


def _run(cfg, modules=None, autocast=False, keep_last_layers=0, min_offload_bytes=0, **kwargs):
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    offload = None
    if modules is not None:
        offload = ActivationOffload(modules, keep_last_layers=keep_last_layers, min_offload_bytes=min_offload_bytes,
                                    **kwargs).attach(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
    held = offload.live_host_bytes if offload is not None else 0
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if offload is not None:
        assert offload.live_host_bytes == 0  # every host copy released once its backward has used it
        offload.detach()
    return loss.detach(), grads, held


def _assert_same_grads(plain, other):
    assert torch.equal(plain[0], other[0])
    for name, grad in plain[1].items():
        assert grad is not None and torch.equal(grad, other[1][name]), name


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("modules", [(name,) for name in OFFLOAD_MODULES] + [OFFLOAD_MODULES],
                         ids=lambda m: "+".join(m))
def test_offloaded_parts_give_the_plain_gradients(modules, autocast):
    plain = _run(_config(), autocast=autocast)
    offloaded = _run(_config(), list(modules), autocast=autocast)
    assert offloaded[2] > 0  # something was held on the host between forward and backward
    _assert_same_grads(plain, offloaded)


@pytest.mark.parametrize("recompute", [
    {"recompute": [n for n in RECOMPUTE_MODULES if n not in ("mla_up_proj", "moe")]},
    {"recompute": ["moe"]},
    {"recompute_every_n_layers": 2, "recompute": ["layernorm", "moe_act"]},
], ids=["selective", "moe", "whole_every_2"])
def test_offload_combined_with_recompute_gives_the_plain_gradients(recompute):
    plain = _run(_config())
    combined = _run(_config(**recompute), list(OFFLOAD_MODULES))
    assert combined[2] > 0
    _assert_same_grads(plain, combined)


def test_last_layers_stay_and_small_tensors_stay():
    first_two = _run(_config(), ["layers.0.attention_norm", "layers.1.attention_norm"])[2]
    assert 0 < first_two < _run(_config(), ["attn_norm"])[2]
    assert _run(_config(), ["attn_norm"], keep_last_layers=1)[2] == first_two
    assert _run(_config(), ["attn_norm"], keep_last_layers=3)[2] == 0
    assert _run(_config(), ["attn_norm"], min_offload_bytes=1 << 30)[2] == 0


def test_parameters_and_their_casts_are_not_offloaded():
    """Under bf16 autocast the projections save the bf16 cast of their input and of their fp32
    weight: only the three inputs' casts ([B*S, D] bf16) of each of the 3 blocks are copied."""
    cfg = _config()
    held = _run(cfg, ["qkv_linear"], autocast=True)[2]
    assert held == 3 * 3 * (2 * 16 * cfg.hidden_size * 2)
    held = _run(cfg, ["qkv_linear"])[2]  # fp32: the three projections save one input, copied once
    assert held == 3 * (2 * 16 * cfg.hidden_size * 4)


def test_user_module_classes_and_name_patterns():
    plain = _run(_config())
    by_class = _run(_config(), [DenseMLP])
    by_pattern = _run(_config(), ["*.shared_experts"])
    assert by_class[2] > 0 and by_pattern[2] > 0
    _assert_same_grads(plain, by_class)
    _assert_same_grads(plain, by_pattern)


class _SavesFP8(torch.autograd.Function):
    """y = x * w, saving x as FP8 (as an FP8 GEMM saves its quantized operand)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x.to(torch.float8_e4m3fn), w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x8, w = ctx.saved_tensors
        assert x8.dtype == torch.float8_e4m3fn
        return grad * w, (grad * x8.float()).sum(0)


class _FP8Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, x):
        return _SavesFP8.apply(x, self.w)


def test_fp8_saved_tensors_travel_as_their_bytes(monkeypatch):
    from lightning_moe.callbacks import activation_offload

    model = nn.Sequential(nn.ModuleList([_FP8Block(), _FP8Block()]))
    copied = []
    to_host = activation_offload.ActivationOffload._to_host

    def spy(self, t):
        copy = to_host(self, t)
        copied.append((t.dtype, copy.host.dtype))
        return copy

    monkeypatch.setattr(activation_offload.ActivationOffload, "_to_host", spy)

    def grads(offload):
        torch.manual_seed(0)
        for block in model[0]:
            block.w.grad = None
        x = torch.randn(32, 64, requires_grad=True)
        if offload:
            callback = ActivationOffload([_FP8Block], keep_last_layers=0, min_offload_bytes=0).attach(model)
        h = x
        for block in model[0]:
            h = block(h)
        h.square().sum().backward()
        if offload:
            callback.detach()
        return [x.grad] + [block.w.grad for block in model[0]]

    plain, offloaded = grads(False), grads(True)
    assert copied == [(torch.float8_e4m3fn, torch.uint8)] * 2
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)


class _Tokens(Dataset):
    def __init__(self, n, seq, vocab):
        self.tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _fit(callbacks, steps=50, accumulate=2):
    from lightning.pytorch import Trainer, seed_everything

    from lightning_moe.models import MoELanguageModel
    from lightning_moe.strategies import MegatronMoEStrategy

    seed_everything(0)
    module = MoELanguageModel("tiny", overrides={"num_layers": 3, "first_k_dense_layers": 1, "moe": MOE},
                              warmup_steps=2, max_steps=steps)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=MegatronMoEStrategy(print_layout=False), max_steps=steps,
        accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    try:
        trainer.fit(module, DataLoader(_Tokens(steps * accumulate, 16, 256), batch_size=2))
    finally:  # the strategy initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_fifty_steps_of_accumulation_release_every_host_copy():
    from lightning.pytorch import Callback

    offload = ActivationOffload(list(OFFLOAD_MODULES), keep_last_layers=1, min_offload_bytes=0)
    seen = []

    class Watch(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen.append(("forward", offload.live_host_bytes))

        def on_after_backward(self, trainer, pl_module):
            seen.append(("backward", offload.live_host_bytes))

    trained = _fit([offload, Watch()])
    plain = _fit([])
    held = [b for phase, b in seen if phase == "forward"]
    assert len(held) == 100 and min(held) > 0 and len(set(held)) == 1  # the same bytes every micro-batch
    assert all(b == 0 for phase, b in seen if phase == "backward")  # nothing left after any backward
    for name, param in plain.items():
        assert torch.equal(param, trained[name]), name


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"modules": []}, ValueError, "non-empty list"),
    ({"modules": "attn_norm"}, ValueError, "non-empty list"),
    ({"modules": [3]}, TypeError, "neither a part name"),
    ({"modules": [int]}, TypeError, "neither a part name"),
    ({"modules": ["attn_norm"], "prefetch_layers": 0}, ValueError, "prefetch_layers"),
    ({"modules": ["attn_norm"], "keep_last_layers": -1}, ValueError, "keep_last_layers"),
])
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        ActivationOffload(**kwargs)


def test_a_part_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match="'mlp_norms' matches no module"):
        ActivationOffload(["mlp_norms"]).attach(MoEDecoder(_config()))


def test_cuda_graphs_callback_is_refused():
    from lightning.pytorch import Callback

    class CUDAGraphs(Callback):
        pass

    class _Trainer:
        callbacks = [CUDAGraphs()]

    with pytest.raises(ValueError, match="CUDAGraphs callback"):
        ActivationOffload(["attn_norm"]).setup(_Trainer(), None, "fit")


@pytest.mark.parametrize("prefetch_layers", [1, 2])
def test_earlier_layers_come_back_before_the_backward_needs_them(monkeypatch, prefetch_layers):
    """When the backward first unpacks a tensor of layer i, layers i-1 .. i-prefetch_layers are
    already on their way back (started when the backward reached layer i's output)."""
    from lightning_moe.callbacks import activation_offload

    torch.manual_seed(0)
    cfg = _config(num_layers=4)
    model = MoEDecoder(cfg)
    offload = ActivationOffload(["attn_norm", "expert_fc1"], keep_last_layers=0, min_offload_bytes=0,
                                prefetch_layers=prefetch_layers).attach(model)
    first_unpacks = {}
    unpack = activation_offload._LayerGroup.unpack

    def spy(self, copy):
        if self.index not in first_unpacks:
            groups = offload._groups
            first_unpacks[self.index] = [groups[i].fetched for i in range(self.index - prefetch_layers, self.index)
                                         if i >= 0]
        return unpack(self, copy)

    monkeypatch.setattr(activation_offload._LayerGroup, "unpack", spy)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1)).backward()
    assert sorted(first_unpacks) == [0, 1, 2, 3]
    assert all(all(fetched) for fetched in first_unpacks.values())
    assert [len(v) for _, v in sorted(first_unpacks.items())] == [min(i, prefetch_layers) for i in range(4)]


def test_parts_outside_the_layers_are_offloaded_per_call():
    """A part outside every layer (the final norm) has a group of its own per forward: nothing of
    one micro-batch stays referenced into the next."""
    plain = _run(_config())
    offload_kwargs = {"keep_last_layers": 0, "min_offload_bytes": 0}
    torch.manual_seed(0)
    model = MoEDecoder(_config())
    offload = ActivationOffload(["norm", "attn_norm"], **offload_kwargs).attach(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        assert offload.live_host_bytes > 0
        loss.backward()
        assert offload.live_host_bytes == 0 and -1 not in offload._groups
    _assert_same_grads(plain, (loss.detach(), {n: p.grad for n, p in model.named_parameters()}))


def test_weight_copies_are_told_from_activations_made_from_weights():
    from lightning_moe.nn.saved_tensors import parameter_derived

    w = nn.Parameter(torch.randn(8, 8))
    assert parameter_derived(w) and parameter_derived(w.t()) and parameter_derived(w.to(torch.bfloat16))
    assert parameter_derived(w[:, :4].t().to(torch.bfloat16))
    assert not parameter_derived(nn.functional.embedding(torch.tensor([1, 2]), w))  # the residual stream
    assert not parameter_derived(torch.nn.functional.silu(w))
    assert not parameter_derived(torch.randn(8, 8))
