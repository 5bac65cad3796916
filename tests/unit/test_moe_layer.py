"""MoELayer outputs and gradients equal a naive per-token MoE (fp32/fp64, tight tolerance)."""


import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.nn.reference import naive_moe_forward

BASE = dict(hidden_size=16, ffn_hidden_size=24, num_experts=8, router_topk=2)

CASES = {
    "softmax": {},
    "softmax_pre": dict(router_pre_softmax=True),
    "topk1": dict(router_topk=1, router_pre_softmax=True),
    "topk8_of_8": dict(router_topk=8),
    "sigmoid": dict(router_score_function="sigmoid"),
    "sigmoid_bias_scaled": dict(
        router_score_function="sigmoid", router_enable_expert_bias=True, router_topk_scaling_factor=2.5
    ),
    "groups": dict(num_experts=16, router_topk=4, router_num_groups=4, router_group_topk=2, router_pre_softmax=True),
    "capacity_probs": dict(expert_capacity_factor=0.5, token_drop_policy="probs"),
    "capacity_position": dict(expert_capacity_factor=0.75, token_drop_policy="position"),
    "capacity_padded": dict(expert_capacity_factor=0.6, pad_expert_input_to_capacity=True),
    "aligned16": dict(expert_alignment=16),
    "shared": dict(shared_expert_intermediate_size=20),
    "shared_gate": dict(shared_expert_intermediate_size=20, shared_expert_gate=True),
    "gelu": dict(activation="gelu"),
    "probs_on_input": dict(router_topk=1, router_pre_softmax=True, apply_probs_on_input=True),
    "aux_z_losses": dict(
        router_load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[1e-2, 1e-3], z_loss_coeff=1e-3
    ),
    "many_experts": dict(num_experts=64, router_topk=6, ffn_hidden_size=8),
    "loop_backend": dict(expert_backend="loop"),
}


def _layer(overrides, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = MoEConfig(**{**BASE, **overrides})
    layer = MoELayer(cfg).to(dtype)
    if cfg.router_enable_expert_bias:
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    return layer


def _grads(layer, x, fn):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = fn(layer, x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    (y * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", [(40, 16), (3, 13, 16)])
def test_layer_matches_naive_reference(case, shape):
    layer = _layer(CASES[case])
    x = torch.randn(*shape)
    y, gx, grads = _grads(layer, x, lambda m, a: m(a))
    y_ref, gx_ref, grads_ref = _grads(layer, x, naive_moe_forward)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)


def test_float64_runs_the_loop_and_matches():
    layer = _layer(dict(expert_alignment=8), dtype=torch.float64)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), naive_moe_forward(layer, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", range(1, 9))
def test_every_topk_in_fp32(k):
    overrides = dict(num_experts=12, router_topk=k, router_pre_softmax=(k == 1))
    layer = _layer(overrides, seed=k, dtype=torch.float32)
    x = torch.randn(2, 24, 16)
    y, gx, grads = _grads(layer, x, lambda m, a: m(a))
    y_ref, gx_ref, grads_ref = _grads(layer, x, naive_moe_forward)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=0, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)


def test_empty_experts_get_no_rows_and_zero_grads():
    layer = _layer(dict(num_experts=8, router_topk=1, router_pre_softmax=True))
    with torch.no_grad():  # route every token to expert 3 or 5 only
        layer.router.weight.zero_()
        layer.router.weight[3] = 1.0
        layer.router.weight[5] = -1.0
    x = torch.randn(30, 16)
    y, _, grads = _grads(layer, x, lambda m, a: m(a))
    counts = layer.last_stats.tokens_per_expert_E
    assert counts.sum() == 30 and set(counts.nonzero().flatten().tolist()) <= {3, 5}
    empty = [e for e in range(8) if counts[e] == 0]
    assert torch.all(grads["experts.fc1_weight"][empty] == 0)
    y_ref = naive_moe_forward(layer, x)
    torch.testing.assert_close(y, y_ref.detach(), rtol=0, atol=1e-5)


def test_bf16_activations_keep_fp32_router():
    layer = _layer({}, dtype=torch.float32)
    layer.experts.to(torch.bfloat16)
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.router.weight.dtype == torch.float32
    y.float().sum().backward()
    assert layer.router.weight.grad.dtype == torch.float32


def test_stats_count_drops():
    layer = _layer(dict(expert_capacity_factor=0.25))
    x = torch.randn(64, 16)
    layer(x)
    stats = layer.last_stats
    assert stats.num_assignments == 128
    assert int(stats.num_dropped) == 128 - int(stats.tokens_per_expert_E.sum()) > 0


def test_meta_device_init_then_reset_parameters():
    cfg = MoEConfig(**BASE, shared_expert_intermediate_size=8, shared_expert_gate=True)
    with torch.device("meta"):
        layer = MoELayer(cfg)
    layer.to_empty(device="cpu")
    torch.manual_seed(0)
    layer.reset_parameters()
    torch.manual_seed(0)
    ref = MoELayer(cfg)
    for (n, a), (_, b) in zip(layer.state_dict().items(), ref.state_dict().items()):
        assert torch.isfinite(a).all(), n
    assert all(torch.all(b == 0) for n, b in layer.named_buffers())
    y = layer(torch.randn(5, 16))
    assert torch.isfinite(y).all()


def test_experts_with_an_unwritten_tail_never_read_it():
    """GroupedExperts(tail_unwritten=True), what the all-gather dispatcher relies on: NaN in the
    rows after the groups (input, and the output's gradient) reaches neither the grouped rows
    nor the weight gradients; experts that read those rows refuse the flag."""
    from lightning_moe.nn.experts import GroupedExperts

    torch.manual_seed(0)
    sizes = torch.tensor([7, 0, 12, 5])
    rows, used = 40, 24
    experts = GroupedExperts(4, 16, 24, backend="grouped_mm")
    x = torch.randn(rows, 16)
    g = torch.randn(rows, 16)
    x[used:] = 0
    results = []
    for tail_value, unwritten in ((0.0, False), (float("nan"), True)):
        experts.zero_grad()
        xx = x.clone()
        xx[used:] = tail_value
        xx.requires_grad_(True)
        gg = g.clone()
        gg[used:] = tail_value
        y = experts(xx, sizes, tail_unwritten=unwritten)
        y.backward(gg)
        results.append((y[:used], xx.grad[:used], experts.fc1_weight.grad, experts.fc2_weight.grad))
    for a, b in zip(*results):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert experts.reads_only_grouped_rows(torch.float32) and not experts.reads_only_grouped_rows(torch.float64)
    loop = GroupedExperts(4, 16, 24, backend="loop")
    assert not loop.reads_only_grouped_rows(torch.float32)
    with pytest.raises(ValueError, match="tail_unwritten=True needs experts that read only the grouped rows"):
        loop(x, sizes, tail_unwritten=True)


@pytest.mark.parametrize("probs_on_input", [False, True])
def test_deferred_permutation_is_the_permutation(probs_on_input):
    """``dispatch(..., defer_permute=True)`` hands over the tokens and the plan (`DeferredPermutation`)
    whose `materialize` is the permuted rows, except under ``apply_probs_on_input`` (the rows are
    scaled in the dispatcher, so they come permuted); experts that cannot read the permutation
    inside a quantized cast (no quantization here) permute it themselves: the same output and
    the same token gradient as from the permuted rows."""
    from lightning_moe.nn.dispatcher import LocalDispatcher
    from lightning_moe.nn.permutation import DeferredPermutation

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=32, ffn_hidden_size=48, num_experts=6, router_topk=1 if probs_on_input else 2,
                    expert_alignment=8, apply_probs_on_input=probs_on_input, router_pre_softmax=probs_on_input)
    layer = MoELayer(cfg)
    x = torch.randn(40, 32, requires_grad=True)
    routing = layer.router(x)
    dispatcher = LocalDispatcher(cfg)
    deferred, sizes, _ = dispatcher.dispatch(x, routing, defer_permute=True)
    rows, sizes_ref, _ = dispatcher.dispatch(x, routing)
    assert torch.equal(sizes, sizes_ref)
    if probs_on_input:
        assert torch.is_tensor(deferred) and torch.equal(deferred, rows)
        return
    assert isinstance(deferred, DeferredPermutation) and deferred.num_rows == rows.shape[0]
    assert torch.equal(deferred.materialize(), rows)
    assert not layer.experts.takes_deferred_permutation(x)
    out = layer.experts(deferred, sizes)
    (grad,) = torch.autograd.grad(out.square().sum(), x, retain_graph=True)
    out_ref = layer.experts(rows, sizes)
    (grad_ref,) = torch.autograd.grad(out_ref.square().sum(), x)
    assert torch.equal(out, out_ref) and torch.equal(grad, grad_ref)


def test_master_weight_cast_leaves_a_missing_gradient_missing():
    """`_MasterWeightCast` (fp32 master weight -> bf16, gradient widened back) gives a weight no
    gradient when none reaches it, as ``w.to(torch.bfloat16)`` does, instead of fp32 zeros that an
    optimizer would decay."""
    from lightning_moe.nn.compute_weights import _MasterWeightCast

    class DropsGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    for cast in (_MasterWeightCast.apply, lambda w: w.to(torch.bfloat16)):
        w = torch.randn(3, 4, requires_grad=True)
        other = torch.randn(2, requires_grad=True)
        (DropsGradient.apply(cast(w)).float().sum() + other.sum()).backward()
        assert w.grad is None and other.grad is not None
