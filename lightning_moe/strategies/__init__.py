from lightning_moe.strategies.megatron_moe import MegatronMoEStrategy


def _register_strategy_name() -> None:
    """``Trainer(strategy="megatron_moe")`` resolves from here on."""
    from lightning.pytorch.strategies import StrategyRegistry

    if MegatronMoEStrategy.strategy_name not in StrategyRegistry:
        MegatronMoEStrategy.register_strategies(StrategyRegistry)


_register_strategy_name()

__all__ = ["MegatronMoEStrategy"]
