"""The wiring of the expert weights' early FP8 casts (``GroupedExperts.prefetch``). The casts
themselves run on CUDA only (GPU test ``test_prefetched_weights_train_identically``); here the
side-stream cast is replaced by a recorder, to check what is started, with which state, and
that whatever no GEMM took is released."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.precision import FP8Recipe, weight_prefetch
from lightning_moe.precision import modules as fp8_modules
from lightning_moe.precision.modules import FP8GroupedGemm


class _Started:
    """Stands for a `weight_prefetch.PrefetchedWeight`: counts releases."""

    def __init__(self, w, state) -> None:
        self.w, self.state, self.released = w, state, 0

    def release(self) -> None:
        self.released += 1


@pytest.fixture
def recorded(monkeypatch):
    """Every weight counts as castable early, on the "torch" backend; casts are recorded."""
    started = []

    def start(w, recipe, state):
        started.append(_Started(w, state))
        return started[-1]

    monkeypatch.setattr(weight_prefetch, "can_prefetch_weight_layouts", lambda w, recipe: True)
    monkeypatch.setattr(weight_prefetch, "prefetch_weight_layouts", start)
    monkeypatch.setattr(fp8_modules, "resolve_backend", lambda *args, **kwargs: "torch")
    return started


def _delayed_gemm_after_one_forward(experts: int = 4) -> FP8GroupedGemm:
    gemm = FP8GroupedGemm(FP8Recipe("delayed"), backend="emulated")
    x = torch.randn(4 * experts, 16, requires_grad=True)
    offsets = torch.arange(1, experts + 1, dtype=torch.int32) * 4
    h = gemm.grouped_mm(x, torch.randn(experts, 16, 8, requires_grad=True), offsets, "fc1")
    gemm.grouped_mm(h, torch.randn(experts, 8, 16, requires_grad=True), offsets, "fc2").sum().backward()
    return gemm


def test_weights_of_another_shape_never_touch_the_delayed_state(recorded):
    """An FSDP shard (or any weight the state was not sized for) starts nothing and leaves the
    amax histories as they are; the first forward, not the prefetch, allocates them."""
    fresh = FP8GroupedGemm(FP8Recipe("delayed"))
    fresh.prefetch_weights({"fc1": torch.randn(4, 16, 8, requires_grad=True)})
    assert recorded == [] and fresh.fp8_scale is None  # no state yet: nothing started or allocated

    gemm = _delayed_gemm_after_one_forward(experts=4)
    history, scale = gemm.fp8_amax_history, gemm.fp8_scale
    snapshot = history.clone()
    gemm.prefetch_weights({"fc1": torch.randn(2, 16, 8, requires_grad=True)})  # half the experts
    assert recorded == []
    assert gemm.fp8_amax_history is history and gemm.fp8_scale is scale
    assert torch.equal(history, snapshot)

    gemm.prefetch_weights({"fc1": torch.randn(4, 16, 8, requires_grad=True),
                           "fc2": torch.randn(4, 8, 16, requires_grad=True)})
    assert len(recorded) == 2
    # each projection's own half of the buffers: fc1's experts first, then fc2's
    assert recorded[0].state.scale.data_ptr() == scale[:, :4].data_ptr()
    assert recorded[1].state.scale.data_ptr() == scale[:, 4:].data_ptr()


def test_copies_no_gemm_took_are_released(recorded):
    gemm = _delayed_gemm_after_one_forward(experts=4)
    weights = {"fc1": torch.randn(4, 16, 8, requires_grad=True), "fc2": torch.randn(4, 8, 16, requires_grad=True)}
    gemm.prefetch_weights(weights)
    first = list(recorded)
    assert gemm._take_prefetched("fc1") is first[0]  # taken by fc1's GEMM: not released here
    gemm.prefetch_weights(weights)  # the next forward's: fc2's leftover is released first
    assert (first[0].released, first[1].released) == (0, 1)
    gemm.release_prefetched()
    assert [s.released for s in recorded[2:]] == [1, 1]
    gemm.release_prefetched()  # nothing pending any more
    assert [s.released for s in recorded[2:]] == [1, 1]


def test_moe_layer_releases_what_a_failed_forward_left(recorded, monkeypatch):
    """A forward that stops before its experts run (here: in the router) still releases the
    copies it started, so no later work (an optimizer step) races their casts."""
    layer = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, router_topk=2))
    layer.experts.quantization = _delayed_gemm_after_one_forward(experts=4)

    def failing_router(*args, **kwargs):
        raise RuntimeError("router failed")

    monkeypatch.setattr(layer.router, "forward", failing_router)
    with pytest.raises(RuntimeError, match="router failed"):
        layer(torch.randn(2, 3, 16))
    assert len(recorded) == 2 and [s.released for s in recorded] == [1, 1]
    assert "_prefetched" not in layer.experts.quantization.__dict__


def test_graphed_casts_take_the_prefetch_when_they_run(recorded, monkeypatch):
    """With ``graph_weight_casts`` the prefetch offers its casts to the layer's graph first (the
    same projections, weights and states the eager casts would get) and casts eagerly only where
    the graph declines."""
    import dataclasses

    from lightning_moe.precision.graphed_casts import GraphedWeightCasts

    gemm = _delayed_gemm_after_one_forward(experts=4)
    gemm.recipe = dataclasses.replace(gemm.recipe, graph_weight_casts=True)
    offered, answer = [], {"value": None}

    def start(self, jobs, recipe):
        offered.append(jobs)
        return answer["value"]

    monkeypatch.setattr(GraphedWeightCasts, "start", start)
    weights = {"fc1": torch.randn(4, 16, 8, requires_grad=True), "fc2": torch.randn(4, 8, 16, requires_grad=True)}
    gemm.prefetch_weights(weights)  # declined: eager casts
    assert [(p, w is weights[p]) for p, w, _ in offered[0]] == [("fc1", True), ("fc2", True)]
    assert offered[0][1][2].scale.data_ptr() == gemm.fp8_scale[:, 4:].data_ptr()
    assert len(recorded) == 2 and gemm._take_prefetched("fc1") is recorded[0]
    answer["value"] = {"fc1": "graphed fc1", "fc2": "graphed fc2"}
    monkeypatch.setattr(weight_prefetch.PrefetchedWeight, "release", lambda self: None, raising=False)
    gemm.__dict__["_prefetched"] = {}
    gemm.prefetch_weights(weights)  # taken: nothing cast eagerly
    assert len(recorded) == 2 and gemm._take_prefetched("fc2") == "graphed fc2"
    # the graph is the module's own, not state: a copy starts without one
    import copy

    assert isinstance(gemm.graphed_weight_casts, GraphedWeightCasts)
    assert copy.deepcopy(gemm).__dict__.get("_graphed_weight_casts") is not gemm.graphed_weight_casts


def test_graph_weight_casts_options_are_checked(monkeypatch):
    """Every combination in which no cast would be graphed is refused up front, naming the fix."""
    from lightning_moe.precision import FP8Precision

    for recipe in ("tensorwise", "blockwise"):
        with pytest.raises(ValueError, match="graph_weight_casts.*'delayed' or 'rowwise'"):
            FP8Recipe(recipe, graph_weight_casts=True)
    with pytest.raises(ValueError, match="quantize_weights_once"):
        FP8Recipe("delayed", graph_weight_casts=True, quantize_weights_once=False)
    assert "CUDA-graphed" in FP8Recipe("rowwise", graph_weight_casts=True).describe()
    graphed = FP8Recipe("delayed", graph_weight_casts=True)
    with pytest.raises(ValueError, match="backend='torch'"):
        FP8Precision(recipe=graphed, backend="emulated", device="cpu")
    with pytest.raises(ValueError, match="backend 'torch'"):
        FP8GroupedGemm(graphed, backend="emulated")
    # "auto" that resolves to another backend where the casts would run: refused there
    gemm = FP8GroupedGemm(graphed, backend="auto")
    monkeypatch.setattr(weight_prefetch, "can_prefetch_weight_layouts", lambda w, recipe: True)
    monkeypatch.setattr(fp8_modules, "resolve_backend", lambda *args, **kwargs: "te")
    with pytest.raises(ValueError, match="graph_weight_casts=False"):
        gemm.prefetch_weights({"fc1": torch.randn(4, 16, 8, requires_grad=True)})


def test_graph_weight_casts_refused_with_fsdp_sharded_experts(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from lightning_moe.nn.experts import GroupedExperts

    experts = GroupedExperts(num_experts=4, hidden_size=16, ffn_hidden_size=8)
    experts.quantization = FP8GroupedGemm(FP8Recipe("delayed", graph_weight_casts=True), backend="auto")
    experts.__class__ = type("ShardedExperts", (FSDPModule, GroupedExperts), {})  # as fully_shard makes it
    with pytest.raises(ValueError, match="not sharded by FSDP"):
        experts.prefetch()


def test_strategy_refuses_graphed_casts_with_fsdp_sharded_experts(monkeypatch):
    from lightning_moe.precision import FP8Precision
    from lightning_moe.precision import plugin as plugin_module
    from lightning_moe.strategies import MegatronMoEStrategy

    monkeypatch.setattr(plugin_module, "resolve_backend", lambda recipe, backend, device: "torch")
    strategy = MegatronMoEStrategy()
    strategy._precision_plugin = FP8Precision(recipe=FP8Recipe("delayed", graph_weight_casts=True), backend="torch",
                                              device="cpu")
    strategy._check_fp8_options()  # experts not sharded: fine
    strategy._experts_fsdp = True
    with pytest.raises(ValueError, match="expert_sharding='ddp'.*graph_weight_casts=False"):
        strategy._check_fp8_options()
