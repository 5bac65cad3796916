"""Moving weights between an HF checkpoint and a (possibly parallelized) reference decoder.

`load_hf_weights` runs on every rank after a strategy has parallelized the model: for each
parameter it takes the block of global indices this rank holds (the whole tensor for a plain
parameter; for a DTensor, sharded over experts (EP), tensor-parallel ranks and FSDP alike, the
box DTensor's placements give) and reads just that block from the HF tensors, into the local
shard, in place. No rank holds more of the checkpoint than one parameter's local block.

`save_hf_weights` gathers one parameter at a time (``full_tensor()``, a collective every rank
joins in the same order), splits it into its HF tensors and hands them to rank 0's
`ShardedSafetensorsWriter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_moe.models.decoder import MoEDecoder
from lightning_moe.models.hf.config_mapping import hf_config_dict
from lightning_moe.models.hf.reader import HFCheckpointError, SafetensorsCheckpoint
from lightning_moe.models.hf.tensor_mapping import buffer_sources, check_against_checkpoint, parameter_sources
from lightning_moe.models.hf.writer import DEFAULT_MAX_SHARD_BYTES, ShardedSafetensorsWriter, shard_size_bytes

# HF tensors that carry no weights of their own: a tied output projection some checkpoints
# store anyway, rotary tables older checkpoints saved.
_TIED_OUTPUT = "lm_head.weight"


def local_block(param: Tensor) -> tuple[Tensor, tuple[slice, ...]]:
    """This rank's local tensor of ``param`` and the global indices it holds (one slice per dim)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, size) for size in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} differs from its placements' block {tuple(shape)}.")
    return local, tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _ignorable(model: MoEDecoder, checkpoint: SafetensorsCheckpoint, arch: str) -> frozenset[str]:
    names = {n for n in checkpoint.names() if n.endswith("rotary_emb.inv_freq")}
    if arch == "deepseek_v3":
        # DeepSeek-V3's multi-token-prediction module is stored as the layers after the last
        # block (model.layers.61 in the released checkpoint); the decoder has no such module.
        for name in checkpoint.names():
            parts = name.split(".")
            if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= model.config.num_layers:
                names.add(name)
    if model.config.tie_word_embeddings:
        names.add(_TIED_OUTPUT)
    return frozenset(names)


@torch.no_grad()
def load_hf_weights(model: MoEDecoder, path: str | Path, arch: str) -> int:
    """Fill every parameter of ``model`` (built from the checkpoint's config) from the HF
    checkpoint at ``path``, reading only this rank's blocks; returns the bytes read.

    Router state buffers are reset (zero counts, zero expert bias), then the expert bias is read
    where the architecture stores one (DeepSeek-V3's ``e_score_correction_bias``). Raises
    `HFCheckpointError` before reading anything when the checkpoint lacks a tensor, has one of
    another shape, or holds one the model would ignore.
    """
    _refuse_pipeline_stage(model, "load_hf_weights (from_hf(materialize=False))", "use "
                           "MoELanguageModel.from_hf(path, materialize=True), which reads the weights into the whole "
                           "model before the strategy splits it")
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        raise RuntimeError("load_hf_weights needs materialized parameters (to_empty() the meta model first).")
    stored_buffers = buffer_sources(model.config, arch)
    sources = {**parameter_sources(model.config, arch), **stored_buffers}
    buffers = dict(model.named_buffers())
    tensors = {**params, **{name: buffers[name] for name in stored_buffers}}
    with SafetensorsCheckpoint(path) as checkpoint:
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        check_against_checkpoint(sources, shapes, checkpoint, _ignorable(model, checkpoint, arch))
        for moe in model.moe_layers():  # before reading: a checkpoint may hold the expert bias
            moe.router.reset_step_state()
            if moe.router.expert_bias is not None:
                moe.router.expert_bias.zero_()
        for name, tensor in tensors.items():
            local, box = local_block(tensor)
            if local.numel():
                sources[name].read_into(checkpoint, box, local)
        return checkpoint.bytes_read


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _refuse_pipeline_stage(model: MoEDecoder, what: str, fix: str) -> None:
    """A model pruned to one pipeline stage holds only some tensors: refused on every rank alike."""
    if getattr(model, "pipeline_pruned", False):
        raise HFCheckpointError(
            f"{what} is not supported under pipeline parallelism (each rank holds one stage's blocks): {fix}, or "
            "set pipeline_parallel_size=1."
        )


@torch.no_grad()
def save_hf_weights(
    model: MoEDecoder,
    path: str | Path,
    arch: str,
    base_config: Optional[dict[str, Any]] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
) -> Optional[list[Path]]:
    """Write ``model`` as an HF ``arch`` checkpoint at ``path`` (called on every rank; rank 0
    writes). ``dtype``: of the saved tensors (None: each parameter's own). Returns rank 0's shard files
    (None on other ranks)."""
    from torch.distributed.tensor import DTensor

    _refuse_pipeline_stage(model, "save_hf", "save a checkpoint (trainer.save_checkpoint) and export it from a run "
                           "with pipeline_parallel_size=1, which loads it (checkpoints reshard across pipeline sizes)")
    stored_buffers = buffer_sources(model.config, arch)
    sources = {**parameter_sources(model.config, arch), **stored_buffers}
    params = dict(model.named_parameters())
    unmapped = sorted(set(params) - set(sources))
    if unmapped:
        raise HFCheckpointError(f"the model's parameters {unmapped[:5]} have no {arch} tensor.")
    max_shard_bytes = shard_size_bytes(max_shard_bytes)  # before any collective: a bad size fails on every rank
    writer = ShardedSafetensorsWriter(path, max_shard_bytes) if _rank() == 0 else None
    buffers = dict(model.named_buffers())
    for name, param in [*params.items(), *((name, buffers[name]) for name in stored_buffers)]:
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if writer is None:
            continue
        # Router state (the expert bias) stays fp32 whatever the weights' dtype, as DeepSeek stores it.
        cast = full if name in stored_buffers else full.to(dtype or full.dtype)
        for hf_name, tensor in sources[name].to_hf(cast):
            writer.add(hf_name, tensor)
    if writer is None:
        return None
    config_dtype = dtype or model.embed_tokens.weight.dtype  # routers stay fp32 under bf16 weights
    config = hf_config_dict(model.config, arch, base_config, dtype=str(config_dtype).removeprefix("torch."))
    return writer.finish(config)


def bytes_of(module: nn.Module) -> int:
    """Bytes of the parameters of ``module`` as this rank holds them (local shards)."""
    return sum(local_block(p)[0].numel() * p.element_size() for p in module.parameters())
