"""`lightning-moe`: the command line (LightningCLI) for :class:`MoELanguageModel` + :class:`LMDataModule`.

::

    lightning-moe fit --config examples/configs/tiny_cpu.yaml
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --trainer.max_steps=50 --model.learning_rate=1e-3
    lightning-moe fit --config examples/configs/ep2_cpu.yaml --ckpt_path=runs/ep2_cpu/version_0/checkpoints/last.ckpt
    lightning-moe validate --config examples/configs/tiny_cpu.yaml --ckpt_path=PATH
    lightning-moe fit --config examples/configs/tiny_cpu.yaml --print_config         # resolved YAML
    python -m lightning_moe fit ...                                                  # the same

Subcommands: ``fit``, ``validate`` and ``test`` (the held-out split); ``convert`` turns a Hugging
Face checkpoint directory into a distributed checkpoint and back (``lightning-moe convert --help``). Everything else is LightningCLI's: ``--config``
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
:class:`MoEProgressBar` (Rich; steps out of ``max_steps`` for a step-limited run),
:class:`MoEMonitor`, :class:`MoEThroughput`, ``ModelCheckpoint(save_last="link")`` (a
``trainer.callbacks`` list in a config replaces the whole list). A default callback that a
Trainer flag turns off (``enable_progress_bar=false``, ``enable_checkpointing=false``) is dropped
instead of failing.

Data -> model, resolved before instantiation and written into the saved ``config.yaml``:

- ``model.overrides.max_seq_length`` follows ``data.seq_length`` unless the overrides set it
  (setting it shorter than ``data.seq_length`` is an error).
- ``model.overrides.vocab_size`` follows an explicit ``data.vocab_size`` (with ``data.data_path``),
  or with ``data.text_files`` the tokenizer's size (``data.vocab_size`` when given), unless the
  overrides set it or ``model.config`` is a Hugging Face checkpoint directory (its embedding fixes
  it). A model vocabulary smaller than the data's (256 for the embedded corpus, an explicit
  ``data.vocab_size``, or the tokenizer's) is an error.

These are not ``parser.link_arguments`` links: a link target must be its own init argument and
stops being settable, while the model takes these fields inside its ``overrides`` dict.

Errors. A value that a constructor rejects (a ``ValueError`` from the model, the data, a plugin,
a callback, ...; a ``MisconfigurationException`` from the Trainer) or that the links above reject
ends the command with ``error: <Class>: <message>`` on stderr and exit code 2, as an argument
parse error does, instead of a traceback or jsonargparse's list of every type the value was
tried against. Parse errors print one usage line; ``--help`` lists every option. A file that
turns out unusable once the run starts (a missing dataset, a damaged checkpoint: an
:class:`~lightning_moe.errors.InputError`, whose message names the file and the fix) ends it
the same way, printed by rank 0 only in a distributed run. A start that fails (any error before
the first training or evaluation step) leaves no new ``<save_dir>/<name>/version_N``: the run
directory it created is removed, and nothing that existed before.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, TextIO

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_moe.strategies  # noqa: F401  registers the "megatron_moe" strategy name
from lightning_moe.data.corpus import VOCAB_SIZE
from lightning_moe.data.datamodule import LMDataModule
from lightning_moe.data.text import load_tokenizer
from lightning_moe.errors import InputError
from lightning_moe.models.hf.reader import is_hf_checkpoint_dir
from lightning_moe.models.lightning_module import MoELanguageModel, resolve_model_config

DEFAULT_CALLBACKS: list[dict[str, Any]] = [
    {"class_path": "lightning_moe.callbacks.MoEProgressBar"},
    {"class_path": "lightning_moe.callbacks.MoEMonitor"},
    {"class_path": "lightning_moe.callbacks.MoEThroughput"},
    {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": "link"}},
]


def default_precision() -> str:
    """ "bf16-mixed" on a CUDA GPU that supports bf16, else "32-true" (CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


class MoEArgumentParser(LightningArgumentParser):
    """The CLI's parser: a parse error prints one usage line above the error, not the usage of
    every trainer, model and data option (60+ lines); ``--help`` still lists them all."""

    def print_usage(self, file: Optional[TextIO] = None) -> None:
        prog = self.prog.replace(" [options]", "")  # a subcommand's prog is "lightning-moe [options] fit"
        (file or sys.stdout).write(f"usage: {prog} [-h] [-c CONFIG] [options]\n")


class MoECLI(LightningCLI):
    """LightningCLI for :class:`MoELanguageModel` and :class:`LMDataModule` (see the module doc)."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_defaults", {"precision": default_precision(), "log_every_n_steps": 10})
        kwargs.setdefault("seed_everything_default", 1234)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", MoEArgumentParser)
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
        try:
            link_data_to_model(config)
        except ValueError as err:
            self._exit_with_error(str(err))
        drop_disabled_callbacks(config)

    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does; a constructor's rejection ends the command with its
        message (see the module doc).

        jsonargparse tries a value against every type of a Union (``trainer.plugins`` has
        five) and reports the constructor's ``ValueError`` only inside a list of all the
        failures, without chaining it, so an instantiator records it on the way out. The model
        and the data are built by Lightning's own instantiators, whose errors are not wrapped:
        those are recognised by the constructor in their traceback, like the Trainer's.
        """
        rejected: list[tuple[type, Exception]] = []

        def instantiate(cls: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return cls(*args, **kwargs)
            except ValueError as err:
                rejected.append((cls, err))
                raise

        self.parser.add_instantiator(instantiate, object)
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as err:
            built = (self._model_class, self._datamodule_class, self.trainer_class)
            cls: Optional[type] = _constructor_in_traceback(err.__traceback__, built)
            cause: Exception = err
            if cls is None and rejected:
                cls, cause = rejected[-1]  # the last constructor that failed: the one jsonargparse gave up on
            if cls is None:
                raise
            self._exit_with_error(f"{cls.__name__}: {cause}")

    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand as LightningCLI does, with two changes for a start that fails
        (see the module doc): the run directory it created is removed, and an
        :class:`~lightning_moe.errors.InputError` ends the command with its message."""
        new_dirs = _NewRunDirs(self.trainer.loggers)
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            if not _passed_through_run_stage(err, type(self.trainer)):
                new_dirs.remove()
            if isinstance(err, InputError):
                self._exit_with_error(str(err))
            raise

    def _exit_with_error(self, message: str) -> None:
        """``error: <message>`` on stderr and exit code 2, as for an argument parse error. Only
        global rank 0 prints; the other ranks of a distributed run exit quietly with the same code."""
        if rank_zero_only.rank == 0:
            self.parser.exit(2, f"error: {message}\n")
        _wait_for_launching_process()
        sys.exit(2)


def link_data_to_model(config: Namespace) -> None:
    """Carry ``data.seq_length`` (and an explicit ``data.vocab_size``, or the text tokenizer's size) into
    ``model.overrides``; check that the model's vocabulary covers the data's."""
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
    if data.get("text_files") is not None and data.get("tokenizer") is not None:
        data_vocab = data.vocab_size or len(load_tokenizer(data.tokenizer))  # local files only, no download
        # A Hugging Face checkpoint's vocabulary is its embedding's (often padded past the tokenizer's
        # size); only a model built from scratch takes the tokenizer's.
        from_checkpoint = isinstance(model.config, str) and is_hf_checkpoint_dir(model.config)
        if not from_checkpoint:
            overrides.setdefault("vocab_size", data_vocab)
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


def _constructor_in_traceback(tb: Optional[TracebackType], classes: tuple[type, ...]) -> Optional[type]:
    """The first of ``classes`` whose ``__init__`` is a frame of ``tb`` (the error passed through it)."""
    codes = {inspect.unwrap(cls.__init__).__code__: cls for cls in classes}
    while tb is not None:
        cls = codes.get(tb.tb_frame.f_code)
        if cls is not None:
            return cls
        tb = tb.tb_next
    return None


def _passed_through_run_stage(err: BaseException, trainer_class: type) -> bool:
    """Whether ``err``, or an exception it chains, passed through ``Trainer._run_stage`` (the
    loop of training / evaluation steps, sanity check included): the run had started. True
    when the Trainer has no ``_run_stage`` (nothing is then taken for a failed start)."""
    codes = set()
    for cls in {trainer_class, Trainer}:
        run_stage = getattr(cls, "_run_stage", None)
        if run_stage is None:
            return True
        codes.add(inspect.unwrap(run_stage).__code__)
    seen: set[int] = set()
    exc: Optional[BaseException] = err
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in codes:
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


class _NewRunDirs:
    """The run directory (``<save_dir>/<name>/version_N``) that each local logger creates during
    a run, told apart from what existed before: a failed start removes the new ones, and
    ``<save_dir>/<name>`` and ``<save_dir>`` if the run created them and they are left empty.
    Nothing that existed before the run is removed. Only global rank 0 writes logs, and only it
    removes them."""

    def __init__(self, loggers: list[Any]) -> None:
        self._loggers: list[tuple[Any, Path, set[str], list[Path]]] = []
        for logger in loggers:
            root = getattr(logger, "root_dir", None)
            if not isinstance(root, str) or "://" in root:
                continue
            root_path = Path(root)
            entries = set(os.listdir(root_path)) if root_path.is_dir() else set()
            created = [p for p in (root_path, *root_path.parents) if not p.exists()]  # deepest first
            self._loggers.append((logger, root_path, entries, created))

    def remove(self) -> None:
        if rank_zero_only.rank != 0:
            return
        for logger, root, entries, created in self._loggers:
            try:
                log_dir = getattr(logger, "log_dir", None)
            except Exception:  # noqa: BLE001 - a logger that cannot name its directory left nothing to remove
                log_dir = None
            if not isinstance(log_dir, str):
                continue
            top = os.path.relpath(log_dir, root).split(os.sep)[0]
            if top not in ("", os.curdir, os.pardir) and top not in entries and (root / top).is_dir():
                shutil.rmtree(root / top, ignore_errors=True)
            for directory in created:
                try:
                    directory.rmdir()
                except OSError:  # not empty (or gone): keep it and everything above
                    break


def _wait_for_launching_process(timeout: float = 15.0) -> None:
    """In a process that Lightning's launcher started (a local rank > 0 whose parent runs the same
    command), wait until the parent (rank 0) has exited, at most ``timeout`` s. The launcher
    kills every process once a child exits with a non-zero code (it checks every 5 s), which
    could cut rank 0 off before it prints the error."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return
    parent = os.getppid()
    try:
        parent_args = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return
    args = sys.argv[1:]
    if parent_args and parent_args[-1] == "":
        parent_args = parent_args[:-1]
    if args and parent_args[-len(args) :] != args:
        return
    deadline = time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)


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
    """Entry point of ``lightning-moe`` and ``python -m lightning_moe``; ``convert`` (HF checkpoints
    <-> distributed checkpoints, `lightning_moe.models.hf.convert`) runs outside LightningCLI."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["convert"]:
        from lightning_moe.models.hf.convert import main as convert

        convert(argv[1:])
        return
    MoECLI(args=args)


if __name__ == "__main__":
    main()
