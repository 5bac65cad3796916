"""FP8 modules and the model conversion that installs them.

- `FP8Linear`: an ``nn.Linear`` whose GEMMs run quantized (torch / emulated backends).
  Same parameters (``weight``, ``bias``, fp32 master copies) and no persistent buffers, so
  its state dict equals the ``nn.Linear`` it replaces: FP8 can be switched on or off between
  saving and resuming.
- `FP8GroupedGemm`: the object ``GroupedExperts.quantization`` takes (``grouped_mm(x_RK,
  w_EKN, offsets_E) -> y_RN``).
- `configure_fp8`: walks a model, swaps eligible linears (``te.Linear`` under the "te"
  backend) and sets the experts' quantization, keeping routers, norms, embeddings, the
  output layer and optionally the first / last blocks in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import Tensor, nn

from lightning_moe.precision import _te
from lightning_moe.precision.delayed import delayed_state, register_delayed_buffers
from lightning_moe.precision.gemm import fp8_grouped_mm, fp8_linear
from lightning_moe.precision.recipes import FP8Recipe, resolve_backend

ModuleFilter = Callable[[str, nn.Module], bool]
# Leaf names of linears that are routers / output heads in common model code (Megatron,
# Hugging Face, torchtitan). Routers stay fp32, output layers high precision.
_ROUTER_NAMES = ("router", "gate")
_OUTPUT_NAMES = ("lm_head", "output_layer", "output", "head", "classifier")


class FP8Linear(nn.Linear):
    """``nn.Linear`` with quantized forward and backward GEMMs (see `fp8_linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: FP8Recipe | str = "tensorwise",
                 backend: str = "emulated", device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = FP8Recipe.of(recipe)
        self.backend = backend
        if self.recipe.name == "delayed":
            register_delayed_buffers(self, self.recipe, groups=1, device=device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe, backend: str) -> "FP8Linear":
        """Wrap ``linear``'s own parameter objects (no copy, no re-initialization)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, backend, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        if recipe.name == "delayed":
            register_delayed_buffers(new, recipe, groups=1, device=linear.weight.device)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.recipe, self.backend, self.bias, delayed_state(self))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, backend={self.backend}"


class FP8GroupedGemm(nn.Module):
    """Quantized grouped GEMM for grouped experts (``experts.quantization = FP8GroupedGemm(...)``).

    A module so that delayed-scaling buffers (non-persistent) follow ``.to(device)``; it
    has no parameters and adds nothing to the state dict.
    """

    def __init__(self, recipe: FP8Recipe | str = "tensorwise", backend: str = "emulated") -> None:
        super().__init__()
        self.recipe = FP8Recipe.of(recipe)
        self.backend = backend
        if self.recipe.name == "delayed":
            # Sized at the first call: under expert parallelism only the local experts' weights arrive here.
            self.register_buffer("fp8_amax_history", None, persistent=False)
            self.register_buffer("fp8_scale", None, persistent=False)

    def grouped_mm(self, x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        if self.recipe.name == "delayed" and (self.fp8_scale is None or self.fp8_scale.shape[1] != w_EKN.shape[0]):
            register_delayed_buffers(self, self.recipe, groups=w_EKN.shape[0], device=w_EKN.device)
        return fp8_grouped_mm(x_RK, w_EKN, offsets_E, self.recipe, self.backend, delayed_state(self))

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


def _is_grouped_experts(module: nn.Module) -> bool:
    """Duck-typed ``GroupedExperts``: fused ``fc1_weight`` / ``fc2_weight`` and a ``quantization`` slot."""
    return hasattr(module, "quantization") and hasattr(module, "fc1_weight") and hasattr(module, "fc2_weight")


def _block_list(model: nn.Module) -> tuple[str, Optional[nn.ModuleList]]:
    """The transformer blocks: the shallowest ``nn.ModuleList`` with at least two entries."""
    best: tuple[int, str, Optional[nn.ModuleList]] = (10**9, "", None)
    for name, module in model.named_modules():
        depth = name.count(".") + bool(name)
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and depth < best[0]:
            best = (depth, name, module)
    return best[1], best[2]


def _high_precision_prefixes(model: nn.Module, keep: int) -> list[str]:
    if keep <= 0:
        return []
    name, blocks = _block_list(model)
    if blocks is None:
        raise ValueError(
            "keep_high_precision_layers needs the model's transformer blocks in an nn.ModuleList; none was "
            "found. Pass module_filter=lambda name, module: ... to choose the FP8 modules instead."
        )
    indices = sorted(set(range(min(keep, len(blocks)))) | set(range(max(len(blocks) - keep, 0), len(blocks))))
    return [f"{name}.{i}." if name else f"{i}." for i in indices]


def _excluded(name: str, module: nn.Linear, tied: set[int]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    in_router = any(part in _ROUTER_NAMES or "router" in part for part in name.split("."))
    return in_router or leaf in _OUTPUT_NAMES or id(module.weight) in tied


def configure_fp8(
    model: nn.Module,
    recipe: FP8Recipe | str = "tensorwise",
    backend: str = "auto",
    keep_high_precision_layers: int = 0,
    module_filter: Optional[ModuleFilter] = None,
    device: Optional[str] = None,
) -> FP8Summary:
    """Install FP8 in ``model`` in place.

    Converted: every ``nn.Linear`` (attention projections, dense / shared-expert MLPs) except
    routers (a module path part named ``router``/``gate``), output layers (leaf named
    ``lm_head``, ``output_layer``, ``output``, ``head``, ``classifier``, or a weight tied to an
    ``nn.Embedding``), linears in the first / last ``keep_high_precision_layers`` blocks, and
    those ``module_filter(name, module)`` rejects; under "te" / "torch", also linears whose
    dimensions are not multiples of 16 (their FP8 kernels need it). Grouped experts get an
    `FP8GroupedGemm` (Transformer Engine has no grouped GEMM on fused ``[E, K, N]`` weights,
    so under "te" they use "torch" where it runs, else "emulated"; experts built on
    ``te.GroupedLinear`` are quantized by TE's autocast and left alone). Norms and embeddings
    are not linears and never change.
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
        if _is_grouped_experts(module):
            if not wanted(name, module):
                summary.kept.append(name)
                continue
            if summary.experts_backend is None:
                summary.experts_backend = _experts_backend(recipe, backend, linear_backend, device)
            module.quantization = FP8GroupedGemm(recipe, summary.experts_backend)
            summary.experts.append(name)
        elif _is_te_grouped_linear(module):
            summary.te_experts.append(name)
        elif type(module) is nn.Linear:
            if _excluded(name, module, tied) or not wanted(name, module) or not _kernel_fits(module, linear_backend):
                summary.kept.append(name)
            else:
                replacements.append((name, module))
    for name, module in replacements:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = _te.make_linear(module) if linear_backend == "te" else FP8Linear.from_linear(module, recipe, linear_backend)
        setattr(parent, leaf, new)
        summary.converted.append(name)
    return summary


def _experts_backend(recipe: FP8Recipe, backend: str, linear_backend: str, device: Optional[str]) -> str:
    if linear_backend != "te":
        return resolve_backend(recipe, backend, device, grouped=True)
    try:
        return resolve_backend(recipe, "torch", device, grouped=True)
    except ValueError:
        return "emulated"


def _is_te_grouped_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "GroupedLinear" and type(module).__module__.startswith("transformer_engine")


def _kernel_fits(linear: nn.Linear, backend: str) -> bool:
    return backend == "emulated" or (linear.in_features % 16 == 0 and linear.out_features % 16 == 0)


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """Modules holding delayed-scaling state (for `update_delayed_scaling`)."""
    return [m for m in model.modules() if delayed_state(m) is not None]
