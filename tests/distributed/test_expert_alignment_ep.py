"""Expert parallelism and the FP8 expert alignment (EP=2 on gloo): whichever runs first, the
expert-parallel dispatcher and the router hold the layer's one (frozen) config, padded to the FP8
kernels' 16 rows; a layer padded after expert-parallel setup trains as one built padded."""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.parallel.expert_parallel import expert_parallel_layer

BASE = {"hidden_size": 16, "ffn_hidden_size": 8, "num_experts": 8, "router_topk": 2}


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(21, BASE["hidden_size"], generator=torch.Generator().manual_seed(1000 + rank))


def _fp8_alignment_any_order(rank, world_size, dispatcher, order):
    from lightning_moe.precision import modules

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    original = modules._experts_backend
    modules._experts_backend = lambda *args: "torch"  # what configure_fp8 picks on CUDA
    try:
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**BASE))
        if order == "ep_first":
            expert_parallel_layer(layer, mesh, dispatcher)
        summary = modules.configure_fp8(layer, "rowwise", "emulated")
        if order == "fp8_first":
            expert_parallel_layer(layer, mesh, dispatcher)
    finally:
        modules._experts_backend = original
    assert summary.expert_alignment == 16
    assert layer.router.cfg is layer.config and layer.dispatcher.cfg is layer.config
    assert layer.config.expert_alignment == layer.expert_alignment == 16
    x_TD = _tokens(rank)
    group_sizes = layer.dispatcher.dispatch(x_TD, layer.router(x_TD))[1]
    assert group_sizes.numel() == BASE["num_experts"] // world_size and (group_sizes % 16 == 0).all()
    return True


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("order", ["ep_first", "fp8_first"])
def test_fp8_alignment_reaches_the_expert_parallel_dispatcher(dispatcher, order):
    assert run_distributed(_fp8_alignment_any_order, 2, dispatcher, order) == [True, True]


def _padded_later_trains_as_built_padded(rank, world_size, dispatcher):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    results = []
    for later in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**BASE, expert_alignment=1 if later else 16, aux_loss_coeff=1e-2))
        expert_parallel_layer(layer, mesh, dispatcher)
        if later:
            layer.set_expert_alignment(16)
        x = _tokens(rank).requires_grad_(True)
        out = layer(x)
        out.square().sum().backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in layer.parameters()]
        results.append([out.detach(), x.grad] + grads)
    return all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_alignment_set_after_expert_parallel_setup_trains_identically(dispatcher):
    assert run_distributed(_padded_later_trains_as_built_padded, 2, dispatcher) == [True, True]
