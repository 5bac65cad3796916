"""`ActivationOffload`: tensors saved for backward by chosen parts of each layer go to host memory.

During the forward, the tensors that the named parts of a layer save for backward are copied to
pinned host memory on a side stream, so their device memory is freed as soon as the forward no
longer needs it; during the backward they are copied back on another side stream, started when
the backward reaches the layer ``prefetch_layers`` after theirs, so the copies overlap the
compute of the later layers. CUDA events order the copies against the compute streams; nothing
waits on the host (no device-to-host sync). On a CPU device the same path runs without streams
(copies to separate CPU tensors), which is what the CPU tests check.

Part names (Megatron-Core's ``--offload-modules`` where they apply to the reference decoder):

=================  =====================================================================
``attn_norm``      ``attention_norm`` (its input, the residual stream)
``qkv_linear``     the projections reading the normed input: ``q_proj``, ``k_proj``, ``v_proj``
                   (MLA: ``q_proj`` or ``q_a_proj``, ``kv_a_proj_with_mqa``)
``core_attn``      the attention product (``core_attention``: q, k, v, output and statistics)
``attn_proj``      ``attention.o_proj`` (the attention output)
``mlp_norm``       ``mlp_norm``
``expert_fc1``     the experts' first GEMM (its input, the permuted tokens)
``moe_act``        the experts' activation (its input, fc1's output); FP8 experts that fuse the
                   SwiGLU into fc2's cast offload what that saves, FP8 bytes as FP8 bytes
=================  =====================================================================

Other entries: an ``nn.Module`` subclass (every instance) or a pattern on qualified module names
(``fnmatch``, e.g. ``"*.shared_experts"``) for one's own models.

Not offloaded: parameters and tensors made from them by views and casts (they live with the
weights), tensors below ``min_offload_bytes``, tensor subclasses other than DTensor, views that do
not cover a dense block of memory, and anything saved inside an activation-checkpointed region
(recomputed instead). Layers are the children of the model's outermost ``ModuleList`` /
``ModuleDict`` holding a matched part (the reference decoder's ``layers``).

With recomputation (``ModelConfig.recompute``, ``recompute_every_n_layers``) a part is offloaded
only where the recomputation leaves it tensors of its own to store; where both would handle the
same tensors, `attach` refuses the pair, naming it (keep one of the two for that part):

- ``attn_norm`` / ``mlp_norm`` with ``layernorm`` (the norm runs inside its recomputation),
- ``qkv_linear`` with ``layernorm`` (the projections' input is the recomputed norm output),
- ``qkv_linear`` with ``mla_up_proj`` where MLA's ``q_proj`` is full-rank (it runs inside the
  recomputed up-projection),
- ``expert_fc1`` / ``moe_act`` (any part inside the MoE block or dense MLP) with ``moe`` / ``mlp``,
  parts inside the shared experts with ``shared_experts``.

Parts inside the blocks that ``recompute_every_n_layers`` recomputes whole are left alone (those
blocks keep only their input; a notice says so), and where that leaves no part at all (``N = 1``)
`attach` refuses. Offloading such a block itself, by name, stores its input, which is what its
checkpoint keeps.

Every other pair works: e.g. ``core_attn`` with ``core_attn`` offloads q, k, v (what the
recomputation keeps), ``moe_act`` with ``moe_act`` offloads the activation's input (fc1's output,
what its recomputation keeps; it comes back for the recomputation, and the activation's output is
recomputed instead of kept: Megatron-Core's pairing, which leaves the bf16 experts nothing on the
device between forward and backward with ``expert_fc1``), ``expert_fc1`` with ``moe_act``, the
norms and projections with ``moe``.

Not with pipeline parallelism (``pipeline_parallel_size > 1``): the copies are grouped per layer,
and a pipeline schedule keeps several micro-batches of a layer in flight.
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_moe.callbacks._layout import refuse_pipeline_parallelism
from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.nn.saved_tensors import (
    SavedTensorPolicy,
    parameter_derived,
    policies_allowed,
    saved_tensor_policy,
    set_region_context,
)

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
# Megatron names -> patterns on the reference decoder's qualified module names
_NAME_PATTERNS = {
    "attn_norm": ("*attention_norm",),
    "qkv_linear": ("*attention.q_proj", "*attention.k_proj", "*attention.v_proj", "*attention.q_a_proj",
                   "*attention.kv_a_proj_with_mqa"),
    "core_attn": ("*attention.core_attention",),
    "attn_proj": ("*attention.o_proj",),
    "mlp_norm": ("*mlp_norm",),
}
_REGIONS = ("expert_fc1", "moe_act")  # memory regions of GroupedExperts (lightning_moe.nn.saved_tensors)

ModuleSpec = Union[str, type]


def _dense_layout(t: Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without gaps or overlaps (any dim order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _within(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def _recompute_overlap(model: nn.Module, name: str, region: Optional[str]) -> Optional[tuple[str, str]]:
    """(the recompute setting, why) where the reference decoder's recomputation takes away what
    the part ``name`` (``region``: a memory region of it) would offload; None where both work."""
    modules = dict(model.named_modules())
    pieces = name.split(".") if name else []
    for depth in range(len(pieces) + 1):
        outer = ".".join(pieces[:depth])
        module = modules.get(outer)
        if module is None:
            continue
        inner = outer != name  # the part lies strictly inside ``module``
        prefix = f"{outer}." if outer else ""
        if inner and getattr(module, "recompute_layer", False) is True:
            return "recompute_every_n_layers", f"block {outer} is recomputed whole and keeps only its input"
        names = getattr(module, "recompute", None)
        if isinstance(names, (set, frozenset)):
            if "layernorm" in names and any(_within(name, prefix + n) for n in ("attention_norm", "mlp_norm")):
                return "layernorm", "the norm runs inside its recomputation"
            if "layernorm" in names and name in {f"{prefix}attention.{p}" for p in _QKV_PROJECTIONS}:
                return "layernorm", "its input, the norm's output, is recomputed instead of stored"
            block = "moe" if getattr(module, "is_moe", False) else "mlp"
            if block in names and _within(name, prefix + "mlp"):
                return block, "the block runs inside its recomputation"
        if inner and names is True:  # AttentionCore.recompute
            return "core_attn", "the attention product runs inside its recomputation"
        if getattr(module, "recompute_shared_experts", False) is True and _within(name, prefix + "shared_experts"):
            return "shared_experts", "the shared experts run inside their recomputation"
        if getattr(module, "recompute_up_proj", False) is True and any(
                _within(name, prefix + n) for n in ("q_proj", "q_b_proj", "kv_a_layernorm", "kv_b_proj")):
            return "mla_up_proj", "it runs inside the recomputed up-projection"
    return None


_QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa")


Part = tuple[str, nn.Module, Optional[str]]


def _without_recomputed(model: nn.Module, parts: list[Part], specs: dict[tuple[str, Optional[str]], str]) -> list[Part]:
    """``parts`` less those inside blocks recomputed whole (with a notice; ``ValueError`` where none
    is left); ``ValueError`` naming the pair for a part that overlaps a selective recomputation."""
    kept, skipped = [], []
    for name, module, region in parts:
        overlap = _recompute_overlap(model, name, region)
        if overlap is None:
            kept.append((name, module, region))
            continue
        setting, why = overlap
        if setting == "recompute_every_n_layers":
            skipped.append(name)
            continue
        spec = specs.get((name, region), name)
        where = f"{name}'s {region}" if region else name
        raise ValueError(
            f"ActivationOffload: {spec!r} ({where}) overlaps ModelConfig.recompute {setting!r}: {why}, so offloading "
            f"it stores nothing or copies for nothing. Keep one of the two: drop {spec!r} from ActivationOffload or "
            f"{setting!r} from ModelConfig.recompute."
        )
    if skipped and not kept:
        raise ValueError(
            "ActivationOffload: every part named lies in a block recomputed whole (recompute_every_n_layers), which "
            "keeps only its input: nothing to offload. Keep one of the two: set recompute_every_n_layers=None (or "
            "N > 1), or drop the callback (or offload the blocks themselves, by name)."
        )
    if skipped:
        rank_zero_info(f"ActivationOffload: {len(skipped)} parts in blocks recomputed whole (recompute_every_n_layers) "
                       "are left alone: those blocks keep only their input.")
    return kept


class _Copy:
    """One offloaded tensor: its host copy, and once fetched, its device copy."""

    __slots__ = ("host", "device", "meta", "d2h_done", "ready", "uses", "__weakref__")

    def __init__(self, host: Tensor, device: torch.device, meta: Any, d2h_done: Any) -> None:
        self.host: Optional[Tensor] = host
        self.device = device
        self.meta = meta  # (None or a DTensor's (mesh, placements, shape, stride), the tensor's dtype)
        self.d2h_done = d2h_done  # CUDA event after the host copy (None on CPU)
        self.ready: Optional[tuple[Tensor, Any]] = None  # (device copy, CUDA event or None)
        self.uses = 0


class _LayerGroup(SavedTensorPolicy):
    """The offload policy of one forward of one layer: packs that layer's claimed tensors."""

    def __init__(self, owner: "ActivationOffload", index: int) -> None:
        self.owner, self.index = owner, index
        self.copies: list[weakref.ref[_Copy]] = []
        # one copy per memory block saved several times in this forward (autocast's or F.linear's views of
        # one input): keyed by storage, shape, strides and dtype; the tensor is held until the layer's
        # forward ends so that its storage cannot be reused under the key meanwhile
        self._recent: dict[tuple, tuple[Tensor, _Copy]] = {}
        self.fetched = False

    def pack(self, tensor: Tensor) -> Optional[_Copy]:
        owner = self.owner
        if not owner._eligible(tensor):
            return None
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's own data_ptr is not its memory's
        key = (local.data_ptr(), local.shape, local.stride(), tensor.dtype, getattr(tensor, "placements", None))
        seen = self._recent.get(key)
        if seen is not None:
            seen[1].uses += 1
            return seen[1]
        copy = owner._to_host(tensor)
        copy.uses = 1
        self._recent[key] = (tensor, copy)
        self.copies.append(weakref.ref(copy))
        return copy

    def unpack(self, copy: _Copy) -> Tensor:
        owner = self.owner
        if copy.ready is None:
            owner._prefetch_from(self.index)  # not prefetched (the backward got here first)
        if copy.ready is None:
            if copy.host is None:
                raise RuntimeError("ActivationOffload: this saved tensor was released after its use; a second "
                                   "backward through the same graph (retain_graph=True) is not supported.")
            owner._to_device(copy)
        return owner._take(copy)

    def end_forward(self) -> None:
        self._recent.clear()

    def fetch(self) -> None:
        """Start the copies back of every tensor of this group still held by the graph."""
        self.fetched = True
        self._recent.clear()
        for ref in self.copies:
            copy = ref()
            if copy is not None and copy.ready is None and copy.host is not None:
                self.owner._to_device(copy)


class ActivationOffload(Callback):
    """Offload the tensors that parts of each layer save for backward to host memory.

    Args:
        modules: the parts: names from ``OFFLOAD_MODULES`` ("attn_norm", "qkv_linear", "core_attn",
            "attn_proj", "mlp_norm", "expert_fc1", "moe_act"), ``nn.Module`` subclasses, or
            ``fnmatch`` patterns on qualified module names.
        keep_last_layers: the last layers of the forward keep their tensors on the device (the
            backward needs them first, with nothing to overlap their copies with). Default 1.
        prefetch_layers: when the backward reaches layer ``i``, the tensors of layers ``i - 1`` ..
            ``i - prefetch_layers`` start coming back (at least 1). Default 1.
        min_offload_bytes: smaller tensors stay on the device (copies of small tensors cost more in
            launches than they free). Default 1 MiB.
        pin_memory: host copies in pinned memory (asynchronous copies; CUDA only). Default True.

    ``live_host_bytes`` is the host memory held now; ``offloaded_bytes`` the bytes copied out since
    the last training batch started. Use `attach` / `detach` directly in a loop without a Trainer.
    Not with the CUDA-graph callback (captured graphs cannot run the copies), nor inside a region
    checkpointed by ``torch.utils.checkpoint`` directly (use ``ModelConfig.recompute`` or
    `lightning_moe.nn.saved_tensors.checkpoint`, whose regions are left alone).
    """

    def __init__(self, modules: Sequence[ModuleSpec], keep_last_layers: int = 1, prefetch_layers: int = 1,
                 min_offload_bytes: int = 1 << 20, pin_memory: bool = True) -> None:
        if isinstance(modules, (str, type)) or not modules:
            raise ValueError(f"ActivationOffload(modules={modules!r}): give a non-empty list of part names "
                             f"({', '.join(OFFLOAD_MODULES)}), module classes or name patterns.")
        for spec in modules:
            if not isinstance(spec, (str, type)) or (isinstance(spec, type) and not issubclass(spec, nn.Module)):
                raise TypeError(f"ActivationOffload: {spec!r} is neither a part name, a name pattern nor an "
                                "nn.Module subclass.")
        for name, value, low in (("keep_last_layers", keep_last_layers, 0), ("prefetch_layers", prefetch_layers, 1),
                                 ("min_offload_bytes", min_offload_bytes, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ActivationOffload({name}={value!r}): an int >= {low}.")
        self.modules = list(modules)
        self.keep_last_layers = keep_last_layers
        self.prefetch_layers = prefetch_layers
        self.min_offload_bytes = min_offload_bytes
        self.pin_memory = pin_memory
        self.live_host_bytes = 0
        self.offloaded_bytes = 0
        self._handles: list[RemovableHandle] = []
        self._regions: list[tuple[nn.Module, str]] = []
        self._groups: dict[int, _LayerGroup] = {}
        self._active: list[Any] = []  # open policy contexts of the parts now running
        self._streams: Optional[tuple[Any, Any]] = None  # (device-to-host, host-to-device) CUDA streams
        self._num_layers = 0
        self._specs: dict[tuple[str, Optional[str]], str] = {}  # part -> the entry of ``modules`` that named it

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        refuse_pipeline_parallelism(trainer, "ActivationOffload", "its copies are grouped per layer, and a "
                                    "pipeline schedule keeps several micro-batches of a layer in flight")
        graphs = [type(cb).__name__ for cb in trainer.callbacks if type(cb).__name__ == "CUDAGraphs"]
        if graphs:
            raise ValueError(
                "ActivationOffload cannot run with the CUDAGraphs callback: a captured graph replays fixed kernels "
                "and cannot run the copies to and from host memory. Drop one of the two callbacks (or capture only "
                "layers whose parts are not offloaded and pass the others to ActivationOffload by name)."
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.attach(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.detach()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.detach()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.offloaded_bytes = 0

    # ------------------------------------------------------------------ installation
    def attach(self, model: nn.Module) -> "ActivationOffload":
        """Install the hooks on ``model``'s matching parts; raises where a name matches nothing, or
        where a part overlaps the model's recomputation (see the module docstring)."""
        self.detach()
        parts = self._matching_parts(model)
        layers = self._layers(model, [name for name, _, _ in parts])
        parts = _without_recomputed(model, parts, self._specs)
        self._num_layers = len(layers)
        layer_of = {}
        for index, (name, module) in enumerate(layers):
            layer_of[name] = index
            self._handles.append(module.register_forward_pre_hook(self._layer_start(index)))
            self._handles.append(module.register_forward_hook(self._layer_end(index)))
        for name, module, region in parts:
            index = self._layer_index(name, layer_of)
            if index >= self._num_layers - self.keep_last_layers:
                continue
            if region is None:
                self._handles.append(module.register_forward_pre_hook(self._enter(index)))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))
            else:
                set_region_context(module, region, self._region_context(index))
                self._regions.append((module, region))
        return self

    def detach(self) -> None:
        """Remove every hook `attach` installed."""
        for handle in self._handles:
            handle.remove()
        for module, region in self._regions:
            set_region_context(module, region, None)
        self._handles, self._regions, self._groups = [], [], {}

    def _matching_parts(self, model: nn.Module) -> list[tuple[str, nn.Module, Optional[str]]]:
        """(qualified name, module, memory region or None) of every part to offload."""
        named = list(model.named_modules())
        parts: dict[tuple[str, Optional[str]], nn.Module] = {}
        self._specs = {}
        for spec in self.modules:
            found = []
            if isinstance(spec, type):
                found = [(n, m, None) for n, m in named if isinstance(m, spec)]
            elif spec in _REGIONS:
                found = [(n, m, spec) for n, m in named if isinstance(m, GroupedExperts)]
            else:
                patterns = _NAME_PATTERNS.get(spec, (spec,))
                found = [(n, m, None) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
            if not found:
                raise ValueError(
                    f"ActivationOffload: {spec!r} matches no module of {type(model).__name__}. Use a part name of the "
                    f"reference decoder ({', '.join(OFFLOAD_MODULES)}), one of your nn.Module classes, or a pattern on "
                    "qualified module names (e.g. '*.shared_experts')."
                )
            for name, module, region in found:
                parts[(name, region)] = module
                self._specs.setdefault((name, region), spec.__name__ if isinstance(spec, type) else spec)
        return [(name, module, region) for (name, region), module in parts.items()]

    @staticmethod
    def _layers(model: nn.Module, part_names: list[str]) -> list[tuple[str, nn.Module]]:
        """The children of the outermost ModuleList/ModuleDict holding a part, in order; else the parts."""
        for name, module in model.named_modules():
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                prefix = f"{name}." if name else ""
                children = [(f"{prefix}{child}", m) for child, m in module.named_children()]
                if any(p == c or p.startswith(c + ".") for p in part_names for c, _ in children):
                    return children
        modules = dict(model.named_modules())
        return [(name, modules[name]) for name in dict.fromkeys(part_names)]

    @staticmethod
    def _layer_index(part: str, layer_of: dict[str, int]) -> int:
        for layer, index in layer_of.items():
            if part == layer or part.startswith(layer + "."):
                return index
        return -1  # outside every layer (e.g. a final norm): offloaded, never prefetched early

    # ------------------------------------------------------------------ forward hooks
    def _layer_start(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if policies_allowed():
                self._groups[index] = _LayerGroup(self, index)
        return hook

    def _layer_end(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            group = self._groups.get(index)
            if group is not None:
                group.end_forward()
            if isinstance(output, Tensor) and output.requires_grad and policies_allowed():
                # the backward reaches this layer: bring back the layers before it
                output.register_hook(lambda grad: self._prefetch_from(index))
        return hook

    def _group(self, index: int) -> _LayerGroup:
        group = self._groups.get(index)
        if group is None:
            group = self._groups[index] = _LayerGroup(self, index)
        return group

    def _enter(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            # a part outside every layer gets a group of its own per call (fetched when first used)
            group = self._group(index) if index >= 0 else _LayerGroup(self, index)
            context = saved_tensor_policy(group)
            context.__enter__()
            self._active.append((context, group))
        return hook

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active:
            context, group = self._active.pop()
            context.__exit__(None, None, None)
            if group.index < 0:
                group.end_forward()

    def _region_context(self, index: int):
        @contextlib.contextmanager
        def region() -> Iterator[None]:
            group = self._group(index) if index >= 0 else _LayerGroup(self, index)
            with saved_tensor_policy(group):
                yield
            if index < 0:
                group.end_forward()
        return region

    # ------------------------------------------------------------------ copies
    def _eligible(self, t: Tensor) -> bool:
        if type(t) not in (Tensor, nn.Parameter):
            from torch.distributed.tensor import DTensor

            if not isinstance(t, DTensor):
                return False
            local = t._local_tensor
        else:
            local = t
        return (local.numel() * local.element_size() >= max(self.min_offload_bytes, 1)
                and _dense_layout(local) and not parameter_derived(t))

    def _cuda_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def _to_host(self, t: Tensor) -> _Copy:
        meta = None
        if type(t) not in (Tensor, nn.Parameter):  # a DTensor (`_eligible`)
            meta = (t.device_mesh, t.placements, t.shape, t.stride())
            t = t._local_tensor
        src = t.detach()
        if src.dtype.itemsize == 1 and src.is_floating_point():
            src = src.view(torch.uint8)  # FP8: copied as its bytes
        pin = self.pin_memory and src.is_cuda
        host = torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu", pin_memory=pin)
        done = None
        if src.is_cuda:
            d2h, _ = self._cuda_streams()
            d2h.wait_stream(torch.cuda.current_stream(src.device))  # the tensor is written on the compute stream
            with torch.cuda.stream(d2h):
                host.copy_(src, non_blocking=pin)
                done = torch.cuda.Event()
                done.record(d2h)
            src.record_stream(d2h)  # its memory is reused only once the copy has read it
        else:
            host.copy_(src)
        nbytes = host.numel() * host.element_size()
        self.live_host_bytes += nbytes
        self.offloaded_bytes += nbytes
        weakref.finalize(host, self._released, nbytes)
        return _Copy(host, t.device, (meta, t.dtype), done)

    def _released(self, nbytes: int) -> None:
        self.live_host_bytes -= nbytes

    def _to_device(self, copy: _Copy) -> None:
        host = copy.host
        ready = None
        if copy.device.type == "cuda":
            _, h2d = self._cuda_streams()
            # Allocated on the compute stream, which uses and frees it: the caching allocator returns a
            # freed block to the pool of the stream that allocated it, so a block allocated on the copy
            # stream could be reused only by later copies, never by the compute stream. The copy stream
            # first waits for the compute stream's work queued so far (the block may have been freed by
            # it with kernels still reading it), and `record_stream` keeps the block from being handed
            # out again before the copy into it is done (when the tensor is dropped unused).
            compute = torch.cuda.current_stream(copy.device)
            dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=copy.device)
            h2d.wait_stream(compute)
            dev.record_stream(h2d)
            with torch.cuda.stream(h2d):
                h2d.wait_event(copy.d2h_done)
                dev.copy_(host, non_blocking=host.is_pinned())
                ready = torch.cuda.Event()
                ready.record(h2d)
        else:
            dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=copy.device)
            dev.copy_(host)
        copy.ready = (dev, ready)

    def _take(self, copy: _Copy) -> Tensor:
        dev, ready = copy.ready
        if ready is not None:
            stream = torch.cuda.current_stream(dev.device)
            stream.wait_event(ready)  # the compute stream waits for the copy; the host does not
            dev.record_stream(stream)  # a no-op on the stream that allocated it; needed on any other
        copy.uses -= 1
        if copy.uses <= 0:  # the last saved use: the host copy is released, the device copy goes with autograd
            copy.host, copy.ready = None, None
        dtensor_meta, dtype = copy.meta
        out = dev.view(dtype) if dev.dtype != dtype else dev
        if dtensor_meta is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = dtensor_meta
            out = DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=stride)
        return out

    def _prefetch_from(self, index: int) -> None:
        """Bring back layer ``index`` (where not already) and the ``prefetch_layers`` before it."""
        for i in range(index, index - self.prefetch_layers - 1, -1):
            group = self._groups.get(i)
            if group is not None and not group.fetched:
                group.fetch()
