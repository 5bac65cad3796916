"""Plain-PyTorch MoE building blocks: router, permutation, dispatchers, experts, `MoELayer`, router replay."""

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.dispatcher import LocalDispatcher, TokenDispatcher
from lightning_moe.nn.experts import GroupedExperts, SharedExperts
from lightning_moe.nn.moe_layer import MoELayer, RoutingStats
from lightning_moe.nn.router import RoutingResult, TopKRouter, route
from lightning_moe.nn.router_replay import ReplayedRouting, RouterReplay

__all__ = [
    "GroupedExperts",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "ReplayedRouting",
    "RouterReplay",
    "RoutingResult",
    "RoutingStats",
    "SharedExperts",
    "TokenDispatcher",
    "TopKRouter",
    "route",
]
