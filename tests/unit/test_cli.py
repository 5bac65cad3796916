"""The `lightning-moe` command line: printed config, data -> model links, strategy selection, a short fit."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest
import yaml

from lightning_moe import MegatronMoEStrategy
from lightning_moe.callbacks import MoEMonitor, MoEThroughput
from lightning_moe.cli import MoECLI

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
TINY = str(CONFIGS / "tiny_cpu.yaml")
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def _bare_argv(monkeypatch):
    """LightningCLI warns when pytest's own arguments sit in sys.argv next to ``args``."""
    monkeypatch.setattr(sys, "argv", ["lightning-moe"])


def _cli_from_yaml(tmp_path: Path, text: str, *args: str) -> MoECLI:
    """``MoECLI(run=False)`` from a YAML config written to ``tmp_path``."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return MoECLI(args=["--config", str(path), *args, *QUIET], run=False)


def test_print_config_resolves_the_example_config(capsys):
    with pytest.raises(SystemExit) as exit_info:
        MoECLI(args=["fit", "--config", TINY, "--trainer.max_steps=7", "--print_config"])
    assert exit_info.value.code in (None, 0)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["config"] == "tiny"
    assert printed["data"]["seq_length"] == 128
    assert printed["trainer"]["max_steps"] == 7
    classes = [c["class_path"] for c in printed["trainer"]["callbacks"]]
    assert classes == [
        "lightning_moe.callbacks.MoEProgressBar",
        "lightning_moe.callbacks.MoEMonitor",
        "lightning_moe.callbacks.MoEThroughput",
        "lightning.pytorch.callbacks.ModelCheckpoint",
    ]
    for config in ("small_gpu.yaml", "small_gpu_fp8.yaml", "ep2_gpu.yaml", "ep2_cpu.yaml"):
        with pytest.raises(SystemExit):
            MoECLI(args=["fit", "--config", str(CONFIGS / config), "--print_config"])
        assert yaml.safe_load(capsys.readouterr().out)["model"]["config"] in ("tiny", "small")


def test_defaults_links_and_strategy_selection(tmp_path):
    cli = MoECLI(args=["--data.seq_length=64", "--data.micro_batch_size=2", *QUIET], run=False)
    assert cli.model.model_config.max_seq_length == 64  # linked from data.seq_length
    assert cli.config["model"]["overrides"] == {"max_seq_length": 64}
    assert str(cli.trainer.precision) == "32-true"  # no GPU here
    assert cli.trainer.log_every_n_steps == 10
    types = [type(c) for c in cli.trainer.callbacks]
    assert MoEMonitor in types and MoEThroughput in types  # the default list, progress bar dropped
    assert not any("Rich" in t.__name__ for t in types)

    cli = MoECLI(
        args=["--data.seq_length=64", "--data.micro_batch_size=2", "--trainer.strategy=megatron_moe", *QUIET], run=False
    )
    assert isinstance(cli.trainer.strategy, MegatronMoEStrategy)

    cli = _cli_from_yaml(
        tmp_path,
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_moe.MegatronMoEStrategy\n"
        "    init_args: {expert_parallel_size: 2, sharding: ddp}\n"
        "data: {seq_length: 32, micro_batch_size: 2}\n",
        "--trainer.enable_checkpointing=false",
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MegatronMoEStrategy)
    assert strategy.sizes["expert_parallel_size"] == 2 and strategy.sharding == "ddp"
    assert cli.trainer.checkpoint_callback is None  # the default ModelCheckpoint was dropped, not an error

    # An inline model config (jsonargparse parses it as a ModelConfig) links like a preset.
    cli = _cli_from_yaml(
        tmp_path,
        "model:\n"
        "  config:\n"
        "    {vocab_size: 300, hidden_size: 32, num_layers: 1, num_attention_heads: 2,\n"
        "     moe: {hidden_size: 32, ffn_hidden_size: 16, num_experts: 4, router_topk: 2}}\n"
        "data: {seq_length: 24, micro_batch_size: 2}\n",
        "--trainer.logger=false",
    )
    cfg = cli.model.model_config
    assert (cfg.max_seq_length, cfg.vocab_size, cfg.moe.num_experts) == (24, 300, 4)

    # An explicit data vocabulary (tokenized data) becomes the model's; the files are read only at setup.
    cli = MoECLI(
        args=["--data.seq_length=8", "--data.micro_batch_size=2", "--data.data_path=/data/tokens",
              "--data.vocab_size=50304", "--trainer.logger=false", *QUIET],
        run=False,
    )  # fmt: skip
    assert cli.model.model_config.vocab_size == 50304


def test_link_errors_are_short(capsys):
    for override, message in (
        ("{max_seq_length: 16}", "max_seq_length=16 is shorter than data.seq_length=64"),
        ("{vocab_size: 128}", "vocab_size >= 256"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            MoECLI(
                args=["--data.seq_length=64", "--data.micro_batch_size=2", f"--model.overrides={override}"], run=False
            )
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        # jsonargparse tries the plugin against the five types of `trainer.plugins` and used to
        # print all five failures (97 lines) around the plugin's own message.
        (
            ["--trainer.plugins=lightning_moe.precision.FP8Precision", "--trainer.plugins.backend=torch",
             "--trainer.precision=null"],
            "error: FP8Precision: backend='torch' runs on CUDA only; this plugin targets the CPU. "
            "Use backend='emulated' or backend='te'.",
        ),
        (["--model.learning_rate=-1"], "error: MoELanguageModel: learning_rate must be positive, got -1.0."),
        (["--data.val_fraction=2"], "error: LMDataModule: val_fraction must be in [0, 1), got 2.0"),
        (["--trainer.accelerator=gpu"], "error: Trainer: "),
    ],
    ids=["plugin", "model", "data", "trainer"],
)  # fmt: skip
def test_rejected_values_end_with_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        MoECLI(args=["fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), captured.err
    assert "Traceback" not in captured.out
    assert list(tmp_path.iterdir()) == []


def test_parse_errors_print_one_usage_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        MoECLI(args=["fit", "--config", TINY, "--trainer.max_stepz=3"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: lightning-moe fit [-h] [-c CONFIG] [options]",
        "tip: For details of accepted options run: lightning-moe fit --help",
        "error: unrecognized arguments: --trainer.max_stepz=3",
    ]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def test_a_failed_start_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    """A missing dataset ends with one `error:` line; a failure before the first step removes the
    `version_N` it created (and the name / save directories it created), nothing older; a
    failure after the first step keeps its run directory."""
    from lightning_moe.models.lightning_module import MoELanguageModel

    logs = tmp_path / "logs"
    kept = logs / "tiny_cpu" / "version_0"
    kept.mkdir(parents=True)
    (kept / "metrics.csv").write_text("step,train/loss\n0,5.5\n")
    before = _tree(logs)
    short = ["fit", "--config", TINY, *QUIET, "--trainer.max_steps=2", "--data.seq_length=32",
             "--data.micro_batch_size=2"]  # fmt: skip

    missing = tmp_path / "data" / "corpus"
    with pytest.raises(SystemExit) as exit_info:
        MoECLI(args=[*short, f"--trainer.logger.init_args.save_dir={logs}", f"--data.data_path={missing}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"error: data_path: no Megatron indexed dataset at {missing}: "), err
    assert "IndexedDatasetWriter" in err[-1] and sum(line.startswith("error:") for line in err) == 1
    assert _tree(logs) == before

    # Any error before the first step (here after config.yaml was written), traceback kept.
    def fail(self):
        raise RuntimeError("no optimizer today")

    configure_optimizers = MoELanguageModel.configure_optimizers
    monkeypatch.setattr(MoELanguageModel, "configure_optimizers", fail)
    with pytest.raises(RuntimeError, match="no optimizer today"):
        MoECLI(args=[*short, f"--trainer.logger.init_args.save_dir={logs}"])
    assert _tree(logs) == before
    fresh = tmp_path / "fresh" / "logs"
    with pytest.raises(RuntimeError, match="no optimizer today"):
        MoECLI(args=[*short, f"--trainer.logger.init_args.save_dir={fresh}"])
    assert not (tmp_path / "fresh").exists()
    monkeypatch.setattr(MoELanguageModel, "configure_optimizers", configure_optimizers)

    def fail_step(self, batch, batch_idx):
        raise RuntimeError("step failed")

    monkeypatch.setattr(MoELanguageModel, "training_step", fail_step)
    with pytest.raises(RuntimeError, match="step failed"):
        MoECLI(args=[*short, f"--trainer.logger.init_args.save_dir={logs}"])
    assert (logs / "tiny_cpu" / "version_1" / "config.yaml").is_file()  # a run that started keeps its directory
    assert {k: v for k, v in _tree(logs).items() if "version_1" not in k} == before


def _column(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


def test_short_fit_through_the_cli_learns(tmp_path):
    steps = 30
    cli = MoECLI(
        args=[
            "fit",
            "--config",
            TINY,
            *QUIET,
            f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps}",
            "--trainer.limit_val_batches=4",
            "--trainer.log_every_n_steps=1",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.logger.init_args.version=0",
            "--model.warmup_steps=5",
            "--data.seq_length=64",
            "--data.micro_batch_size=8",
        ]
    )
    assert cli.trainer.global_step == steps
    run_dir = tmp_path / "tiny_cpu" / "version_0"
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    losses = _column(rows, "train/loss")
    assert [s for s, _ in losses] == list(range(steps))
    first = losses[0][1]
    last = sum(v for _, v in losses[-5:]) / 5
    assert first == pytest.approx(math.log(256), abs=0.3)  # an untrained model is ~uniform over bytes
    assert last < first - 1.5, (first, last)  # the embedded corpus is learnable (unigram entropy ~3.2)
    ((val_step, val_loss),) = _column(rows, "val/loss")
    assert val_step == steps - 1 and math.isfinite(val_loss) and val_loss < first - 1.0
    assert _column(rows, "moe/model.layers.3.mlp/tokens")  # the callbacks logged
    assert _column(rows, "throughput/tokens_per_sec")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["overrides"] == {"max_seq_length": 64}  # the link is in the saved config
    # `validate` restores the checkpoint and sees the same validation loss.
    validate = MoECLI(
        args=[
            "validate",
            "--config",
            TINY,
            *QUIET,
            "--trainer.limit_val_batches=4",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--data.seq_length=64",
            "--data.micro_batch_size=8",
            f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
        ]
    )
    assert validate.trainer.callback_metrics["val/loss"].item() == pytest.approx(val_loss, rel=1e-6)


def test_main_job_beats_the_unigram_entropy(tmp_path):
    """A shorter run of the README's main job (100 of its 400 steps): the validation loss is
    already below the corpus's unigram entropy (the model learned more than byte frequencies)."""
    from lightning_moe.data.corpus import load_corpus, unigram_entropy_nats

    steps = 100
    MoECLI(
        args=[
            "fit", "--config", TINY, *QUIET,
            f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
            "--trainer.limit_val_batches=8",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.version=0",
            "--trainer.enable_checkpointing=false",
        ]
    )
    rows = list(csv.DictReader((tmp_path / "tiny_cpu" / "version_0" / "metrics.csv").open()))
    ((_, val_loss),) = _column(rows, "val/loss")
    entropy = unigram_entropy_nats(load_corpus().val_tokens)
    assert val_loss < entropy - 0.3, (val_loss, entropy)


def test_fp8_example_config_builds_its_plugin(tmp_path):
    """examples/configs/small_gpu_fp8.yaml: the FP8 plugin with a nested FP8Recipe, no
    precision flag beside it. On this CPU machine: the emulated backend, no weight cache."""
    from lightning_moe.precision import FP8Precision

    config = yaml.safe_load((CONFIGS / "small_gpu_fp8.yaml").read_text())
    config["trainer"].update(accelerator="cpu", logger=False, callbacks=[])
    plugin_args = config["trainer"]["plugins"][0]["init_args"]
    plugin_args.update(backend="emulated", cache_fp8_weights=False, device="cpu")
    cli = _cli_from_yaml(tmp_path, yaml.safe_dump(config))
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, FP8Precision)
    assert plugin.recipe.name == "rowwise" and plugin.recipe.fast_accumulation == ("fprop", "dgrad", "wgrad")
    assert cli.trainer.accumulate_grad_batches == 2
