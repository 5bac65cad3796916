"""lightning_moe: Megatron-Core-class Mixture-of-Experts training for PyTorch Lightning."""

from lightning_moe.layout import ParallelLayout
from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.strategies import MegatronMoEStrategy

__version__ = "0.1.0"


def _register_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    if MegatronMoEStrategy.strategy_name not in StrategyRegistry:
        MegatronMoEStrategy.register_strategies(StrategyRegistry)


_register_strategy()

__all__ = ["MegatronMoEStrategy", "MoEConfig", "MoELayer", "ParallelLayout", "__version__"]
