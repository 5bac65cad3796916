"""Names and layouts: which HF tensors make each parameter of the reference decoder, and back.

Every parameter of :class:`~lightning_moe.models.decoder.MoEDecoder` has one `TensorSource`:

- `Same`: one HF tensor of the same shape and layout (embeddings, norms, attention, routers).
- `StackedExperts`: the grouped expert weights, stacked from one HF tensor per expert and
  projection. ``fc1_weight [E, D, 2, F]`` holds expert ``e``'s ``gate_proj``/``w1`` ``[F, D]``
  transposed at ``[e, :, 0, :]`` and its ``up_proj``/``w3`` at ``[e, :, 1, :]``;
  ``fc2_weight [E, F, D]`` holds ``down_proj``/``w2`` ``[D, F]`` transposed.
- `RowBlocks`: a weight whose rows are HF tensors one after another (the shared expert's fused
  ``linear_fc1 [2F, D]`` = ``[gate_proj; up_proj]``).
- `InterleavedRope` (``rope_layout``): DeepSeek-V3's attention weights whose rotary rows are
  interleaved in the checkpoint.

`buffer_sources` does the same for the router state an architecture stores (DeepSeek-V3's
``e_score_correction_bias``, our ``expert_bias``).

``read_into(checkpoint, box, out)`` fills ``out`` with the slice ``box`` of the parameter (its
global indices) from only the matching slices of the HF tensors, one HF slice at a time: every
rank of a sharded model reads just what it holds, and no more than one HF tensor is in flight
beside the model. ``to_hf(full)`` splits a whole parameter into its HF tensors for export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from torch import Tensor

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.hf.reader import HFCheckpointError, SafetensorsCheckpoint
from lightning_moe.models.hf.rope_layout import InterleavedRope


class TensorSource(Protocol):
    def hf_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """HF name -> shape that a parameter of global ``shape`` is made of."""

    def read_into(self, checkpoint: SafetensorsCheckpoint, box: Sequence[slice], out: Tensor) -> None:
        """Copy the slice ``box`` of the parameter, read from ``checkpoint``, into ``out``."""

    def to_hf(self, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        """The HF tensors of the whole parameter ``full``."""


@dataclass(frozen=True)
class Same:
    name: str

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        return {self.name: tuple(shape)}

    def read_into(self, checkpoint: SafetensorsCheckpoint, box: Sequence[slice], out: Tensor) -> None:
        out.copy_(checkpoint.read(self.name, box))

    def to_hf(self, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        yield self.name, full


@dataclass(frozen=True)
class StackedExperts:
    """``names[e][p]``: the HF ``[N, K]`` tensor of expert ``e`` and part ``p`` of a parameter laid
    out ``[E, K, P, N]`` (``P`` parts: gate and up) or, with ``parts=False``, ``[E, K, N]``."""

    names: tuple[tuple[str, ...], ...]
    parts: bool

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        k, n = shape[1], shape[-1]
        return {name: (n, k) for per_expert in self.names for name in per_expert}

    def read_into(self, checkpoint: SafetensorsCheckpoint, box: Sequence[slice], out: Tensor) -> None:
        experts, k_rows, n_cols = box[0], box[1], box[-1]
        parts = box[2] if self.parts else slice(0, 1)
        for e in range(experts.start, experts.stop):
            for p in range(parts.start, parts.stop):
                # HF stores [N, K]: read the transposed box, copy it transposed into our [K, N]
                block_NK = checkpoint.read(self.names[e][p], (n_cols, k_rows))
                target_KN = out[e - experts.start, :, p - parts.start] if self.parts else out[e - experts.start]
                target_KN.copy_(block_NK.T)

    def to_hf(self, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        for e, per_expert in enumerate(self.names):
            for p, name in enumerate(per_expert):
                weight_KN = full[e, :, p, :] if self.parts else full[e]
                yield name, weight_KN.T.contiguous()


@dataclass(frozen=True)
class RowBlocks:
    """A ``[sum(rows), K]`` parameter whose consecutive row blocks are the HF tensors ``names``."""

    names: tuple[str, ...]

    def hf_shapes(self, shape: Sequence[int]) -> dict[str, tuple[int, ...]]:
        rows = shape[0] // len(self.names)
        return {name: (rows, *shape[1:]) for name in self.names}

    def read_into(self, checkpoint: SafetensorsCheckpoint, box: Sequence[slice], out: Tensor) -> None:
        start = 0
        for name in self.names:
            rows = checkpoint.shape(name)[0]
            lo, hi = max(box[0].start, start), min(box[0].stop, start + rows)
            if lo < hi:
                block = checkpoint.read(name, (slice(lo - start, hi - start), *box[1:]))
                out[lo - box[0].start : hi - box[0].start].copy_(block)
            start += rows

    def to_hf(self, full: Tensor) -> Iterator[tuple[str, Tensor]]:
        for name, block in zip(self.names, full.chunk(len(self.names))):
            yield name, block.contiguous()


def _expert_names(arch: str) -> tuple[str, str, str, str]:
    """(MoE block name under ``model.layers.{i}``, gate, up, down projection names) of ``arch``."""
    if arch == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def parameter_sources(cfg: ModelConfig, arch: str) -> dict[str, TensorSource]:
    """Our parameter name -> its `TensorSource` in an HF ``arch`` checkpoint of ``cfg``."""
    sources: dict[str, TensorSource] = {
        "embed_tokens.weight": Same("model.embed_tokens.weight"),
        "norm.weight": Same("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        sources["lm_head.weight"] = Same("lm_head.weight")
    block, gate, up, down = _expert_names(arch)
    for i, is_moe in enumerate(cfg.moe_layer_pattern):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        sources[f"{ours}.attention_norm.weight"] = Same(f"{theirs}.input_layernorm.weight")
        sources[f"{ours}.mlp_norm.weight"] = Same(f"{theirs}.post_attention_layernorm.weight")
        if cfg.attention_type == "mla":
            sources.update(_latent_attention_sources(cfg, f"{ours}.attention", f"{theirs}.self_attn"))
        else:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                sources[f"{ours}.attention.{proj}.weight"] = Same(f"{theirs}.self_attn.{proj}.weight")
        if cfg.add_qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                sources[f"{ours}.attention.{proj}.bias"] = Same(f"{theirs}.self_attn.{proj}.bias")
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                sources[f"{ours}.attention.{norm}.weight"] = Same(f"{theirs}.self_attn.{norm}.weight")
        if not is_moe:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                sources[f"{ours}.mlp.{proj}.weight"] = Same(f"{theirs}.mlp.{proj}.weight")
            continue
        moe = f"{theirs}.{block}"
        experts = range(cfg.moe.num_experts)
        sources[f"{ours}.mlp.router.weight"] = Same(f"{moe}.gate.weight")
        sources[f"{ours}.mlp.experts.fc1_weight"] = StackedExperts(
            tuple((f"{moe}.experts.{e}.{gate}.weight", f"{moe}.experts.{e}.{up}.weight") for e in experts), parts=True
        )
        sources[f"{ours}.mlp.experts.fc2_weight"] = StackedExperts(
            tuple((f"{moe}.experts.{e}.{down}.weight",) for e in experts), parts=False
        )
        if cfg.moe.shared_expert_intermediate_size is not None:
            shared = f"{moe}.shared_experts" if arch == "deepseek_v3" else f"{moe}.shared_expert"
            sources[f"{ours}.mlp.shared_experts.linear_fc1.weight"] = RowBlocks(
                (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight")
            )
            sources[f"{ours}.mlp.shared_experts.linear_fc2.weight"] = Same(f"{shared}.down_proj.weight")
            if cfg.moe.shared_expert_gate:
                sources[f"{ours}.mlp.shared_experts.gate_weight"] = Same(f"{moe}.shared_expert_gate.weight")
    return sources


def _latent_attention_sources(cfg: ModelConfig, ours: str, theirs: str) -> dict[str, TensorSource]:
    """DeepSeek-V3's MLA: the same names; the rotary rows of the query up-projection (per head)
    and of ``kv_a_proj_with_mqa`` (after the latent) are interleaved in the checkpoint."""
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_up = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
    sources: dict[str, TensorSource] = {
        f"{ours}.{q_up}.weight": InterleavedRope(f"{theirs}.{q_up}.weight", nope + rope, nope, rope),
        f"{ours}.kv_a_proj_with_mqa.weight": InterleavedRope(
            f"{theirs}.kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + rope, cfg.kv_lora_rank, rope
        ),
    }
    same = ["kv_a_layernorm", "kv_b_proj", "o_proj"]
    if cfg.q_lora_rank is not None:
        same += ["q_a_proj", "q_a_layernorm"]
    for name in same:
        sources[f"{ours}.{name}.weight"] = Same(f"{theirs}.{name}.weight")
    return sources


def buffer_sources(cfg: ModelConfig, arch: str) -> dict[str, TensorSource]:
    """Our buffer name -> its `TensorSource`, for the router state ``arch`` checkpoints hold."""
    if arch != "deepseek_v3":
        return {}
    return {
        f"layers.{i}.mlp.router.expert_bias": Same(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        for i, is_moe in enumerate(cfg.moe_layer_pattern)
        if is_moe
    }


def check_against_checkpoint(
    sources: dict[str, TensorSource], shapes: dict[str, Sequence[int]], checkpoint: SafetensorsCheckpoint,
    ignorable: frozenset[str] = frozenset(),
) -> None:
    """Before anything is read: every parameter has its source, every HF tensor it needs exists
    with the expected shape, and no HF tensor is left over (all from the headers)."""
    missing = sorted(set(shapes) - set(sources))
    if missing:
        raise HFCheckpointError(f"no HF tensor is mapped to the model's parameters {missing[:5]}.")
    needed: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        needed.update(sources[name].hf_shapes(shape))
    available = checkpoint.names()
    absent = sorted(set(needed) - available)
    if absent:
        raise HFCheckpointError(
            f"{checkpoint.path} lacks {len(absent)} tensor(s) the model needs, e.g. {absent[:3]}: "
            "does config.json describe these weights?"
        )
    wrong = [f"{n}: {list(checkpoint.shape(n))} (expected {list(s)})" for n, s in needed.items()
             if tuple(checkpoint.shape(n)) != tuple(s)]
    if wrong:
        raise HFCheckpointError(f"{checkpoint.path} has tensors of unexpected shape: {'; '.join(wrong[:3])}.")
    unused = sorted(available - set(needed) - ignorable)
    if unused:
        raise HFCheckpointError(
            f"{checkpoint.path} holds {len(unused)} tensor(s) the model would ignore, e.g. {unused[:3]}: "
            "the config does not describe the weights (or the architecture has parts this decoder lacks)."
        )
