"""`MoEThroughput`: tokens/s, TFLOP/s per device and MFU of MoE training, from model FLOPs.

FLOPs per token come from :func:`~lightning_moe.models.flops.model_flops_per_token` (active
parameters and attention, forward + backward; see its module for the convention), so MFU counts
only the experts a token is routed to. Peak FLOP/s per device come from :data:`PEAK_FLOPS`
(dense tensor-core datasheet values, no sparsity) or from ``peak_flops_per_device``.

Timing is wall-clock between logging steps, synchronized with the GPU only at those steps (and
at the start and end of validation, whose time is left out). Between them nothing syncs.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_moe.callbacks._logging import check_positive_int_or_none, log_to_loggers
from lightning_moe.models.flops import model_flops_per_token

PeakDtype = Literal["bf16", "fp8", "fp4"]

#: Dense (non-sparse) tensor-core peak FLOP/s per GPU, from NVIDIA's datasheets. "fp8" covers
#: FP8 and MXFP8, "fp4" NVFP4; fp16 equals bf16. Keys are matched against the lower-cased
#: ``torch.cuda.get_device_name()`` by :func:`device_peak_flops`, most specific first.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "gb200": {"bf16": 2.5e15, "fp8": 5.0e15, "fp4": 10.0e15},
    "b200": {"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9.0e15},
    "h200 nvl": {"bf16": 835.5e12, "fp8": 1671e12},
    "h200": {"bf16": 989.4e12, "fp8": 1978.9e12},  # SXM ("NVIDIA H200")
    "h100 nvl": {"bf16": 835.5e12, "fp8": 1671e12},
    "h100 pcie": {"bf16": 756.5e12, "fp8": 1513e12},
    "h100": {"bf16": 989.4e12, "fp8": 1978.9e12},  # SXM ("NVIDIA H100 80GB HBM3")
    "a100": {"bf16": 312e12},
}


def device_peak_flops(device_name: str, dtype: str) -> Optional[float]:
    """Peak dense FLOP/s of ``dtype`` on a GPU named ``device_name``; None if not in the table."""
    name = device_name.lower()
    for key, peaks in PEAK_FLOPS.items():  # ordered most specific first
        if key in name:
            return peaks.get(dtype)
    return None


def precision_peak_dtype(trainer: Trainer) -> Optional[str]:
    """The :data:`PEAK_FLOPS` column of the Trainer's precision: "fp4" / "fp8" under
    ``FP8Precision`` (NVFP4 / other recipes), "bf16" under 16-bit precision, else None."""
    recipe = getattr(trainer.precision_plugin, "recipe", None)
    if recipe is not None and hasattr(recipe, "name"):
        return "fp4" if recipe.name == "nvfp4" else "fp8"
    precision = str(trainer.precision)
    if precision.startswith(("bf16", "16")):
        return "bf16"
    return None


class MoEThroughput(Callback):
    """Log training throughput and model FLOPs utilization every ``log_every_n_steps`` optimizer steps.

    Logged (``<prefix>/...``), over the window since the previous logging step, validation
    excluded:

    - ``tokens_per_sec``: tokens of all data-parallel replicas per second (TP/EP/CP peers of a
      replica read the same batch, so it is counted once).
    - ``tokens_per_sec_per_device``: the above over the number of devices (processes).
    - ``step_time_s``: seconds per optimizer step.
    - ``tflops_per_device``: model TFLOP/s per device (model FLOPs of all tokens / devices / time).
    - ``mfu``: ``tflops_per_device * 1e12 / peak_flops_per_device`` (a fraction), when the peak is
      known.

    Args:
        log_every_n_steps: optimizer steps per window; None: ``Trainer(log_every_n_steps)``.
        peak_flops_per_device: peak FLOP/s of one device for MFU; None: looked up in
            :data:`PEAK_FLOPS` for the GPU and the precision (no MFU on CPU or in fp32). Pass e.g.
            ``787e12`` (a measured H200 bf16 GEMM) for MFU against achievable throughput.
        peak_dtype: the :data:`PEAK_FLOPS` column ("bf16", "fp8", "fp4"); None: from the
            Trainer's precision (:func:`precision_peak_dtype`).
        flops_per_token: training FLOPs per token; None: ``model_flops_per_token(
            pl_module.model_config, S)`` with ``S`` each micro-batch's sequence length.
        prefix: metric name prefix.

    Attributes (after each logging step; the same on every rank): ``tokens_per_sec``,
    ``tokens_per_sec_per_device``, ``step_time_s``, ``tflops_per_device``, ``mfu`` (None without a
    peak), ``metrics`` (the logged dict), and from the start of training ``peak_flops_per_device``,
    ``num_devices`` and ``data_parallel_size``.

    Batches: a dict with ``input_ids`` ``[B, S]`` (what ``LMDataModule`` yields), a tensor, or a
    tuple/list whose first element is one; tokens are read from shapes (no sync). Under
    context parallelism, static or `DynamicContextParallel`, callbacks see each DP replica's
    micro-batch before the strategy shards or re-lays it, so every token is counted once however
    many ranks share it (and FLOPs per token use the batch's sequence length in both layouts).
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        peak_flops_per_device: Optional[float] = None,
        peak_dtype: Optional[PeakDtype] = None,
        flops_per_token: Optional[float] = None,
        prefix: str = "throughput",
    ) -> None:
        check_positive_int_or_none("log_every_n_steps", log_every_n_steps)
        for name, value in (("peak_flops_per_device", peak_flops_per_device), ("flops_per_token", flops_per_token)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, got {value!r}.")
        if peak_dtype not in (None, "bf16", "fp8", "fp4"):
            raise ValueError(f"peak_dtype={peak_dtype!r}: choose 'bf16', 'fp8', 'fp4' or None.")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops_per_device = peak_flops_per_device
        self.peak_dtype = peak_dtype
        self.flops_per_token = flops_per_token
        self.prefix = prefix
        self.tokens_per_sec: Optional[float] = None
        self.tokens_per_sec_per_device: Optional[float] = None
        self.step_time_s: Optional[float] = None
        self.tflops_per_device: Optional[float] = None
        self.mfu: Optional[float] = None
        self.metrics: dict[str, float] = {}
        self.num_devices = 1
        self.data_parallel_size = 1
        self._clock = time.perf_counter  # tests substitute a fake clock
        self._every = 1
        self._device: Optional[torch.device] = None
        self._flops_per_token_at: dict[int, float] = {}
        self._model_config: Any = None
        self._last_step = 0
        self._reset_window(None)

    def _reset_window(self, start: Optional[float]) -> None:
        self._window_start = start
        self._paused_at: Optional[float] = None
        self._excluded_s = 0.0
        self._tokens = 0  # this rank's tokens in the window
        self._flops = 0.0  # model FLOPs of those tokens
        self._steps = 0

    # ------------------------------------------------------------------ lifecycle
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps))
        self._device = pl_module.device
        self.num_devices = max(1, int(trainer.world_size))
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.data_parallel_size = int(kwargs.get("num_replicas", 1)) if trainer.world_size > 1 else 1
        self._model_config = getattr(pl_module, "model_config", None)
        if self.flops_per_token is None and self._model_config is None:
            rank_zero_info(
                "MoEThroughput: the module has no `model_config` and no flops_per_token was given; "
                "logging tokens/s only."
            )
        if self.peak_flops_per_device is None and self._device.type == "cuda":
            dtype = self.peak_dtype or precision_peak_dtype(trainer)
            name = torch.cuda.get_device_name(self._device)
            self.peak_flops_per_device = device_peak_flops(name, dtype) if dtype else None
            if self.peak_flops_per_device is None:
                rank_zero_info(
                    f"MoEThroughput: no peak FLOP/s for {name!r} at precision {trainer.precision!r}; "
                    "pass peak_flops_per_device for MFU."
                )
        self._reset_window(None)
        self._last_step = trainer.global_step

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._window_start is None:
            # Sync once at the first batch, so the first window does not include work queued
            # before training (sanity validation, setup).
            self._window_start = self._now()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens, seq_length = _batch_tokens(batch)
        self._tokens += tokens
        self._flops += tokens * self._flops_per_token(seq_length)
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: no optimizer step yet
        self._last_step = trainer.global_step
        self._steps += 1
        if trainer.global_step % self._every == 0:
            self._log_window(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._window_start is not None:
            # Sync: validation inside fit is left out of the window; training work queued before
            # it must finish before the clock pauses. Once per validation run.
            self._paused_at = self._now()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._paused_at is not None:
            # Sync: validation work must finish before the clock resumes. Once per validation run.
            self._excluded_s += self._now() - self._paused_at
            self._paused_at = None

    # ------------------------------------------------------------------ math
    def _now(self) -> float:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # the reason this is called only at window edges
        return self._clock()

    def _flops_per_token(self, seq_length: int) -> float:
        if self.flops_per_token is not None:
            return self.flops_per_token
        if self._model_config is None or seq_length <= 0:
            return 0.0
        if seq_length not in self._flops_per_token_at:
            self._flops_per_token_at[seq_length] = model_flops_per_token(self._model_config, seq_length)
        return self._flops_per_token_at[seq_length]

    def _log_window(self, trainer: Trainer) -> None:
        # Sync (in _now): the GPU must have finished the window's steps before the clock stops.
        end = self._now()
        start = self._window_start if self._window_start is not None else end
        elapsed = end - start - self._excluded_s
        if elapsed > 0:
            self.metrics = self.compute(self._tokens, self._flops, self._steps, elapsed)
            log_to_loggers(trainer, self.metrics)
        self._reset_window(end)

    def compute(self, local_tokens: int, local_flops: float, steps: int, elapsed_s: float) -> dict[str, float]:
        """Throughput of a window in which this rank processed ``local_tokens`` (worth
        ``local_flops`` model FLOPs) in ``steps`` optimizer steps and ``elapsed_s`` seconds; sets
        the attributes and returns the metrics dict."""
        global_tokens = local_tokens * self.data_parallel_size
        global_flops = local_flops * self.data_parallel_size
        self.tokens_per_sec = global_tokens / elapsed_s
        self.tokens_per_sec_per_device = self.tokens_per_sec / self.num_devices
        self.step_time_s = elapsed_s / max(1, steps)
        p = self.prefix
        out = {
            f"{p}/tokens_per_sec": self.tokens_per_sec,
            f"{p}/tokens_per_sec_per_device": self.tokens_per_sec_per_device,
            f"{p}/step_time_s": self.step_time_s,
        }
        self.tflops_per_device = self.mfu = None
        if global_flops > 0:
            flops_per_device = global_flops / elapsed_s / self.num_devices
            self.tflops_per_device = flops_per_device / 1e12
            out[f"{p}/tflops_per_device"] = self.tflops_per_device
            if self.peak_flops_per_device:
                self.mfu = flops_per_device / self.peak_flops_per_device
                out[f"{p}/mfu"] = self.mfu
        return out


def _batch_tokens(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of a batch, from shapes."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        return 0, 0
    return batch.numel(), int(batch.shape[-1])


__all__ = ["PEAK_FLOPS", "MoEThroughput", "device_peak_flops", "precision_peak_dtype"]
