"""Router and aux losses against Megatron-Core 0.16.1 (functional pieces and the real TopKRouter)."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from lightning_moe.nn.aux_losses import (
    AuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    global_load_balancing_loss,
    sequence_load_balancing_loss,
    switch_load_balancing_loss,
    tokens_per_expert,
    tokens_per_sequence_expert,
    z_loss,
)
from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.router import TopKRouter, route

D = 32


def _mcore_utils():
    pytest.importorskip("megatron.core")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.transformer.moe.moe_utils as mu
    return mu


def _cfg(num_experts: int, topk: int, **kw) -> MoEConfig:
    return MoEConfig(hidden_size=D, ffn_hidden_size=64, num_experts=num_experts, router_topk=topk, **kw)


@contextlib.contextmanager
def _stable_topk():
    """Make ``torch.topk`` break ties by index (earliest first), as CUDA's top-k does.

    CPU ``torch.topk`` picks tied elements in no set order, so Megatron's "position" drop policy
    (a top-k over a 0/1 map) keeps arbitrary tokens on CPU; the policy means "earliest tokens".
    """
    original = torch.topk

    def topk(input, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = original


ROUTING_CASES = [
    {"E": 8, "k": 2},
    {"E": 16, "k": 1, "router_pre_softmax": True},
    {"E": 64, "k": 4, "router_pre_softmax": True, "router_topk_scaling_factor": 2.5},
    {"E": 64, "k": 8, "router_num_groups": 8, "router_group_topk": 4},
    {"E": 32, "k": 6, "router_pre_softmax": True, "router_num_groups": 4, "router_group_topk": 2},
    {"E": 8, "k": 1, "router_score_function": "sigmoid"},
    {"E": 32, "k": 4, "router_score_function": "sigmoid", "router_topk_scaling_factor": 2.5},
    {"E": 16, "k": 2, "router_score_function": "sigmoid", "router_enable_expert_bias": True},
    {
        "E": 64,
        "k": 8,
        "router_score_function": "sigmoid",
        "router_enable_expert_bias": True,
        "router_num_groups": 8,
        "router_group_topk": 4,
        "router_topk_scaling_factor": 2.5,
    },
    {"E": 8, "k": 2, "expert_capacity_factor": 1.0},
    {"E": 16, "k": 4, "expert_capacity_factor": 0.5, "router_pre_softmax": True},
    {
        "E": 16,
        "k": 4,
        "router_score_function": "sigmoid",
        "router_enable_expert_bias": True,
        "expert_capacity_factor": 1.25,
    },
    {"E": 8, "k": 2, "expert_capacity_factor": 0.75, "pad_expert_input_to_capacity": True},
    {"E": 64, "k": 8, "expert_capacity_factor": 4.0, "pad_expert_input_to_capacity": True},
    {"E": 8, "k": 2, "expert_capacity_factor": 1.0, "token_drop_policy": "position"},
    {
        "E": 32,
        "k": 4,
        "router_score_function": "sigmoid",
        "expert_capacity_factor": 0.5,
        "token_drop_policy": "position",
        "pad_expert_input_to_capacity": True,
    },
]


def _case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items()).replace("router_", "")


@pytest.mark.parametrize("case", ROUTING_CASES, ids=_case_id)
@pytest.mark.parametrize("num_tokens", [7, 128, 512])
def test_route_matches_megatron(case: dict, num_tokens: int) -> None:
    mu = _mcore_utils()
    case = dict(case)
    num_experts, k = case.pop("E"), case.pop("k")
    cfg = _cfg(num_experts, k, **case)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        logits_TE = torch.randn(num_tokens, num_experts, generator=gen) * 2
        bias_E = torch.randn(num_experts, generator=gen) * 0.1 if cfg.router_enable_expert_bias else None

        result = route(logits_TE, cfg, bias_E)
        probs_TE, map_TE = result.dense()

        ref_probs, ref_map = mu.topk_routing_with_score_function(
            logits_TE,
            k,
            use_pre_softmax=cfg.router_pre_softmax,
            num_groups=cfg.router_num_groups,
            group_topk=cfg.router_group_topk,
            scaling_factor=cfg.router_topk_scaling_factor,
            score_function=cfg.router_score_function,
            expert_bias=bias_E,
        )
        routed_map = ref_map
        if cfg.expert_capacity_factor is not None:
            drop = contextlib.nullcontext() if cfg.token_drop_policy == "probs" else _stable_topk()
            with drop:
                ref_probs, ref_map = mu.apply_router_token_dropping(
                    ref_probs,
                    ref_map,
                    router_topk=k,
                    capacity_factor=cfg.expert_capacity_factor,
                    drop_policy=cfg.token_drop_policy,
                    pad_to_capacity=cfg.pad_expert_input_to_capacity,
                )
            assert result.capacity == mu.get_capacity(num_tokens * k, num_experts, cfg.expert_capacity_factor)
        torch.testing.assert_close(probs_TE, ref_probs, rtol=0, atol=1e-6)
        if cfg.pad_expert_input_to_capacity:
            # Megatron pads every expert to min(capacity, T) with zero-probability pairs; ours keeps
            # only the real kept assignments (the layer pads with zero rows instead).
            assert torch.equal(ref_map.sum(0), torch.full((num_experts,), min(result.capacity, num_tokens)))
            ref_map = ref_map & routed_map
        assert torch.equal(map_TE, ref_map)
        assert torch.equal(result.tokens_per_expert_E, ref_map.sum(0))
        assert int(result.num_dropped) == num_tokens * k - int(ref_map.sum())
        assert result.probs_TK.dtype == torch.float32 and result.experts_TK.dtype == torch.int64


def test_position_policy_keeps_earliest_tokens() -> None:
    cfg = _cfg(8, 2, expert_capacity_factor=0.5, token_drop_policy="position")
    result = route(torch.randn(64, 8), cfg)
    _, map_TE = result.dense()
    full_map = torch.zeros(64, 8, dtype=torch.bool).scatter(1, result.experts_TK, True)
    for e in range(8):
        routed = torch.nonzero(full_map[:, e]).flatten()
        assert torch.equal(torch.nonzero(map_TE[:, e]).flatten(), routed[: result.capacity])


def test_route_probs_carry_gradient() -> None:
    cfg = _cfg(16, 4, router_score_function="sigmoid", expert_capacity_factor=1.0)
    logits_TE = torch.randn(32, 16, requires_grad=True)
    route(logits_TE, cfg).probs_TK.sum().backward()
    assert logits_TE.grad is not None and logits_TE.grad.abs().sum() > 0


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_aux_scores_and_losses_match_megatron(score_function: str) -> None:
    mu = _mcore_utils()
    gen = torch.Generator().manual_seed(0)
    num_seqs, seq_len, num_experts, k, coeff = 4, 96, 32, 4, 1e-2
    logits_TE = torch.randn(num_seqs * seq_len, num_experts, generator=gen)

    experts_TK, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, k, score_function)
    ref_map, ref_scores = mu.compute_routing_scores_for_aux_loss(logits_TE, k, score_function)
    torch.testing.assert_close(scores_TE, ref_scores, rtol=0, atol=0)
    assert torch.equal(torch.zeros_like(ref_map).scatter(1, experts_TK, True), ref_map)

    counts_E = tokens_per_expert(experts_TK, num_experts)
    assert torch.equal(counts_E, ref_map.sum(0))
    ours = switch_load_balancing_loss(scores_TE, counts_E, 3 * seq_len, k, num_experts, coeff)
    ref = mu.switch_load_balancing_loss_func(scores_TE, ref_map.sum(0), 3 * seq_len, k, num_experts, coeff)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)

    # Sequence-level: Megatron folds [S, B, E] (sequence-first) into [S, B*E] and divides by B.
    scores_BSE = scores_TE.view(num_seqs, seq_len, num_experts)
    map_BSE = ref_map.view(num_seqs, seq_len, num_experts)
    counts_BE = tokens_per_sequence_expert(experts_TK.view(num_seqs, seq_len, k), num_experts)
    assert torch.equal(counts_BE, map_BSE.sum(1))
    ours = sequence_load_balancing_loss(scores_BSE, counts_BE, seq_len, k, coeff)
    scores_SBE = scores_BSE.transpose(0, 1).reshape(seq_len, -1)
    map_SBE = map_BSE.transpose(0, 1).reshape(seq_len, -1)
    ref = mu.switch_load_balancing_loss_func(scores_SBE, map_SBE.sum(0), seq_len, k, num_experts, coeff) / num_seqs
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)

    # Global: running mean of the counts over micro-batches.
    acc_E = counts_E.float() * 3 + 5
    ours = global_load_balancing_loss(scores_TE, acc_E, torch.tensor(4.0), scores_TE.shape[0], k, num_experts, coeff)
    ref = mu.switch_load_balancing_loss_func(scores_TE, acc_E / 4, scores_TE.shape[0], k, num_experts, coeff)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)

    torch.testing.assert_close(z_loss(logits_TE, 1e-3), mu.z_loss_func(logits_TE, 1e-3), rtol=0, atol=0)


def test_autoscaler_injects_scaled_gradient() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    loss = (w**2).sum()
    y = AuxLossAutoScaler.apply(x * 1.0, loss, 0.25)
    assert torch.equal(y, x)
    y.sum().backward()
    torch.testing.assert_close(w.grad, 0.25 * 2 * w.detach())
    torch.testing.assert_close(x.grad, torch.ones_like(x))


# ----------------------------------------------------------------------------------------------
# TopKRouter: gradients, scale, precision, meta init
# ----------------------------------------------------------------------------------------------


def _task_weights(shape: torch.Size, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_aux_loss_gradient_reaches_weight(balancing: str, scale: float) -> None:
    coeff, z_coeff = 0.1, 0.01
    cfg = _cfg(8, 2, router_load_balancing_type=balancing, aux_loss_coeff=coeff, z_loss_coeff=z_coeff)
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    router.aux_loss_scale = scale
    x = torch.randn(3, 20, D)

    result = router(x)
    task = (result.probs_TK * _task_weights(result.probs_TK.shape)).sum()
    task.backward()
    grad_auto = router.weight.grad.clone()
    assert set(router.latest_losses) == {balancing, "z_loss"}

    # By hand: the same task loss plus scale * (coeff * aux + z_coeff * z) built explicitly.
    weight = router.weight.detach().clone().requires_grad_(True)
    logits_TE = x.reshape(-1, D) @ weight.T
    probs_TK = route(logits_TE, cfg).probs_TK
    experts_TK, scores_TE = compute_routing_scores_for_aux_loss(logits_TE, 2, "softmax")
    if balancing == "seq_aux_loss":
        counts_BE = tokens_per_sequence_expert(experts_TK.view(3, 20, 2), 8)
        aux = sequence_load_balancing_loss(scores_TE.view(3, 20, 8), counts_BE, 20, 2, coeff)
    else:  # one micro-batch: the global mean of counts is this micro-batch's counts
        aux = switch_load_balancing_loss(scores_TE, tokens_per_expert(experts_TK, 8), 60, 2, 8, coeff)
    z = z_loss(logits_TE, z_coeff)
    total = (probs_TK * _task_weights(probs_TK.shape)).sum() + scale * (aux + z)
    total.backward()
    torch.testing.assert_close(grad_auto, weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(router.latest_losses[balancing], (aux / coeff).detach())
    torch.testing.assert_close(router.latest_losses["z_loss"], (z / z_coeff).detach())


def test_losses_only_in_training_with_grad() -> None:
    cfg = _cfg(8, 2, router_load_balancing_type=["aux_loss", "none"], aux_loss_coeff=[0.1, 0.5], z_loss_coeff=1e-3)
    router = TopKRouter(cfg)
    x = torch.randn(10, D)
    router(x)
    assert set(router.latest_losses) == {"aux_loss", "z_loss"}
    assert all(v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in router.latest_losses.values())
    with torch.no_grad():
        router(x)
    assert router.latest_losses == {}
    router.eval()
    router(x)
    assert router.latest_losses == {}
    off = TopKRouter(_cfg(8, 2, aux_loss_coeff=0.0))
    off(x)
    assert off.latest_losses == {}


def test_bf16_input_keeps_fp32_routing() -> None:
    cfg = _cfg(16, 4, router_score_function="sigmoid", router_enable_expert_bias=True, aux_loss_coeff=1e-2)
    router = TopKRouter(cfg).to(torch.bfloat16)  # router state refuses low precision
    assert router.weight.dtype == torch.float32 and router.expert_bias.dtype == torch.float32
    assert router.local_tokens_per_expert.dtype == torch.float32
    x = torch.randn(2, 8, D, dtype=torch.bfloat16, requires_grad=True)
    result = router(x)
    assert result.probs_TK.dtype == torch.float32
    probs_ref = route(x.detach().reshape(-1, D).float() @ router.weight.detach().T, cfg, router.expert_bias).probs_TK
    torch.testing.assert_close(result.probs_TK.detach(), probs_ref, rtol=0, atol=0)
    result.probs_TK.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and router.weight.grad.dtype == torch.float32


def test_jitter_only_in_training() -> None:
    cfg = _cfg(8, 2, input_jitter_eps=0.1)
    router = TopKRouter(cfg)
    x = torch.randn(64, D)
    torch.manual_seed(0)
    a = router(x).probs_TK
    b = router(x).probs_TK
    assert not torch.equal(a, b)
    router.eval()
    torch.testing.assert_close(router(x).probs_TK, route(x @ router.weight.T, cfg).probs_TK, rtol=0, atol=0)


def test_reset_parameters_after_meta_init() -> None:
    cfg = _cfg(
        64,
        4,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_load_balancing_type="global_aux_loss",
        aux_loss_coeff=1e-3,
        init_method_std=0.02,
    )
    with torch.device("meta"):
        router = TopKRouter(cfg)
    assert router.weight.is_meta
    router.to_empty(device="cpu")
    torch.manual_seed(0)
    router.reset_parameters()
    assert not router.weight.is_meta and router.weight.dtype == torch.float32
    assert abs(router.weight.std().item() - 0.02) < 0.002
    for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "global_aux_num_microbatches"):
        buf = getattr(router, name)
        assert buf.dtype == torch.float32 and torch.count_nonzero(buf) == 0
    assert set(router.state_dict()) == {
        "weight",
        "expert_bias",
        "local_tokens_per_expert",
        "global_tokens_per_expert",
        "global_aux_num_microbatches",
    }
    router(torch.randn(4, 5, D)).probs_TK.sum().backward()


def test_rejects_bad_input_shape() -> None:
    router = TopKRouter(_cfg(8, 2))
    with pytest.raises(ValueError, match="router input"):
        router(torch.randn(2, 3, 4, D))


# ----------------------------------------------------------------------------------------------
# Megatron's real TopKRouter on CPU
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcore_router_env(tmp_path_factory):
    """Megatron pieces to run its ``TopKRouter`` on CPU with a one-process gloo group.

    Three adaptations, none touching the routing math: ``gating`` moves the weight to CUDA when
    it sits on CPU, so it is replaced by its own ``router_gating_linear`` call in fp32; the
    module-level ``te_general_gemm`` name is absent without Transformer Engine and is set to None
    (its intended fallback); ``torch.cuda.current_device`` is pointed at the CPU while buffers are
    created. ``torch.compile`` (Megatron's jit fuser for the bias counter) is disabled for speed.
    """
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.transformer.moe.moe_utils as mu
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.router import TopKRouter as MTopKRouter
        from megatron.core.transformer.transformer_config import TransformerConfig

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.new_group([0])
    pg = ProcessGroupCollection()
    pg.tp = pg.cp = pg.tp_cp = pg.tp_dp_cp = group
    mp = pytest.MonkeyPatch()
    mp.setattr(mu, "te_general_gemm", None, raising=False)
    mp.setattr(torch._dynamo.config, "disable", True)
    env = {"mu": mu, "pg": pg, "TopKRouter": MTopKRouter, "TransformerConfig": TransformerConfig, "mp": mp}
    yield env
    mp.undo()
    mu.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    mu.clear_aux_losses_tracker()
    if created:
        dist.destroy_process_group()


def _mcore_config(env, cfg: MoEConfig):
    """Megatron's TransformerConfig for the same layer, with fp32 router math on CPU."""
    return env["TransformerConfig"](
        num_layers=1,
        hidden_size=cfg.hidden_size,
        num_attention_heads=4,
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.ffn_hidden_size,
        moe_router_topk=cfg.router_topk,
        moe_router_score_function=cfg.router_score_function,
        moe_router_pre_softmax=cfg.router_pre_softmax,
        moe_router_num_groups=cfg.router_num_groups,
        moe_router_group_topk=cfg.router_group_topk,
        moe_router_topk_scaling_factor=cfg.router_topk_scaling_factor,
        moe_router_enable_expert_bias=cfg.router_enable_expert_bias,
        moe_router_bias_update_rate=cfg.router_bias_update_rate,
        moe_router_load_balancing_type=cfg.router_load_balancing_type,
        moe_aux_loss_coeff=cfg.aux_loss_coeff,
        moe_z_loss_coeff=cfg.z_loss_coeff,
        moe_expert_capacity_factor=cfg.expert_capacity_factor,
        moe_token_drop_policy=cfg.token_drop_policy,
        moe_pad_expert_input_to_capacity=cfg.pad_expert_input_to_capacity,
        moe_router_dtype="fp32",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )


def _build_mcore_router(env, cfg: MoEConfig, weight: torch.Tensor, bias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notes about unrelated defaults
        mcfg = _mcore_config(env, cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        router = env["TopKRouter"](mcfg, pg_collection=env["pg"])
    mu = env["mu"]
    router.gating = lambda inp: mu.router_gating_linear(inp, router.weight, None, torch.float32)
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(weight)
        if bias is not None:
            router.expert_bias.copy_(bias)
    return router


MCORE_ROUTER_CASES = [
    {"E": 8, "k": 2, "router_load_balancing_type": "aux_loss", "aux_loss_coeff": 1e-2, "z_loss_coeff": 1e-3},
    {
        "E": 16,
        "k": 4,
        "router_score_function": "sigmoid",
        "router_enable_expert_bias": True,
        "router_num_groups": 4,
        "router_group_topk": 2,
        "router_topk_scaling_factor": 2.5,
        "router_load_balancing_type": ["aux_loss", "seq_aux_loss", "global_aux_loss"],
        "aux_loss_coeff": [1e-2, 1e-3, 3e-2],
    },
    {
        "E": 8,
        "k": 2,
        "router_pre_softmax": True,
        "router_load_balancing_type": "seq_aux_loss",
        "aux_loss_coeff": 0.1,
        "expert_capacity_factor": 1.0,
        "z_loss_coeff": 1e-2,
    },
    {
        "E": 8,
        "k": 2,
        "router_score_function": "sigmoid",
        "router_enable_expert_bias": True,
        "router_load_balancing_type": "global_aux_loss",
        "aux_loss_coeff": 0.1,
    },
    {
        "E": 16,
        "k": 4,
        "router_score_function": "sigmoid",
        "router_enable_expert_bias": True,
        "router_load_balancing_type": "aux_loss",
        "aux_loss_coeff": 0.1,
        "expert_capacity_factor": 0.75,
        "token_drop_policy": "position",
        "pad_expert_input_to_capacity": True,
        "one_sequence": True,
    },
]


@pytest.mark.parametrize("case", MCORE_ROUTER_CASES, ids=_case_id)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_topk_router_matches_megatron_router(mcore_router_env, case: dict, scale: float) -> None:
    """Forward probs/map, logged losses, bias counts and weight gradients over two micro-batches."""
    env, mu = mcore_router_env, mcore_router_env["mu"]
    case = dict(case)
    num_experts, k = case.pop("E"), case.pop("k")
    one_sequence = case.pop("one_sequence", False)
    cfg = _cfg(num_experts, k, **case)
    torch.manual_seed(0)
    ours = TopKRouter(cfg)
    ours.aux_loss_scale = scale
    bias = torch.randn(num_experts) * 0.05 if cfg.router_enable_expert_bias else None
    if bias is not None:
        ours.expert_bias.copy_(bias)
    theirs = _build_mcore_router(env, cfg, ours.weight.detach(), bias)
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
    names = {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
        "z_loss": "z_loss",
    }

    expected_losses = set(cfg.active_aux_losses) | ({"z_loss"} if cfg.z_loss_coeff else set())
    num_seqs, seq_len = (1, 48) if one_sequence else (4, 12)
    for micro_batch in range(2):
        x_BSD = torch.randn(num_seqs, seq_len, D)
        mu.clear_aux_losses_tracker()
        result = ours(x_BSD[0] if one_sequence else x_BSD)
        with _stable_topk() if cfg.token_drop_policy == "position" else contextlib.nullcontext():
            probs_m, map_m = theirs(x_BSD.transpose(0, 1).contiguous())  # Megatron is sequence-first

        def to_batch_first(t_TE: torch.Tensor) -> torch.Tensor:
            return t_TE.view(seq_len, num_seqs, -1).transpose(0, 1).reshape(num_seqs * seq_len, -1)

        probs_TE, map_TE = result.dense()
        torch.testing.assert_close(probs_TE, to_batch_first(probs_m), rtol=0, atol=1e-6)
        map_ref = to_batch_first(map_m)
        if cfg.pad_expert_input_to_capacity:
            map_ref = map_ref & (to_batch_first(probs_m) > 0)
        assert torch.equal(map_TE, map_ref)
        tracker = mu.get_moe_layer_wise_logging_tracker()
        assert set(ours.latest_losses) == expected_losses
        for name, value in ours.latest_losses.items():
            torch.testing.assert_close(value, tracker[names[name]]["values"][0], rtol=1e-6, atol=0)

        task_w = _task_weights(probs_TE.shape, seed=micro_batch)
        (probs_TE * task_w).sum().backward()
        (probs_m * task_w.view(num_seqs, seq_len, -1).transpose(0, 1).reshape(-1, num_experts)).sum().backward()
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-6)
        if bias is not None:
            torch.testing.assert_close(ours.local_tokens_per_expert, theirs.local_tokens_per_expert, rtol=0, atol=0)
        if ours.global_tokens_per_expert is not None:
            torch.testing.assert_close(ours.global_tokens_per_expert, theirs.global_tokens_per_expert, rtol=0, atol=0)
            assert ours.global_aux_num_microbatches.item() == theirs.ga_steps.item() == micro_batch + 1
    assert math.isfinite(ours.weight.grad.norm().item())
    if bias is not None:  # one aux-loss-free balancing step from the accumulated counts
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group", lambda **_: env["pg"].tp_dp_cp)
            expected = mu.get_updated_expert_bias(
                theirs.local_tokens_per_expert.clone(), theirs.expert_bias, cfg.router_bias_update_rate
            )
        ours.update_expert_bias()
        assert torch.equal(ours.expert_bias, expected)
        # Megatron's padded map gives every expert the same count: the bias cannot move.
        assert torch.equal(ours.expert_bias, bias) == cfg.pad_expert_input_to_capacity


@pytest.mark.parametrize(
    ("balancing", "group_attr", "expected"),
    [("aux_loss", None, False), ("aux_loss", "sequence_parallel_group", True),
     ("seq_aux_loss", "global_aux_loss_group", False), ("global_aux_loss", "global_aux_loss_group", True),
     ("none", "sequence_parallel_group", False)],
)
def test_router_reports_whether_its_forward_communicates(monkeypatch, balancing, group_attr, expected) -> None:
    """The MoE layer only gathers tokens ahead of routing when the router has no collectives of
    its own (two communicators' NCCL kernels side by side could deadlock)."""
    import lightning_moe.nn.router as router_module

    coeff = 0.0 if balancing == "none" else 1e-2
    router = TopKRouter(_cfg(8, 2, router_load_balancing_type=balancing, aux_loss_coeff=coeff))
    assert not router.communicates()  # no groups at all
    marker = object()
    monkeypatch.setattr(router_module, "group_size", lambda group: 2 if group is marker else 1)
    if group_attr is not None:
        setattr(router, group_attr, marker)
    assert router.communicates() is expected
