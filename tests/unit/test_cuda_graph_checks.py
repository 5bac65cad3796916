"""`capture_moe_layer` refuses, naming the fix, what a CUDA graph could not replay (checked on
CPU, before the capture; the captures themselves are GPU tests)."""

from types import SimpleNamespace

import pytest
import torch

from lightning_moe.cuda_graphs import capture_moe_layer
from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.parallel.dispatchers import AllToAllDispatcher
from lightning_moe.precision import FP8Precision, FP8Recipe, update_delayed_scaling
from lightning_moe.precision.delayed import amax_recording_paused
from lightning_moe.precision.modules import fp8_modules


def _layer() -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, router_topk=2))


def test_cpu_layer_is_refused():
    layer = _layer()
    with pytest.raises(ValueError, match="CUDA device"):
        capture_moe_layer(layer, torch.randn(8, 32))


def test_evaluation_mode_is_refused():
    layer = _layer().eval()
    with pytest.raises(ValueError, match=r"layer\.train\(\)"):
        capture_moe_layer(layer, torch.randn(8, 32))


def test_dropless_all_to_all_is_refused():
    """The dropless all-to-all reads its split sizes on the host; padding to capacity does not."""
    dropless = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, router_topk=2)
    padded = MoEConfig(hidden_size=32, ffn_hidden_size=64, num_experts=4, router_topk=2,
                       expert_capacity_factor=1.5, pad_expert_input_to_capacity=True)
    syncs_host = AllToAllDispatcher.syncs_host.fget
    assert syncs_host(SimpleNamespace(cfg=dropless)) is True
    assert syncs_host(SimpleNamespace(cfg=padded)) is False
    layer = _layer()
    layer.set_dispatcher(SimpleNamespace(syncs_host=True))
    with pytest.raises(ValueError, match="pad_expert_input_to_capacity=True"):
        capture_moe_layer(layer, torch.randn(8, 32))


def test_fsdp_sharded_layer_is_refused(monkeypatch):
    from torch.distributed import fsdp

    layer = _layer()
    # What fully_shard does to a module's class, without a process group.
    layer.experts.__class__ = type("FSDPGroupedExperts", (fsdp.FSDPModule, type(layer.experts)), {})
    with pytest.raises(ValueError, match="FSDP"):
        capture_moe_layer(layer, torch.randn(8, 32))


def test_fp8_delayed_state_without_scales_is_refused():
    """A state without an update yet would freeze its amax pre-pass into the graph."""
    layer = _layer()
    recipe = FP8Recipe("delayed")
    plugin = FP8Precision(recipe=recipe, backend="emulated", device="cpu")
    plugin.convert_module(layer)
    x = torch.randn(8, 32)
    with plugin.forward_context():
        layer(x).sum().backward()
    with pytest.raises(ValueError, match="update_delayed_scaling"):
        capture_moe_layer(layer, x)
    update_delayed_scaling(fp8_modules(layer), recipe)
    with amax_recording_paused(), pytest.raises(ValueError, match="amax_recording_paused"):
        capture_moe_layer(layer, x)
    with pytest.raises(ValueError, match="CUDA device"):  # past the FP8 checks
        capture_moe_layer(layer, x)


def test_autocast_wrapper_follows_the_layer():
    """The wrapper the capture runs under autocast: its parameters are the layer's (what
    make_graphed_callables takes gradients for) and its training mode is the layer's (which
    decides between replay and the eager forward after the capture)."""
    from lightning_moe.cuda_graphs import _ForwardUnderAutocast

    layer = _layer()
    wrapper = _ForwardUnderAutocast(layer, layer.forward, torch.bfloat16)
    assert [id(p) for p in wrapper.parameters()] == [id(p) for p in layer.parameters()]
    assert wrapper.training
    layer.eval()
    assert not wrapper.training
    wrapper.train()
    assert wrapper.training and layer.training


def test_collector_held_off_during_captures():
    """Captures run with Python's cyclic collector off (it could destroy dead graphs mid-capture)
    and restore its previous state, on errors too."""
    import gc

    from lightning_moe._capture import collector_held_off

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_held_off():
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_held_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # was off before: stays off
    finally:
        gc.enable()
