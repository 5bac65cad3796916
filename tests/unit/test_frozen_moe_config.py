"""`MoEConfig` is frozen: derived settings (the FP8 expert alignment) replace a layer's config as
a whole, through `MoELayer.set_config` / `set_expert_alignment`, and the layer, its router and its
dispatcher always hold the same object."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_moe import MoEConfig, MoELayer
from lightning_moe.nn.dispatcher import LocalDispatcher
from lightning_moe.precision import modules
from lightning_moe.precision.modules import configure_fp8

BASE = {"hidden_size": 64, "ffn_hidden_size": 32, "num_experts": 4, "router_topk": 2}


def _config(**overrides) -> MoEConfig:
    return MoEConfig(**{**BASE, **overrides})


def _same_config_everywhere(layer: MoELayer) -> MoEConfig:
    """The layer's config, after checking that its router and dispatcher hold that very object."""
    assert layer.router.cfg is layer.config and layer.dispatcher.cfg is layer.config
    return layer.config


def _expert_group_sizes(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """The group sizes the experts receive in a forward (and backward) of ``layer`` on ``x_TD``."""
    seen = []
    handle = layer.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    try:
        layer(x_TD).sum().backward()
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def test_assigning_a_field_raises_frozen_instance_error():
    cfg = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.expert_alignment = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_experts = 8
    assert cfg.expert_alignment == 1 and cfg.num_experts == 4
    # validation still runs, on construction and on dataclasses.replace
    with pytest.raises(ValueError, match="expert_alignment"):
        _config(expert_alignment=12)
    with pytest.raises(ValueError, match="expert_alignment"):
        dataclasses.replace(cfg, expert_alignment=12)
    assert dataclasses.replace(cfg, expert_alignment=16).expert_alignment == 16 and cfg.expert_alignment == 1


def test_fp8_padding_reaches_router_dispatcher_and_experts_alike():
    """configure_fp8 with a recipe that needs aligned groups (emulated NVFP4: its weight gradient's
    16-token Hadamard blocks must not mix two experts) gives each layer one new config: the layer,
    its router and its dispatcher hold it, and the experts get groups of whole multiples of it. The
    config the layers were built from (one, shared, as a model's ``ModelConfig.moe``) is unchanged."""
    shared = _config()
    model = nn.Sequential(MoELayer(shared), MoELayer(shared))
    summary = configure_fp8(model, "nvfp4", "emulated")
    assert summary.expert_alignment == 16
    assert shared.expert_alignment == 1
    torch.manual_seed(0)
    x_TD = torch.randn(21, 64)
    for layer in model:
        cfg = _same_config_everywhere(layer)
        assert cfg is not shared and cfg == dataclasses.replace(shared, expert_alignment=16)
        assert layer.expert_alignment == cfg.expert_alignment == 16
        sizes = _expert_group_sizes(layer, x_TD)
        assert (sizes % 16 == 0).all() and sizes.sum() >= 21 * 2
    assert model[0].config is not model[1].config  # one new config per layer


@pytest.mark.parametrize("install", ["before", "after"])
def test_kernel_backend_padding_whatever_the_order_of_dispatcher_install(monkeypatch, install):
    """FP8 kernels (here torch's grouped kernel, as configure_fp8 picks it on CUDA) need 16-row
    groups: a dispatcher installed before the FP8 configuration (as expert parallelism may be) is
    given the new config; one built afterwards from ``layer.config`` has it already."""
    monkeypatch.setattr(modules, "_experts_backend", lambda *args: "torch")
    layer = MoELayer(_config())
    if install == "before":
        layer.set_dispatcher(LocalDispatcher(layer.config))
    summary = configure_fp8(layer, "rowwise", "emulated")
    if install == "after":
        layer.set_dispatcher(LocalDispatcher(layer.config))
    assert summary.experts_backend == "torch" and summary.expert_alignment == 16
    assert _same_config_everywhere(layer).expert_alignment == 16
    x_TD = torch.randn(21, 64)
    group_sizes = layer.dispatcher.dispatch(x_TD, layer.router(x_TD))[1]
    assert (group_sizes % 16 == 0).all() and group_sizes.sum() >= 21 * 2
    # a larger alignment of the user's stays, and the layer keeps its config object
    large = MoELayer(_config(expert_alignment=32))
    before = large.config
    assert modules.pad_expert_groups(large, 16) == 32 and large.config is before


def test_set_expert_alignment_equals_building_with_it():
    """A layer given its alignment later computes what a layer built with it computes, bit for bit
    (outputs and every gradient)."""
    results = []
    for later in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(_config(expert_alignment=1 if later else 16, aux_loss_coeff=1e-2), output_init_std=0.02)
        if later:
            layer.set_expert_alignment(16)
        _same_config_everywhere(layer)
        x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_assigning_layer_config_replaces_it_everywhere():
    """``layer.config = dataclasses.replace(...)`` (what the strategy does for its
    ``dispatch_transport``) goes through `set_config`: the router no longer keeps the old object."""
    layer = MoELayer(_config())
    layer.config = dataclasses.replace(layer.config, dispatch_transport="copy_engine", aux_loss_coeff=0.1)
    cfg = _same_config_everywhere(layer)
    assert cfg.dispatch_transport == "copy_engine" and layer.router.cfg.active_aux_losses == {"aux_loss": 0.1}
    # a dispatcher without a config (a test double) is left alone
    layer.set_dispatcher(SimpleNamespace(syncs_host=False))
    layer.set_expert_alignment(8)
    assert layer.router.cfg is layer.config and layer.expert_alignment == 8


def test_set_config_refuses_what_the_layer_was_built_from():
    layer = MoELayer(_config())
    before = layer.config
    for change in ({"num_experts": 8}, {"hidden_size": 32}, {"activation": "gelu"},
                   {"shared_expert_intermediate_size": 16},
                   {"router_load_balancing_type": "global_aux_loss", "aux_loss_coeff": 1e-2}):
        with pytest.raises(ValueError, match="set_config cannot change"):
            layer.set_config(dataclasses.replace(before, **change))
    with pytest.raises(TypeError, match="MoEConfig"):
        layer.set_config(before.to_dict())
    assert _same_config_everywhere(layer) is before


def test_set_dispatcher_shares_the_layer_config():
    layer = MoELayer(_config())
    equal = LocalDispatcher(_config())  # an equal config, another object: given the layer's
    layer.set_dispatcher(equal)
    assert equal.cfg is layer.config
    with pytest.raises(ValueError, match="config other than the layer's"):
        layer.set_dispatcher(LocalDispatcher(_config(expert_alignment=16)))
    assert layer.dispatcher is equal


def test_pad_expert_groups_needs_a_declared_setter():
    """A module that holds a MoEConfig and grouped experts but cannot take a new alignment is
    refused with the fix named, not mutated."""

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = _config()
            self.experts = MoELayer(self.config).experts

    custom = Custom()
    with pytest.raises(TypeError, match="set_expert_alignment"):
        modules.pad_expert_groups(custom, 16)
    assert custom.config.expert_alignment == 1
