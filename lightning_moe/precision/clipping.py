"""Lightning precision plugins that clip by one norm over every mesh (what `MegatronMoEStrategy` runs with).

Lightning clips gradients through the Trainer's precision plugin (``LightningModule.clip_gradients``
calls ``trainer.precision_plugin.clip_gradients``), with ``torch.nn.utils.clip_grad_norm_``, which
cannot combine DTensors of different meshes (dense vs expert) into one norm. Like Lightning's own
FSDP and DeepSpeed strategies, `MegatronMoEStrategy` therefore runs with precision plugins of its
own kind: `GlobalNormClipping` subclasses. Lightning's stock plugins (what ``Trainer(precision=...)``
builds) are replaced by the subclasses below, built with the same arguments; they keep Lightning's
class names, so checkpoints hold the plugin's state (a GradScaler's) under the same key as before.
`FP8Precision` derives from `GlobalNormClipping` itself; another plugin can too::

    class MyPrecision(GlobalNormClipping, SomeLightningPrecision): ...
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.plugins import precision as lightning_precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe.parallel.gradients import clip_coefficient, scale_grads


class GlobalNormClipping(lightning_precision.Precision):
    """Clip by norm with one norm of all gradients, whatever mesh each lives on.

    ``clip_grad_by_norm`` scales the gradients as :func:`clip_grads_by_global_norm` does and keeps
    the norm before clipping in ``last_grad_norm`` (a tensor; reading it syncs with the device).
    For torch's fused Adam / AdamW (``fused=True``, no GradScaler) the scaling is left to the step
    itself (`scales_in_step`): the optimizer's fused kernel divides each gradient by
    ``1 / coefficient`` as it reads it, which saves a read and a write of every gradient (a
    division instead of a multiplication: the same update within a rounding of the gradient; no
    change at all while the norm is under ``clip_val``). ``.grad`` then holds the unclipped
    gradients until the step.
    Mixed precision without a GradScaler (bf16 autocast) also clips for optimizers that unscale
    gradients themselves (fused AdamW): Lightning refuses those because of fp16's GradScaler,
    but without one the gradients are final, and clipping them is what the user asked for.
    """

    last_grad_norm: Tensor | None = None
    # Set by `MegatronMoEStrategy` under pipeline parallelism: the norm adds every stage's share.
    pipeline_group: ProcessGroup | None = None
    # Set with it: the parameters this rank leaves out of the norm (its copy of a parameter two stages hold).
    pipeline_norm_skip: Callable[[], list[Tensor]] | None = None

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if isinstance(self, lightning_precision.MixedPrecision) and self.scaler is None:
            lightning_precision.Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
            return
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        device = params[0].device if params else None
        skip = self.pipeline_norm_skip() if self.pipeline_norm_skip is not None else ()
        self.last_grad_norm, coeff = clip_coefficient(params, float(clip_val), pipeline_group=self.pipeline_group,
                                                      device=device, exclude_from_norm=skip)
        if params and scales_in_step(optimizer, getattr(self, "scaler", None)):
            scale_in_next_step(optimizer, coeff)
        else:
            scale_grads(params, coeff)


def scales_in_step(optimizer: Optimizer, scaler: object = None) -> bool:
    """Whether ``optimizer``'s step can apply the clip coefficient itself: torch's Adam or AdamW
    with ``fused=True`` in every group (the fused kernels read a ``grad_scale`` to divide the
    gradients by), with no GradScaler (which hands the step its own ``grad_scale``) and none set."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and scaler is None
            and all(group.get("fused") for group in optimizer.param_groups)
            and (getattr(optimizer, "grad_scale", None) is None or _DEFERRED_CLIP in optimizer.__dict__))


def scale_in_next_step(optimizer: Optimizer, coeff: Tensor) -> None:
    """Let ``optimizer``'s next step divide the gradients by ``1 / coeff`` (its ``grad_scale``),
    dropped again by a step post-hook."""
    first = next(p for group in optimizer.param_groups for p in group["params"])
    optimizer.grad_scale = (1.0 / coeff).to(device=first.device, dtype=torch.float32)
    if _DEFERRED_CLIP in optimizer.__dict__:
        return  # clipped again before the step: the new coefficient (of the same unscaled gradients) replaces the old

    def drop(opt: Optimizer, args: object, kwargs: object) -> None:
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop(_DEFERRED_CLIP, None).remove()

    optimizer.__dict__[_DEFERRED_CLIP] = optimizer.register_step_post_hook(drop)


# The step post-hook handle of a clip coefficient left to the next step (`scale_in_next_step`).
_DEFERRED_CLIP = "_lightning_moe_deferred_clip"


class Precision(GlobalNormClipping):
    """Lightning's full precision ("32-true") with `GlobalNormClipping`."""


class MixedPrecision(GlobalNormClipping, lightning_precision.MixedPrecision):
    """Lightning's autocast mixed precision ("16-mixed", "bf16-mixed") with `GlobalNormClipping`."""


class HalfPrecision(GlobalNormClipping, lightning_precision.HalfPrecision):
    """Lightning's half precision ("16-true", "bf16-true") with `GlobalNormClipping`."""


class DoublePrecision(GlobalNormClipping, lightning_precision.DoublePrecision):
    """Lightning's double precision ("64-true") with `GlobalNormClipping`."""


def with_global_norm_clipping(plugin: lightning_precision.Precision) -> GlobalNormClipping:
    """The plugin `MegatronMoEStrategy` runs with in place of ``plugin``: ``plugin`` itself when it
    is a `GlobalNormClipping`; for one of Lightning's stock plugins, the subclass above built with
    the same arguments (a GradScaler is shared, not copied). Any other plugin: ``TypeError``."""
    if isinstance(plugin, GlobalNormClipping):
        return plugin
    kind = type(plugin)
    if kind is lightning_precision.Precision:
        return Precision()
    if kind is lightning_precision.MixedPrecision:
        return MixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    if kind is lightning_precision.HalfPrecision:
        return HalfPrecision(plugin.precision)
    if kind is lightning_precision.DoublePrecision:
        return DoublePrecision()
    raise TypeError(
        f"MegatronMoEStrategy cannot run with the precision plugin {kind.__qualname__}: it clips gradients by one "
        "norm over the dense and expert meshes, which needs a plugin deriving from "
        "lightning_moe.precision.clipping.GlobalNormClipping. Use Trainer(precision=...) with '32-true', "
        "'bf16-mixed', '16-mixed', 'bf16-true', '16-true' or '64-true', or FP8Precision, or define "
        f"`class MoE{kind.__name__}(GlobalNormClipping, {kind.__name__})` and pass an instance of it."
    )
