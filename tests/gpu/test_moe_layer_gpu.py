"""MoELayer on CUDA in bf16 against an fp32 copy of itself (per-expert loop backend)."""

import copy

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer

pytestmark = pytest.mark.gpu


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(expert_alignment=16),
        dict(expert_capacity_factor=1.0),
        dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True),
        dict(router_score_function="sigmoid", router_enable_expert_bias=True, shared_expert_intermediate_size=256),
    ],
)
def test_bf16_grouped_mm_matches_fp32_loop(overrides):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=512, ffn_hidden_size=256, num_experts=16, router_topk=4, **overrides)
    layer = MoELayer(cfg).cuda()
    ref = copy.deepcopy(layer)
    ref.experts.backend = "loop"
    layer.experts.to(torch.bfloat16)  # the router stays fp32 (as the precision plugins keep it)
    if layer.shared_experts is not None:
        layer.shared_experts.to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda")
    x_lp = x.bfloat16().requires_grad_(True)
    y = layer(x_lp)
    x_ref = x_lp.detach().float().requires_grad_(True)
    y_ref = ref(x_ref)
    assert _rel(y.float(), y_ref) < 2e-2
    g = torch.randn_like(y_ref)
    y.backward(g.bfloat16())
    y_ref.backward(g)
    assert _rel(x_lp.grad.float(), x_ref.grad) < 2e-2
    assert _rel(layer.experts.fc1_weight.grad.float(), ref.experts.fc1_weight.grad) < 2e-2
    assert _rel(layer.router.weight.grad, ref.router.weight.grad) < 5e-2


@pytest.mark.parametrize("anomaly", [False, True], ids=["plain", "anomaly_mode"])
@pytest.mark.parametrize("overrides", [dict(expert_capacity_factor=1.0), dict(expert_alignment=8)])
def test_all_gather_buffer_tail_is_never_read(overrides, anomaly):
    """The all-gather dispatcher leaves the rows after its last expert group unwritten; with
    PyTorch filling every new tensor with NaN (deterministic mode), nothing it runs may read
    them: outputs and gradients are finite and equal the local dispatcher's. One GPU, a
    one-rank NCCL group (capacity drops or alignment padding make the tail). Under autograd's
    anomaly mode, which checks every gradient for NaN, the backward functions zero the rows
    they leave unwritten otherwise, so it raises nothing."""
    import torch.distributed as dist

    from lightning_moe.parallel.dispatchers import AllGatherDispatcher

    if dist.is_initialized():
        pytest.skip("needs to own the default process group")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        torch.manual_seed(0)
        cfg = MoEConfig(hidden_size=256, ffn_hidden_size=192, num_experts=8, router_topk=2, **overrides)
        local = MoELayer(cfg).cuda().to(torch.bfloat16)
        gathered = copy.deepcopy(local)
        dispatcher = AllGatherDispatcher(cfg, dist.group.WORLD)
        seen = {}

        def spy(*args, **kwargs):
            out = AllGatherDispatcher.dispatch(dispatcher, *args, **kwargs)
            seen["tail_unwritten"], seen["plan"] = kwargs.get("tail_unwritten"), out[2].plan
            return out

        dispatcher.dispatch = spy
        gathered.dispatcher = dispatcher
        x = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
        results = []
        for layer in (gathered, local):
            xx = x.clone().requires_grad_(True)
            with torch.autograd.set_detect_anomaly(anomaly):
                y = layer(xx)
                y.float().square().sum().backward()
            results.append([y, xx.grad] + [p.grad for p in layer.parameters()])
        plan = seen["plan"]
        assert seen["tail_unwritten"] and int(plan.rows_end) < plan.num_rows  # there is a tail
        for a, b in zip(*results):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute_moe_act"])
def test_probabilities_in_the_swiglu_match_the_weighted_combine_and_keep_less(recompute, monkeypatch):
    """bf16 on CUDA: the weighted SwiGLU + unweighted sum (the default) against the dispatcher's
    weighted combine (`WEIGHTED_SWIGLU_COMBINE` off): the same function up to rounding, and the
    combine's saved expert outputs ([T * K, D] bf16) gone from the memory kept for backward."""
    from lightning_moe.nn import experts as experts_module

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=1024, ffn_hidden_size=512, num_experts=16, router_topk=4)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)
    layer.experts.recompute_activation = recompute
    x = torch.randn(8192, 1024, device="cuda").bfloat16()
    runs = []
    # A warm-up pass of each first: the first GEMMs' workspaces stay allocated, which would count
    # against whichever run came first.
    for weighted in (True, False, True, False):
        monkeypatch.setattr(experts_module, "WEIGHTED_SWIGLU_COMBINE", weighted)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(xi)
        kept = torch.cuda.memory_allocated() - before  # what the forward leaves for backward (and y)
        y.backward(torch.ones_like(y))
        runs.append((y.detach().float(), xi.grad.float(), layer.router.weight.grad.clone(),
                     layer.experts.fc2_weight.grad.float(), kept))
    (y1, gx1, gr1, gw1, kept1), (y0, gx0, gr0, gw0, kept0) = runs[2:]
    assert _rel(y1, y0) < 1e-2 and _rel(gx1, gx0) < 1e-2 and _rel(gw1, gw0) < 1e-2
    assert _rel(gr1, gr0) < 3e-2
    expert_outputs = 8192 * cfg.router_topk * 1024 * 2
    assert kept0 - kept1 >= 0.9 * expert_outputs, (kept0, kept1, expert_outputs)


@pytest.mark.parametrize("weighted", [True, False])
def test_gathered_first_projection_is_bit_equal_and_keeps_less(weighted, monkeypatch):
    """fc1 reading the permutation inside its own node (`GATHERED_FIRST_PROJECTION`) against the
    dispatcher's permuted rows: the same output and gradients bit for bit, and about ``K * D``
    bf16 bytes a token fewer kept from the forward to the backward (the permuted rows)."""
    from lightning_moe.nn import experts as experts_module

    monkeypatch.setattr(experts_module, "WEIGHTED_SWIGLU_COMBINE", weighted)
    torch.manual_seed(0)
    tokens, topk, hidden = 4096, 8, 1024
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=384, num_experts=32, router_topk=topk)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    g = torch.randn(tokens, hidden, device="cuda").bfloat16()
    runs = {}
    for gathered in (False, True, False, True):  # the second pass of each is measured (warm workspaces)
        monkeypatch.setattr(experts_module, "GATHERED_FIRST_PROJECTION", gathered)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = layer(xi)
        kept = torch.cuda.memory_allocated() - before
        y.backward(g)
        runs[gathered] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}, kept)
    (y1, gx1, gp1, kept1), (y0, gx0, gp0, kept0) = runs[True], runs[False]
    assert torch.equal(y1, y0) and torch.equal(gx1, gx0)
    for name in gp0:
        assert torch.equal(gp1[name], gp0[name]), name
    rows_bytes = tokens * topk * hidden * 2
    assert kept0 - kept1 >= 0.9 * rows_bytes, (kept0, kept1, rows_bytes)
