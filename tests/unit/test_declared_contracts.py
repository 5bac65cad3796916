"""The contracts between `MoELayer`, its dispatcher, its experts and their quantization are
declared: base classes list every member the caller uses, with defaults, and nothing is probed."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.nn.dispatcher import (
    LocalDispatcher,
    LocalDispatchState,
    TokenDispatcher,
    expert_input,
    plan_for,
)
from lightning_moe.nn.experts import GroupedExperts, GroupedGemmQuantization, RoutedExperts
from lightning_moe.nn.permutation import unpermute

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_moe"
CFG = {"hidden_size": 16, "ffn_hidden_size": 24, "num_experts": 8, "router_topk": 2, "expert_alignment": 8,
       "aux_loss_coeff": 1e-2}


class PlainDispatcher(TokenDispatcher):
    """Only what the base requires: every capability left at its default."""

    def __init__(self, cfg: MoEConfig) -> None:
        self.cfg = cfg

    def dispatch(self, x_TD, routing):
        plan = plan_for(routing, self.cfg)
        x_RD, probs_TK = expert_input(x_TD, routing.probs_TK, plan, self.cfg)
        return x_RD, plan.group_sizes_E, LocalDispatchState(plan, probs_TK)

    def combine(self, expert_output_RD, state):
        return unpermute(expert_output_RD, state.combine_probs_TK, state.plan)


def _train_step(layer: MoELayer, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("overrides", [{}, {"expert_capacity_factor": 0.75}, {"shared_expert_intermediate_size": 20}])
def test_a_dispatcher_with_the_base_defaults_runs_the_layer_as_the_local_one(overrides):
    """A dispatcher that declares no capability (no prefetch, no deferred permutation or
    combine, no `run`) drives `MoELayer` through `dispatch` and `combine` alone: outputs and
    every gradient equal the local dispatcher's."""
    x = torch.randn(2, 12, 16)
    results = []
    for make in (LocalDispatcher, PlainDispatcher):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**{**CFG, **overrides}))
        layer.set_dispatcher(make(layer.config))
        results.append(_train_step(layer, x))
    assert isinstance(layer.dispatcher, PlainDispatcher) and layer.dispatcher.describe() == "PlainDispatcher"
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_dispatcher_base_lists_every_capability_with_its_default():
    flags = {"prefetches", "can_leave_tail_unwritten", "can_defer_permute", "can_defer_combine", "runs_experts",
             "syncs_host"}
    assert set(TokenDispatcher.CAPABILITIES) == flags
    for flag, member in TokenDispatcher.CAPABILITIES.items():
        assert getattr(TokenDispatcher, flag) is False, flag
        assert member is None or callable(getattr(TokenDispatcher, member)), member
    assert TokenDispatcher.__abstractmethods__ == frozenset({"dispatch", "combine"})
    base = PlainDispatcher(MoEConfig(**CFG))
    assert base.prefetch(torch.zeros(2, 16)) is None
    with pytest.raises(NotImplementedError, match="can_defer_combine"):
        base.deferred_combine(None)
    with pytest.raises(NotImplementedError, match="runs_experts"):
        base.run(None, None, None)


def test_every_dispatcher_derives_from_the_base_and_declares_what_it_offers():
    from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher

    def offered(cls):
        return {flag for flag in TokenDispatcher.CAPABILITIES if getattr(cls, flag) is True}

    assert all(issubclass(cls, TokenDispatcher) for cls in (LocalDispatcher, AllToAllDispatcher, AllGatherDispatcher))
    assert offered(LocalDispatcher) == {"can_defer_permute", "can_defer_combine"}
    assert offered(AllToAllDispatcher) == {"runs_experts"}  # syncs_host: a property of the configuration
    assert isinstance(AllToAllDispatcher.syncs_host, property)
    assert offered(AllGatherDispatcher) == {"prefetches", "can_leave_tail_unwritten", "can_defer_permute"}


def test_a_capability_flag_without_its_member_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match="runs_experts = True but does not implement run"):
        class Half(PlainDispatcher):
            runs_experts = True


def test_the_layer_probes_neither_dispatcher_nor_experts():
    source = (PACKAGE / "nn" / "moe_layer.py").read_text()
    members = set(TokenDispatcher.CAPABILITIES) | {m for m in TokenDispatcher.CAPABILITIES.values() if m}
    members |= {name for name in dir(RoutedExperts) if not name.startswith("_")}
    for member in members:
        assert f'"{member}"' not in source, member


def test_the_experts_declare_what_the_layer_calls():
    members = {name for name, _ in inspect.getmembers(RoutedExperts, inspect.isfunction) if not name.startswith("_")}
    assert members == {"prefetch", "release_prefetched", "reads_only_grouped_rows", "takes_deferred_permutation",
                       "takes_deferred_combine"}
    assert all(callable(getattr(GroupedExperts, name)) for name in members)


class PlainGemm(GroupedGemmQuantization):
    """A quantization with only the required member: the full-precision grouped GEMM."""

    def __init__(self) -> None:
        self.projections = []

    def grouped_mm(self, x_RK, w_EKN, offsets_E, projection=""):
        self.projections.append(projection)
        return torch._grouped_mm(x_RK, w_EKN.to(x_RK.dtype), offs=offsets_E)


def test_the_quantization_base_lists_every_member_the_experts_call_with_its_default():
    assert GroupedGemmQuantization.__abstractmethods__ == frozenset({"grouped_mm"})
    gemm, x = PlainGemm(), torch.zeros(4, 8)
    assert gemm.swiglu_takes_combine is True and gemm.prefetches_weights is False
    assert gemm.grouped_mm_swiglu(x, x, x, "fc2", combine=None) is None
    assert gemm.grouped_mm_gathered(x, None, x, x, "fc1") is None
    assert not gemm.takes_deferred_permutation(x) and not gemm.takes_deferred_combine(x)
    assert gemm.prefetch_weights({"fc1": x}) is None and gemm.release_prefetched() is None
    assert gemm.check_sharded_weights() is None


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_a_quantization_with_the_base_defaults_runs_the_experts(activation):
    """Only `grouped_mm`: the layer runs as without quantization (same GEMMs), bit for bit."""
    x = torch.randn(20, 16)
    results = []
    for gemm in (None, PlainGemm()):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**CFG, activation=activation, expert_backend="grouped_mm"))
        layer.experts.quantization = gemm
        results.append(_train_step(layer, x))
    assert gemm.projections == ["fc1", "fc2"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class Duck(torch.nn.Module):
    """A quantization hook that does not derive from `GroupedGemmQuantization`."""

    def grouped_mm(self, x_RK, w_EKN, offsets_E, projection=""):
        return torch._grouped_mm(x_RK, w_EKN.to(x_RK.dtype), offs=offsets_E)

    def prefetch_weights(self, weights):
        self.prefetched = sorted(weights)


def test_a_quantization_that_does_not_derive_from_the_base_is_refused():
    """An object that is not a `GroupedGemmQuantization` (a hook written before it) is refused at
    assignment with the fix named, instead of being probed member by member."""
    experts = GroupedExperts(4, 16, 8, backend="grouped_mm")
    with pytest.raises(TypeError, match="derive from it"):
        experts.quantization = Duck()
    experts.quantization = None
    assert experts.quantization is None

    class Derived(Duck, GroupedGemmQuantization):
        prefetches_weights = True

    derived = Derived()
    experts.quantization = derived
    experts.prefetch()
    assert derived.prefetched == ["fc1", "fc2"]
    experts.release_prefetched()
    assert experts(torch.randn(12, 16), torch.tensor([3, 4, 0, 5])).shape == (12, 16)


def test_a_swiglu_override_without_combine_declares_so():
    """`swiglu_takes_combine` is a declared flag: a subclass whose `grouped_mm_swiglu` takes no
    ``combine`` says so, and the experts then combine after it."""

    class Old(PlainGemm):
        swiglu_takes_combine = False

        def grouped_mm_swiglu(self, h_RF2, w_EFN, offsets_E, projection=""):
            return None

    assert PlainGemm.swiglu_takes_combine and not Old.swiglu_takes_combine


def test_fp8_grouped_gemm_derives_from_the_nn_interface():
    from lightning_moe.precision.modules import FP8GroupedGemm

    gemm = FP8GroupedGemm("delayed", backend="emulated")
    assert isinstance(gemm, GroupedGemmQuantization) and isinstance(gemm, torch.nn.Module)
    assert FP8GroupedGemm.swiglu_takes_combine and FP8GroupedGemm.prefetches_weights
    experts = GroupedExperts(4, 16, 8)
    experts.quantization = gemm
    assert experts.quantization is gemm


def test_nn_knows_nothing_of_precision():
    """No module of ``lightning_moe.nn`` imports the precision package, and importing the experts,
    the dispatcher and the layer loads none of it."""
    importers = sorted(p.name for p in (PACKAGE / "nn").glob("*.py")
                       if "lightning_moe.precision" in p.read_text() or "from lightning_moe import precision"
                       in p.read_text())
    assert not importers, importers
    code = ("import sys, lightning_moe.nn.experts, lightning_moe.nn.moe_layer, lightning_moe.nn.dispatcher; "
            "loaded = [m for m in sys.modules if m.startswith('lightning_moe.precision')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
