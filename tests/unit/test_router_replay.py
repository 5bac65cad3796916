"""Router replay: replayed forwards use exactly the recorded experts (and drops) while the router's
probabilities, and so its gradients, come from the current weights; checked against a hand-written
reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.models import MoEDecoder, ModelConfig
from lightning_moe.nn import MoEConfig, MoELayer, RouterReplay, TopKRouter

D, FFN = 16, 8

CONFIGS = {
    "softmax_topk": dict(num_experts=8, router_topk=2),
    "pre_softmax": dict(num_experts=8, router_topk=2, router_pre_softmax=True),
    "sigmoid_bias_groups_scaled": dict(num_experts=8, router_topk=4, router_score_function="sigmoid",
                                       router_enable_expert_bias=True, router_num_groups=4, router_group_topk=2,
                                       router_topk_scaling_factor=2.5),
    "capacity_probs_policy": dict(num_experts=4, router_topk=2, expert_capacity_factor=0.75),
    "capacity_padded": dict(num_experts=4, router_topk=2, expert_capacity_factor=0.75, token_drop_policy="position",
                            pad_expert_input_to_capacity=True),
}


def _routings(router: TopKRouter, results: list):
    """A forward hook that appends each RoutingResult of ``router`` to ``results``."""
    return router.register_forward_hook(lambda module, args, result: results.append(result))


def _reference_output(x_TD, weight_ED, fc1, fc2, experts_TK, keep_TK, cfg: MoEConfig):
    """The MoE output computed by hand: combine weights gathered at the given experts from the score
    function, renormalised and scaled as ``cfg`` says, times each expert's SwiGLU MLP."""
    logits_TE = x_TD @ weight_ED.T
    if cfg.router_score_function == "softmax":
        if cfg.router_pre_softmax:
            probs_TK = torch.softmax(logits_TE, dim=-1).gather(1, experts_TK)
        else:
            probs_TK = torch.softmax(logits_TE.gather(1, experts_TK), dim=-1)
    else:
        scores_TK = torch.sigmoid(logits_TE).gather(1, experts_TK)
        probs_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True) if cfg.router_topk > 1 else scores_TK
    if cfg.router_topk_scaling_factor:
        probs_TK = probs_TK * cfg.router_topk_scaling_factor
    if keep_TK is not None:
        probs_TK = probs_TK * keep_TK
    y_TD = torch.zeros_like(x_TD)
    for k in range(cfg.router_topk):
        e_T = experts_TK[:, k]
        h_T2F = torch.einsum("td,tdgf->tgf", x_TD, fc1[e_T])
        a_TF = F.silu(h_T2F[:, 0]) * h_T2F[:, 1]
        y_TD = y_TD + probs_TK[:, k : k + 1] * torch.einsum("tf,tfd->td", a_TF, fc2[e_T])
    return y_TD


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_replay_uses_the_recorded_experts_and_gradients_match_the_reference(name):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=D, ffn_hidden_size=FFN, expert_backend="loop", **CONFIGS[name])
    layer = MoELayer(cfg).train()
    router = layer.router
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)  # the bias steers the recorded choice
    x = torch.randn(2, 12, D)
    recorded = []
    handle = _routings(router, recorded)
    with torch.no_grad(), RouterReplay.record(layer) as replay:  # the "rollout"
        layer(x)
    handle.remove()
    assert len(replay.routings["router"]) == 1
    torch.testing.assert_close(replay.experts["router"][0], recorded[0].experts_TK, rtol=0, atol=0)

    with torch.no_grad():  # the policy moved on: new router weights (and bias)
        router.weight.add_(torch.randn_like(router.weight))
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
        fresh = router(x).experts_TK
    assert not torch.equal(fresh, recorded[0].experts_TK)  # left alone, the router would now choose others

    replayed = []
    handle = _routings(router, replayed)
    x_replay = x.clone().requires_grad_()
    g = torch.randn_like(x)
    with replay.replay(layer):
        (layer(x_replay) * g).sum().backward()
    handle.remove()
    assert router.replayed_routing is None
    torch.testing.assert_close(replayed[0].experts_TK, recorded[0].experts_TK, rtol=0, atol=0)
    if cfg.expert_capacity_factor is not None:
        torch.testing.assert_close(replayed[0].keep_TK, recorded[0].keep_TK, rtol=0, atol=0)
        assert not recorded[0].keep_TK.all()  # the case does drop assignments

    leaves = [t.detach().clone().requires_grad_() for t in
              (x, router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight)]
    x_ref, weight_ref, fc1_ref, fc2_ref = leaves
    y_ref = _reference_output(x_ref.reshape(-1, D), weight_ref, fc1_ref, fc2_ref, recorded[0].experts_TK,
                              recorded[0].keep_TK, cfg)
    (y_ref.view_as(x) * g).sum().backward()
    for got, want in zip((x_replay, router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight), leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    assert router.weight.grad.abs().sum() > 0


def _decoder(seed: int = 0, first_k_dense_layers: int = 1) -> MoEDecoder:
    torch.manual_seed(seed)
    moe = dict(ffn_hidden_size=16, num_experts=8, router_topk=2, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    return MoEDecoder(ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=4,
                                  ffn_hidden_size=48, first_k_dense_layers=first_k_dense_layers, moe=moe))


def test_a_decoder_replays_every_layer_over_micro_batches_in_order():
    model = _decoder()
    batches = [torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with torch.no_grad(), RouterReplay.record(model) as replay:
        for ids in batches:
            model(ids)
    assert sorted(replay.routings) == ["layers.1.mlp.router", "layers.2.mlp.router"]
    assert all(len(entries) == 2 for entries in replay.routings.values())
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.weight.add_(torch.randn_like(moe.router.weight))
    seen = {name: [] for name in replay.routings}
    handles = [_routings(model.get_submodule(name), seen[name]) for name in seen]
    for _ in range(2):  # every replay context starts again at the first recorded forward
        with replay.replay(model):
            for ids in batches:
                model.loss(ids, torch.roll(ids, -1, dims=1)).backward()
    for h in handles:
        h.remove()
    for name, results in seen.items():
        for i, result in enumerate(results):
            torch.testing.assert_close(result.experts_TK, replay.experts[name][i % 2], rtol=0, atol=0)
    assert all(moe.router.weight.grad.abs().sum() > 0 for moe in model.moe_layers())


def test_from_experts_replays_ids_chosen_elsewhere_and_checks_them():
    model = _decoder()
    ids = torch.randint(0, 64, (1, 6))
    chosen = {name: [torch.tensor([[e % 8, (e + 3) % 8] for e in range(6)])]
              for name, m in model.named_modules() if isinstance(m, TopKRouter)}
    replay = RouterReplay.from_experts(model, chosen)
    seen = []
    handle = _routings(model.layers["2"].mlp.router, seen)
    with replay.replay(model):
        model(ids)
    handle.remove()
    torch.testing.assert_close(seen[0].experts_TK, chosen["layers.2.mlp.router"][0], rtol=0, atol=0)
    bad = {name: [torch.tensor([[1, 1]] * 6)] for name in chosen}
    with pytest.raises(ValueError, match="twice"):
        RouterReplay.from_experts(model, bad)
    bad = {name: [torch.tensor([[1, 8]] * 6)] for name in chosen}
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        RouterReplay.from_experts(model, bad)


def test_mismatches_are_refused_with_the_fix():
    model = _decoder()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad(), RouterReplay.record(model) as replay:
        model(ids)
    with pytest.raises(ValueError, match="recorded 20 tokens x top-2 of 8 experts, but this forward routes 10"):
        with replay.replay(model):
            model(ids[:1])
    assert all(moe.router.replayed_routing is None for moe in model.moe_layers())  # cleaned up after the error
    with pytest.raises(RuntimeError, match="recorded 1 forward"):
        with replay.replay(model):
            model(ids)
            model(ids)
    with pytest.raises(ValueError, match="not recorded"):
        with replay.replay(_decoder(first_k_dense_layers=0)):
            pass
    with pytest.raises(RuntimeError, match="already replaying"):
        with replay.replay(model), replay.replay(model):
            pass
    for moe in model.moe_layers():
        moe.set_config(dataclasses.replace(moe.config, expert_capacity_factor=1.0))
    with pytest.raises(ValueError, match="keep expert_capacity_factor"):
        with replay.replay(model):
            model(ids)
    with pytest.raises(ValueError, match="no TopKRouter"):
        RouterReplay.record(torch.nn.Linear(2, 2)).__enter__()
