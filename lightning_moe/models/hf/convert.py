"""``lightning-moe convert``: HF checkpoint directory <-> lightning_moe distributed checkpoint.

::

    lightning-moe convert hf-to-checkpoint HF_DIR CKPT_DIR
    lightning-moe convert checkpoint-to-hf CKPT_DIR HF_DIR [--architecture qwen3_moe] [--dtype bfloat16]
                                                            [--max-shard-size 5000000000]

``hf-to-checkpoint`` writes a weights-only checkpoint (DCP shards plus ``meta.pt`` with the
module's hyperparameters, step 0) that ``lightning-moe validate/test --ckpt_path`` and
:class:`~lightning_moe.MegatronMoEStrategy` load into any layout (DCP reshards). It records the
HF ``config.json`` so that ``checkpoint-to-hf`` writes the same token ids and generation
settings back. ``checkpoint-to-hf`` takes any checkpoint of :class:`MoELanguageModel` (a
training run's, or a directory whose ``latest`` names one) and writes a directory that
transformers' ``AutoModelForCausalLM.from_pretrained`` loads.

Both run in one process and hold the model once in host memory; HF tensors are read and
written one at a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import torch

def hf_to_checkpoint(hf_dir: str | Path, checkpoint_dir: str | Path) -> Path:
    """Write the HF checkpoint at ``hf_dir`` as a weights-only lightning_moe checkpoint."""
    import lightning

    from lightning_moe.models.lightning_module import HF_SOURCE_KEY, MoELanguageModel
    from lightning_moe.parallel import checkpoint as ckpt

    module = MoELanguageModel.from_hf(hf_dir)
    meta: dict[str, Any] = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": lightning.__version__,
        "hparams_name": "kwargs",
        "hyper_parameters": dict(module.hparams),
        HF_SOURCE_KEY: {k: module.hf_source[k] for k in ("model_type", "config")},
    }
    return ckpt.save_distributed({"state_dict": module.state_dict()}, meta, Path(checkpoint_dir))


def checkpoint_to_hf(
    checkpoint_dir: str | Path,
    hf_dir: str | Path,
    architecture: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write the model of a lightning_moe checkpoint as an HF checkpoint directory."""
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.parallel import checkpoint as ckpt

    path = ckpt.resolve_checkpoint(Path(checkpoint_dir))
    meta = torch.load(path / ckpt.META_FILE, map_location="cpu", weights_only=True)
    if "hyper_parameters" not in meta:
        raise ckpt.CheckpointNotFoundError(f"{path} holds no hyperparameters of a MoELanguageModel.")
    module = MoELanguageModel(**meta["hyper_parameters"])
    with torch.device("meta"):
        module.configure_model()
    module.model.to_empty(device="cpu")
    state = module.state_dict()  # the module's own tensors: DCP loads into them in place
    ckpt.load_distributed({"state_dict": state}, path)
    module.load_state_dict(state)
    module.on_load_checkpoint(meta)  # the HF architecture and config.json the weights came from, if any
    module.save_hf(hf_dir, architecture=architecture, dtype=dtype, max_shard_size=max_shard_size)


def main(argv: list[str]) -> None:
    """``lightning-moe convert ...`` (see the module doc)."""
    from lightning_moe.models.hf.config_mapping import ARCHITECTURES

    parser = argparse.ArgumentParser(prog="lightning-moe convert",
                                     description="Convert between HF checkpoints and lightning_moe checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    to_ckpt = commands.add_parser("hf-to-checkpoint", help="HF save_pretrained directory -> distributed checkpoint")
    to_ckpt.add_argument("hf_dir")
    to_ckpt.add_argument("checkpoint_dir")
    to_hf = commands.add_parser("checkpoint-to-hf", help="distributed checkpoint -> HF directory")
    to_hf.add_argument("checkpoint_dir")
    to_hf.add_argument("hf_dir")
    to_hf.add_argument("--architecture", choices=sorted(ARCHITECTURES), default=None,
                       help="HF model_type (default: the one imported from, else the first that fits)")
    to_hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="dtype of the saved tensors (default: the parameters')")
    to_hf.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors shard, or e.g. 5GB, 500MB")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-checkpoint":
            out = hf_to_checkpoint(args.hf_dir, args.checkpoint_dir)
        else:
            dtype = getattr(torch, args.dtype) if args.dtype else None
            checkpoint_to_hf(args.checkpoint_dir, args.hf_dir, args.architecture, dtype, args.max_shard_size)
            out = args.hf_dir
    except (ValueError, FileNotFoundError) as err:  # bad input: one line naming the file or setting
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {out}")
