"""The layout table's precision row names the precision in use, not the plugin's class."""

import pytest
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_moe.precision import FP8Precision
from lightning_moe.strategies.megatron_moe import precision_description


@pytest.mark.parametrize(
    "plugin, expected",
    [
        (Precision(), "32-true"),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (HalfPrecision("bf16-true"), "bf16-true"),
        (DoublePrecision(), "64-true"),
    ],
    ids=["32-true", "bf16-mixed", "bf16-true", "64-true"],
)
def test_lightning_plugins_show_their_precision(plugin, expected):
    assert precision_description(plugin) == expected


def test_fp8_shows_its_recipe_and_backend():
    text = precision_description(FP8Precision(backend="emulated"))
    assert text.startswith("delayed") and "emulated" in text, text
