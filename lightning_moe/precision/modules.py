"""FP8 modules and the model conversion that installs them.

- `FP8Linear`: an ``nn.Linear`` whose GEMMs run quantized (torch / emulated backends).
  Same parameters (``weight``, ``bias``, fp32 master copies) and no persistent buffers, so
  its state dict equals the ``nn.Linear`` it replaces: FP8 can be switched on or off between
  saving and resuming.
- `FP8GroupedGemm`: the object ``GroupedExperts.quantization`` takes (``grouped_mm(x_RK,
  w_EKN, offsets_E, projection) -> y_RN``).
- `configure_fp8`: walks a model, swaps eligible linears (``te.Linear`` under the "te"
  backend) and sets the experts' quantization, keeping routers, norms, embeddings, the
  output layer and optionally the first / last blocks in high precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_moe.nn.compute_weights import CachedCastLinear
from lightning_moe.nn.experts import GroupedGemmQuantization
from lightning_moe.precision import _te
from lightning_moe.precision.delayed import DelayedState, delayed_state, ensure_delayed_state, register_delayed_buffers
from lightning_moe.precision.gemm import (
    fp8_grouped_mm,
    fp8_grouped_mm_gathered,
    fp8_grouped_mm_swiglu,
    fp8_linear,
    gathered_cast_runs,
)
from lightning_moe.precision.quantize import NVFP4_BLOCK
from lightning_moe.precision.recipes import FP8Recipe, resolve_backend

if TYPE_CHECKING:
    from lightning_moe.nn.permutation import DeferredCombine, PermutationPlan
    from lightning_moe.precision.graphed_casts import GraphedWeightCasts
    from lightning_moe.precision.weight_prefetch import PrefetchedWeight

ModuleFilter = Callable[[str, nn.Module], bool]
# Leaf names of linears that are routers / output heads in common model code (Megatron,
# Hugging Face, torchtitan). Routers stay fp32, output layers high precision.
_ROUTER_NAMES = ("router", "gate")
_OUTPUT_NAMES = ("lm_head", "output_layer", "output", "head", "classifier")


class FP8Linear(nn.Linear):
    """``nn.Linear`` with quantized forward and backward GEMMs (see `fp8_linear`)."""

    is_fp8_linear = True  # marks converted linears (FP8Linear and the Transformer Engine one)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: FP8Recipe | str = "tensorwise",
                 backend: str = "emulated", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._set_fp8(FP8Recipe.of(recipe), backend)

    def _set_fp8(self, recipe: FP8Recipe, backend: str) -> None:
        self.recipe, self.backend = recipe, backend
        if recipe.name == "delayed":
            register_delayed_buffers(self)

    @classmethod
    def convert(cls, linear: nn.Linear, recipe: FP8Recipe, backend: str) -> FP8Linear:
        """Make ``linear`` itself an FP8 linear, in place: same object, parameters, hooks and
        ``reset_parameters`` (its class becomes a subclass of both ``FP8Linear`` and its own
        class, as FSDP2's ``fully_shard`` does); `restore` undoes it."""
        linear.__class__ = _fp8_class(type(linear))
        linear._set_fp8(recipe, backend)
        return linear

    @staticmethod
    def restore(linear: FP8Linear) -> nn.Linear:
        """Turn a converted linear back into its original class (high precision)."""
        base = next(c for c in type(linear).__mro__ if c is not FP8Linear and not issubclass(c, FP8Linear))
        for name in ("fp8_amax_history", "fp8_scale"):
            linear._buffers.pop(name, None)
            linear._non_persistent_buffers_set.discard(name)
        del linear.recipe, linear.backend
        linear.__class__ = base
        return linear

    def forward(self, x: Tensor) -> Tensor:
        state = None
        if self.recipe.name == "delayed":
            state = ensure_delayed_state(self, self.recipe, 1, self.weight.device)
        return fp8_linear(x, self.weight, self.recipe, self.backend, self.bias, state, weight_key=(id(self), "weight"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}"


@functools.cache
def _fp8_class(cls: type) -> type:
    if cls is nn.Linear:
        return FP8Linear
    return type(f"FP8{cls.__name__}", (FP8Linear, cls), {"__module__": cls.__module__})


# The grouped experts' projections, each with its own delayed-scaling scales.
_PROJECTIONS = ("fc1", "fc2")


class FP8GroupedGemm(nn.Module, GroupedGemmQuantization):
    """Quantized grouped GEMM for grouped experts (``experts.quantization = FP8GroupedGemm(...)``),
    implementing every member of ``nn.experts.GroupedGemmQuantization``.

    A module so that delayed-scaling buffers (non-persistent) follow ``.to(device)``; it
    has no parameters and adds nothing to the state dict. A subclass that overrides
    `grouped_mm_swiglu` without ``combine`` declares ``swiglu_takes_combine = False``; the experts
    then combine after it.
    """

    swiglu_takes_combine = True
    prefetches_weights = True

    def __init__(self, recipe: FP8Recipe | str = "tensorwise", backend: str = "emulated") -> None:
        super().__init__()
        self.recipe = FP8Recipe.of(recipe)
        self.backend = backend
        if self.recipe.name == "delayed":
            register_delayed_buffers(self)  # one history per projection and local expert, sized at the first call
        if self.recipe.graph_weight_casts and backend not in ("torch", "auto"):
            raise ValueError(f"FP8Recipe(graph_weight_casts=True) graphs the native backend's casts; this grouped GEMM "
                             f"runs backend {backend!r}. Use backend 'torch' (or 'auto' on a Hopper GPU).")

    def _delayed_state(self, projection: str, experts: int, device: torch.device) -> DelayedState:
        """The delayed-scaling state of one projection: fc1 and fc2 keep separate scales per
        expert and role (as Transformer Engine's two GroupedLinear modules do), as two halves
        of this module's buffers, so one update covers both. Other names take fc1's half."""
        state = ensure_delayed_state(self, self.recipe, len(_PROJECTIONS) * experts, device)
        # The views are kept while the buffers are the same tensors over the same memory (several
        # calls per forward; each slicing is a dispatcher call): an update writes into them in place.
        identity = (id(state.amax_history), state.amax_history.data_ptr(), id(state.scale), state.scale.data_ptr(),
                    state.fresh, state.group)
        views = self.__dict__.setdefault("_delayed_views", {})  # not module state
        kept = views.get((projection, experts))
        if kept is not None and kept[0] == identity:
            return kept[2]
        part = _PROJECTIONS.index(projection) if projection in _PROJECTIONS else 0
        groups = slice(part * experts, (part + 1) * experts)
        view = DelayedState(state.amax_history[:, :, groups], state.scale[:, groups], state.fresh, state.group)
        # The buffers ride along so that their ids cannot be reused while the entry is kept.
        views[(projection, experts)] = (identity, (state.amax_history, state.scale), view)
        return view

    def _state_and_key(self, projection: str, w_EKN: Tensor) -> tuple[DelayedState | None, tuple | None]:
        """The projection's delayed-scaling state (None unless delayed) and weight-cache key."""
        state = self._delayed_state(projection, w_EKN.shape[0], w_EKN.device) if self.recipe.name == "delayed" else None
        return state, ((id(self), projection) if projection else None)

    def prefetch_weights(self, weights: dict[str, Tensor]) -> None:
        """Start the FP8 copies of each projection's weight (``{"fc1": w1, "fc2": w2}``) on a
        side stream, before the tokens arrive, where the native backend's training forward
        would cast them (``weight_prefetch.can_prefetch_weight_layouts``); nothing elsewhere. The
        next `grouped_mm` / `grouped_mm_gathered` / `grouped_mm_swiglu` of that projection
        takes them.

        The delayed recipe needs its scaling state already sized for these weights (the first
        forward allocates it); this never allocates or resizes it, so weights of another shape
        (say, an FSDP shard seen before the unshard) cannot reset the amax histories.
        """
        self.release_prefetched()
        from lightning_moe.precision.weight_prefetch import can_prefetch_weight_layouts, prefetch_weight_layouts

        jobs = []
        for projection, w_EKN in weights.items():
            if not can_prefetch_weight_layouts(w_EKN, self.recipe):
                continue
            if resolve_backend(self.recipe, self.backend, device=w_EKN.device.type, grouped=True) != "torch":
                if self.recipe.graph_weight_casts:
                    raise ValueError("FP8Recipe(graph_weight_casts=True): these experts' FP8 GEMMs do not run on the "
                                     "native backend here (no Hopper GPU); set graph_weight_casts=False.")
                continue
            if self.recipe.name == "delayed" and not self._delayed_state_fits(w_EKN.shape[0]):
                continue
            state, _ = self._state_and_key(projection, w_EKN)
            jobs.append((projection, w_EKN, state))
        started = None
        if self.recipe.graph_weight_casts:
            started = self.graphed_weight_casts.start(jobs, self.recipe)
        if started is None:
            started = {projection: prefetch_weight_layouts(w_EKN, self.recipe, state)
                       for projection, w_EKN, state in jobs}
        self.__dict__["_prefetched"] = started  # not module state: per forward, never saved

    @property
    def graphed_weight_casts(self) -> GraphedWeightCasts:
        """The CUDA graph of this GEMM's prefetched weight casts (``FP8Recipe.graph_weight_casts``),
        made at first use; not module state (a copy of the module starts without one)."""
        graphed = self.__dict__.get("_graphed_weight_casts")
        if graphed is None:
            from lightning_moe.precision.graphed_casts import GraphedWeightCasts

            graphed = self.__dict__["_graphed_weight_casts"] = GraphedWeightCasts()
        return graphed

    def _delayed_state_fits(self, experts: int) -> bool:
        state = delayed_state(self)
        return state is not None and state.scale.shape[1] == len(_PROJECTIONS) * experts

    def check_sharded_weights(self) -> None:
        """The experts are sharded by FSDP (weights gathered only inside their forward), so nothing
        is prefetched: refused under ``graph_weight_casts``, which needs the prefetch."""
        if self.recipe.graph_weight_casts:
            raise ValueError("FP8Recipe(graph_weight_casts=True) needs experts not sharded by FSDP (their weights "
                             "are gathered only inside their forward); shard them with DDP or set "
                             "graph_weight_casts=False.")

    def release_prefetched(self) -> None:
        """Drop copies `prefetch_weights` started that no GEMM took (a forward that stopped
        early), after making the current stream wait for them: their casts may still be
        reading the weights and recording amaxes."""
        for leftover in self.__dict__.pop("_prefetched", {}).values():
            leftover.release()

    def _take_prefetched(self, projection: str) -> PrefetchedWeight | None:
        """The projection's prefetched copies (None if none), removed from the pending ones."""
        return self.__dict__.get("_prefetched", {}).pop(projection, None)

    def grouped_mm(self, x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor, projection: str = "") -> Tensor:
        """``projection`` ("fc1" / "fc2") names the weight for the FP8 weight cache and picks
        its delayed-scaling state (and its copies from `prefetch_weights`)."""
        state, key = self._state_and_key(projection, w_EKN)
        prefetched = self._take_prefetched(projection)
        try:
            return fp8_grouped_mm(x_RK, w_EKN, offsets_E, self.recipe, self.backend, state, weight_key=key,
                                  prefetched=prefetched)
        finally:
            if prefetched is not None:
                prefetched.release()  # taken, or dropped by a path that did not use it

    def takes_deferred_permutation(self, tokens_TK: Tensor) -> bool:
        """Whether `grouped_mm_gathered` runs on ``tokens_TK`` (the native delayed-scaling casts:
        recipe "delayed" on the "torch" backend with Triton on CUDA; `gathered_cast_runs`)."""
        return gathered_cast_runs(self.recipe, self.backend, tokens_TK)

    def grouped_mm_gathered(self, tokens_TK: Tensor, plan: PermutationPlan, w_EKN: Tensor, offsets_E: Tensor,
                            projection: str = "") -> Tensor | None:
        """``permute(tokens, plan) @ w`` with the permutation read inside the FP8 cast
        (`fp8_grouped_mm_gathered`), or None where that does not run (then the caller permutes
        the tokens and calls `grouped_mm`)."""
        return self._fused_delayed_call(projection, w_EKN, lambda state, key, prefetched: fp8_grouped_mm_gathered(
            tokens_TK, plan, w_EKN, offsets_E, self.recipe, self.backend, state, weight_key=key, prefetched=prefetched))

    def takes_deferred_combine(self, tokens_TK: Tensor) -> bool:
        """Whether `grouped_mm_swiglu` with ``combine`` would run in this layer (the test of
        `takes_deferred_permutation`, in a training pass); where it then declines after all, the
        experts carry the combine out themselves."""
        # takes_deferred_permutation holds for the delayed recipe's native casts only
        return torch.is_grad_enabled() and self.swiglu_takes_combine and self.takes_deferred_permutation(tokens_TK)

    def grouped_mm_swiglu(self, h_RF2: Tensor, w_EFN: Tensor, offsets_E: Tensor,
                          projection: str = "", combine: DeferredCombine | None = None) -> Tensor | None:
        """``swiglu(h) @ w`` with the SwiGLU fused into the FP8 cast (`fp8_grouped_mm_swiglu`),
        or None where that does not run (then the caller applies the SwiGLU and `grouped_mm`).
        ``combine``: end in that `DeferredCombine` (``[T, N]``, see `fp8_grouped_mm_swiglu`)."""
        return self._fused_delayed_call(projection, w_EFN, lambda state, key, prefetched: fp8_grouped_mm_swiglu(
            h_RF2, w_EFN, offsets_E, self.recipe, self.backend, state, weight_key=key, prefetched=prefetched,
            combine=combine))

    def _fused_delayed_call(self, projection: str, w: Tensor,
                            run: Callable[[DelayedState, tuple | None, PrefetchedWeight | None],
                                          Tensor | None]) -> Tensor | None:
        """A delayed-scaling GEMM with a cast fused in, ``run(state, weight key, prefetched
        copies)``, or None (not delayed, or ``run`` declined). The projection's prefetched weight
        copies are handed over and dropped only when ``run`` used them; else `grouped_mm` takes
        them."""
        if self.recipe.name != "delayed":
            return None
        state, key = self._state_and_key(projection, w)
        prefetched = self.__dict__.get("_prefetched", {}).get(projection)
        y = run(state, key, prefetched)
        if y is not None and prefetched is not None:
            self._take_prefetched(projection).release()  # used
        return y

    def extra_repr(self) -> str:
        return f"recipe={self.recipe.name}, backend={self.backend}"


@dataclass
class FP8Summary:
    """What `configure_fp8` did: names of converted / kept modules and the backends used."""

    linear_backend: str
    experts_backend: Optional[str] = None
    converted: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    te_experts: list[str] = field(default_factory=list)
    # Under "te": sharded (DTensor) linears converted in place on this backend instead.
    sharded_backend: Optional[str] = None
    sharded: list[str] = field(default_factory=list)
    # Token-group padding the FP8 expert kernels need, set on every MoE layer's config (or None).
    expert_alignment: Optional[int] = None


def is_grouped_experts(module: nn.Module) -> bool:
    """Duck-typed ``GroupedExperts``: fused ``fc1_weight`` / ``fc2_weight`` and a ``quantization`` slot."""
    return hasattr(module, "quantization") and hasattr(module, "fc1_weight") and hasattr(module, "fc2_weight")


def _block_names(model: nn.Module) -> Optional[list[str]]:
    """Qualified names of the transformer blocks, in order: the children of the shallowest
    ``nn.ModuleList`` / ``nn.ModuleDict`` holding at least two modules with parameters (so a
    parameter-free container such as a torchmetrics ``MetricCollection`` is not mistaken for
    the blocks)."""
    best: Optional[tuple[int, str, nn.Module]] = None
    for name, module in model.named_modules():
        depth = name.count(".") + bool(name)
        is_container = isinstance(module, (nn.ModuleList, nn.ModuleDict)) and (
            sum(1 for child in module.children() if next(child.parameters(), None) is not None) >= 2
        )
        if is_container and (best is None or depth < best[0]):
            best = (depth, name, module)
    if best is None:
        return None
    _, name, blocks = best
    return [f"{name}.{child}" if name else child for child, _ in blocks.named_children()]


def _high_precision_prefixes(model: nn.Module, keep: int) -> list[str]:
    if keep <= 0:
        return []
    blocks = _block_names(model)
    if blocks is None:
        raise ValueError(
            "keep_high_precision_layers needs the model's transformer blocks in an nn.ModuleList or "
            "nn.ModuleDict; none was found. Pass module_filter=lambda name, module: ... to choose the FP8 "
            "modules instead."
        )
    return [f"{name}." for name in blocks[:keep] + blocks[max(len(blocks) - keep, keep):]]


def _excluded(name: str, module: nn.Linear, tied: set[int]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    in_router = any(part in _ROUTER_NAMES or "router" in part for part in name.split("."))
    return in_router or leaf.endswith("_gate") or leaf in _OUTPUT_NAMES or id(module.weight) in tied


def configure_fp8(
    model: nn.Module,
    recipe: FP8Recipe | str = "tensorwise",
    backend: str = "auto",
    keep_high_precision_layers: int = 0,
    module_filter: Optional[ModuleFilter] = None,
    device: Optional[str] = None,
) -> FP8Summary:
    """Install FP8 in ``model`` in place and say what was done.

    Converted, in place (`FP8Linear.convert`; ``te.Linear`` under the "te" backend): every
    ``nn.Linear`` (attention projections, dense and shared-expert MLPs), including
    subclasses that keep ``nn.Linear.forward``. Kept in high precision: routers and gates (a
    module path part named ``router`` or ``gate``, a leaf ending in ``_gate``), output layers
    (leaf ``lm_head``, ``output_layer``, ``output``, ``head``, ``classifier``, or a weight tied
    to an ``nn.Embedding``), the first / last ``keep_high_precision_layers`` blocks, modules
    ``module_filter(name, module)`` rejects, and, under "te" / "torch", linears whose sizes are
    not multiples of 16 (32 for mxfp8 / nvfp4; the kernels need it). Norms and embeddings are never touched.

    Grouped experts (``fc1_weight`` / ``fc2_weight`` / ``quantization``) get an
    `FP8GroupedGemm`. Under "te", experts on the "te" expert backend (``te.GroupedLinear``) are
    quantized by TE's autocast instead (``quantization`` stays None), other
    experts run on "torch" where it can, else "emulated"; modules built on ``te.GroupedLinear``
    are left alone. Linears already sharded (DTensor weights) cannot become ``te.Linear`` and are
    converted in place on "torch" / "emulated".
    """
    recipe = FP8Recipe.of(recipe)
    linear_backend = resolve_backend(recipe, backend, device)
    summary = FP8Summary(linear_backend)
    keep_prefixes = _high_precision_prefixes(model, keep_high_precision_layers)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def wanted(name: str, module: nn.Module) -> bool:
        if any(f"{name}.".startswith(p) for p in keep_prefixes):
            return False
        return module_filter is None or module_filter(name, module)

    replacements = []
    for name, module in model.named_modules():
        if is_grouped_experts(module):
            on_te = linear_backend == "te" and getattr(module, "backend", None) == "te"
            if not wanted(name, module):
                summary.kept.append(name)
                if on_te:  # te.GroupedLinear would be quantized by the plugin's te.autocast
                    module.quantization = _te.HighPrecisionGroupedGemm()
                continue
            # "te" experts are quantized by TE itself, under the plugin's te.autocast (each
            # projection has its own te.GroupedLinear, so delayed scaling keeps per-layer state).
            if on_te:
                module.quantization = None
                summary.te_experts.append(name)
                continue
            if summary.experts_backend is None:
                summary.experts_backend = _experts_backend(recipe, backend, linear_backend, device)
            module.quantization = FP8GroupedGemm(recipe, summary.experts_backend)
            summary.experts.append(name)
        elif _is_te_grouped_linear(module):
            summary.te_experts.append(name)
        elif getattr(module, "is_fp8_linear", False):  # converted by an earlier call (a second fit)
            summary.converted.append(name)
        elif _is_plain_linear(module):
            keep = _excluded(name, module, tied) or not wanted(name, module)
            if keep or not _kernel_fits(module, recipe, linear_backend):
                summary.kept.append(name)
            else:
                replacements.append((name, module))
    for name, module in replacements:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if linear_backend == "te" and isinstance(module.weight, DTensor):
            # Sharded already (FSDP2 / TP run before convert_module): a new te.Linear would
            # hold a full plain weight that neither FSDP nor TP manages. Convert in place instead.
            summary.sharded_backend = summary.sharded_backend or _non_te_backend(recipe, device, grouped=False)
            FP8Linear.convert(module, recipe, summary.sharded_backend)
            summary.sharded.append(name)
        elif linear_backend == "te":
            setattr(parent, leaf, _te.make_linear(module))
        else:
            FP8Linear.convert(module, recipe, linear_backend)
        summary.converted.append(name)
    if summary.te_experts or (summary.experts and summary.experts_backend != "emulated"):
        summary.expert_alignment = pad_expert_groups(model, recipe.alignment)
    elif summary.experts and recipe.is_fp4 and recipe.nvfp4_rht:
        # Emulated too: the weight gradient's 16-token Hadamard blocks must not mix two experts.
        summary.expert_alignment = pad_expert_groups(model, NVFP4_BLOCK)
    return summary


def pad_expert_groups(model: nn.Module, alignment: int) -> int:
    """Pad every MoE layer's expert token groups to a multiple of ``alignment`` (the FP8 /
    MXFP8 / NVFP4 kernels' need: cuBLAS, ``torch._scaled_grouped_mm`` and TE's grouped GEMM
    reject other group sizes). A layer whose ``config.expert_alignment`` is smaller gets a new
    config with the larger one through ``layer.set_expert_alignment`` (``MoEConfig`` is frozen):
    the layer hands it to its router and its installed dispatcher, local or expert-parallel, and a
    dispatcher installed later is built from it, so the order of expert-parallel setup and this
    conversion does not matter. Padding rows are zeros and cost only their GEMM rows (under
    ``pad_expert_input_to_capacity`` each expert's capacity block is rounded up the same way).
    Returns the alignment now in effect (the largest over the layers)."""
    from lightning_moe.nn.config import MoEConfig

    in_effect = alignment
    for module in model.modules():
        cfg, experts = getattr(module, "config", None), getattr(module, "experts", None)
        if isinstance(cfg, MoEConfig) and experts is not None and is_grouped_experts(experts):
            # lcm of powers of two (the values MoEConfig accepts) is the larger one
            wanted = max(cfg.expert_alignment, alignment)
            if wanted != cfg.expert_alignment:
                set_alignment = getattr(module, "set_expert_alignment", None)
                if set_alignment is None:
                    raise TypeError(
                        f"{type(module).__name__} holds a MoEConfig and grouped experts but has no "
                        "set_expert_alignment(n) to pad their groups to the FP8 kernels' multiple of "
                        f"{wanted} (MoEConfig is frozen): use MoELayer or give it that method."
                    )
                set_alignment(wanted)
            in_effect = max(in_effect, wanted)
    return in_effect


def _experts_backend(recipe: FP8Recipe, backend: str, linear_backend: str, device: Optional[str]) -> str:
    if linear_backend != "te":
        return resolve_backend(recipe, backend, device, grouped=True)
    return _non_te_backend(recipe, device, grouped=True)


def _non_te_backend(recipe: FP8Recipe, device: Optional[str], grouped: bool) -> str:
    """What runs modules Transformer Engine cannot take: torch where it can, else emulated."""
    try:
        return resolve_backend(recipe, "torch", device, grouped=grouped)
    except ValueError:
        return "emulated"


def _is_plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` (or a subclass that only changes initialization, or whose forward only
    casts its weight once per step, `CachedCastLinear`) not yet converted."""
    return isinstance(module, nn.Linear) and type(module).forward in (nn.Linear.forward, CachedCastLinear.forward)


def _is_te_grouped_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "GroupedLinear" and type(module).__module__.startswith("transformer_engine")


def _kernel_fits(linear: nn.Linear, recipe: FP8Recipe, backend: str) -> bool:
    """FP8 kernels need both sizes in multiples of 16 (32 for the MX / NVFP4 block formats)."""
    multiple = 32 if recipe.name in ("mxfp8", "nvfp4") else 16
    return backend == "emulated" or (linear.in_features % multiple == 0 and linear.out_features % multiple == 0)


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """Modules with delayed-scaling state, including state allocated at the first call
    (for `update_delayed_scaling`)."""
    return [m for m in model.modules() if "fp8_amax_history" in m._buffers]
