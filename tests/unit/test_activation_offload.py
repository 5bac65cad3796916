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


@pytest.mark.parametrize("modules, recompute", [
    (["core_attn", "attn_proj", "expert_fc1"], {"recompute": [n for n in RECOMPUTE_MODULES if n not in ("mla_up_proj",
                                                                                                      "moe")]}),
    (["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"], {"recompute": ["moe"]}),
    (["layers.0", "layers.2", "layers.1.attention_norm", "layers.1.attention.o_proj"],
     {"recompute_every_n_layers": 2, "recompute": ["core_attn"]}),
], ids=["selective", "moe", "whole_every_2"])
def test_offload_combined_with_recompute_gives_the_plain_gradients(modules, recompute):
    """The pairs that work together: each part offloads what the recomputation leaves it (a block
    recomputed whole: the block itself, by name, offloads its input, which its checkpoint keeps)."""
    plain = _run(_config())
    combined = _run(_config(**recompute), modules)
    assert combined[2] > 0
    _assert_same_grads(plain, combined)


def test_core_attention_offloaded_and_recomputed_moves_q_k_v_to_the_host():
    """core_attn offload + core_attn recompute: the checkpoint's inputs (q, k, v) are what is stored,
    on the host; the device tensors are gone after the forward (kept without the offload)."""
    import weakref

    def run(offload):
        torch.manual_seed(0)
        model = MoEDecoder(_config(recompute=["core_attn"]))
        callback = ActivationOffload(["core_attn"], keep_last_layers=0, min_offload_bytes=0) if offload else None
        if callback is not None:
            callback.attach(model)
        refs = []
        for layer in model.layers.values():
            layer.attention.core_attention.register_forward_pre_hook(
                lambda module, args: refs.extend(weakref.ref(t) for t in args[:3]))
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        alive = [ref() is not None for ref in refs]
        held = callback.live_host_bytes if callback is not None else 0
        loss.backward()
        return alive, held

    alive, held = run(offload=False)
    assert len(alive) == 9 and all(alive)  # q, k, v of 3 blocks kept by the checkpoints
    alive, held = run(offload=True)
    cfg = _config()
    width = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim  # q, k, v (GQA)
    assert not any(alive) and held == 3 * (2 * 16 * width * 4)


@pytest.mark.parametrize("modules, recompute, message", [
    (["attn_norm"], {"recompute": ["layernorm"]}, "'attn_norm'.*'layernorm': the norm runs inside"),
    (["mlp_norm"], {"recompute": ["layernorm"]}, "'mlp_norm'.*'layernorm'"),
    (["qkv_linear"], {"recompute": ["layernorm"]}, "'qkv_linear'.*'layernorm': its input"),
    (["expert_fc1"], {"recompute": ["moe"]}, "'expert_fc1'.*'moe': the block runs inside"),
    (["moe_act"], {"recompute": ["moe"]}, "'moe_act'.*'moe'"),
    (["*.shared_experts"], {"recompute": ["shared_experts"]}, "'shared_experts': the shared experts"),
    (["core_attn", "attn_norm"], {"recompute_every_n_layers": 1}, "every part named lies in a block recomputed"),
    (["layers.1.*"], {"recompute_every_n_layers": 1}, "every part named"),
], ids=["attn_norm+layernorm", "mlp_norm+layernorm", "qkv_linear+layernorm",
        "expert_fc1+moe", "moe_act+moe", "shared_experts", "every_1", "pattern_in_every_1"])
def test_offload_and_recompute_of_the_same_part_are_refused(modules, recompute, message):
    with pytest.raises(ValueError, match=message) as error:
        ActivationOffload(modules).attach(MoEDecoder(_config(**recompute)))
    assert "Keep one of the two" in str(error.value)


def test_parts_in_blocks_recomputed_whole_are_left_alone(caplog):
    """recompute_every_n_layers=2 over 3 blocks: blocks 0 and 2 keep only their input; the parts of
    block 1 alone are offloaded, with a notice (and the same gradients)."""
    import logging

    plain = _run(_config())
    with caplog.at_level(logging.INFO):
        every_2 = _run(_config(recompute_every_n_layers=2), ["attn_norm", "expert_fc1"])
    only_block_1 = _run(_config(recompute_every_n_layers=2), ["layers.1.attention_norm", "expert_fc1"])
    assert every_2[2] > 0
    _assert_same_grads(plain, every_2)
    assert every_2[2] == only_block_1[2]
    assert "3 parts in blocks recomputed whole" in caplog.text  # 2 norms, block 2's experts (block 0 is dense)
    offload = ActivationOffload(["attn_norm"]).attach(MoEDecoder(_config(recompute_every_n_layers=2)))
    assert len(offload._handles) == 3 * 2 + 2  # the 3 blocks' own hooks, block 1's norm's pre- and post-hook
    offload.detach()


def test_mla_projections_inside_the_recomputed_up_projection_are_refused():
    mla = {"attention_type": "mla", "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16, "qk_norm": False, "num_query_groups": None}
    with pytest.raises(ValueError, match="'qkv_linear'.*'mla_up_proj'"):  # full-rank q_proj: inside it
        ActivationOffload(["qkv_linear"]).attach(MoEDecoder(_config(**mla, recompute=["mla_up_proj"])))
    plain = _run(_config(**mla, q_lora_rank=32))
    combined = _run(_config(**mla, q_lora_rank=32, recompute=["mla_up_proj"]), ["qkv_linear"])
    assert combined[2] > 0  # q_a_proj and kv_a_proj_with_mqa run before it
    _assert_same_grads(plain, combined)


def test_pipeline_parallelism_is_refused_at_setup():
    from types import SimpleNamespace

    def trainer(pp):
        return SimpleNamespace(strategy=SimpleNamespace(layout=SimpleNamespace(pipeline_parallel_size=pp)),
                               callbacks=[])

    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        ActivationOffload(["attn_norm"]).setup(trainer(2), None, "fit")
    ActivationOffload(["attn_norm"]).setup(trainer(1), None, "fit")
    ActivationOffload(["attn_norm"]).setup(SimpleNamespace(strategy=object(), callbacks=[]), None, "fit")


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


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_recomputed_activation_has_its_input_offloaded(monkeypatch, autocast):
    """moe_act offload + moe_act recompute (Megatron-Core's pairing): the activation's input, which
    its recomputation keeps, goes to the host and comes back for the recomputation; the device
    copy is gone after the forward (kept by the recomputation alone), the host holds exactly those
    inputs, and the gradients are the plain run's."""
    import weakref

    from lightning_moe.nn import experts

    inputs, calls = [], []
    real_activate, real_second = experts.activate, experts.GroupedExperts._second_projection

    def recording_activate(h, activation):  # routed and shared experts, forward and recomputation
        calls.append(h.shape)
        return real_activate(h, activation)

    def recording_second(self, h_RF, *args, **kwargs):  # the routed experts' activation input
        inputs.append((weakref.ref(h_RF), h_RF.numel() * h_RF.element_size()))
        return real_second(self, h_RF, *args, **kwargs)

    monkeypatch.setattr(experts, "activate", recording_activate)
    monkeypatch.setattr(experts.GroupedExperts, "_second_projection", recording_second)

    def run(recompute, offload):
        inputs.clear()
        calls.clear()
        torch.manual_seed(0)
        model = MoEDecoder(_config(recompute=["moe_act"] if recompute else []))
        callback = ActivationOffload(["moe_act"], keep_last_layers=0, min_offload_bytes=0) if offload else None
        if callback is not None:
            callback.attach(model)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        forward_calls = len(calls)
        alive = [ref() is not None for ref, _ in inputs]
        input_bytes = sum(size for _, size in inputs)
        held = callback.live_host_bytes if callback is not None else 0
        loss.backward()
        if callback is not None:
            assert callback.live_host_bytes == 0
            callback.detach()
        grads = {name: p.grad for name, p in model.named_parameters()}
        return loss.detach(), grads, held, alive, forward_calls, len(calls), input_bytes

    plain = run(recompute=False, offload=False)
    recomputed = run(recompute=True, offload=False)
    offloaded = run(recompute=False, offload=True)
    both = run(recompute=True, offload=True)
    # two MoE blocks (block 0 is dense); the activation saves its input for its backward
    assert plain[3] == recomputed[3] == [True, True]  # the recomputation alone keeps it on the device
    assert both[3] == [False, False]  # with the offload they are on the host only
    assert both[2] == both[6] > 0  # exactly the inputs are held (the eager SwiGLU's offload alone keeps
    assert offloaded[2] > 0  # its input's halves as views on the device: what it holds differs)
    assert plain[5] == plain[4] and both[5] == both[4] + 2  # one recomputation per block in the backward
    for other in (recomputed, offloaded, both):
        _assert_same_grads(plain, other)
