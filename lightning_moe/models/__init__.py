"""Reference MoE decoder, its configuration and presets, FLOP accounting, upcycling and the LightningModule."""

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import MoEDecoder, causal_lm_loss
from lightning_moe.models.flops import active_parameters, model_flops_per_token, total_parameters
from lightning_moe.models.lightning_module import MoELanguageModel
from lightning_moe.models.presets import get_preset, list_presets
from lightning_moe.models.upcycle import upcycle

__all__ = [
    "ModelConfig",
    "MoEDecoder",
    "MoELanguageModel",
    "active_parameters",
    "causal_lm_loss",
    "get_preset",
    "list_presets",
    "model_flops_per_token",
    "total_parameters",
    "upcycle",
]
