"""Selective and whole-layer recomputation (`ModelConfig.recompute`, `recompute_every_n_layers`):
the same gradients and router state as without it, bit for bit in fp32 (and under bf16 autocast),
the recomputed tensors really gone after the forward, and the refusals."""

import weakref

import pytest
import torch

from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset
from lightning_moe.models import decoder as decoder_module
from lightning_moe.models.recompute import RECOMPUTE_MODULES
from lightning_moe.nn import experts as experts_module

MOE = {
    "num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
    "router_score_function": "sigmoid", "router_enable_expert_bias": True,
    "router_load_balancing_type": ["aux_loss", "global_aux_loss"], "aux_loss_coeff": [1e-2, 1e-2],
    "z_loss_coeff": 1e-3,
}
MLA = {"attention_type": "mla", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_norm": False, "num_query_groups": None}


def _config(mla: bool = False, **overrides):
    extra = MLA if mla else {"qk_norm": True}
    return get_preset("tiny", **{"num_layers": 3, "first_k_dense_layers": 1, "moe": MOE, **extra, **overrides})


def _run(cfg, autocast: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = MoEDecoder(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers() if b is not None}
    return loss.detach(), grads, buffers


def _assert_same(plain, other):
    loss, grads, buffers = plain
    assert torch.equal(loss, other[0])
    assert grads.keys() == other[1].keys()
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, other[1][name]), name
    for name, buf in buffers.items():
        assert torch.equal(buf, other[2][name]), name  # expert-bias and global aux-loss counters counted once


SELECTIVE = [(name,) for name in RECOMPUTE_MODULES if name != "mla_up_proj"]
ALL_BUT_MOE = tuple(n for n in RECOMPUTE_MODULES if n not in ("mla_up_proj", "moe"))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("modules", SELECTIVE + [ALL_BUT_MOE], ids=lambda m: "+".join(m))
def test_selective_recompute_gives_the_plain_gradients(modules, autocast):
    _assert_same(_run(_config(), autocast), _run(_config(recompute=list(modules)), autocast))


@pytest.mark.parametrize("modules", [("mla_up_proj",), ("mla_up_proj", "core_attn", "layernorm", "moe_act")],
                         ids=lambda m: "+".join(m))
def test_mla_recompute_gives_the_plain_gradients(modules):
    _assert_same(_run(_config(mla=True)), _run(_config(mla=True, recompute=list(modules))))


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_whole_layer_recompute_gives_the_plain_gradients(every, autocast):
    cfg = _config(recompute_every_n_layers=every, recompute=["layernorm", "moe_act"])
    _assert_same(_run(_config(), autocast), _run(cfg, autocast))


def test_whole_layer_recompute_picks_every_nth_block():
    cfg = _config(recompute_every_n_layers=2, recompute=["core_attn"])
    model = MoEDecoder(cfg)
    assert [layer.recompute_layer for layer in model.layers.values()] == [True, False, True]
    assert [layer.attention.core_attention.recompute for layer in model.layers.values()] == [False, True, False]


def _norm_outputs_alive(cfg) -> tuple[list[bool], int]:
    """Whether the norms' outputs are still alive after the forward, and the norm calls made."""
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    refs, calls = [], [0]

    def keep(module, args, out):
        refs.append(weakref.ref(out))

    def count(module, args):  # a pre-hook: a recomputation stops once it has what backward needs
        calls[0] += 1

    for layer in model.layers.values():
        for norm in (layer.attention_norm, layer.mlp_norm):
            norm.register_forward_hook(keep)
            norm.register_forward_pre_hook(count)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
    alive = [ref() is not None for ref in refs]
    forward_calls = calls[0]
    loss.backward()
    return alive, forward_calls, calls[0]


def test_layernorm_recompute_frees_the_norm_outputs_and_recomputes_them():
    alive, forward_calls, total = _norm_outputs_alive(_config())
    assert all(alive) and total == forward_calls == 6  # kept for backward by the projections
    alive, forward_calls, total = _norm_outputs_alive(_config(recompute=["layernorm"]))
    assert not any(alive) and forward_calls == 6
    # each norm recomputed once in backward: one run serves its own backward and the GEMMs' copies
    assert total == 6 + 6


def test_moe_act_recompute_frees_the_activation_output(monkeypatch):
    outputs = []
    activate = experts_module.activate

    def spy(h, activation):
        out = activate(h, activation)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(experts_module, "activate", spy)
    for recompute, kept in ((None, True), (["moe_act"], False)):
        outputs.clear()
        torch.manual_seed(0)
        model = MoEDecoder(_config(recompute=recompute, moe={**MOE, "shared_expert_intermediate_size": None}))
        ids = torch.randint(0, 256, (2, 16))
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        assert [ref() is not None for ref in outputs] == [kept] * 2  # the two MoE blocks
        loss.backward()


def test_core_attention_recompute_runs_the_product_again(monkeypatch):
    calls = []
    attend = decoder_module.AttentionCore._attend

    def spy(*args):
        calls.append(1)
        return attend(*args)

    monkeypatch.setattr(decoder_module.AttentionCore, "_attend", staticmethod(spy))
    _run(_config(recompute=["core_attn"]))
    assert len(calls) == 6  # three blocks: forward and recomputation
    calls.clear()
    _run(_config())
    assert len(calls) == 3


def test_recompute_is_inactive_without_gradients():
    torch.manual_seed(0)
    model = MoEDecoder(_config(recompute_every_n_layers=1, recompute=["layernorm"]))
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        out = model(ids)
    torch.manual_seed(0)
    assert torch.equal(out, MoEDecoder(_config())(ids).detach())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recompute": ["attention"]}, "unknown"),
        ({"recompute": "layernorm"}, "list of module names"),
        ({"recompute": ["mla_up_proj"]}, "attention_type='gqa' has no up-projections"),
        ({"recompute": ["moe"], "moe": None}, "no MoE block"),
        ({"recompute": ["moe_act"], "moe": None}, "no MoE block"),
        ({"recompute": ["shared_experts"], "moe": {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32}},
         "no shared experts"),
        ({"recompute": ["mlp"], "first_k_dense_layers": 0}, "every block is MoE"),
        ({"recompute_every_n_layers": 0}, "positive int"),
    ],
)
def test_unsupported_recompute_settings_are_refused(overrides, message):
    base = {"num_layers": 2, "first_k_dense_layers": 1, "ffn_hidden_size": 64}
    with pytest.raises(ValueError, match=message):
        get_preset("tiny", **{**base, **overrides})


def test_moe_act_recompute_refuses_fp8_experts():
    from lightning_moe.precision import configure_fp8

    torch.manual_seed(0)
    model = MoEDecoder(_config(recompute=["moe_act"]))
    configure_fp8(model, "delayed", "emulated")
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(ValueError, match="recompute 'moe'"):
        model(ids)


def test_router_replay_refuses_a_recomputed_moe_block():
    from lightning_moe.nn import RouterReplay

    torch.manual_seed(0)
    plain = MoEDecoder(_config())
    ids = torch.randint(0, 256, (2, 16))
    with RouterReplay.record(plain) as recorder:
        plain(ids)
    torch.manual_seed(0)
    model = MoEDecoder(_config(recompute=["moe"]))
    with recorder.replay(model):
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        with pytest.raises(RuntimeError, match="recomputed in backward"):
            loss.backward()


def test_config_round_trips_the_recompute_fields():
    from lightning_moe.models import ModelConfig

    cfg = _config(recompute=["layernorm", "moe_act", "layernorm"], recompute_every_n_layers=3)
    assert cfg.recompute == ["layernorm", "moe_act"]
    assert ModelConfig(**cfg.to_dict()) == cfg


def test_fp8_delayed_recompute_records_no_second_amax():
    """Recomputed FP8 forwards cast with the step's scales and leave the amax histories alone: with
    the histories' current row cleared between forward and backward, the recomputed blocks record
    only the gradients' amaxes; the gradients equal those of the run without recomputation."""
    from lightning_moe.precision import configure_fp8
    from lightning_moe.precision.delayed import SLOTS, delayed_state

    results = {}
    for every in (None, 1):
        torch.manual_seed(0)
        model = MoEDecoder(_config(recompute_every_n_layers=every))
        configure_fp8(model, "delayed", "emulated")
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        states = [s for s in (delayed_state(m) for m in model.modules()) if s is not None]
        assert states
        for state in states:
            state.amax_history[0].zero_()
        loss.backward()
        forward_rows = torch.stack([s.amax_history[0, [SLOTS["input"], SLOTS["weight"]]].abs().sum() for s in states])
        grad_rows = torch.stack([s.amax_history[0, SLOTS["grad"]].abs().sum() for s in states])
        results[every] = (forward_rows, grad_rows, {n: p.grad for n, p in model.named_parameters()})
    assert torch.all(results[None][1] > 0) and torch.all(results[1][1] > 0)
    assert torch.all(results[1][0] == 0)  # no second record of the inputs' and weights' amaxes
    for name, grad in results[None][2].items():
        assert torch.equal(grad, results[1][2][name]), name


def test_output_recompute_runs_the_function_again_as_a_recomputation():
    """An `OutputRecompute` function runs once during backward (one run serves its own saved
    tensors and the GEMM's saved copy of its output) and sees `recomputing()` True there, so that
    side effects (amax records, router counts) are not repeated."""
    from lightning_moe.nn.saved_tensors import OutputRecompute, recomputing

    seen = []

    def norm(x):
        seen.append(recomputing())
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with OutputRecompute() as outputs:
        y = outputs.run(norm, x) @ w
    assert seen == [False]
    y.square().sum().backward()
    assert seen == [False, True]
