"""MegatronMoEStrategy's precision plugins: one global-norm clip through plugins of its own kind.

The strategy patches nothing: Lightning's classes keep their methods, the plugin instance has no
per-instance method overrides, and clipping runs through `GlobalNormClipping` subclasses (the
numbers across meshes are checked by tests/distributed/test_strategy_parity.py).
"""

import pytest
import torch
from lightning.pytorch.plugins import precision as lightning_precision
from torch.utils.data import DataLoader, Dataset

from lightning_moe import MegatronMoEStrategy
from lightning_moe.models.lightning_module import MoELanguageModel
from lightning_moe.parallel.gradients import clip_grads_by_global_norm
from lightning_moe.precision.clipping import GlobalNormClipping, with_global_norm_clipping

_LIGHTNING_CLASSES = (
    lightning_precision.Precision,
    lightning_precision.MixedPrecision,
    lightning_precision.HalfPrecision,
    lightning_precision.DoublePrecision,
)


class _Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        self.tokens = torch.randint(0, 64, (n, seq + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def _class_methods() -> dict:
    return {cls: dict(vars(cls)) for cls in _LIGHTNING_CLASSES}


def _instance_overrides(plugin) -> list[str]:
    """Attributes of the instance that are callables shadowing a method of its class."""
    return [name for name, value in vars(plugin).items() if callable(value) and hasattr(type(plugin), name)]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_setup_patches_nothing_and_clips_with_the_global_norm(precision):
    from lightning.pytorch import Trainer

    before = _class_methods()
    original_clip = lightning_precision.Precision.clip_gradients
    module = MoELanguageModel("tiny", overrides={"num_layers": 1, "vocab_size": 64}, max_steps=2)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=MegatronMoEStrategy(print_layout=False), precision=precision,
        max_steps=2, gradient_clip_val=1e-3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module, DataLoader(_Tokens(4, 16), batch_size=2))
    finally:  # the strategy initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert trainer.global_step == 2
    assert lightning_precision.Precision.clip_gradients is original_clip
    assert _class_methods() == before
    plugin = trainer.precision_plugin
    assert plugin is trainer.strategy.precision_plugin
    assert isinstance(plugin, GlobalNormClipping) and plugin.precision == precision
    assert _instance_overrides(plugin) == []
    assert type(plugin).clip_grad_by_norm is GlobalNormClipping.clip_grad_by_norm
    # Lightning keys the plugin's checkpoint state by class name: the same as its stock plugin's.
    stock = {"32-true": "Precision", "bf16-mixed": "MixedPrecision", "bf16-true": "HalfPrecision"}[precision]
    assert type(plugin).__qualname__ == stock
    assert isinstance(plugin, getattr(lightning_precision, stock))
    # The clip bit (gradient_clip_val is tiny) and its norm is the strategy's.
    assert trainer.strategy.last_grad_norm is plugin.last_grad_norm
    assert float(trainer.strategy.last_grad_norm) > 1e-3


def test_stock_plugins_become_global_norm_clipping_subclasses_with_the_same_arguments():
    scaler_plugin = lightning_precision.MixedPrecision("16-mixed", "cpu")
    mixed = with_global_norm_clipping(scaler_plugin)
    assert type(mixed).__qualname__ == "MixedPrecision" and isinstance(mixed, GlobalNormClipping)
    assert mixed.precision == "16-mixed" and mixed.device == "cpu" and mixed.scaler is scaler_plugin.scaler
    half = with_global_norm_clipping(lightning_precision.HalfPrecision("bf16-true"))
    assert half.precision == "bf16-true" and half._desired_input_dtype == torch.bfloat16
    assert with_global_norm_clipping(lightning_precision.DoublePrecision()).precision == "64-true"
    assert with_global_norm_clipping(lightning_precision.Precision()).precision == "32-true"
    for plugin in (mixed, half):
        assert _instance_overrides(plugin) == []


def test_own_plugins_are_kept_and_others_refused():
    from lightning_moe.precision import FP8Precision

    fp8 = FP8Precision(recipe="tensorwise", backend="emulated", device="cpu")
    strategy = MegatronMoEStrategy(print_layout=False)
    strategy.precision_plugin = fp8
    assert strategy.precision_plugin is fp8  # the user's instance: its state is the one that trains
    assert _instance_overrides(fp8) == []

    class Custom(GlobalNormClipping, lightning_precision.HalfPrecision):
        pass

    custom = Custom("bf16-true")
    strategy.precision_plugin = custom
    assert strategy.precision_plugin is custom

    class Foreign(lightning_precision.HalfPrecision):
        pass

    with pytest.raises(TypeError, match="GlobalNormClipping"):
        strategy.precision_plugin = Foreign("bf16-true")
    strategy.precision_plugin = None
    assert isinstance(strategy.precision_plugin, GlobalNormClipping)
    assert strategy.last_grad_norm is None


def _model_and_optimizer(fused: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)


def test_global_norm_clip_matches_torch_on_plain_tensors():
    plugin = with_global_norm_clipping(lightning_precision.Precision())
    model, optimizer = _model_and_optimizer()
    expected_model, _ = _model_and_optimizer()
    expected_norm = torch.nn.utils.clip_grad_norm_(expected_model.parameters(), 0.1)
    plugin.clip_gradients(optimizer, 0.1)
    torch.testing.assert_close(plugin.last_grad_norm, expected_norm)
    for p, q in zip(model.parameters(), expected_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_bf16_clips_for_fused_optimizers_and_fp16_still_refuses():
    model, optimizer = _model_and_optimizer(fused=True)
    bf16 = with_global_norm_clipping(lightning_precision.MixedPrecision("bf16-mixed", "cpu"))
    bf16.clip_gradients(optimizer, 1e-3)  # no GradScaler: the gradients are final
    assert bf16.last_grad_norm is not None and optimizer.grad_scale is not None  # applied by the step
    fp16 = with_global_norm_clipping(lightning_precision.MixedPrecision("16-mixed", "cpu"))
    with pytest.raises(RuntimeError, match="unscaling"):
        fp16.clip_gradients(optimizer, 1e-3)


def _stepped(clip, clip_val: float, fused: bool = True, times: int = 1):
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer(fused=fused)
    grads = [p.grad.clone() for p in model.parameters()]
    norm = None
    for _ in range(times):
        norm = clip(model, optimizer, clip_val)
    untouched = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    optimizer.step()
    return model, optimizer, untouched, norm


def _plugin_clip(model, optimizer, clip_val):
    plugin = with_global_norm_clipping(lightning_precision.MixedPrecision("bf16-mixed", "cpu"))
    plugin.clip_gradients(optimizer, clip_val)
    return plugin.last_grad_norm


def _scaling_clip(model, optimizer, clip_val):
    return clip_grads_by_global_norm(list(model.parameters()), clip_val)


@pytest.mark.parametrize("times", [1, 2])
def test_fused_adamw_takes_the_clip_coefficient_in_its_step(times):
    """The fused step divides by 1 / coefficient instead of a pass scaling .grad first: the same
    update within a rounding, .grad not touched before the step, the grad_scale gone after it;
    clipping twice before the step is clipping once."""
    model, optimizer, untouched, norm = _stepped(_plugin_clip, 1e-3, times=times)
    expected, _, _, expected_norm = _stepped(_scaling_clip, 1e-3)
    torch.testing.assert_close(norm, expected_norm)
    assert untouched  # no pass over .grad before the step: the kernel divides as it reads
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
    assert getattr(optimizer, "grad_scale", None) is None and not optimizer._optimizer_step_post_hooks
    assert not torch.equal(model[0].weight, _stepped(lambda *a: None, 1e-3)[0][0].weight)  # the clip did act


def test_fused_adamw_under_the_clip_value_steps_bit_for_bit_as_unclipped():
    model, _, _, _ = _stepped(_plugin_clip, 1e6)
    expected, _, _, _ = _stepped(lambda *a: None, 1e6)
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.equal(p, q)


def test_unfused_optimizers_still_scale_the_gradients():
    model, optimizer, untouched, _ = _stepped(_plugin_clip, 1e-3, fused=False)
    assert not untouched
    assert not hasattr(optimizer, "grad_scale") or optimizer.grad_scale is None
    assert max(float(p.grad.norm()) for p in model.parameters()) <= 1e-3 + 1e-6


class _AdamWModel(MoELanguageModel):
    def __init__(self, fused: bool) -> None:
        super().__init__("tiny", overrides={"num_layers": 1, "vocab_size": 64}, max_steps=1)
        self.fused = fused

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)


def _fit_with_adamw(in_step: bool, monkeypatch) -> tuple[dict, int]:
    """One clipped step of fused AdamW (one: a rounding's difference in the weights could move a
    token to another expert in the next step); ``in_step`` False: the clip scales .grad first."""
    from lightning.pytorch import Trainer

    from lightning_moe.precision import clipping

    deferred = []
    real = clipping.scale_in_next_step
    monkeypatch.setattr(clipping, "scale_in_next_step", lambda opt, coeff: deferred.append(1) or real(opt, coeff))
    if not in_step:
        monkeypatch.setattr(clipping, "scales_in_step", lambda optimizer, scaler=None: False)
    torch.manual_seed(0)
    module = _AdamWModel(fused=True)
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=MegatronMoEStrategy(print_layout=False), precision="32-true",
        max_steps=1, gradient_clip_val=1e-3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(module, DataLoader(_Tokens(6, 16), batch_size=2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    optimizer = trainer.optimizers[0]
    assert getattr(optimizer, "grad_scale", None) is None and not optimizer._optimizer_step_post_hooks
    return {n: p.detach().clone() for n, p in module.named_parameters()}, len(deferred)


def test_a_fit_with_fused_adamw_clips_in_the_step_as_a_scaling_pass_would(monkeypatch):
    in_step, deferred = _fit_with_adamw(True, monkeypatch)
    scaled, not_deferred = _fit_with_adamw(False, monkeypatch)
    assert deferred == 1 and not_deferred == 0  # the clip left to the fused kernel
    for name, value in in_step.items():
        torch.testing.assert_close(value, scaled[name], rtol=1e-6, atol=1e-7, msg=name)
