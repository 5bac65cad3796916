from lightning_moe.strategies.megatron_moe import MegatronMoEStrategy

__all__ = ["MegatronMoEStrategy"]
