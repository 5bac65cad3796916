"""Plain-PyTorch MoE building blocks: router, permutation, dispatchers, experts, `MoELayer`."""

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import LocalDispatcher, TokenDispatcher
from lightning_moe.nn.experts import GroupedExperts, SharedExperts
from lightning_moe.nn.moe_layer import MoELayer, RoutingStats
from lightning_moe.nn.router import RoutingResult, TopKRouter, route

__all__ = [
    "GroupedExperts",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "RoutingResult",
    "RoutingStats",
    "SharedExperts",
    "TokenDispatcher",
    "TopKRouter",
    "route",
]
