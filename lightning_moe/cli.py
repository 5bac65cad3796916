"""`lightning-moe`: the command line (LightningCLI) for :class:`MoELanguageModel` + :class:`LMDataModule`.

::

    lightning-moe fit --config examples/configs/tiny_cpu.yaml
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --trainer.max_steps=50 --model.learning_rate=1e-3
    lightning-moe fit --config examples/configs/ep2_cpu.yaml --ckpt_path=runs/ep2_cpu/version_0/checkpoints/last.ckpt
    lightning-moe validate --config examples/configs/tiny_cpu.yaml --ckpt_path=PATH
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --print_config         # resolved YAML
    python -m lightning_moe fit ...                                                  # the same

Subcommands: ``fit``, ``validate`` and ``test`` (the held-out split). Everything else is LightningCLI's: ``--config``
(repeatable, later wins), ``--print_config``, ``--seed_everything``, ``--trainer.*``, ``--model.*``,
``--data.*``, ``--ckpt_path``, ``--optimizer`` / ``--lr_scheduler`` (replace the model's AdamW +
warmup-cosine).

The strategy is chosen like any Trainer argument: ``--trainer.strategy=megatron_moe`` (the
registered name, default sizes) or, with sizes, in YAML::

    trainer:
      strategy:
        class_path: lightning_moe.MegatronMoEStrategy
        init_args: {expert_parallel_size: 2}

Defaults that differ from Lightning's: ``precision`` is "bf16-mixed" when a CUDA GPU with bf16
is present, else "32-true"; ``log_every_n_steps`` 10; ``seed_everything`` 1234; callbacks
``RichProgressBar``, :class:`MoEMonitor`, :class:`MoEThroughput`, ``ModelCheckpoint(save_last="link")``
(a ``trainer.callbacks`` list in a config replaces the whole list). A default callback that a
Trainer flag turns off (``enable_progress_bar=false``, ``enable_checkpointing=false``) is dropped
instead of failing.

Data -> model, resolved before instantiation and written into the saved ``config.yaml``:

- ``model.overrides.max_seq_length`` follows ``data.seq_length`` unless the overrides set it
  (setting it shorter than ``data.seq_length`` is an error).
- ``model.overrides.vocab_size`` follows an explicit ``data.vocab_size`` (with ``data.data_path``)
  unless the overrides set it. A model vocabulary smaller than the data's (256 for the embedded
  corpus, or an explicit ``data.vocab_size``) is an error.

These are not ``parser.link_arguments`` links: a link target must be its own init argument and
stops being settable, while the model takes these fields inside its ``overrides`` dict.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_moe  # noqa: F401  registers the "megatron_moe" strategy name
from lightning_moe.data.corpus import VOCAB_SIZE
from lightning_moe.data.datamodule import LMDataModule
from lightning_moe.models.lightning_module import MoELanguageModel, resolve_model_config

DEFAULT_CALLBACKS: list[dict[str, Any]] = [
    {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
    {"class_path": "lightning_moe.callbacks.MoEMonitor"},
    {"class_path": "lightning_moe.callbacks.MoEThroughput"},
    {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": "link"}},
]


def default_precision() -> str:
    """ "bf16-mixed" on a CUDA GPU that supports bf16, else "32-true" (CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


class MoECLI(LightningCLI):
    """LightningCLI for :class:`MoELanguageModel` and :class:`LMDataModule` (see the module doc)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_defaults", {"precision": default_precision(), "log_every_n_steps": 10})
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(MoELanguageModel, LMDataModule, args=args, run=run, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``; not ``predict`` (the model has no ``predict_step``)."""
        keep = {"fit", "validate", "test"}
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in keep}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"trainer.callbacks": DEFAULT_CALLBACKS})

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        link_data_to_model(config)
        drop_disabled_callbacks(config)


def link_data_to_model(config: Namespace) -> None:
    """Carry ``data.seq_length`` (and an explicit ``data.vocab_size``) into ``model.overrides``; check
    that the model's vocabulary covers the data's."""
    data, model = config.data, config.model
    overrides = dict(model.overrides or {})
    if "max_seq_length" in overrides:
        if overrides["max_seq_length"] < data.seq_length:
            raise ValueError(
                f"model.overrides.max_seq_length={overrides['max_seq_length']} is shorter than "
                f"data.seq_length={data.seq_length}: raise it or drop it (it then follows data.seq_length)."
            )
    else:
        overrides["max_seq_length"] = data.seq_length
    data_vocab = VOCAB_SIZE if data.data_path is None else data.vocab_size
    if data.data_path is not None and data.vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = data.vocab_size
    model.overrides = overrides
    cfg = resolve_model_config(_plain(model.config), overrides)
    if data_vocab is not None and cfg.vocab_size < data_vocab:
        raise ValueError(
            f"the model's vocab_size={cfg.vocab_size} is smaller than the data's ({data_vocab}): set "
            f"model.overrides.vocab_size >= {data_vocab} (or choose another model.config)."
        )


def drop_disabled_callbacks(config: Namespace) -> None:
    """Remove progress-bar / checkpoint callbacks that ``enable_progress_bar`` /
    ``enable_checkpointing`` turn off (Lightning raises when both are given)."""
    trainer = config.trainer
    callbacks = trainer.get("callbacks")
    if not isinstance(callbacks, list):
        return
    disabled: list[type] = []
    if trainer.get("enable_progress_bar") is False:
        disabled.append(ProgressBar)
    if trainer.get("enable_checkpointing") is False:
        disabled.append(ModelCheckpoint)
    if disabled:
        trainer.callbacks = [c for c in callbacks if not _is_subclass(c, tuple(disabled))]


def _is_subclass(spec: Any, classes: tuple[type, ...]) -> bool:
    if isinstance(spec, classes):
        return True
    class_path = spec.get("class_path") if isinstance(spec, (Namespace, dict)) else None
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    return isinstance(cls, type) and issubclass(cls, classes)


def _plain(value: Any) -> Any:
    """``model.config`` as :func:`resolve_model_config` takes it: a YAML mapping that jsonargparse
    parsed as a ``ModelConfig`` (``class_path`` / ``init_args``, nested for ``moe``) becomes the
    plain dict of its fields."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        value = value.get("init_args", value) if "class_path" in value else value
        return {k: _plain(v) for k, v in value.items() if not k.startswith("__")}
    return value


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``lightning-moe`` and ``python -m lightning_moe``."""
    MoECLI(args=args)


if __name__ == "__main__":
    main()
