"""`ParallelLayout`: the folded process grid of dense and MoE layers (Parallel Folding).

One world of ``W`` ranks is read as two grids over the same ranks:

* dense (attention, embeddings, dense MLPs): ``tp-cp-dp-pp``, ``W = TP x CP x DP x PP``;
* expert (MoE layers): ``etp-ep-edp-pp``, ``W = ETP x EP x EDP x PP``.

Both grids number ranks like Megatron-Core's default order ``tp-cp-ep-dp-pp``: the
left-most axis varies fastest, ``rank = sum(idx_i * prod(size_j for j < i))``. The
``TP x CP`` block of a pipeline stage is therefore re-read as the ``ETP x EP`` block, which
lets EP exceed DP; pipeline groups are the same in both grids.

Everything except :meth:`ParallelLayout.build_meshes` is pure arithmetic and needs no
process group, so invalid layouts fail before any collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from torch.distributed.device_mesh import DeviceMesh

#: Axes of each grid, fastest-varying first (the rank order of both grids).
DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")

#: Dimension names of the two DeviceMeshes, slowest first (row-major, as torch lays out meshes).
DENSE_MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "etp")

#: Flattened 1-D meshes built by `build_meshes`: name -> (grid, dims it flattens).
#: "dp_cp": FSDP of dense parameters and the loss/gradient average of dense layers.
#: "cp_tp": ranks that split one sequence (token counts for the aux loss, as Megatron's tp-cp group).
#: "ep_etp": all ranks of one expert-parallel block (Megatron's expert tensor-and-model group).
#: "edp_etp": ranks that hold the same experts, as shards (ETP) or replicas (EDP): expert FP8 amax reductions.
_FLATTENED = {
    "dp_cp": ("dense", ("dp", "cp")),
    "cp_tp": ("dense", ("cp", "tp")),
    "ep_etp": ("expert", ("ep", "etp")),
    "edp_etp": ("expert", ("edp", "etp")),
}

_SIZE_ARGUMENTS = {
    "tp": "tensor_parallel_size",
    "cp": "context_parallel_size",
    "pp": "pipeline_parallel_size",
    "ep": "expert_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "dp": "data_parallel_size",
}


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}; pass an int >= 1.")


@dataclass(frozen=True, eq=True, repr=False)
class ParallelLayout:
    """Sizes of every parallel dimension, their validation, rank groups and DeviceMeshes.

    Args:
        world_size: total number of ranks ``W``.
        tensor_parallel_size: TP, ranks splitting each dense weight.
        context_parallel_size: CP, ranks splitting each sequence.
        pipeline_parallel_size: PP, pipeline stages (identical in both grids).
        expert_parallel_size: EP, ranks holding disjoint sets of experts.
        expert_tensor_parallel_size: ETP, ranks splitting each expert's weights (default 1:
            fine-grained experts run best unsplit).
        data_parallel_size: DP of the dense grid; "auto" derives ``W / (PP x TP x CP)``, an
            explicit value must equal it.
        num_experts, num_attention_heads, num_query_groups, expert_ffn_hidden_size: optional
            model sizes; when given, the layout checks that they split evenly.

    The expert data-parallel size is derived: ``EDP = W / (PP x ETP x EP)``.
    """

    world_size: int
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    data_parallel_size: int | Literal["auto"] = "auto"
    num_experts: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    expert_ffn_hidden_size: int | None = None
    expert_data_parallel_size: int = field(init=False)

    def __post_init__(self) -> None:
        _check_positive_int("world_size", self.world_size)
        for axis in ("tp", "cp", "pp", "ep", "etp"):
            _check_positive_int(_SIZE_ARGUMENTS[axis], getattr(self, _SIZE_ARGUMENTS[axis]))
        W = self.world_size
        tp, cp, pp = self.tensor_parallel_size, self.context_parallel_size, self.pipeline_parallel_size
        ep, etp = self.expert_parallel_size, self.expert_tensor_parallel_size

        dense_block = tp * cp * pp
        if W % dense_block:
            raise ValueError(
                f"tensor_parallel_size x context_parallel_size x pipeline_parallel_size = "
                f"{tp} x {cp} x {pp} = {dense_block} does not divide world_size={W}; choose sizes "
                f"whose product divides {W} (data parallelism takes the remaining factor)."
            )
        expert_block = etp * ep * pp
        if W % expert_block:
            raise ValueError(
                f"expert_tensor_parallel_size x expert_parallel_size x pipeline_parallel_size = "
                f"{etp} x {ep} x {pp} = {expert_block} does not divide world_size={W}; choose sizes "
                f"whose product divides {W} (expert data parallelism takes the remaining factor)."
            )
        dp = W // dense_block
        if self.data_parallel_size != "auto":
            _check_positive_int("data_parallel_size", self.data_parallel_size)
            if self.data_parallel_size != dp:
                raise ValueError(
                    f"data_parallel_size={self.data_parallel_size} does not match world_size / "
                    f"(tensor x context x pipeline parallel size) = {W} / {dense_block} = {dp}; pass "
                    f"data_parallel_size='auto' or {dp}, or change the other sizes."
                )
        object.__setattr__(self, "data_parallel_size", dp)
        object.__setattr__(self, "expert_data_parallel_size", W // expert_block)
        # DeviceMeshes of this process, filled by `build_meshes`. Deliberately not a dataclass
        # field: `asdict`, `replace`, `==` and hashing see only the sizes.
        object.__setattr__(self, "_meshes", {})

        checks = (
            ("num_experts", self.num_experts, "expert_parallel_size", ep),
            ("expert_ffn_hidden_size", self.expert_ffn_hidden_size, "expert_tensor_parallel_size", etp),
            ("num_attention_heads", self.num_attention_heads, "tensor_parallel_size", tp),
            ("num_query_groups", self.num_query_groups, "tensor_parallel_size", tp),
        )
        for model_name, model_size, split_name, split in checks:
            if model_size is None:
                continue
            _check_positive_int(model_name, model_size)
            if model_size % split:
                divisors = [d for d in range(1, model_size + 1) if model_size % d == 0 and W % d == 0]
                raise ValueError(
                    f"{split_name}={split} does not divide {model_name}={model_size}; choose "
                    f"{split_name} among the divisors of {model_size} that fit the world size "
                    f"({', '.join(map(str, divisors))}) or change {model_name}."
                )

    # ------------------------------------------------------------------ sizes and groups
    def _sizes(self) -> dict[str, int]:
        return {
            "tp": self.tensor_parallel_size,
            "cp": self.context_parallel_size,
            "dp": self.data_parallel_size,
            "pp": self.pipeline_parallel_size,
            "etp": self.expert_tensor_parallel_size,
            "ep": self.expert_parallel_size,
            "edp": self.expert_data_parallel_size,
        }

    def _parse(self, axis: str) -> tuple[tuple[str, ...], list[bool]]:
        """Resolve ``"dp-cp"`` / ``"dp_cp"`` to (grid axes fastest first, mask of the named ones)."""
        tokens = axis.replace("_", "-").split("-") if isinstance(axis, str) else []
        if not tokens or len(set(tokens)) != len(tokens) or not set(tokens) <= set(DENSE_AXES + EXPERT_AXES):
            raise ValueError(
                f"Unknown axis {axis!r}; use one or more distinct names joined by '-' from the "
                f"dense grid {DENSE_AXES} or from the expert grid {EXPERT_AXES}, e.g. 'dp-cp' or 'ep'."
            )
        if set(tokens) <= set(DENSE_AXES):
            grid = DENSE_AXES
        elif set(tokens) <= set(EXPERT_AXES):
            grid = EXPERT_AXES
        else:
            raise ValueError(
                f"Axis {axis!r} mixes the dense grid {DENSE_AXES} and the expert grid {EXPERT_AXES}; "
                f"combine axes of one grid only (Megatron's expert 'tp-ep' group is 'etp-ep' here)."
            )
        return grid, [name in tokens for name in grid]

    def size(self, axis: str) -> int:
        """Number of ranks in one group of ``axis`` (e.g. ``size("dp-cp") == DP x CP``)."""
        grid, mask = self._parse(axis)
        sizes = self._sizes()
        return math.prod(sizes[name] for name, m in zip(grid, mask) if m)

    def groups(self, axis: str) -> list[list[int]]:
        """All rank groups of ``axis``, like Megatron's ``RankGenerator.get_ranks``.

        ``axis`` is one name or several of one grid joined by '-' (order irrelevant):
        dense ``tp, cp, dp, pp``; expert ``etp, ep, edp, pp``. Groups are listed with the
        fastest remaining axis varying fastest; inside a group, ranks follow the same rule.
        """
        grid, mask = self._parse(axis)
        sizes = self._sizes()
        shape = [sizes[name] for name in grid]
        strides = [math.prod(shape[:i]) for i in range(len(shape))]

        def offsets(keep: bool) -> list[int]:
            # Rank offsets spanned by the (un)masked axes, fastest axis first.
            out = [0]
            for size, stride, m in zip(shape, strides, mask):
                if m == keep:
                    out = [o + i * stride for i in range(size) for o in out]
            return out

        in_group = offsets(True)
        return [[base + o for o in in_group] for base in offsets(False)]

    def coordinates(self, rank: int) -> dict[str, int]:
        """Index of ``rank`` along every axis of both grids (keys tp, cp, dp, pp, etp, ep, edp)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}.")
        sizes = self._sizes()
        coords: dict[str, int] = {}
        for grid in (DENSE_AXES, EXPERT_AXES):
            rest = rank
            for name in grid:
                rest, coords[name] = divmod(rest, sizes[name])
        return coords

    def _index(self, axis: str, rank: int, keep: bool) -> int:
        grid, mask = self._parse(axis)
        sizes, coords = self._sizes(), self.coordinates(rank)
        index, stride = 0, 1
        for name, m in zip(grid, mask):
            if m == keep:
                index += coords[name] * stride
                stride *= sizes[name]
        return index

    def group_index(self, axis: str, rank: int) -> int:
        """Position in ``groups(axis)`` of the group containing ``rank``."""
        return self._index(axis, rank, keep=False)

    def rank_in_group(self, axis: str, rank: int) -> int:
        """Position of ``rank`` inside its ``axis`` group (e.g. the DP rank for the sampler)."""
        return self._index(axis, rank, keep=True)

    def group(self, axis: str, rank: int) -> list[int]:
        """The ``axis`` group that contains ``rank`` (one entry of ``groups(axis)``)."""
        return self.groups(axis)[self.group_index(axis, rank)]

    # ------------------------------------------------------------------ device meshes
    def build_meshes(self, device_type: str) -> ParallelLayout:
        """Create this process's DeviceMeshes; call on every rank after ``init_process_group``.

        One root mesh ``("world",)`` is unflattened into ``("pp", "stage")``, and the stage
        dimension is unflattened twice: into ``("dp", "cp", "tp")`` for the dense mesh and into
        ``("edp", "ep", "etp")`` for the expert mesh. Both meshes thus share one root (DTensor
        placements, FSDP2 and DCP compose across them) and one set of pipeline groups. The
        flattened meshes of ``_FLATTENED`` are created here too, because creating process
        groups is collective: doing it lazily on only some ranks would hang.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if self._meshes:
            if self._meshes["world"].device_type != device_type:
                raise ValueError(
                    f"Meshes were already built for device type "
                    f"{self._meshes['world'].device_type!r}; create a new ParallelLayout for {device_type!r}."
                )
            return self
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ParallelLayout.build_meshes needs the default process group; call "
                "torch.distributed.init_process_group(...) first (the strategy does this in setup)."
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"The process group has {dist.get_world_size()} ranks but the layout was built for "
                f"world_size={self.world_size}; build the ParallelLayout with "
                f"world_size={dist.get_world_size()}."
            )
        s = self._sizes()
        # `_unflatten` registers nothing on the root, so the same stage dim can be unflattened into
        # two shapes; unflattening the stage (not the root twice) creates the pp groups only once.
        # `_flatten` names, by contrast, live in one registry on the root shared by both meshes,
        # and `get_group(name)` consults it before a mesh's own dims: they must differ from every
        # dim name. Slicing a flattened name from the root is deprecated, so we keep references.
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        stage = self.world_size // self.pipeline_parallel_size
        staged = world._unflatten(0, (self.pipeline_parallel_size, stage), ("pp", "stage"))
        dense = staged._unflatten(1, tuple(s[d] for d in DENSE_MESH_DIMS[1:]), DENSE_MESH_DIMS[1:])
        expert = staged._unflatten(1, tuple(s[d] for d in EXPERT_MESH_DIMS[1:]), EXPERT_MESH_DIMS[1:])

        meshes = {"world": world, "stage": staged["stage"], "dense": dense, "expert": expert}
        meshes.update({d: dense[d] for d in DENSE_MESH_DIMS})
        meshes.update({d: expert[d] for d in EXPERT_MESH_DIMS[1:]})
        for name, (grid, dims) in _FLATTENED.items():
            meshes[name] = meshes[grid][dims]._flatten(name)
        self._meshes.update(meshes)
        return self

    def _built(self, name: str) -> DeviceMesh:
        if not self._meshes:
            raise RuntimeError(
                f"The {name!r} mesh does not exist yet; call layout.build_meshes(device_type) on "
                f"every rank after torch.distributed.init_process_group(...)."
            )
        if name not in self._meshes:
            raise KeyError(f"Unknown mesh {name!r}; available meshes: {', '.join(self.mesh_names)}.")
        return self._meshes[name]

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """Names accepted by :meth:`mesh`."""
        return ("world", "stage", "dense", "expert", *DENSE_MESH_DIMS, *EXPERT_MESH_DIMS[1:], *_FLATTENED)

    @property
    def meshes_built(self) -> bool:
        return bool(self._meshes)

    @property
    def dense_mesh(self) -> DeviceMesh:
        """4-D mesh ``("pp", "dp", "cp", "tp")`` of attention and dense layers."""
        return self._built("dense")

    @property
    def expert_mesh(self) -> DeviceMesh:
        """4-D mesh ``("pp", "edp", "ep", "etp")`` of MoE layers, same root as `dense_mesh`."""
        return self._built("expert")

    def mesh(self, name: str) -> DeviceMesh:
        """A mesh by name: "world", "dense", "expert", "stage" (all ranks of this pipeline
        stage), a 1-D slice ("pp", "dp", "cp", "tp", "edp", "ep", "etp") or a flattened mesh
        ("dp_cp", "cp_tp", "ep_etp", "edp_etp")."""
        return self._built(name)

    # ------------------------------------------------------------------ reporting
    def summary_table(self, backends: dict[str, str] | None = None) -> Table:
        """A rich table of the sizes, the two grid orders and the chosen ``backends``."""
        from rich.table import Table

        s = self._sizes()
        table = Table(title="lightning_moe parallel layout", title_justify="left")
        table.add_column("setting", style="bold")
        table.add_column("value")
        table.add_row("world size", str(self.world_size))
        names = {
            "tp": "TP (tensor)",
            "cp": "CP (context)",
            "dp": "DP (data)",
            "pp": "PP (pipeline)",
            "ep": "EP (expert)",
            "etp": "ETP (expert tensor)",
            "edp": "EDP (expert data)",
        }
        for axis, label in names.items():
            table.add_row(label, str(s[axis]))
        table.add_section()
        for label, grid in (("dense grid", DENSE_AXES), ("expert grid", EXPERT_AXES)):
            table.add_row(f"{label} ({'-'.join(grid)})", " x ".join(str(s[a]) for a in grid))
        table.add_row("rank order", "tp-cp-ep-dp-pp, left-most fastest")
        if self.pipeline_parallel_size > 1:
            for stage, ranks in enumerate(self.groups("tp-cp-dp")):
                table.add_row(f"PP stage {stage}", "ranks " + ", ".join(map(str, ranks)))
        if backends:
            table.add_section()
            for piece, backend in backends.items():
                table.add_row(piece, backend)
        return table

    def print_summary(self, backends: dict[str, str] | None = None, console: Console | None = None) -> None:
        """Print :meth:`summary_table` (the strategy calls this once, on rank 0)."""
        from rich.console import Console

        (console or Console()).print(self.summary_table(backends))

    def __repr__(self) -> str:
        s = self._sizes()
        dense = " ".join(f"{a}={s[a]}" for a in DENSE_AXES)
        expert = " ".join(f"{a}={s[a]}" for a in EXPERT_AXES)
        return f"ParallelLayout(world_size={self.world_size}; dense {dense}; expert {expert})"
