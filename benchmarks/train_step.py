"""Whole-model training step: Trainer + MegatronMoEStrategy vs a bare torch loop, same model.

    python benchmarks/train_step.py                     # qwen3_30b_a3b shape, 4 layers, seq 4096, bf16
    python benchmarks/train_step.py --micro-batch 4 --accumulate 2   # 32k tokens per optimizer step
    python benchmarks/train_step.py --preset small --layers 8 --steps 30

Both runs build the same model from the same seed, use the optimizer and LR schedule the
LightningModule configures, bf16 autocast with fp32 master weights, random tokens (never
zeros), and time each optimizer step (``--accumulate`` micro-batches, then the optimizer) from
one step's end to the next, each end marked by a CUDA synchronize (the same in both runs, so
data loading between micro-batches is inside the time). Reports median step time, tokens/s,
TFLOP/s per GPU (model FLOPs per step, ``model_flops_per_token``: active parameters + attention,
fwd+bwd, over time and GPUs) and MFU against the GPU's dense spec peak (``MoEThroughput``'s
table: 989.4 TFLOP/s bf16, 1978.9 FP8 on H100 / H200 SXM; the FP8 peak for an FP8 run), as
Megatron-Core and the peers report it, with the ratio to a measured H200 bf16 GEMM rate (787e12)
as a second, labelled figure; and the Lightning overhead = trainer median / bare median - 1. On
CUDA, next to each run's peak of allocated memory: its activation memory (``activation_gib``), the
measured steps' peak minus what was allocated when they started (``static_gib``: parameters,
gradients, optimizer states, weight-cast caches), the part that offload and recompute can cut
(`ActivationMemory`; the HF peer's is not measured). Writes
``benchmarks/results/train_step_<tag>.json``.

Several GPUs (the Lightning run only, ``--skip-bare``): ``--devices N`` with the folded layout's
sizes, e.g. ``--devices 8 --tensor-parallel 2 --expert-parallel 4`` (dense TP2 x DP4, experts EP4 x
EDP2 over the same ranks). Lightning starts one process per device. Each data-parallel rank takes
its own micro-batches (tensor-parallel peers the same ones) through Lightning's distributed
sampler, which also shuffles them, so the loss curve is not the one-device stream's. An optimizer
step covers ``micro_batch x seq x accumulate x DP`` tokens; tokens/s and TFLOP/s are the whole
job's, TFLOP/s and MFU per GPU. Rank 0 writes the results; the losses and the peak
memory in them are rank 0's own. ``--accelerator cpu`` runs the same on CPU processes (gloo), a
plumbing check: its MFU means nothing (on one CPU process the bare loop runs too).

Packed documents (``--packed``): each row of ``--seq`` tokens is filled exactly by documents of
lognormal lengths (median ``--doc-median``, log-space sigma ``--doc-sigma``, at least ``--doc-min``,
the row's last document cut to fit; seeded by ``--doc-seed``, drawn apart from the tokens, so a
packed run trains the same tokens as the unpacked one). Both runs feed ``document_ids`` and
per-document ``position_ids`` (restarting at 0, as ``LMDataModule(pack_sequences=True)`` does), and
a document's last token does not predict the next document (label -100); attention stays inside
each document (compiled FlexAttention with a block mask on CUDA). The attention FLOPs are then
counted per document (`packed_model_flops`): ``sum_i L_i^2`` instead of ``S^2`` per row, in the
same full-square convention as ``model_flops_per_token``, so packed and unpacked TFLOP/s compare;
``tflops_per_gpu_causal`` counts the causal half in both (``sum_i L_i^2 / 2`` against ``S^2 / 2``).
The JSON's ``config.packed`` / ``config.documents`` / ``config.flops_model`` record the flag, the
document-length statistics of the run's micro-batches and the FLOP count used:

    python benchmarks/train_step.py --seq 16384 --layers 4 --micro-batch 1 --packed
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.moe_block import expert_alignment  # noqa: E402

MEASURED_H200_BF16_GEMM = 787e12  # dense bf16 GEMM rate measured on one H200 (a second, labelled ratio)


def spec_peak_flops(args) -> Optional[float]:
    """The GPU's dense spec peak FLOP/s for this run's precision (``MoEThroughput``'s table), or None
    (CPU, or a GPU the table lacks)."""
    if args.accelerator != "cuda":
        return None
    from lightning_moe.callbacks.throughput import device_peak_flops

    dtype = "bf16" if args.precision == "bf16" else "fp4" if args.precision == "nvfp4" else "fp8"
    return device_peak_flops(torch.cuda.get_device_name(), dtype)


def marginal_layer(step_s: tuple[float, float], flops: tuple[float, float], layers: tuple[int, int],
                   full_layers: int, full_flops: float, devices: int) -> dict:
    """What one more layer costs, from the same model timed at two layer counts: the step time and
    FLOPs per added layer, their TFLOP/s per GPU, and the step time and TFLOP/s per GPU projected
    for ``full_layers`` layers (``full_flops`` FLOPs per step): the shorter model's time plus a
    marginal layer's for each missing layer. The embedding, the LM head and the optimizer weigh
    far more in a 4-layer model than in the preset's full depth; this takes them out."""
    (t1, t2), (f1, f2), (l1, l2) = step_s, flops, layers
    if l2 == l1:
        raise ValueError("marginal_layer needs two different layer counts")
    dt, df = (t2 - t1) / (l2 - l1), (f2 - f1) / (l2 - l1)
    full_s = t1 + (full_layers - l1) * dt
    return {
        "layers": [l1, l2], "step_s": [t1, t2], "flops_per_step": [f1, f2],
        "step_s_per_layer": dt, "flops_per_layer": df,
        "tflops_per_gpu_per_layer": df / dt / 1e12 / devices if dt > 0 else None,
        "full_layers": full_layers, "projected_full_step_s": full_s,
        "projected_full_tflops_per_gpu": full_flops / full_s / 1e12 / devices if full_s > 0 else None,
    }


def packed_model_flops(cfg, document_lengths: list[list[int]], causal: bool = False) -> dict:
    """Training (forward + backward) FLOPs of packed rows whose attention stays inside each document.

    ``document_lengths``: per row, the lengths ``L_i`` of its documents (each row's sum is its
    tokens). The matrix products cost ``6 * forward_matmul_parameters(cfg)`` per token, as in
    ``model_flops_per_token``; attention costs ``attention_flops_per_token(cfg, L_i)`` per token of
    document ``i``, i.e. ``sum_i L_i^2`` score pairs per row in ``model_flops_per_token``'s full-square
    convention (one document filling the row gives exactly ``model_flops_per_token(cfg, S) * S``), or
    half of that with ``causal`` (``sum_i L_i^2 / 2``: the pairs a causal kernel must compute, up to
    the diagonal). Returns ``{"tokens", "matmul", "attention", "total"}`` (FLOPs)."""
    from lightning_moe.models.flops import attention_flops_per_token, forward_matmul_parameters

    lengths = [int(n) for row in document_lengths for n in row]
    if any(n <= 0 for n in lengths):
        raise ValueError(f"document lengths must be positive, got {sorted(lengths)[:5]}...")
    tokens = sum(lengths)
    # attention_flops_per_token is linear in the length: its value at 1 is the FLOPs per score pair
    per_pair = attention_flops_per_token(cfg, 1) * (0.5 if causal else 1.0)
    matmul = 6.0 * forward_matmul_parameters(cfg) * tokens
    attention = per_pair * sum(n * n for n in lengths)
    return {"tokens": tokens, "matmul": matmul, "attention": attention, "total": matmul + attention}


def document_lengths(args, rows: int) -> list[list[int]]:
    """The document lengths of the first ``rows`` packed rows (``--doc-*``): lognormal, each row
    filled exactly to ``--seq``, its last document cut to fit. The same stream for every caller
    (a fixed seed), so the bare loop, the Lightning run and the FLOP count see the same rows."""
    rng = random.Random(args.doc_seed)
    mu = math.log(args.doc_median)
    out = []
    for _ in range(rows):
        row, total = [], 0
        while total < args.seq:
            n = max(args.doc_min, int(round(rng.lognormvariate(mu, args.doc_sigma))))
            n = min(n, args.seq - total)
            row.append(n)
            total += n
        out.append(row)
    return out


def packed_fields(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``document_ids``, ``position_ids`` ``[B, S]`` of packed rows (the representation of
    ``lightning_moe.models.document_mask``) and the ``[B, S]`` mask of the labels to ignore: every
    document's last token but the row's last (that document is cut, as a window cuts one)."""
    docs, positions, ends = [], [], []
    for row in lengths:
        sizes = torch.tensor(row)
        docs.append(torch.repeat_interleave(torch.arange(len(row)), sizes))
        positions.append(torch.cat([torch.arange(n) for n in row]))
        end = torch.zeros(int(sizes.sum()), dtype=torch.bool)
        end[sizes.cumsum(0)[:-1] - 1] = True
        ends.append(end)
    return torch.stack(docs), torch.stack(positions), torch.stack(ends)


def document_stats(lengths: list[list[int]], seq: int) -> dict:
    """Statistics of the documents of packed rows (the JSON's ``config.documents``)."""
    flat = sorted(n for row in lengths for n in row)
    pairs = sum(n * n for n in flat)
    return {
        "rows": len(lengths), "documents": len(flat),
        "documents_per_row": len(flat) / len(lengths),
        "mean": statistics.fmean(flat), "median": statistics.median(flat),
        "p90": flat[min(len(flat) - 1, int(0.9 * len(flat)))], "min": flat[0], "max": flat[-1],
        # sum_i L_i^2 over S^2 per row: the packed attention's share of the unpacked one's pairs
        "attention_pair_fraction": pairs / (len(lengths) * seq * seq),
    }


def step_flops(args, cfg, tokens: int, rows: int) -> dict:
    """The FLOP count of one optimizer step of ``tokens`` tokens (the JSON's ``config.flops_model``):
    ``model_flops_per_token(cfg, S) * tokens``, or with ``--packed`` the mean over the run's first
    ``rows`` packed rows of `packed_model_flops` per token, times the tokens. ``total`` is the
    full-square count (TFLOP/s); ``total_causal`` counts the causal half of the attention."""
    from lightning_moe.models.flops import attention_flops_per_token, model_flops_per_token

    if not args.packed:
        total = model_flops_per_token(cfg, args.seq) * tokens
        attention = attention_flops_per_token(cfg, args.seq) * tokens
        return {"name": "model_flops_per_token", "attention": "full S x S per row", "total": total,
                "attention_flops": attention, "total_causal": total - attention / 2}
    full = packed_model_flops(cfg, document_lengths(args, rows))
    scale = tokens / full["tokens"]  # the rows' mean per token, over the step's tokens
    return {"name": "packed_model_flops", "attention": "per document: sum_i L_i^2 per row",
            "total": full["total"] * scale,
            "attention_flops": full["attention"] * scale,
            "total_causal": (full["total"] - full["attention"] / 2) * scale, "rows_averaged": rows}


def trainer_rank_zero(args) -> bool:
    """Whether this process is the first of the Lightning run (launched by Lightning as LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def sync(args) -> None:
    """Wait for the device's queued work (a host sync; nothing to wait for on CPU)."""
    if args.accelerator == "cuda":
        torch.cuda.synchronize()


def profiled_optimizer_step(warmup: int, steps: int) -> int:
    """The optimizer step (counted from 0) that ``--profile`` traces under ``Trainer``: the last but
    one of the fit where there are two or more after the warm-up, else the last. The last writes the
    module's metrics (a host sync, and on its first logging each metric is registered by host-to-
    device copies), which no other step does while ``log_every_n_steps`` exceeds the fit."""
    return warmup + steps - (2 if steps >= 2 else 1)


def data_parallel_size(args) -> int:
    """Ranks that take different micro-batches: the devices over the tensor-parallel size (`main`
    checks that it divides them)."""
    return args.devices // args.tensor_parallel


# --offload / --recompute / --recompute-layers: activation memory options of the Lightning run.
def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_moe.callbacks.activation_offload import OFFLOAD_MODULES
    from lightning_moe.models.recompute import RECOMPUTE_MODULES

    parser.add_argument("--offload", nargs="+", default=None, choices=OFFLOAD_MODULES, metavar="MODULE",
                        help=f"ActivationOffload(modules=...) in the Lightning run: {', '.join(OFFLOAD_MODULES)}")
    parser.add_argument("--offload-keep-last-layers", type=int, default=1,
                        help="ActivationOffload(keep_last_layers=...): last layers that keep their tensors")
    parser.add_argument("--recompute", nargs="+", default=None, choices=RECOMPUTE_MODULES, metavar="MODULE",
                        help=f"ModelConfig.recompute (selective recompute): {', '.join(RECOMPUTE_MODULES)}")
    parser.add_argument("--recompute-layers", type=int, default=None, metavar="N",
                        help="ModelConfig.recompute_every_n_layers: whole blocks 0, N, 2N, ... recomputed")


def check_memory_arguments(args) -> None:
    if (args.offload or args.recompute or args.recompute_layers) and not args.skip_bare:
        raise SystemExit("--offload / --recompute / --recompute-layers configure the Lightning run: add --skip-bare")
    if args.offload and args.cuda_graph is not None:
        raise SystemExit("--offload cannot run with --cuda-graph (ActivationOffload refuses CUDAGraphs): drop one")


def memory_overrides(args) -> dict:
    """ModelConfig overrides of --recompute / --recompute-layers."""
    return {"recompute": args.recompute, "recompute_every_n_layers": args.recompute_layers}


class ActivationMemory:
    """Activation memory of a run: the peak of allocated CUDA memory over the measured steps minus
    the static memory (``static_gib``): what is allocated just before each measured optimizer
    step, when the backward is done and the activations are gone, but the parameters, gradients,
    optimizer states and the step's weight-cast caches (bf16 casts and FP8 weights, made again in
    every step's first forward and kept to its optimizer step) are all there. Taken at the step's
    start instead, the caches (2 bytes a parameter) would count as activations. `measured_start`
    resets the peak statistics and keeps the warm-up's peak, so that `run_peak` is still the peak
    of the whole run. Off CUDA (or before CUDA starts) every figure is None."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started = False
        self.static: Optional[int] = None
        self.measured_peak: Optional[int] = None
        self.warmup_peak = 0

    @staticmethod
    def _cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def measured_start(self) -> None:
        """At the start of the first measured step (no host sync: allocator statistics only)."""
        if not self._cuda():
            return
        self.warmup_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.started = True

    def before_optimizer_step(self) -> None:
        """After a measured step's last backward, before its optimizer step (allocator statistics
        only, no host sync): the static bytes, the largest over the measured steps."""
        if self.started:
            self.static = max(self.static or 0, torch.cuda.memory_allocated())

    def measured_end(self) -> None:
        if self.static is not None:
            self.measured_peak = torch.cuda.max_memory_allocated()

    def run_peak(self) -> Optional[int]:
        """The peak over the whole run (warm-up included)."""
        if not self._cuda():
            return None
        return max(self.warmup_peak, torch.cuda.max_memory_allocated())

    def figures(self) -> dict:
        """GiB: ``static_gib``, ``measured_peak_gib``, ``activation_gib`` (None where not measured)."""
        if self.static is None or self.measured_peak is None:
            return {"static_gib": None, "measured_peak_gib": None, "activation_gib": None}
        return {"static_gib": self.static / 2**30, "measured_peak_gib": self.measured_peak / 2**30,
                "activation_gib": (self.measured_peak - self.static) / 2**30}


ACTIVATION_MEMORY = ActivationMemory()  # the run in progress (runs go one after the other)


def activation_memory_callback(args, tracker: Optional[ActivationMemory] = None):
    """A Lightning callback marking ``tracker``'s measured steps: from the first micro-batch after
    the warm-up's optimizer steps to the end of training."""
    from lightning.pytorch.callbacks import Callback

    tracker = ACTIVATION_MEMORY if tracker is None else tracker

    class MarkMeasuredSteps(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup * args.accumulate:
                tracker.measured_start()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            tracker.before_optimizer_step()

        def on_train_end(self, trainer, pl_module):
            tracker.measured_end()

    return MarkMeasuredSteps()


def memory_callbacks(args) -> list:
    """The measured steps' activation memory (`ActivationMemory`) and the ActivationOffload
    callback of --offload."""
    callbacks = [activation_memory_callback(args)]
    if not args.offload:
        return callbacks
    from lightning_moe.callbacks import ActivationOffload

    return callbacks + [ActivationOffload(args.offload, keep_last_layers=args.offload_keep_last_layers)]


def _default_lm_head_chunk() -> int:
    from dataclasses import fields

    from lightning_moe.models import ModelConfig

    default = next(f.default for f in fields(ModelConfig) if f.name == "lm_head_chunk_tokens")
    return default or 0  # None (the unchunked head) is 0 on the command line


def experts_only(name: str, module) -> bool:
    """`FP8Precision` module filter of ``--fp8-modules experts``: the routed experts alone in FP8."""
    from lightning_moe.nn import GroupedExperts

    return isinstance(module, GroupedExperts)


def build_module(args):
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.nn import experts

    experts.GATHERED_FIRST_PROJECTION = getattr(args, "gathered_fc1", "on") == "on"
    from lightning_moe import cuda_graphs

    cuda_graphs.OWN_WARMUP = getattr(args, "capture_warmup", "own") == "own"
    overrides = {"num_layers": args.layers, "max_seq_length": args.seq, "moe": {"expert_backend": args.expert_backend}}
    # FP8 grouped GEMMs (torch and TE kernels) need every expert's token group padded.
    overrides["moe"]["expert_alignment"] = expert_alignment(args.precision)
    overrides.update(memory_overrides(args))
    overrides["lm_head_chunk_tokens"] = args.lm_head_chunk_tokens or None  # 0: the unchunked head
    return MoELanguageModel(args.preset, overrides=overrides, learning_rate=1e-4, warmup_steps=10, max_steps=10_000)


def batches(args, vocab: int, count: int, device):
    """``count`` micro-batches: random tokens, or random windows of the embedded corpus's
    training split (``--data corpus``: loss curves that mean something). ``--packed``: with the
    rows' ``document_ids`` and ``position_ids`` (`document_lengths`) and no label across a
    document boundary; the tokens are the unpacked run's."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    packed = getattr(args, "packed", False)
    lengths = document_lengths(args, count * args.micro_batch) if packed else None
    stream = None
    if args.data == "corpus":
        from lightning_moe.data.corpus import load_corpus

        stream = torch.from_numpy(load_corpus().train_tokens.astype("int64"))
    for i in range(count):
        if stream is None:
            t = torch.randint(1, vocab, (args.micro_batch, args.seq + 1), generator=g)
        else:
            starts = torch.randint(0, stream.numel() - args.seq - 1, (args.micro_batch,), generator=g)
            t = torch.stack([stream[s : s + args.seq + 1] for s in starts.tolist()])
        batch = {"input_ids": t[:, :-1], "labels": t[:, 1:]}
        if packed:
            docs, positions, ends = packed_fields(lengths[i * args.micro_batch : (i + 1) * args.micro_batch])
            batch = {**batch, "labels": batch["labels"].masked_fill(ends, -100), "document_ids": docs,
                     "position_ids": positions}
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_loss(model, batch: dict) -> torch.Tensor:
    """The decoder's loss on a micro-batch, packed or not (as ``MoELanguageModel`` computes it)."""
    return model.loss(batch["input_ids"], batch["labels"], batch.get("position_ids"), batch.get("document_ids"))


def clip(optimizer, max_norm: float) -> None:
    """Clip by norm as the strategy's precision plugin does (`GlobalNormClipping`: one norm; a fused
    Adam(W) step takes the coefficient itself, with no pass scaling the gradients first)."""
    from lightning_moe.precision.clipping import Precision

    Precision().clip_grad_by_norm(optimizer, max_norm)


def bare_loop(args) -> list[float]:
    """The same module, optimizer and schedule driven by a plain loop (no Lightning), on one GPU
    (or one CPU process with ``--accelerator cpu``: a plumbing check)."""
    device = "cuda" if args.accelerator == "cuda" else "cpu"
    torch.manual_seed(0)
    module = build_module(args)
    with torch.device("meta"):
        module.configure_model()
    module.model.to_empty(device=device)
    module.model.init_weights()
    opt_cfg = module.configure_optimizers()  # max_steps is given: no Trainer needed
    optimizer, scheduler = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    times: list[float] = []
    vocab = module.model_config.vocab_size
    data = batches(args, vocab, (args.warmup + args.steps) * args.accumulate, device)
    losses: list[torch.Tensor] = []
    from lightning_moe.nn.compute_weights import ComputeWeightCache

    # the weight casts of one optimizer step shared by its micro-batches, as the strategy does
    weight_casts = ComputeWeightCache(accumulate_grads_in_place=args.accumulate_grads_in_place == "on")
    casts_active = weight_casts.active if args.cache_weight_casts == "on" else contextlib.nullcontext
    sync(args)  # host sync: the first step's start
    last_end = time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            ACTIVATION_MEMORY.measured_start()
        window_loss = 0.0  # the optimizer step's mean loss over its micro-batches
        for _ in range(args.accumulate):
            batch = next(data)
            with casts_active(), torch.autocast(device, dtype=torch.bfloat16):
                loss = batch_loss(module.model, batch) / args.accumulate
            loss.backward()
            window_loss = window_loss + loss.detach()
        ACTIVATION_MEMORY.before_optimizer_step()
        if args.clip:
            clip(optimizer, args.clip)
        optimizer.step()
        weight_casts.clear()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync(args)  # host sync: end of the timed step (same in the Lightning run)
        now = time.perf_counter()
        times.append(now - last_end)
        last_end = now
        losses.append(window_loss)  # read once after the loop: no extra sync in the timed steps
    ACTIVATION_MEMORY.measured_end()
    losses_list = torch.stack(losses).tolist()
    if args.profile:
        from benchmarks._profile import print_profile, profile_step

        batch = next(batches(args, vocab, 1, device))

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = batch_loss(module.model, batch)
            loss.backward()  # outside autocast, as the timed loop and Lightning run it
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        print_profile(profile_step(step))
    del module, optimizer, scheduler
    if device == "cuda":
        torch.cuda.empty_cache()
    return times[args.warmup :], losses_list


def lightning_run(args, cuda_graph: Optional[str] = None) -> Optional[tuple[list[float], list[float]]]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_moe import MegatronMoEStrategy

    # Lightning's seed as well as torch's: the strategy's setup re-seeds from PL_GLOBAL_SEED when a
    # seed_everything() before (in this process) left one, and the model is built after it.
    L.seed_everything(0, verbose=False)
    module = build_module(args)
    times: list[float] = []
    losses: list[float] = []

    class Timer(Callback):
        """Times optimizer steps end to end (the first interval starts at the first batch)."""

        last_end = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.last_end is None:
                sync(args)  # host sync: the first step's start
                self.last_end = time.perf_counter()

        window_loss = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Lightning hands back each micro-batch's loss divided by the accumulation count, so
            # their sum over the window is the optimizer step's mean loss (as the bare loop's).
            self.window_loss = self.window_loss + outputs["loss"].detach()
            if (batch_idx + 1) % args.accumulate:
                return
            sync(args)  # host sync: end of the timed step (same in the bare loop)
            now = time.perf_counter()
            times.append(now - self.last_end)
            self.last_end = now
            losses.append(self.window_loss)
            self.window_loss = 0.0

    class ProfileSteadyStep(Callback):
        """``--profile --skip-bare``: the kernels of one optimizer step (all its micro-batches and
        the optimizer), as Lightning runs it: the last but one (`profiled_optimizer_step`). The
        fit's last step is not representative: it is the one whose metrics the module logs, and
        its first logging of each metric registers it (the metric's states are made on the host
        and copied to the device, each copy from pageable memory waiting for the queue to drain)."""

        prof = None
        step = profiled_optimizer_step(args.warmup, args.steps)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == self.step * args.accumulate:
                from torch.profiler import ProfilerActivity, profile

                sync(args)  # host sync: the profiled step starts on an idle GPU
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()
            elif batch_idx == (self.step + 1) * args.accumulate:
                self._write()

        def on_train_end(self, trainer, pl_module):
            self._write()  # the profiled step was the fit's last

        def _write(self):
            if self.prof is None:
                return
            from benchmarks._profile import print_profile, summarize_profile

            sync(args)  # host sync: every kernel of the step inside the trace
            self.prof.__exit__(None, None, None)
            summary = summarize_profile(self.prof, top_kernels=60)
            self.prof = None
            print_profile(summary, rows=40)
            tag = args.tag or f"{args.preset}_{args.layers}l"
            graphed = "_cuda_graph" if cuda_graph is not None else ""  # the eager run's file kept beside it
            write_results(f"train_step_{tag}{graphed}_profile",
                          {"config": vars(args), "profiled_optimizer_step": self.step, "profile": summary},
                          results_dir=args.results_dir)

    callbacks = [Timer()]
    if cuda_graph is not None:  # --cuda-graph: the same run with CUDAGraphs, captured inside the warm-up
        from lightning_moe.callbacks import CUDAGraphs

        callbacks.append(CUDAGraphs(scope=cuda_graph.split("+") if "+" in cuda_graph else cuda_graph,
                                    warmup_steps=min(3, args.warmup - 1)))
    callbacks += memory_callbacks(args)
    if args.profile and args.skip_bare and trainer_rank_zero(args):
        callbacks.append(ProfileSteadyStep())
    # Every data-parallel rank takes its share (the strategy's distributed sampler) of DP times the
    # micro-batches one rank runs.
    num_batches = (args.warmup + args.steps) * args.accumulate * data_parallel_size(args)
    data = list(batches(args, module.model_config.vocab_size, num_batches, "cpu"))
    precision: dict = {"precision": "bf16-mixed"}
    if args.precision != "bf16":
        from lightning_moe.precision import FP8Precision, FP8Recipe

        fast = None if args.fast_accumulation is None else tuple(args.fast_accumulation)
        recipe = FP8Recipe(args.precision, fast_accumulation=fast, graph_weight_casts=args.graph_weight_casts)
        cache = {"auto": None, "on": True, "off": False}[args.cache_fp8_weights]
        module_filter = None if args.fp8_modules == "all" else experts_only
        plugin = FP8Precision(recipe=recipe, backend=args.fp8_backend, cache_fp8_weights=cache,
                              module_filter=module_filter)
        precision = {"plugins": [plugin]}
    strategy = MegatronMoEStrategy(
        tensor_parallel_size=args.tensor_parallel, expert_parallel_size=args.expert_parallel,
        expert_tensor_parallel_size=args.expert_tensor_parallel, sharding=args.sharding,
        expert_sharding=args.expert_sharding, token_dispatcher=args.dispatcher, print_layout=False,
        cache_weight_casts=args.cache_weight_casts == "on",
        accumulate_grads_in_place=None if args.accumulate_grads_in_place == "on" else False,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy,
        **precision, max_steps=args.warmup + args.steps, logger=False,
        accumulate_grad_batches=args.accumulate,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=args.clip, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0,
        # On one device the micro-batches are already a deterministic stream: keep their order, as
        # the bare loop does (a distributed strategy would otherwise get Lightning's shuffling
        # sampler, whose permutation depends on the number of micro-batches). On several, the
        # strategy's sampler deals them to the data-parallel ranks.
        use_distributed_sampler=args.devices > 1,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=None, pin_memory=args.accelerator == "cuda")
    trainer.fit(module, loader)
    if not trainer.is_global_zero:
        return None
    return times[args.warmup :], [float(x) for x in losses]


# On/off switches of module constants (experiments, and defaults a run may switch off): flag, module,
# constant, the constant's default, and what "on" does. A module is imported only to change its constant.
EXPERIMENT_TOGGLES = [
    ("--dense-transposed-copies", "lightning_moe.precision.scaled_mm", "DENSE_TRANSPOSED_COPIES", False,
     "a delayed dense linear's input cast in both layouts in the forward and its weight's transposed FP8 copy "
     "cached per optimizer step, instead of the backward's float8 transposes"),
    ("--dense-grad-both-layouts", "lightning_moe.precision.scaled_mm", "DENSE_GRAD_BOTH_LAYOUTS", False,
     "with the transposed copies, a delayed dense linear's output gradient cast in both layouts by one read "
     "instead of transposed"),
    ("--tiled-fp8-transposes", "lightning_moe.precision.native_gemms", "TILED_FP8_TRANSPOSES", True,
     "a dense linear's float8 transposes by the tiled byte transpose kernel instead of torch's elementwise copy"),
    ("--wgrad-prefetch-old", "lightning_moe.kernels.fp8_grouped_gemm_triton", "WGRAD_PREFETCH_OLD", True,
     "the FP8 expert weight gradient loads each tile's old .grad values before its contraction instead of after it"),
    ("--wgrad-fp32-store-whole", "lightning_moe.kernels.fp8_grouped_gemm_triton", "WGRAD_FP32_STORE_WHOLE", True,
     "the FP8 expert weight gradient stores each fp32 tile by TMA whole instead of in two column halves"),
    ("--wgrad-tma-reduce", "lightning_moe.kernels.fp8_grouped_gemm_triton", "TMA_REDUCE", False,
     "the FP8 expert weight gradient adds each tile into .grad by TMA's reduce-add instead of loading the old values"),
    ("--wgrad-columns-first", "lightning_moe.kernels.fp8_grouped_gemm_triton", "WGRAD_COLUMNS_FIRST", False,
     "the FP8 expert weight gradient deals an expert's tiles along the gradient's rows first"),
]


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and micro-batch shape (`build_module`, `batches`), shared with the tools that
    build the same model."""
    parser.add_argument("--preset", default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--gathered-fc1", choices=["on", "off"], default="on",
                        help="off: the dispatcher permutes and the experts' fc1 keeps the permuted rows for backward "
                             "(experts.GATHERED_FIRST_PROJECTION; on: it keeps the tokens and gathers again)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--data", choices=["random", "corpus"], default="random",
                        help="random tokens, or windows of the embedded byte-level corpus")
    parser.add_argument("--precision", default="bf16",
                        help="bf16, or an FP8Precision recipe for the Lightning run (tensorwise, blockwise, delayed, ...)")
    parser.add_argument("--fp8-backend", default="auto", help="FP8Precision backend: auto, te, torch, emulated")
    parser.add_argument("--fast-accumulation", nargs="*", default=None, choices=["fprop", "dgrad", "wgrad"],
                        help="FP8Recipe.fast_accumulation (default: the recipe's)")
    parser.add_argument("--cache-fp8-weights", choices=["auto", "on", "off"], default="auto",
                        help="FP8Precision(cache_fp8_weights=None / True / False); auto: the plugin's default")
    parser.add_argument("--graph-weight-casts", action="store_true", help="FP8Recipe(graph_weight_casts=True)")
    parser.add_argument("--fp8-modules", choices=["all", "experts"], default="all",
                        help="all: FP8Precision's default conversion; experts: a module_filter keeping every "
                             "module but the routed experts in bf16 (what the dense linears' FP8 costs or gains)")
    parser.add_argument("--expert-backend", default="auto", help="grouped GEMM backend: auto, grouped_mm, te")
    parser.add_argument("--cache-weight-casts", choices=["on", "off"], default="on",
                        help="MegatronMoEStrategy(cache_weight_casts=...): bf16 weight casts once per optimizer step")
    parser.add_argument("--accumulate-grads-in-place", choices=["on", "off"], default="on",
                        help="on: MegatronMoEStrategy(accumulate_grads_in_place=None), the default; off: False "
                             "(micro-batches after the first add their weight gradients into .grad in one pass: "
                             "the bf16 casts' and, under --precision, the FP8 GEMMs')")
    parser.add_argument("--fused-cross-entropy", choices=["on", "off"], default="on",
                        help="off: the LM loss through F.cross_entropy on fp32 logits (nn.cross_entropy.FUSED_KERNEL)")
    parser.add_argument("--lm-head-chunk-tokens", type=int, default=_default_lm_head_chunk(), metavar="N",
                        help="ModelConfig.lm_head_chunk_tokens: the training loss's LM head and cross-entropy N tokens "
                             "at a time, no [tokens, vocab] logits (default: the ModelConfig default); 0: off, the "
                             "unchunked head (logits, then the fused cross-entropy)")
    for flag, module, constant, default, effect in EXPERIMENT_TOGGLES:
        parser.add_argument(flag, choices=["on", "off"], default="on" if default else "off",
                            help=f"{module.rsplit('.', 1)[-1]}.{constant} ({'default' if default else 'experiment'}):"
                                 f" {effect}")
    parser.add_argument("--single-group-chunk-rows", type=int, default=0, metavar="N",
                        help="fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS (experiment): a dense operand's both-layout "
                             "cast in runs of N rows per program on the Triton kernel; 0: one program per column "
                             "block (bf16 on the CUDA kernel)")
    parser.add_argument("--fused-rotary", choices=["on", "off"], default="on",
                        help="off: per-head qk-norm and rotary embedding through the eager fp32 ops instead of "
                             "one Triton kernel each way (models.rotary.FUSED_KERNEL)")
    parser.add_argument("--skip-bare", action="store_true", help="only the Lightning run (loss-curve studies)")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of one bare step")
    parser.add_argument("--devices", type=int, default=1, help="devices (processes) of the Lightning run")
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the Lightning run on CPU processes, a check of the multi-process plumbing")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="MegatronMoEStrategy tensor_parallel_size")
    parser.add_argument("--expert-parallel", type=int, default=1, help="MegatronMoEStrategy expert_parallel_size")
    parser.add_argument("--expert-tensor-parallel", type=int, default=1,
                        help="MegatronMoEStrategy expert_tensor_parallel_size")
    parser.add_argument("--sharding", choices=["fsdp", "ddp"], default="fsdp", help="dense parameters")
    parser.add_argument("--expert-sharding", choices=["fsdp", "ddp"], default="fsdp", help="expert parameters")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default=None,
                        help="token dispatcher under expert parallelism (default: the strategy's)")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    parser.add_argument("--peer", choices=["hf"], default=None,
                        help="hf: also time HF transformers' Qwen3MoeForCausalLM of the same shape, trained the same "
                             "way (benchmarks/hf_peer.py), its TFLOP/s from the same FLOP count")
    parser.add_argument("--capture-warmup", choices=["torch", "own"], default="own",
                        help="--cuda-graph: who runs the warm-up passes before the capture (cuda_graphs.OWN_WARMUP; "
                             "own, the library's default: their results are dropped before the capture allocates; "
                             "torch: make_graphed_callables' own warm-up)")
    parser.add_argument("--marginal-layers", type=int, default=None,
                        help="also time the Lightning run with this many layers: the cost of a layer and the "
                             "TFLOP/s per GPU projected for the preset's full depth (`marginal_layer`)")
    parser.add_argument("--cuda-graph", default=None,
                        choices=["full", "attn", "moe", "attn+moe", "full_iteration"],
                        help="also run the Lightning step with CUDAGraphs(scope=...) (captured inside the "
                             "untimed warm-up, which must be at least 2 steps): its time against the eager "
                             "Lightning step and both peak memories")
    parser.add_argument("--packed", action="store_true",
                        help="packed documents: document_ids and per-document position_ids in every batch, "
                             "attention inside each document, its FLOPs counted per document")
    parser.add_argument("--doc-median", type=float, default=2048.0, help="--packed: median document length")
    parser.add_argument("--doc-sigma", type=float, default=1.0,
                        help="--packed: sigma of the log of the document length (lognormal)")
    parser.add_argument("--doc-min", type=int, default=32, help="--packed: shortest document drawn (before the cut)")
    parser.add_argument("--doc-seed", type=int, default=4321, help="--packed: seed of the document lengths")
    add_memory_arguments(parser)
    args = parser.parse_args(argv)
    check_memory_arguments(args)
    if args.cuda_graph is not None and args.warmup < 2:
        raise SystemExit("--cuda-graph needs --warmup >= 2: the capture and a first replay stay untimed")
    if args.fused_cross_entropy == "off":
        import lightning_moe.nn.cross_entropy as cross_entropy

        cross_entropy.FUSED_KERNEL = False
    if args.lm_head_chunk_tokens < 0:
        raise SystemExit(f"--lm-head-chunk-tokens {args.lm_head_chunk_tokens}: give a positive chunk, or 0 for off")
    for flag, module, constant, default, _ in EXPERIMENT_TOGGLES:
        on = getattr(args, flag[2:].replace("-", "_")) == "on"
        if on != default:  # imported only when asked to change it
            setattr(importlib.import_module(module), constant, on)
    if args.single_group_chunk_rows < 0 or args.single_group_chunk_rows % 16:
        raise SystemExit(f"--single-group-chunk-rows {args.single_group_chunk_rows}: give a multiple of 16 rows, "
                         "or 0 for off")
    if args.single_group_chunk_rows:
        import lightning_moe.kernels.fp8_delayed_triton as fp8_delayed_triton

        fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = args.single_group_chunk_rows
    if args.fused_rotary == "off":
        import lightning_moe.models.rotary as rotary

        rotary.FUSED_KERNEL = False
    if args.devices < 1 or args.tensor_parallel < 1 or args.devices % args.tensor_parallel:
        raise SystemExit(f"--devices {args.devices} must be a positive multiple of --tensor-parallel "
                         f"{args.tensor_parallel}")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_step.py needs a CUDA GPU (or --accelerator cpu for the Lightning run on CPU)")
    if args.devices > 1 and not args.skip_bare:
        raise SystemExit("the bare loop runs on one device: add --skip-bare for --devices > 1")
    if args.packed and (args.doc_median < 1 or args.doc_sigma < 0 or args.doc_min < 1):
        raise SystemExit("--doc-median and --doc-min must be at least 1 and --doc-sigma at least 0")
    if args.packed and args.peer is not None:
        raise SystemExit("--peer hf trains without document masks: drop --packed or --peer")
    from lightning_moe.models import get_preset

    cfg = get_preset(args.preset, num_layers=args.layers, max_seq_length=args.seq)
    tokens = args.micro_batch * args.seq * args.accumulate * data_parallel_size(args)  # per optimizer step, all ranks
    # the rows of every micro-batch the Lightning run draws (the bare loop's are the first of them)
    rows = (args.warmup + args.steps) * args.accumulate * data_parallel_size(args) * args.micro_batch
    flops_model = step_flops(args, cfg, tokens, rows)
    flops_per_step = flops_model["total"]
    documents = document_stats(document_lengths(args, rows), args.seq) if args.packed else None
    if documents is not None and trainer_rank_zero(args):
        print(f"packed: {documents['documents_per_row']:.1f} documents per row of {args.seq}, median "
              f"{documents['median']:.0f} mean {documents['mean']:.0f} max {documents['max']} tokens; "
              f"attention pairs {documents['attention_pair_fraction']*100:.1f}% of unpacked", flush=True)
    results = {}
    runs = (("bare_torch", bare_loop), ("lightning", lightning_run))
    if args.skip_bare:
        runs = runs[1:]
    if args.peer == "hf":
        if args.devices != 1 or args.accelerator != "cuda":
            raise SystemExit("--peer hf runs on one GPU: drop --devices / --accelerator cpu")
        from benchmarks.hf_peer import hf_config, hf_loop

        hf_config(cfg)  # refuses a shape HF's Qwen3-MoE cannot express, before anything runs
        runs = (*runs, ("hf_transformers", lambda a: hf_loop(a, cfg, batches)))
    if args.cuda_graph is not None:
        runs = (*runs, ("lightning_cuda_graph", lambda a: lightning_run(a, a.cuda_graph)))
    if args.precision != "bf16" and not args.skip_bare:
        raise SystemExit("--precision applies to the Lightning run only: add --skip-bare")
    cuda = args.accelerator == "cuda"
    peak_flops = spec_peak_flops(args)
    for name, fn in runs:
        if cuda:
            gc.collect()  # the run before may leave its model in reference cycles: free it first
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ACTIVATION_MEMORY.reset()
        outcome = fn(args)
        if outcome is None:  # a rank other than 0 of a multi-process run: rank 0 reports
            return
        times, losses = outcome
        final_loss = losses[-1]
        median = statistics.median(times)
        results[name] = {
            "median_step_s": median,
            "tokens_per_s": tokens / median,
            "tflops_per_gpu": flops_per_step / median / 1e12 / args.devices,
            "tflops": flops_per_step / median / 1e12,
            "tflops_per_gpu_causal": flops_model["total_causal"] / median / 1e12 / args.devices,
            "spec_peak_tflops": None if peak_flops is None else peak_flops / 1e12,
            "mfu": None if peak_flops is None else flops_per_step / (median * peak_flops * args.devices),
            "ratio_to_measured_h200_bf16_gemm": flops_per_step / (median * MEASURED_H200_BF16_GEMM * args.devices),
            "peak_gib": None if not cuda or ACTIVATION_MEMORY.run_peak() is None else ACTIVATION_MEMORY.run_peak() / 2**30,
            # the measured steps' peak over what was allocated at their start (`ActivationMemory`)
            **ACTIVATION_MEMORY.figures(),
            "final_loss": final_loss,
            "step_times_s": times,
            "losses": losses,
        }
        r = results[name]
        peak = "" if r["peak_gib"] is None else f" peak {r['peak_gib']:.1f} GiB"
        if r["activation_gib"] is not None:
            peak += f" (activations {r['activation_gib']:.2f} GiB over {r['static_gib']:.2f} static)"
        mfu = "MFU n/a" if r["mfu"] is None else f"MFU {r['mfu']*100:5.1f}% of {r['spec_peak_tflops']:.0f} spec"
        print(f"{name:11s} {r['tflops_per_gpu']:6.1f} TFLOP/s per GPU ({r['tflops_per_gpu_causal']:.1f} causal), {mfu} "
              f"({r['ratio_to_measured_h200_bf16_gemm']*100:.1f}% of a measured H200 bf16 GEMM), "
              f"{median*1e3:8.1f} ms/step {r['tokens_per_s']:9.0f} tok/s{peak} loss {final_loss:.3f}", flush=True)
    marginal = None
    if args.marginal_layers is not None:
        if args.marginal_layers == args.layers:
            raise SystemExit("--marginal-layers must differ from --layers")
        other = argparse.Namespace(**{**vars(args), "layers": args.marginal_layers})
        # The first run's Trainer, module and optimizer states form reference cycles: collect them
        # before the second model is built (at accumulate 8 both did not fit one H100 together).
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        outcome = lightning_run(other)
        if outcome is None:
            return
        other_flops = step_flops(args, get_preset(args.preset, num_layers=args.marginal_layers,
                                                  max_seq_length=args.seq), tokens, rows)["total"]
        full = get_preset(args.preset, max_seq_length=args.seq)
        marginal = marginal_layer((results["lightning"]["median_step_s"], statistics.median(outcome[0])),
                                  (flops_per_step, other_flops), (args.layers, args.marginal_layers),
                                  full.num_layers, step_flops(args, full, tokens, rows)["total"], args.devices)
        per_layer = marginal["tflops_per_gpu_per_layer"]
        projected = marginal["projected_full_tflops_per_gpu"]
        print(f"marginal layer: {marginal['step_s_per_layer']*1e3:.2f} ms, "
              f"{'n/a' if per_layer is None else f'{per_layer:.1f}'} TFLOP/s per GPU; "
              f"projected at {full.num_layers} layers: {marginal['projected_full_step_s']*1e3:.1f} ms/step, "
              f"{'n/a' if projected is None else f'{projected:.1f}'} TFLOP/s per GPU", flush=True)
    cuda_graph = None
    if "lightning_cuda_graph" in results:
        graphed, eager = results["lightning_cuda_graph"], results["lightning"]
        cuda_graph = {"scope": args.cuda_graph, "speedup": eager["median_step_s"] / graphed["median_step_s"],
                      "peak_ratio": None if eager["peak_gib"] is None else graphed["peak_gib"] / eager["peak_gib"]}
        peaks = "" if cuda_graph["peak_ratio"] is None else (
            f"; peak {graphed['peak_gib']:.2f} against {eager['peak_gib']:.2f} GiB ({cuda_graph['peak_ratio']:.3f}x)")
        print(f"CUDA graphs ({args.cuda_graph}): {cuda_graph['speedup']:.3f}x the eager Lightning step{peaks}")
    if "hf_transformers" in results:
        ratio = results["hf_transformers"]["median_step_s"] / results["lightning"]["median_step_s"]
        print(f"lightning_moe (Trainer) against HF transformers: {ratio:.2f}x the speed")
    overhead = None
    if "bare_torch" in results:
        overhead = results["lightning"]["median_step_s"] / results["bare_torch"]["median_step_s"] - 1
        print(f"Lightning overhead: {overhead*100:+.2f}%")
    tag = args.tag or f"{args.preset}_{args.layers}l"
    write_results(f"train_step_{tag}", {
        "config": {**vars(args), "tokens_per_step": tokens, "model_flops_per_step": flops_per_step,
                   "data_parallel_size": data_parallel_size(args), "flops_model": flops_model,
                   "documents": documents},
        "results": results,
        "marginal_layer": marginal,
        "lightning_overhead": overhead,
        "cuda_graph": cuda_graph,
    }, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
