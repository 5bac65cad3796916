"""`FP8Recipe`: which low-precision recipe to train with, and `resolve_backend`: who runs it.

Recipes (names follow the torchao / Transformer Engine vocabulary):

| name | tiles (activations, grads / weights) | scales | TE recipe |
|---|---|---|---|
| tensorwise | whole tensor | fp32, current amax | ``Float8CurrentScaling`` |
| delayed | whole tensor | fp32, max of an amax history | ``DelayedScaling`` |
| rowwise | one per row (of the contraction) | fp32 | none (torch ``_scaled_mm``) |
| blockwise | 1x128 / 128x128 | power-of-two fp32 | ``Float8BlockScaling`` |
| mxfp8 | 1x32 | E8M0 | ``MXFP8BlockScaling`` (sm100+) |
| nvfp4 | 1x16 / 16x16, E2M1 values | E4M3 + fp32 per tensor | ``NVFP4BlockScaling`` (sm100+) |

Backends: "te" (Transformer Engine), "torch" (``torch._scaled_mm`` / ``_scaled_grouped_mm``),
"emulated" (quantize-dequantize in fp32, any device), "auto" (the best of these that runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import torch

from lightning_moe.precision import _te
from lightning_moe.precision.formats import E2M1, FloatFormat, fp8_format

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "nvfp4")
BACKENDS = ("auto", "te", "torch", "emulated")
ROLES = ("input", "weight", "grad")
_TORCH_RECIPES = ("tensorwise", "rowwise", "delayed")
_TE_RECIPES = ("tensorwise", "blockwise", "delayed", "mxfp8", "nvfp4")
_DEFAULT_FMT = {"tensorwise": "hybrid", "delayed": "hybrid", "rowwise": "e4m3", "blockwise": "e4m3", "mxfp8": "e4m3"}


@dataclass
class FP8Recipe:
    """A low-precision training recipe.

    Args:
        name: one of "tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "nvfp4".
        fmt: "hybrid" (E4M3 forward, E5M2 gradients: TE's default for tensorwise/delayed) or
            "e4m3" (everywhere: default for rowwise/blockwise/mxfp8). NVFP4 is always "e2m1".
        margin: delayed scaling: scales are divided by ``2**margin``.
        amax_history_len: delayed scaling: steps of amax history (TE default 1024).
        amax_compute_algo: delayed scaling: "max" over the history or "most_recent".
        nvfp4_2d_weights / nvfp4_rht / nvfp4_stochastic_rounding: the three NVFP4 techniques
            (16x16 weight tiles, random Hadamard transform on the weight-gradient GEMM inputs,
            stochastic rounding of gradients); all on by default, as in TE.
        rht_seed: seed of the Hadamard transform's random signs.
        fast_accumulation: which FP8 GEMMs ("fprop", "dgrad", "wgrad") accumulate in Hopper's
            fast (reduced-precision) FP8 tensor-core accumulator instead of promoting partial
            sums to fp32 ("split accumulation"). Default: TE's, ``("fprop",)`` for tensorwise,
            rowwise and delayed, ``()`` for blockwise (TE requires split accumulation there);
            not applicable to mxfp8 / nvfp4. Adding "dgrad" and "wgrad" makes torch's grouped
            FP8 kernel about 3x faster on small experts at some
            gradient accuracy. The emulated backend ignores it (its GEMMs always accumulate in
            fp32).
        quantize_weights_once: native backend, grouped experts with the fused quantizers
            (rowwise and delayed recipes on CUDA): a training forward quantizes each expert
            weight for both of its GEMMs at once (delayed: one read instead of two; rowwise:
            two instead of four) and saves the data-gradient copy for the backward, as
            Transformer Engine keeps its FP8 weight transpose. That holds one byte per expert
            parameter from a layer's forward to its backward (activation checkpointing drops
            and remakes it like any saved tensor). None (default): on, except that
            `MegatronMoEStrategy` turns it off when FSDP shards the experts (the copy would be
            of the unsharded weight); True / False force it. The bits are the same either way.
        graph_weight_casts: native backend on CUDA, rowwise and delayed recipes: capture each
            layer's expert weight casts (the ones started before routing) in a CUDA graph and
            replay it at every training forward, one launch instead of about a millisecond of host
            work per layer (`precision.graphed_casts`). Costs memory: both FP8 layouts of the
            local expert weights (2 bytes per parameter) stay allocated for good, about one byte
            per parameter more at peak than the eager casts (two under activation
            checkpointing). Same bits as without it. Needs ``quantize_weights_once`` not False,
            no FP8 weight cache, experts not sharded by FSDP.
        fuse_swiglu_backward: native delayed recipe on CUDA, SwiGLU experts: fc2's backward
            computes the SwiGLU's backward and casts fc1's output gradient straight into the FP8
            copies fc1's backward reads (one kernel instead of two; no bf16 gradient written and
            read back). That gradient then bypasses autograd: hooks, ``retain_grad`` and
            ``torch.autograd.grad`` on fc1's output see none, and fc1's output must feed fc2 alone
            (anything else raises in the backward). Same bits as without it. Off by default.

    ``alignment`` (derived) is the multiple each expert's token group must be padded to:
    16 for FP8, 32 for MXFP8, 128 for NVFP4 (TE's ``get_align_size_for_quantization``).
    """

    name: str = "tensorwise"
    fmt: Optional[str] = None
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    nvfp4_2d_weights: bool = True
    nvfp4_rht: bool = True
    nvfp4_stochastic_rounding: bool = True
    rht_seed: int = 0
    fast_accumulation: Optional[tuple[str, ...]] = None
    quantize_weights_once: Optional[bool] = None
    graph_weight_casts: bool = False
    fuse_swiglu_backward: bool = False
    alignment: int = field(init=False)

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"Unknown FP8 recipe {self.name!r}; known recipes: {', '.join(RECIPES)}.")
        if self.name == "nvfp4":
            if self.fmt not in (None, "e2m1"):
                raise ValueError(f"The nvfp4 recipe stores E2M1 values; got fmt={self.fmt!r} (leave it unset).")
            self.fmt = "e2m1"
        else:
            self.fmt = self.fmt or _DEFAULT_FMT[self.name]
            if self.fmt not in ("hybrid", "e4m3"):
                raise ValueError(
                    f"FP8 fmt must be 'hybrid' or 'e4m3' (E5M2-only training is unstable); got {self.fmt!r}."
                )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent'; got {self.amax_compute_algo!r}.")
        if self.amax_history_len < 1 or self.margin < 0:
            raise ValueError("amax_history_len must be >= 1 and margin >= 0.")
        self.alignment = {"mxfp8": 32, "nvfp4": 128}.get(self.name, 16)
        self._check_fast_accumulation()
        if self.graph_weight_casts and self.name not in ("rowwise", "delayed"):
            raise ValueError(f"graph_weight_casts graphs the native rowwise / delayed expert weight casts; the "
                             f"{self.name} recipe has none. Use recipe 'delayed' or 'rowwise', or leave it False.")
        if self.fuse_swiglu_backward and self.name != "delayed":
            raise ValueError(f"fuse_swiglu_backward fuses the delayed recipe's SwiGLU-backward cast; the {self.name} "
                             "recipe has none. Use recipe 'delayed', or leave it False.")
        if self.graph_weight_casts and self.quantize_weights_once is False:
            raise ValueError("graph_weight_casts graphs the cast of both weight layouts in the forward, which "
                             "quantize_weights_once=False turns off; leave quantize_weights_once unset.")

    @property
    def _default_fast_accumulation(self) -> tuple[str, ...]:
        return ("fprop",) if self.name in ("tensorwise", "rowwise", "delayed") else ()

    def _check_fast_accumulation(self) -> None:
        default = self._default_fast_accumulation
        if self.fast_accumulation is None:
            self.fast_accumulation = default
            return
        if isinstance(self.fast_accumulation, str):
            raise ValueError(f"fast_accumulation is a sequence of GEMM names, e.g. ('fprop', 'wgrad'); "
                             f"got the string {self.fast_accumulation!r}.")
        names = tuple(self.fast_accumulation)  # once: the argument may be an iterator
        unknown = set(names) - {"fprop", "dgrad", "wgrad"}
        if unknown:
            raise ValueError(f"fast_accumulation takes 'fprop', 'dgrad' and 'wgrad'; got {sorted(unknown)}.")
        self.fast_accumulation = tuple(g for g in ("fprop", "dgrad", "wgrad") if g in names)
        if self.fast_accumulation and self.name not in ("tensorwise", "rowwise", "delayed"):
            raise ValueError(
                f"The {self.name} recipe accumulates in fp32 (split accumulation) by design; "
                "leave fast_accumulation unset, or use the tensorwise / rowwise recipes for fast accumulation."
            )

    def fast(self, gemm: str) -> bool:
        """Whether GEMM "fprop", "dgrad" or "wgrad" uses the fast FP8 accumulator."""
        return gemm in self.fast_accumulation

    @classmethod
    def of(cls, recipe: Union[str, FP8Recipe]) -> FP8Recipe:
        """A recipe from its name, or the recipe itself."""
        return recipe if isinstance(recipe, FP8Recipe) else cls(name=recipe)

    @property
    def is_fp4(self) -> bool:
        return self.name == "nvfp4"

    def format(self, role: str) -> FloatFormat:
        """Element format of a GEMM operand: role "input", "weight" or "grad"."""
        if self.is_fp4:
            return E2M1
        return fp8_format("e5m2" if role == "grad" and self.fmt == "hybrid" else "e4m3")

    def tile(self, role: str) -> tuple[Optional[int], Optional[int]]:
        """(rows, cols) of one scaling tile of an operand laid out ``[other, contraction]``;
        None spans the whole axis (or one token group / one expert in grouped GEMMs)."""
        weight = role == "weight"
        if self.name in ("tensorwise", "delayed"):
            return None, None
        if self.name == "rowwise":
            return 1, None
        if self.name == "blockwise":
            return (128, 128) if weight else (1, 128)
        if self.name == "mxfp8":
            return 1, 32
        return (16, 16) if weight and self.nvfp4_2d_weights else (1, 16)

    @property
    def power_2_scales(self) -> bool:
        """Blockwise uses power-of-two scales (TE ``Float8BlockScaling`` default)."""
        return self.name == "blockwise"

    def describe(self) -> str:
        if self.is_fp4:
            parts = [p for p, on in (("2-D weights", self.nvfp4_2d_weights), ("RHT", self.nvfp4_rht),
                                     ("stochastic rounding", self.nvfp4_stochastic_rounding)) if on]
            return f"nvfp4 ({', '.join(parts) or 'plain'})"
        fmt = "E4M3 fwd / E5M2 grads" if self.fmt == "hybrid" else "E4M3"
        fast = ""
        if self.fast_accumulation != self._default_fast_accumulation:  # say it only when not TE's default
            fast = f", fast accumulation: {'/'.join(self.fast_accumulation) or 'none'}"
        graphed = ", weight casts CUDA-graphed" if self.graph_weight_casts else ""
        fused = ", SwiGLU backward fused into fc1's cast" if self.fuse_swiglu_backward else ""
        return f"{self.name} ({fmt}{fast}{graphed}{fused})"


def cuda_capability(device: Optional[torch.device] = None) -> Optional[tuple[int, int]]:
    """Compute capability of the current (or given) CUDA device, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _torch_backend_problem(recipe: FP8Recipe, grouped: bool) -> Optional[str]:
    """Why the native torch kernels cannot run ``recipe`` here (None: they can)."""
    cc = cuda_capability()
    need = (9, 0) if grouped or recipe.name == "rowwise" else (8, 9)
    if cc is None:
        return f"backend='torch' needs a CUDA GPU with compute capability {need[0]}.{need[1]}+ (none found)"
    if cc < need:
        return (f"backend='torch' needs compute capability {need[0]}.{need[1]}+ for "
                f"{'grouped ' if grouped else ''}{recipe.name} FP8 GEMMs; this GPU is {cc[0]}.{cc[1]}")
    return None


def resolve_backend(
    recipe: Union[str, FP8Recipe], backend: str = "auto", device: Optional[str] = None, grouped: bool = False
) -> str:
    """The backend that will run ``recipe``: "te", "torch" or "emulated".

    Args:
        backend: "auto", "te", "torch" or "emulated".
        device: "cuda" or "cpu" (default: "cuda" when available); on "cpu" only the
            emulated backend runs.
        grouped: resolving for grouped expert GEMMs on plain weights (``[E, K, N]``
            parameters): Transformer Engine has no functional grouped GEMM for those, so
            "auto" picks torch / emulated and "te" is refused.

    Raises:
        ValueError: unknown recipe or backend, or a backend that cannot run the recipe
            here; the message names the backends that can.
    """
    recipe = FP8Recipe.of(recipe)
    if backend not in BACKENDS:
        raise ValueError(f"Unknown FP8 backend {backend!r}; use one of {', '.join(BACKENDS)}.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "emulated":
        return "emulated"
    if backend == "auto":
        if device == "cpu":
            return "emulated"
        if not grouped and recipe.name in _TE_RECIPES and _te.available() and _te.supports(recipe)[0]:
            return "te"
        if recipe.name in _TORCH_RECIPES and cuda_capability() is not None and cuda_capability() >= (9, 0):
            return "torch"
        return "emulated"
    if backend == "torch":
        if recipe.name not in _TORCH_RECIPES:
            blackwell = recipe.name in ("mxfp8", "nvfp4")
            alt = "backend='te' (Transformer Engine" + (", Blackwell sm100+)" if blackwell else ")")
            raise ValueError(
                f"FP8 recipe {recipe.name!r} has no native torch kernel; use {alt} or backend='emulated'."
            )
        problem = "backend='torch' runs on CUDA only; this plugin targets the CPU" if device == "cpu" else None
        problem = problem or _torch_backend_problem(recipe, grouped)
        if problem:
            raise ValueError(f"{problem}. Use backend='emulated'" + (" or backend='te'." if not grouped else "."))
        return "torch"
    # backend == "te"
    if grouped:
        raise ValueError(
            "Transformer Engine quantizes grouped experts only inside te.GroupedLinear "
            "(MoEConfig(expert_backend='te')); for grouped_mm experts use backend 'torch' or 'emulated'."
        )
    if recipe.name not in _TE_RECIPES:
        raise ValueError(
            f"Transformer Engine has no {recipe.name!r} recipe; use backend='torch' (Hopper sm90+) "
            "or backend='emulated', or recipe 'tensorwise' / 'blockwise' with TE."
        )
    if not _te.available():
        raise ValueError(
            "backend='te' needs Transformer Engine, which is not installed: "
            "`pip install lightning-moe[te]` (or transformer_engine[pytorch]). " + _te.import_error()
        )
    if device == "cpu":
        raise ValueError("backend='te' runs on CUDA only; use backend='emulated' on the CPU.")
    ok, reason = _te.supports(recipe)
    if not ok:
        can = ["emulated"]
        if recipe.name in _TORCH_RECIPES and _torch_backend_problem(recipe, grouped=False) is None:
            can.insert(0, "torch")
        raise ValueError(
            f"Transformer Engine cannot run the {recipe.name!r} recipe on this GPU: {reason} "
            f"Backends that can: {', '.join(repr(b) for b in can)}."
        )
    return "te"
