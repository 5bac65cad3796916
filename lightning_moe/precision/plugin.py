"""`FP8Precision`: Lightning precision plugin for FP8 / NVFP4 training.

``Trainer(plugins=[FP8Precision(recipe="blockwise")])``: activations run under bf16 autocast
(``torch.autocast("cuda" | "cpu", torch.bfloat16)``), parameters stay fp32 (master weights),
and the model's linears and grouped experts run quantized GEMMs (see `configure_fp8`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_moe.precision import _te
from lightning_moe.precision.delayed import amax_recording_paused, set_amax_group, update_delayed_scaling
from lightning_moe.precision.modules import (
    FP8GroupedGemm,
    FP8Summary,
    ModuleFilter,
    configure_fp8,
    fp8_modules,
    is_grouped_experts,
)
from lightning_moe.precision.recipes import FP8Recipe, resolve_backend
from lightning_moe.precision.weight_cache import FP8WeightCache, caching_fp8_weights
from lightning_moe.precision.clipping import GlobalNormClipping

_BACKEND_WORDS = {
    "te": "Transformer Engine",
    "torch": "torch._scaled_mm / _scaled_grouped_mm",
    "emulated": "emulated (quantize-dequantize, high-precision GEMM)",
}


class FP8Precision(GlobalNormClipping, MixedPrecision):
    """bf16 mixed precision with FP8 (or NVFP4) GEMMs.

    Gradient clipping by norm takes one norm over all gradients, whatever mesh each lives on
    (`GlobalNormClipping`, what `MegatronMoEStrategy` needs), and also clips for optimizers that
    unscale gradients themselves (fused AdamW): bf16 autocast has no GradScaler.

    Args:
        recipe: "tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "nvfp4" or an
            `FP8Recipe`. Default "delayed", as Megatron-Core's ``--fp8-recipe`` and Transformer
            Engine's default recipe; on the native backend its operands are cast in one read
            (per-expert / per-tensor scales from the amax history, updated once per optimizer
            step) instead of a read for the amax and another for the cast.
        backend: "auto" (Transformer Engine when installed and able to run the recipe on
            this GPU, else ``torch._scaled_mm`` on sm90+ for tensorwise / rowwise / delayed, else
            emulated), "te", "torch" or "emulated". An impossible choice raises
            ``ValueError`` at construction, naming the backends that can run the recipe.
        keep_high_precision_layers: keep the first and the last N transformer blocks (the
            shallowest ``nn.ModuleList`` of the model) in bf16.
        module_filter: ``(qualified_name, module) -> bool``; False keeps that linear / experts
            module in high precision (applied after the built-in exclusions: routers, output
            layer; norms and embeddings are never quantized).
        amax_reduction_group: ranks over which the delayed-scaling amaxes of dense layers are
            max-reduced once per optimizer step: the ranks holding replicas or shards of the
            same layers (default: all ranks when ``torch.distributed`` is initialized).
            `MegatronMoEStrategy` installs its stage's TP x CP x DP ranks and refuses another group.
        expert_amax_reduction_group: the same for grouped experts: the ranks holding the same
            experts (default: ``amax_reduction_group``). Under expert parallelism each rank holds
            other experts, so their amaxes must not be reduced over the dense group;
            `MegatronMoEStrategy` installs its ETP x EDP ranks and refuses another group.
        device: autocast device, "cuda" or "cpu" (default: "cuda" when available).
        cache_fp8_weights: keep each weight's FP8 operands from its first quantization in a
            training step until the next optimizer step, so later micro-batches of a
            gradient-accumulation window do not quantize the weights again (see
            `FP8WeightCache`; costs about two bytes per FP8 parameter; evaluation never uses
            it), as Transformer Engine reuses its weight casts after the first micro-batch.
            None (default): on for the native "torch" backend without ``graph_weight_casts``,
            except where `MegatronMoEStrategy` shards with FSDP (there it is left off); True
            asks for it (native backend only; refused with FSDP); False turns it off.
    """

    def __init__(
        self,
        recipe: Union[str, FP8Recipe] = "delayed",
        backend: str = "auto",
        keep_high_precision_layers: int = 0,
        module_filter: Optional[ModuleFilter] = None,
        amax_reduction_group: Optional[dist.ProcessGroup] = None,
        expert_amax_reduction_group: Optional[dist.ProcessGroup] = None,
        device: Optional[str] = None,
        cache_fp8_weights: Optional[bool] = None,
    ) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"FP8Precision(device={device!r}): the autocast device is 'cuda' or 'cpu'.")
        super().__init__("bf16-mixed", device)
        if keep_high_precision_layers < 0:
            raise ValueError(f"keep_high_precision_layers must be >= 0, got {keep_high_precision_layers}.")
        self.recipe = FP8Recipe.of(recipe)
        self.requested_backend = backend
        self.backend = resolve_backend(self.recipe, backend, device)  # fails here, before any setup
        self.keep_high_precision_layers = keep_high_precision_layers
        self.module_filter = module_filter
        self.amax_reduction_group = amax_reduction_group
        self.expert_amax_reduction_group = expert_amax_reduction_group
        self.summary: Optional[FP8Summary] = None
        self._delayed_modules: list[nn.Module] = []  # dense layers' (FP8Linear)
        self._delayed_experts: list[nn.Module] = []  # grouped experts' (FP8GroupedGemm)
        self._te_recipe = _te.te_recipe(self.recipe) if self.backend == "te" else None
        if cache_fp8_weights and self.backend != "torch":
            raise ValueError(
                f"cache_fp8_weights needs the native backend (backend='torch'); this plugin runs {self.backend!r}. "
                "Transformer Engine keeps its own weight casts; the emulated backend is for numerics only."
            )
        if self.recipe.graph_weight_casts and (self.backend != "torch" or cache_fp8_weights):
            raise ValueError(
                "FP8Recipe(graph_weight_casts=True) graphs the native backend's expert weight casts: it needs "
                f"backend='torch' (this plugin runs {self.backend!r}) and no cache_fp8_weights (cached weights are "
                "cast once per optimizer step, nothing is left to graph)."
            )
        self.cache_fp8_weights = cache_fp8_weights  # as asked: None lets the strategy leave it off under FSDP
        if cache_fp8_weights is None:
            cache_fp8_weights = self.backend == "torch" and not self.recipe.graph_weight_casts
        self.weight_cache: Optional[FP8WeightCache] = FP8WeightCache() if cache_fp8_weights else None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Install FP8 modules (called by the strategy before moving and sharding the model)."""
        self.summary = configure_fp8(
            module, self.recipe, self.requested_backend, self.keep_high_precision_layers, self.module_filter,
            self.device,
        )
        delayed = fp8_modules(module)
        self._delayed_experts = [m for m in delayed if isinstance(m, FP8GroupedGemm)]
        self._delayed_modules = [m for m in delayed if not isinstance(m, FP8GroupedGemm)]
        self._assign_amax_groups()
        if self._te_recipe is not None:
            for name in self.summary.te_experts:
                experts = module.get_submodule(name)
                if is_grouped_experts(experts):  # not a user's own te.GroupedLinear (replicated like a dense layer)
                    # TE reduces the amaxes of the modules under one autocast over its group: the
                    # experts' GEMMs run under a nested autocast with the experts' group.
                    _te.run_under_expert_autocast(experts, self._te_expert_autocast)
        if self.summary.experts and self.summary.experts_backend == "emulated" and self.device == "cuda":
            rank_zero_warn(
                f"FP8 grouped experts run emulated on this GPU ({self.recipe.name} has no native grouped kernel "
                "here); build the experts on te.GroupedLinear (MoEConfig(expert_backend='te')) for TE's kernels."
            )
        return module

    def install_amax_reduction_groups(self, dense: dist.ProcessGroup, experts: dist.ProcessGroup) -> None:
        """Set the groups over which dense layers' and grouped experts' delayed-scaling amaxes are
        reduced (a strategy calls this with the groups of its layout). A group given at
        construction must hold the same ranks as the strategy's, else ``ValueError``."""
        for option, given, wanted in (("amax_reduction_group", self.amax_reduction_group, dense),
                                      ("expert_amax_reduction_group", self.expert_amax_reduction_group, experts)):
            if given is not None and _ranks(given) != _ranks(wanted):
                holders = "replicas and shards of the same dense layers" if option == "amax_reduction_group" \
                    else "the same experts (expert tensor x expert data parallel ranks)"
                raise ValueError(
                    f"FP8Precision({option}=...) holds ranks {_ranks(given)}, but on rank {dist.get_rank()} "
                    f"{holders} are ranks {_ranks(wanted)}: reducing amaxes over other ranks mixes the scales of "
                    f"different tensors. Leave {option}=None; the strategy installs the right group."
                )
        self.amax_reduction_group, self.expert_amax_reduction_group = dense, experts
        self._assign_amax_groups()

    def _assign_amax_groups(self) -> None:
        """Tell each delayed-scaling module its reduction group (the first step's casts reduce
        their current amaxes over it, see `delayed`)."""
        dense = self.amax_reduction_group
        if dense is None and dist.is_available() and dist.is_initialized():
            dense = dist.group.WORLD
        experts = self.expert_amax_reduction_group or dense
        for modules, group in ((self._delayed_modules, dense), (self._delayed_experts, experts)):
            for module in modules:
                set_amax_group(module, group)

    def _te_expert_autocast(self) -> Any:
        """The nested TE autocast of grouped experts (None: the outer autocast's group fits them)."""
        group = self.expert_amax_reduction_group
        if group is None or group is self.amax_reduction_group or not _te.fp8_autocast_active():
            return None
        return _te.autocast(self._te_recipe, group)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            stack.enter_context(self.autocast_context_manager())
            if self._te_recipe is not None:
                stack.enter_context(_te.autocast(self._te_recipe, self.amax_reduction_group))
            if self.weight_cache is not None:
                stack.enter_context(caching_fp8_weights(self.weight_cache))
            yield

    @contextmanager
    def _eval_context(self) -> Generator[None, None, None]:
        # No FP8 weight cache in evaluation: weights may be swapped in for it (EMA callbacks).
        with self.forward_context(), amax_recording_paused(), caching_fp8_weights(None):
            yield

    @override
    def val_step_context(self) -> Any:
        return self._eval_context()

    @override
    def test_step_context(self) -> Any:
        return self._eval_context()

    @override
    def predict_step_context(self) -> Any:
        return self._eval_context()

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self.update_delayed_scaling()  # clears the FP8 weight cache: the weights just changed
        return output

    def update_delayed_scaling(self) -> None:
        """Delayed scaling's once-per-step update (`optimizer_step` calls it): reduce this step's
        amaxes, one collective per reduction group, refresh the scales, and drop the cached FP8
        weights (quantized with the old scales; the optimizer step changed the weights too)."""
        experts_group = self.expert_amax_reduction_group
        if experts_group is None or experts_group is self.amax_reduction_group:
            update_delayed_scaling(self._delayed_modules + self._delayed_experts, self.recipe, self.amax_reduction_group)
        else:
            update_delayed_scaling(self._delayed_modules, self.recipe, self.amax_reduction_group)
            update_delayed_scaling(self._delayed_experts, self.recipe, experts_group)
        if self.weight_cache is not None:
            # Cached FP8 weights were quantized with the scales just replaced: quantize afresh.
            self.weight_cache.clear()

    def backend_description(self) -> str:
        """One line for the layout table: recipe, backends and what was converted."""
        text = f"{self.recipe.describe()}; linears: {_BACKEND_WORDS[self.backend]}"
        if self.weight_cache is not None:
            text += " (FP8 weights cached per optimizer step)"
        if self._te_recipe is not None:
            text += f" ({type(self._te_recipe).__name__})"
        if self.summary is None:
            return text + " (model not converted yet)"
        text += f" [{len(self.summary.converted)} FP8, {len(self.summary.kept)} kept bf16]"
        if self.summary.sharded:
            text += f" ({len(self.summary.sharded)} sharded on {_BACKEND_WORDS[self.summary.sharded_backend]})"
        if self.summary.experts:
            text += f"; experts: {_BACKEND_WORDS[self.summary.experts_backend]} [{len(self.summary.experts)}]"
        if self.summary.te_experts:
            text += f"; experts: te.GroupedLinear [{len(self.summary.te_experts)}]"
        return text


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)
