"""What `CUDAGraphs` captures: scopes, module discovery, and the refusals of what a graph cannot replay.

Plain functions over an ``nn.Module`` tree (no Trainer), so that they can be checked on CPU.

Scopes, named as Megatron-Core's ``--cuda-graph-scope`` names them where they exist:

- ``"full"``: whole decoder layers (the reference decoder's ``DecoderLayer``), Megatron's default;
- ``"attn"``: attention only (``Attention``, ``MultiHeadLatentAttention``);
- ``"moe"``: the MoE layer (``MoELayer``: router, dispatch, experts, combine);
- ``"full_iteration"``: the network's whole forward and backward: the reference ``MoEDecoder``'s
  ``loss`` (embedding to logits to the cross-entropy, which the reference LightningModule's
  training step calls), or the ``forward`` of a user's network given by ``modules``; the optimizer
  step stays eager.

``"attn"`` and ``"moe"`` combine (``scope=("attn", "moe")``); the others stand alone. Reference
types are matched by their qualified class names (this package's ``models`` sits above the
callbacks and is not imported here), subclasses included. A user's own modules are added by class
or by name (`fnmatch` patterns over the LightningModule's ``named_modules``). Only the outermost
of nested matches is captured (the inner ones are inside its graph).

Recomputation (``ModelConfig.recompute``, ``recompute_every_n_layers``) is refused where a
recomputed part lies inside a target or around one: a captured module's tensors live in the
graph's memory pool, so recomputing inside it frees nothing, and ``torch.utils.checkpoint`` (every
setting but ``layernorm`` and ``moe_act``) saves the RNG state, which a capture cannot read;
recomputed parts outside every target are fine (e.g. ``"layernorm"`` with ``scope="attn"`` or
``"moe"``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any, Union

from torch import nn

SCOPES = ("full", "attn", "moe", "full_iteration")
_COMBINABLE = {"attn", "moe"}

_SCOPE_TYPES = {
    "full": ("lightning_moe.models.decoder.DecoderLayer",),
    "attn": ("lightning_moe.models.decoder.Attention", "lightning_moe.models.mla.MultiHeadLatentAttention"),
    "moe": ("lightning_moe.nn.moe_layer.MoELayer",),
    "full_iteration": ("lightning_moe.models.decoder.MoEDecoder",),
}

# Mesh dimensions a captured parameter may be sharded over: expert parallelism only (each rank's
# shard is a plain local tensor inside the forward). Anything else is FSDP or tensor parallelism.
_CAPTURABLE_MESH_DIMS = {"ep", "etp"}

ModuleSpec = Union[type, str]


def normalize_scope(scope: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """The scope as a tuple of names; ``ValueError`` naming the choices for anything else."""
    scopes = (scope,) if isinstance(scope, str) else tuple(scope)
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown or not scopes:
        raise ValueError(f"CUDAGraphs(scope={scope!r}): choose one of {SCOPES}, or ('attn', 'moe') together.")
    if len(set(scopes)) != len(scopes):
        raise ValueError(f"CUDAGraphs(scope={scope!r}) names a scope twice.")
    if len(scopes) > 1 and not set(scopes) <= _COMBINABLE:
        raise ValueError(
            f"CUDAGraphs(scope={scope!r}): only 'attn' and 'moe' combine; 'full' already holds both and "
            "'full_iteration' holds the whole network."
        )
    return scopes


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_scope_type(module: nn.Module, scopes: Iterable[str]) -> bool:
    names = {name for scope in scopes for name in _SCOPE_TYPES[scope]}
    return any(qualified_name(cls) in names for cls in type(module).__mro__)


def _matches(name: str, module: nn.Module, spec: ModuleSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return fnmatch.fnmatchcase(name, spec)


def _inside(name: str, outer: str) -> bool:
    return name != outer and (outer == "" or name.startswith(outer + "."))


def find_targets(root: nn.Module, scopes: Sequence[str],
                 modules: Sequence[ModuleSpec] | None = None) -> list[tuple[str, nn.Module]]:
    """The modules of ``root`` to capture, ``(qualified name, module)`` in registration order:
    the scopes' reference types and the user's ``modules`` (classes or name patterns), the
    outermost of nested matches only. ``ValueError`` naming the fix when nothing matches, when a
    user spec matches nothing, or when the match is ``root`` itself."""
    modules = list(modules or [])
    for spec in modules:
        if not isinstance(spec, (type, str)):
            raise ValueError(f"CUDAGraphs(modules=...) takes module classes or qualified-name patterns, got {spec!r}.")
    named = list(root.named_modules())
    used = [False] * len(modules)
    chosen = []
    for name, module in named:
        hit = _is_scope_type(module, scopes)
        for i, spec in enumerate(modules):
            if _matches(name, module, spec):
                used[i] = hit = True
        if hit:
            chosen.append((name, module))
    unused = [spec for spec, u in zip(modules, used) if not u]
    if unused:
        shown = ", ".join(qualified_name(s) if isinstance(s, type) else repr(s) for s in unused)
        raise ValueError(f"CUDAGraphs(modules=...): {shown} matched no module of {type(root).__name__} "
                         "(names are those of named_modules(), e.g. 'model.layers.0').")
    if any(name == "" for name, _ in chosen):
        raise ValueError(
            f"CUDAGraphs cannot capture {type(root).__name__} itself (Lightning calls its training_step, not its "
            "forward): name the network it runs, e.g. modules=['model']."
        )
    targets = [(n, m) for n, m in chosen if not any(_inside(n, o) for o, _ in chosen)]
    if not targets:
        wanted = ", ".join(name.rsplit(".", 1)[1] for scope in scopes for name in _SCOPE_TYPES[scope])
        raise ValueError(
            f"CUDAGraphs(scope={scopes if len(scopes) > 1 else scopes[0]!r}) found no {wanted} in "
            f"{type(root).__name__}: pass your own modules, by class or by name, e.g. "
            "CUDAGraphs(modules=[MyBlock]) or CUDAGraphs(modules=['model.blocks.*'])."
        )
    return targets


def routed_method(module: nn.Module, scopes: Sequence[str]) -> str:
    """The method of a target that the callback routes: ``loss`` for the reference network under
    ``"full_iteration"`` (its training step's whole forward, the loss included), else ``forward``."""
    if "full_iteration" in scopes and _is_scope_type(module, ("full_iteration",)) and callable(
            getattr(module, "loss", None)):
        return "loss"
    return "forward"


def _hooks(module: nn.Module) -> list[str]:
    kinds = {"_forward_pre_hooks": "forward pre-hooks", "_forward_hooks": "forward hooks",
             "_backward_pre_hooks": "backward pre-hooks", "_backward_hooks": "backward hooks"}
    return [label for attr, label in kinds.items() if getattr(module, attr, None)]


def _mesh_dims(param: nn.Parameter) -> set[str]:
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return set()
    return set(mesh.mesh_dim_names or ("unnamed",))


def recomputed_parts(root: nn.Module) -> list[tuple[str, str]]:
    """``(qualified name, recompute setting)`` of every part of ``root`` that the reference
    decoder's recomputation (``ModelConfig.recompute``, ``recompute_every_n_layers``) runs again
    in backward: the module that holds the checkpointed code (found by its switches)."""
    parts = []
    for name, module in root.named_modules():
        prefix = f"{name}." if name else ""
        if getattr(module, "recompute_layer", False) is True:
            parts.append((name, "recompute_every_n_layers"))
        names = getattr(module, "recompute", None)
        if names is True:  # AttentionCore
            parts.append((name, "core_attn"))
        elif isinstance(names, (set, frozenset)):  # DecoderLayer: the names its own forward applies
            if "layernorm" in names:
                parts += [(prefix + n, "layernorm") for n in ("attention_norm", "mlp_norm") if hasattr(module, n)]
            block = "moe" if getattr(module, "is_moe", False) else "mlp"
            if block in names and hasattr(module, "mlp"):
                parts.append((prefix + "mlp", block))
        if getattr(module, "recompute_up_proj", False) is True:
            parts.append((name, "mla_up_proj"))
        if getattr(module, "recompute_activation", False) is True:
            parts.append((name, "moe_act"))
        if getattr(module, "recompute_shared_experts", False) is True and getattr(module, "shared_experts", None):
            parts.append((prefix + "shared_experts", "shared_experts"))
    return parts


def _overlap(a: str, b: str) -> bool:
    return a == b or _inside(a, b) or _inside(b, a)


def check_targets(targets: Sequence[tuple[str, nn.Module]], root: nn.Module | None = None,
                  static_dispatch: bool = False) -> None:
    """Refuse, naming the fix, what a CUDA graph of ``targets`` could not replay correctly:
    FSDP-sharded or tensor-parallel parameters, module hooks (which a graph would run only at the
    capture), a dispatch that reads its split sizes on the host (the dropless all-to-all unless
    ``static_dispatch``: the callback then captures its static path), host-syncing expert backends,
    context-parallel attention, and recomputation in backward of a part inside a target or around
    it (``root``: the module the targets' names are relative to; without it, inside only).
    Raises ``ValueError``."""
    from torch.distributed.fsdp import FSDPModule

    import torch.nn.modules.module as module_globals

    global_hooks = [label for label, hooks in (
        ("forward pre-hooks", module_globals._global_forward_pre_hooks),
        ("forward hooks", module_globals._global_forward_hooks),
        ("backward hooks", module_globals._global_backward_hooks),
        ("backward pre-hooks", getattr(module_globals, "_global_backward_pre_hooks", {})),
    ) if hooks]
    if global_hooks:
        raise ValueError(
            f"CUDAGraphs: global module {', '.join(global_hooks)} are registered (torch.nn.modules.module."
            "register_module_*_hook), which a graph would run only at its capture: remove them before fit."
        )
    _check_recompute(targets, root)
    for name, target in targets:
        shown = name or type(target).__name__
        # An FSDP unit around the target is fine when none of the target's parameters is its (they
        # are then plain tensors or expert-parallel shards, checked below): the MoE layers inside
        # dense FSDP blocks keep their router, shared experts and unsharded experts out of FSDP.
        for inner_name, inner in target.named_modules(prefix=name):
            if isinstance(inner, FSDPModule):
                raise ValueError(_fsdp_message(shown, inner_name))
            hooks = _hooks(inner)
            if hooks:
                raise ValueError(
                    f"CUDAGraphs: {inner_name or type(inner).__name__} ({type(inner).__name__}) inside {shown} has "
                    f"{', '.join(hooks)}, which a graph would run only at its capture (tensor parallelism's input "
                    "layouts, router replay, another callback's hooks). Remove them (tensor_parallel_size=1 for "
                    "tensor parallelism), or leave that module out of the capture (another scope, or modules=[...])."
                )
            if getattr(inner, "cp_group", None) is not None:
                raise ValueError(
                    f"CUDAGraphs: {inner_name} attends across a context-parallel group, which CUDAGraphs does "
                    "not capture: use context_parallel_size=1, or scope='moe' (the MoE layers only)."
                )
            _check_moe_layer(inner_name, inner, static_dispatch)
        for pname, param in target.named_parameters(prefix=name):
            dims = _mesh_dims(param)
            if dims - _CAPTURABLE_MESH_DIMS:
                if "tp" in dims:
                    raise ValueError(
                        f"CUDAGraphs: {pname} is tensor-parallel (a DTensor over {sorted(dims)}), which CUDAGraphs "
                        "does not capture (nor the MoE layers' token split over TP ranks, which runs from hooks): "
                        "use tensor_parallel_size=1."
                    )
                raise ValueError(_fsdp_message(shown, f"{pname} (a DTensor over {sorted(dims)})"))


def _check_recompute(targets: Sequence[tuple[str, nn.Module]], root: nn.Module | None) -> None:
    """Recomputation inside a captured module frees nothing (the graph's pool keeps its tensors), and
    around one (or through torch.utils.checkpoint inside it) would save and restore the CUDA RNG
    state inside the capture and run the forward again between backward graphs: refused unless
    every recomputed part lies outside every target."""
    if root is not None:
        recomputed = recomputed_parts(root)
    else:
        recomputed = [(f"{name}.{part}" if name and part else name or part, setting)
                      for name, target in targets for part, setting in recomputed_parts(target)]
    for name, _ in targets:
        for part, setting in recomputed:
            if _overlap(part, name):
                fix = ("set recompute_every_n_layers=None" if setting == "recompute_every_n_layers"
                       else f"drop {setting!r} from ModelConfig.recompute")
                raise ValueError(
                    f"CUDAGraphs: {part or 'the model'} is recomputed in backward ({setting!r}) and overlaps the "
                    f"captured {name or 'model'} (a graph's memory pool keeps what the recomputation would free, and "
                    f"torch.utils.checkpoint needs the RNG state, which a capture cannot read): {fix}, or capture "
                    "modules outside it (another scope)."
                )


def static_dispatchers(targets: Sequence[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The dispatchers inside ``targets`` that read their split sizes on the host but have a static
    path a graph can capture (`AllToAllDispatcher.static_budget`)."""
    found: dict[int, Any] = {}
    for _, target in targets:
        for inner in target.modules():
            dispatcher = getattr(inner, "dispatcher", None)
            if getattr(dispatcher, "syncs_host", False) and getattr(dispatcher, "takes_static_budget", False):
                found[id(dispatcher)] = dispatcher
    return list(found.values())


def _check_moe_layer(name: str, module: nn.Module, static_dispatch: bool = False) -> None:
    dispatcher = getattr(module, "dispatcher", None)
    if dispatcher is not None and getattr(dispatcher, "syncs_host", False) and not (
            static_dispatch and getattr(dispatcher, "takes_static_budget", False)):
        static = (" give CUDAGraphs an expert_rank_capacity_factor (the static dropless all-to-all),"
                  if getattr(dispatcher, "takes_static_budget", False) else "")
        raise ValueError(
            f"CUDAGraphs: {name} dispatches with {dispatcher.describe() if hasattr(dispatcher, 'describe') else dispatcher}"
            f", whose dropless path reads its split sizes on the host, which a CUDA graph cannot replay:{static} use "
            "MegatronMoEStrategy(token_dispatcher='allgather') (sync-free and dropless), or a capacity with "
            "padding, MoEConfig(expert_capacity_factor=..., pad_expert_input_to_capacity=True)."
        )
    backend = getattr(getattr(module, "experts", None), "backend", None)
    if dispatcher is not None and backend in ("te", "loop"):
        raise ValueError(
            f"CUDAGraphs: {name}'s experts run expert_backend={backend!r}, which reads the group sizes on the host: "
            "use MoEConfig(expert_backend='grouped_mm') (the default)."
        )


def _fsdp_message(target: str, sharded: str) -> str:
    return (
        f"CUDAGraphs cannot capture {target}: {sharded} is FSDP-sharded (its parameters are gathered by hooks "
        "and freed after each use, so a graph would read stale memory). Use MegatronMoEStrategy(sharding='ddp', "
        "expert_sharding='ddp') for the captured modules, or capture modules outside the sharded units "
        "(scope='moe' with expert_sharding='ddp' keeps dense FSDP)."
    )


def describe_targets(targets: Sequence[tuple[str, nn.Module]], scopes: Sequence[str] = ()) -> str:
    """``"4 x DecoderLayer (model.layers.0 .. model.layers.3)"``-style summary for logs and tables
    (``", the loss included"`` where the reference network's loss is captured with it)."""
    counts: dict[str, int] = {}
    for _, module in targets:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    kinds = ", ".join(f"{n} x {kind}" for kind, n in counts.items())
    names = [n for n, _ in targets]
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    loss = any(routed_method(m, scopes) == "loss" for _, m in targets)
    return f"{kinds} ({span})" + (", the loss included" if loss else "")
