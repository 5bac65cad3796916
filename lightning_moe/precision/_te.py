"""Transformer Engine glue, imported lazily: nothing here imports TE at module import time.

Written against TE 2.x's public API (``transformer_engine.pytorch`` and
``transformer_engine.common.recipe``); exercised on GPU machines only.
"""

from __future__ import annotations

import functools
import inspect
import math
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from lightning_utilities.core.imports import RequirementCache

from lightning_moe.nn.experts import GroupedGemmQuantization

if TYPE_CHECKING:
    from lightning_moe.precision.recipes import FP8Recipe

_TE_MODULE = RequirementCache(module="transformer_engine.pytorch")


@functools.lru_cache(maxsize=1)
def _import() -> tuple[Optional[Any], str]:
    """(``transformer_engine.pytorch`` or None, why it failed)."""
    if not _TE_MODULE:
        return None, "Module transformer_engine is not installed."
    try:
        import transformer_engine.pytorch as te
    except Exception as err:  # noqa: BLE001 - a broken install (CUDA / torch mismatch) must not break import
        return None, f"Importing transformer_engine.pytorch failed: {err!r}."
    return te, ""


def available() -> bool:
    """Transformer Engine is installed and importable."""
    return _import()[0] is not None


def import_error() -> str:
    return _import()[1]


def _module() -> Any:
    te, err = _import()
    if te is None:
        raise ValueError(f"Transformer Engine is required here: `pip install lightning-moe[te]`. {err}")
    return te


def _availability(fn: Any) -> tuple[bool, str]:
    """Call a TE ``is_*_available`` check; TE 2.x returns ``(bool, reason)`` or, in newer
    releases, a bool unless ``return_reason=True``."""
    try:
        result = fn(return_reason=True)
    except TypeError:
        result = fn()
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1])
    return bool(result), "" if result else f"transformer_engine.pytorch.{fn.__name__}() is False."


def supports(recipe: FP8Recipe) -> tuple[bool, str]:
    """Whether TE can run ``recipe`` on the current GPU, and TE's reason when not."""
    te = _module()
    if not torch.cuda.is_available():
        return False, "No CUDA device is visible."
    name = {"mxfp8": "is_mxfp8_available", "nvfp4": "is_nvfp4_available",
            "blockwise": "is_fp8_block_scaling_available"}.get(recipe.name, "is_fp8_available")
    check = getattr(te, name, None) or te.is_fp8_available
    try:
        return _availability(check)
    except Exception as err:  # noqa: BLE001 - TE raising instead of answering still means "cannot run"
        return False, f"{name}() failed: {err!r}."


def te_recipe(recipe: FP8Recipe) -> Any:
    """The ``transformer_engine.common.recipe`` object for ``recipe``."""
    if recipe.name == "delayed" and recipe.fast_accumulation != ("fprop",):
        raise ValueError(
            "Transformer Engine's DelayedScaling fixes the accumulation (fast fprop, split dgrad / wgrad); "
            "leave fast_accumulation unset, or use backend='torch' or the tensorwise recipe to choose it."
        )
    _module()
    from transformer_engine.common import recipe as te_recipes

    fmt = te_recipes.Format.HYBRID if recipe.fmt == "hybrid" else te_recipes.Format.E4M3
    if recipe.name == "tensorwise":
        split = {g: te_recipes.MMParams(use_split_accumulator=not recipe.fast(g)) for g in ("fprop", "dgrad", "wgrad")}
        return te_recipes.Float8CurrentScaling(
            fp8_format=fmt, fp8_gemm_fprop=split["fprop"], fp8_gemm_dgrad=split["dgrad"], fp8_gemm_wgrad=split["wgrad"],
        )
    if recipe.name == "delayed":
        return te_recipes.DelayedScaling(
            fp8_format=fmt, margin=recipe.margin, amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.name == "blockwise":
        return te_recipes.Float8BlockScaling(fp8_format=fmt)
    if recipe.name == "mxfp8":
        return te_recipes.MXFP8BlockScaling(fp8_format=fmt)
    if recipe.name == "nvfp4":
        options = {
            "disable_rht": not recipe.nvfp4_rht,
            "disable_stochastic_rounding": not recipe.nvfp4_stochastic_rounding,
            "disable_2d_quantization": not recipe.nvfp4_2d_weights,
        }
        accepted = inspect.signature(te_recipes.NVFP4BlockScaling).parameters
        return te_recipes.NVFP4BlockScaling(**{k: v for k, v in options.items() if k in accepted})
    raise ValueError(f"Transformer Engine has no {recipe.name!r} recipe.")


def autocast(recipe: Any, group: Optional[torch.distributed.ProcessGroup] = None) -> AbstractContextManager:
    """TE's quantization autocast (``te.autocast`` in TE >= 2.8, ``te.fp8_autocast`` before)."""
    te = _module()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)


def fp8_autocast_active() -> bool:
    """Whether a TE quantization autocast is active now (``FP8GlobalStateManager``'s flag)."""
    try:  # TE >= 2.8 moved it to .quantization (keeping .fp8 as an alias for a while)
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return bool(FP8GlobalStateManager.is_fp8_enabled())


_EXPERT_AUTOCAST = "_lightning_moe_expert_autocast"  # module attribute: the open nested autocast


def run_under_expert_autocast(module: torch.nn.Module, make_context: Callable[[], Optional[AbstractContextManager]]) -> None:
    """Run ``module``'s forward inside ``make_context()`` when it returns a context (a nested
    ``te.autocast`` whose amax reduction group is the experts'). TE files each module's FP8
    state under the innermost autocast's group and reduces every group's amaxes over its own
    ranks, forward at the exit of the outermost autocast and backward after the last
    module's backward, so the experts' histories are reduced only over the ranks holding them.
    Installed once per module (a second fit keeps the first hooks)."""
    if getattr(module, "_lightning_moe_expert_autocast_hooks", False):
        return

    def enter(mod: torch.nn.Module, args: Any) -> None:
        context = make_context()
        if context is not None:
            context.__enter__()
            mod.__dict__[_EXPERT_AUTOCAST] = context

    def leave(mod: torch.nn.Module, args: Any, output: Any) -> None:
        context = mod.__dict__.pop(_EXPERT_AUTOCAST, None)
        if context is not None:
            context.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # closes the autocast when forward raises too
    module._lightning_moe_expert_autocast_hooks = True


class HighPrecisionGroupedGemm(torch.nn.Module, GroupedGemmQuantization):
    """``GroupedExperts.quantization`` for "te" experts kept in high precision.

    The plugin's ``te.autocast`` covers the whole forward, so it would quantize these experts'
    ``te.GroupedLinear`` too; their grouped GEMM runs with TE's autocast switched off. A module
    (without state) because ``quantization`` may already hold an `FP8GroupedGemm` child.
    """

    def grouped_mm(self, x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor,
                   projection: str = "") -> torch.Tensor:
        from lightning_moe.nn.grouped_gemm import te_grouped_mm

        sizes_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
        with _module().autocast(enabled=False):
            return te_grouped_mm(x_RK, w_EKN, sizes_E)


@functools.lru_cache(maxsize=1)
def linear_class() -> type:
    """``te.Linear`` without TE's ``_extra_state`` checkpoint entry.

    TE stores FP8 metadata (delayed-scaling amax histories) as extra state; dropping it
    keeps state dicts identical to ``nn.Linear``'s (``weight``, ``bias``), so FP8 can be
    turned on or off between saving and resuming. Delayed-scaling histories restart after a
    resume, as they would for a freshly built TE model.
    """
    te = _module()

    class TELinear(te.Linear):
        get_extra_state = torch.nn.Module.get_extra_state
        set_extra_state = torch.nn.Module.set_extra_state
        is_fp8_linear = True  # marks converted linears for configure_fp8

    TELinear.__qualname__ = TELinear.__name__ = "TELinear"
    return TELinear


def _init_method(linear: torch.nn.Linear) -> Callable[[torch.Tensor], Any]:
    """The weight init TE's ``reset_parameters`` should use (meta-device materialisation calls
    it): Normal(0, ``init_std``) for our linears, ``nn.Linear``'s own otherwise, instead of
    TE's default Normal(0, 0.023). TE zeroes biases."""
    std = getattr(linear, "init_std", None)
    if std is not None:
        return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)
    return functools.partial(torch.nn.init.kaiming_uniform_, a=math.sqrt(5))


def make_linear(linear: torch.nn.Linear) -> torch.nn.Module:
    """A TE linear with ``linear``'s parameters (copied; fp32 master weights stay fp32)."""
    weight = linear.weight
    meta = weight.device.type == "meta"
    if meta:
        device = "meta"  # a string: te.Linear defers init only when ``device == "meta"``, a str test
    elif weight.is_cuda:
        device = weight.device
    else:  # TE allocates on the GPU; the strategy moves the model there anyway
        device = torch.device("cuda", torch.cuda.current_device())
    new = linear_class()(
        linear.in_features, linear.out_features, bias=linear.bias is not None,
        params_dtype=weight.dtype, device=device, init_method=_init_method(linear),
    )
    if not meta:
        with torch.no_grad():
            new.weight.copy_(weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new
