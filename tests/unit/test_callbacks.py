"""MoEMonitor against counts made by hand from the routers' outputs; heatmaps; throughput math."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader, Dataset

from lightning_moe.callbacks import MoEMonitor, MoEThroughput
from lightning_moe.callbacks.throughput import PEAK_FLOPS, device_peak_flops, precision_peak_dtype
from lightning_moe.models import MoELanguageModel, model_flops_per_token
from lightning_moe.nn.router import TopKRouter

SEQ, MICRO = 16, 2


class RandomTokens(Dataset):
    def __init__(self, count: int, vocab: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (count, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def of(self, prefix: str) -> list[tuple[int, dict]]:
        return [(s, m) for s, m in self.calls if any(k.startswith(prefix) for k in m)]


def tiny_model(**moe) -> MoELanguageModel:
    overrides = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2}
    overrides["moe"] = {"ffn_hidden_size": 32, **moe}
    return MoELanguageModel("tiny", overrides=overrides, learning_rate=1e-2, warmup_steps=1)


def trainer(max_steps: int, callbacks: list, logger=None, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class RecordRouting(Callback):
    """Hand counts: a forward hook on every router bincounts the kept experts of each training
    forward and keeps its losses, independently of MoELayer.last_stats."""

    def __init__(self) -> None:
        self.micro_batches: list[dict[str, dict]] = []  # per training forward: layer -> record
        self._current: dict[str, dict] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook(name.rsplit(".router", 1)[0]))

    def _hook(self, layer: str):
        def hook(router, inputs, result) -> None:
            if not router.training:
                return
            experts = result.experts_TK
            keep = result.keep_TK if result.keep_TK is not None else torch.ones_like(experts, dtype=torch.bool)
            self._current[layer] = {
                "counts": torch.bincount(experts[keep], minlength=router.cfg.num_experts),
                "dropped": int((~keep).sum()),
                "assignments": experts.numel(),
                "losses": {k: float(v) for k, v in router.latest_losses.items()},
            }

        return hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.micro_batches.append(self._current)
        self._current = {}


def expected_window(records: list[dict[str, dict]], layer: str) -> dict[str, float]:
    counts = sum(r[layer]["counts"] for r in records).double()
    kept = counts.sum().item()
    dropped = sum(r[layer]["dropped"] for r in records)
    assignments = sum(r[layer]["assignments"] for r in records)
    assert kept + dropped == assignments
    mean = counts.mean().item()
    out = {
        "tokens": kept,
        "load_max": counts.max().item() / mean,
        "load_min": counts.min().item() / mean,
        "load_cv": counts.std(unbiased=False).item() / mean,
        "dropped_frac": dropped / assignments,
    }
    for name in records[0][layer]["losses"]:
        out[name] = sum(r[layer]["losses"][name] for r in records) / len(records)
    return out


def test_moe_monitor_matches_hand_counts_over_accumulated_windows():
    torch.manual_seed(0)
    # Capacity factor 1.0 drops assignments; sigmoid routing with an expert bias adds the bias stats.
    model = tiny_model(
        expert_capacity_factor=1.0,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_bias_update_rate=1e-2,
    )
    monitor = MoEMonitor(log_every_n_steps=2, log_tokens_per_expert=True)
    record = RecordRouting()
    logger = CaptureLogger()
    loader = DataLoader(RandomTokens(16), batch_size=MICRO)
    trainer(4, [record, monitor], logger, accumulate_grad_batches=2).fit(model, loader)

    logged = logger.of("moe/")
    assert [step for step, _ in logged] == [1, 3]  # optimizer steps 2 and 4, in Lightning's step numbering
    assert len(record.micro_batches) == 8
    layers = ["model.layers.0.mlp", "model.layers.1.mlp"]
    for window, (_, metrics) in enumerate(logged):
        records = record.micro_batches[4 * window : 4 * window + 4]  # 2 steps x 2 micro-batches
        total_kept = total_dropped = 0
        for layer in layers:
            expected = expected_window(records, layer)
            assert expected["dropped_frac"] > 0  # the capacity limit is exercised
            assert set(expected) - {"tokens", "load_max", "load_min", "load_cv", "dropped_frac"} == {
                "aux_loss",
                "z_loss",
            }
            for stat, value in expected.items():
                assert metrics[f"moe/{layer}/{stat}"] == pytest.approx(value, rel=1e-5, abs=1e-7), (window, layer, stat)
            counts = sum(r[layer]["counts"] for r in records)
            for e, c in enumerate(counts.tolist()):
                assert metrics[f"moe/{layer}/tokens_per_expert/{e}"] == c
            total_kept += expected["tokens"]
            total_dropped += expected["dropped_frac"] * sum(r[layer]["assignments"] for r in records)
        assert metrics["moe/dropped_frac"] == pytest.approx(total_dropped / (total_kept + total_dropped))
        assert metrics["moe/load_max"] == max(metrics[f"moe/{layer}/load_max"] for layer in layers)
    # The attributes hold the last window; the bias stats are read at the logging step.
    last = record.micro_batches[4:]
    for layer in layers:
        assert torch.equal(monitor.tokens_per_expert[layer], sum(r[layer]["counts"] for r in last))
        bias = dict(model.named_modules())[layer].router.expert_bias
        assert monitor.metrics[f"moe/{layer}/expert_bias_min"] == pytest.approx(bias.min().item())
        assert monitor.metrics[f"moe/{layer}/expert_bias_max"] == pytest.approx(bias.max().item())
        assert bias.abs().max() > 0  # the bias moved, so min/max are not trivially zero
    assert monitor.metrics == logged[-1][1]


def test_moe_monitor_writes_heatmaps_atomically_into_the_log_dir(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    monitor = MoEMonitor(log_every_n_steps=1, heatmap_every_n_steps=2)
    logger = CSVLogger(tmp_path, name="run", version=0)
    loader = DataLoader(RandomTokens(8), batch_size=MICRO)
    trainer(4, [monitor], logger).fit(tiny_model(), loader)
    heatmaps = tmp_path / "run" / "version_0" / "moe_heatmaps"
    written = sorted(p.name for p in heatmaps.iterdir())
    assert written == ["expert_load_step00000002.png", "expert_load_step00000004.png"]  # no temporary files left
    for name in written:
        assert (heatmaps / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert monitor.last_heatmap == heatmaps / written[-1]
    header = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "moe/model.layers.0.mlp/load_cv" in header and "moe/model.layers.1.mlp/z_loss" in header


def test_moe_monitor_asked_for_heatmaps_without_matplotlib_refuses(monkeypatch):
    from lightning_moe.callbacks import moe_monitor

    monkeypatch.setattr(moe_monitor, "_MATPLOTLIB_AVAILABLE", False)
    with pytest.raises(ValueError, match=r"heatmap_every_n_steps=1\) draws PNG heatmaps, but matplotlib is not "
                       r"installed \(pip install 'lightning-moe\[plot\]'\); install it, or set heatmap_every_n_steps=None"):
        MoEMonitor(log_every_n_steps=1, heatmap_every_n_steps=1)
    assert MoEMonitor(log_every_n_steps=1).heatmap_every_n_steps is None  # no heatmaps asked: fine


def test_moe_monitor_validates_intervals():
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MoEMonitor(log_every_n_steps=0)
    monitor = MoEMonitor(log_every_n_steps=2, heatmap_every_n_steps=3)
    loader = DataLoader(RandomTokens(4), batch_size=MICRO)
    with pytest.raises(ValueError, match="multiple of the logging interval 2"):
        trainer(1, [monitor]).fit(tiny_model(), loader)


class FakeClock:
    """Each reading advances the time by the next of ``steps`` seconds."""

    def __init__(self, steps: list[float]) -> None:
        self.steps, self.now, self.readings = list(steps), 100.0, 0

    def __call__(self) -> float:
        self.now += self.steps[self.readings]
        self.readings += 1
        return self.now


def test_throughput_with_a_fake_clock_excludes_validation():
    torch.manual_seed(0)
    model = tiny_model()
    throughput = MoEThroughput(log_every_n_steps=2, peak_flops_per_device=1e9)
    # Readings: first batch start; end of window 1 (+2 s); validation start (+3 s), end (+5 s,
    # left out); end of window 2 (+1 s).
    clock = FakeClock([0.0, 2.0, 3.0, 5.0, 1.0])
    throughput._clock = clock
    logger = CaptureLogger()
    loader = DataLoader(RandomTokens(16), batch_size=MICRO)
    trainer(4, [throughput], logger, val_check_interval=3, limit_val_batches=1).fit(model, loader, loader)

    assert clock.readings == 5
    windows = [m for _, m in logger.of("throughput/")]
    tokens = 2 * MICRO * SEQ  # two optimizer steps per window
    flops_per_token = model_flops_per_token(model.model_config, SEQ)
    for metrics, seconds in zip(windows, [2.0, 3.0 + 1.0]):
        assert metrics["throughput/tokens_per_sec"] == pytest.approx(tokens / seconds)
        assert metrics["throughput/tokens_per_sec_per_device"] == pytest.approx(tokens / seconds)
        assert metrics["throughput/step_time_s"] == pytest.approx(seconds / 2)
        assert metrics["throughput/tflops_per_device"] == pytest.approx(tokens * flops_per_token / seconds / 1e12)
        assert metrics["throughput/mfu"] == pytest.approx(tokens * flops_per_token / seconds / 1e9)
    assert len(windows) == 2
    assert throughput.mfu == pytest.approx(windows[-1]["throughput/mfu"])
    assert throughput.tokens_per_sec == pytest.approx(tokens / 4.0)


def test_throughput_math_counts_data_parallel_replicas_once():
    throughput = MoEThroughput(peak_flops_per_device=400e12, flops_per_token=6e9)
    throughput.data_parallel_size, throughput.num_devices = 4, 16  # e.g. TP=2 x EP... over 16 GPUs, DP=4
    local_tokens = 8 * 4096
    metrics = throughput.compute(local_tokens, local_tokens * 6e9, steps=10, elapsed_s=5.0)
    assert throughput.tokens_per_sec == pytest.approx(4 * local_tokens / 5.0)
    assert throughput.tokens_per_sec_per_device == pytest.approx(4 * local_tokens / 5.0 / 16)
    assert throughput.step_time_s == pytest.approx(0.5)
    per_device = 4 * local_tokens * 6e9 / 5.0 / 16
    assert throughput.tflops_per_device == pytest.approx(per_device / 1e12)
    assert throughput.mfu == pytest.approx(per_device / 400e12)
    assert set(metrics) == {
        f"throughput/{k}"
        for k in ("tokens_per_sec", "tokens_per_sec_per_device", "step_time_s", "tflops_per_device", "mfu")
    }
    no_peak = MoEThroughput()
    assert "throughput/mfu" not in no_peak.compute(100, 1e6, 1, 1.0) and no_peak.mfu is None
    with pytest.raises(ValueError, match="peak_dtype"):
        MoEThroughput(peak_dtype="fp16")


def test_peak_flops_table():
    assert device_peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert device_peak_flops("NVIDIA H200", "fp8") == 1978.9e12
    assert device_peak_flops("NVIDIA H200 NVL", "bf16") == 835.5e12
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert device_peak_flops("NVIDIA B200", "fp8") == 4.5e15
    assert device_peak_flops("NVIDIA GB200", "bf16") == 2.5e15
    assert device_peak_flops("NVIDIA GB200", "fp4") == 10e15
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert device_peak_flops("Some GPU", "bf16") is None
    assert all(math.isclose(p["fp8"], 2 * p["bf16"], rel_tol=1e-3) for p in PEAK_FLOPS.values() if "fp8" in p)

    def fake(precision, recipe=None):
        return SimpleNamespace(precision=precision, precision_plugin=SimpleNamespace(recipe=recipe))

    assert precision_peak_dtype(fake("bf16-mixed")) == "bf16"
    assert precision_peak_dtype(fake("16-mixed")) == "bf16"
    assert precision_peak_dtype(fake("32-true")) is None
    assert precision_peak_dtype(fake("bf16-mixed", SimpleNamespace(name="blockwise"))) == "fp8"
    assert precision_peak_dtype(fake("bf16-mixed", SimpleNamespace(name="nvfp4"))) == "fp4"


def test_moe_monitor_with_one_moe_layer():
    """One layer's states are one-element tensors, which torchmetrics' compute squeezes to 0-dim."""
    model = MoELanguageModel("tiny", overrides={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
                                                "num_attention_heads": 2, "moe": {"ffn_hidden_size": 32}},
                             learning_rate=1e-2, warmup_steps=1)
    monitor = MoEMonitor(log_every_n_steps=1)
    trainer(2, [monitor]).fit(model, DataLoader(RandomTokens(4), batch_size=MICRO))
    (layer,) = monitor.tokens_per_expert
    assert monitor.metrics[f"moe/{layer}/tokens"] > 0 and f"moe/{layer}/load_cv" in monitor.metrics
