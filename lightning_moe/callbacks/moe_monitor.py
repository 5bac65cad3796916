"""`MoEMonitor`: per-layer routing statistics (expert load, drops, router losses), logged periodically.

Every training micro-batch adds each MoE layer's routing counts (``MoELayer.last_stats``) and
router losses (``router.latest_losses``) to device-side accumulators; nothing leaves the device
until a logging step. Every ``log_every_n_steps`` optimizer steps the window's sums are reduced
over all ranks with torchmetrics (one all-gather per state) and the statistics below go to every
logger of the Trainer. An optional heatmap (layers x experts) is written as a PNG.

Which ranks to sum. Counts are summed over the WHOLE world. That is right when every rank routes
distinct tokens, which holds under `MegatronMoEStrategy`: data-parallel ranks read different
batches, expert-parallel peers route their own tokens before the dispatch (the counts are taken
from the router, not from what an expert receives), and tensor-parallel peers of one replica
each route a distinct ``1/TP`` slice of the sequence (see ``parallel.tensor_parallel``). It also
holds for DDP / FSDP. It does NOT hold for a strategy whose tensor-parallel ranks route the same
tokens (e.g. Lightning's own ``ModelParallelStrategy`` with TP > 1 and a replicated MoE input):
there the counts come out ``TP`` times too large, while ratios (load_max, load_cv, dropped_frac)
stay right.

Pipeline parallelism (a strategy with a ``pipeline_group``): each stage holds its own MoE layers.
Every micro-batch the pipeline schedule runs inside one training step is added (a forward hook on
each layer; forwards recomputed during a backward are not counted), the window's sums are reduced
over the ranks of the stage (the strategy's ``stage_group``), and at a logging step the stages'
reduced sums are gathered over the pipeline group, so every rank holds the statistics of every
layer, as without stages.
"""

from __future__ import annotations

import os
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.imports import RequirementCache
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_moe.callbacks._logging import check_positive_int_or_none, log_to_loggers
from lightning_moe.nn.moe_layer import MoELayer

_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")
_MATPLOTLIB_HINT = "matplotlib is not installed (pip install 'lightning-moe[plot]')"

# Losses whose per-rank value is that rank's share of the loss of the tokens routed together
# (the router's `latest_losses` docstring); their group sum is the loss of one micro-batch.
_SHARED_LOSS_GROUP_ATTR = {
    "aux_loss": "sequence_parallel_group",
    "seq_aux_loss": "sequence_parallel_group",
    "global_aux_loss": "global_aux_loss_group",
}


class RoutingWindow(Metric):
    """Sums of routing statistics of ``L`` MoE layers over the micro-batches of one window.

    States (all summed over ranks on ``compute``):
        tokens_per_expert_LE: int64 ``[L, E_max]`` kept (token, expert) assignments; layer ``l``
            uses its first ``E_l`` columns.
        dropped_L: int64 ``[L]`` assignments dropped by the capacity limit.
        loss_sums_LN: fp32 ``[L, N]`` sums of the router losses named ``loss_names``.
        num_updates: int64 micro-batches (one per rank per micro-batch).
    """

    full_state_update = False

    def __init__(self, num_experts: list[int], loss_names: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_experts = list(num_experts)
        self.loss_names = list(loss_names)
        num_layers, max_experts = len(num_experts), max(num_experts)
        self.add_state("tokens_per_expert_LE", torch.zeros(num_layers, max_experts, dtype=torch.int64), "sum")
        self.add_state("dropped_L", torch.zeros(num_layers, dtype=torch.int64), "sum")
        self.add_state("loss_sums_LN", torch.zeros(num_layers, len(loss_names), dtype=torch.float32), "sum")
        self.add_state("num_updates", torch.zeros((), dtype=torch.int64), "sum")

    def update(self, tokens_per_expert: list[Tensor], dropped: list[Tensor], losses: list[list[Tensor]]) -> None:
        """Add one micro-batch: per layer its ``[E_l]`` counts, 0-dim dropped count and ``N``
        0-dim losses (device tensors; no host sync)."""
        for layer, counts_E in enumerate(tokens_per_expert):
            self.tokens_per_expert_LE[layer, : counts_E.numel()] += counts_E.to(torch.int64)
        self.dropped_L += torch.stack(dropped).to(torch.int64)
        if self.loss_names:
            self.loss_sums_LN += torch.stack([torch.stack(values) for values in losses]).float()
        self.num_updates += 1

    def update_layer(self, layer: int, counts_E: Tensor, dropped: Tensor, losses: list[Tensor],
                     new_micro_batch: bool) -> None:
        """Add one micro-batch of one layer (the pipeline's per-layer forward hooks); the first
        layer of the rank counts the micro-batch (``new_micro_batch``)."""
        self.tokens_per_expert_LE[layer, : counts_E.numel()] += counts_E.to(torch.int64)
        self.dropped_L[layer] += dropped.to(torch.int64)
        if self.loss_names:
            self.loss_sums_LN[layer] += torch.stack(losses).float()
        if new_micro_batch:
            self.num_updates += 1

    def compute(self) -> dict[str, Tensor]:
        return {
            "tokens_per_expert_LE": self.tokens_per_expert_LE,
            "dropped_L": self.dropped_L,
            "loss_sums_LN": self.loss_sums_LN,
            "num_updates": self.num_updates,
        }


class MoEMonitor(Callback):
    """Log the expert load, token drops, router losses and expert biases of every MoE layer.

    Per layer (``<prefix>/<module path>/<stat>``, e.g. ``moe/model.layers.0.mlp/load_max``),
    over the micro-batches of the window and all ranks:

    - ``tokens``: kept (token, expert) assignments; ``tokens_per_expert/<e>`` each expert's share
      of them (only with ``log_tokens_per_expert``; always in :attr:`tokens_per_expert`).
    - ``load_max`` / ``load_min``: most / least loaded expert's count over the mean count
      (1.0 is perfect balance; ``load_max = E`` means one expert took everything).
    - ``load_cv``: coefficient of variation of the counts (population std / mean).
    - ``dropped_frac``: dropped / (kept + dropped) assignments (capacity-limited routing).
    - ``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``, ``z_loss`` (the ones the router
      computes): mean per micro-batch, without coefficients (Megatron's logged values). A rank's
      load-balancing loss is its share when the router sums counts over a group, so the shares are
      added up within that group before averaging.
    - ``expert_bias_min`` / ``expert_bias_max``: the aux-loss-free selection bias, at the log step.

    Summaries over layers: ``<prefix>/load_max`` (max), ``<prefix>/load_cv`` (mean),
    ``<prefix>/dropped_frac`` (all layers' drops over all assignments).

    Args:
        log_every_n_steps: optimizer steps per window; None: ``Trainer(log_every_n_steps)``.
        log_tokens_per_expert: also log every expert's count (``L x E`` scalars per window).
        heatmap_every_n_steps: write a layers x experts load heatmap (PNG) at logging steps that are
            multiples of this; None: never. Must be a multiple of the logging interval. Needs
            matplotlib (the ``plot`` extra): without it the constructor raises ``ValueError``.
        heatmap_dir: where the PNGs go; None: ``<logger log_dir>/moe_heatmaps`` (else
            ``<Trainer default_root_dir>/moe_heatmaps``).
        prefix: metric name prefix.

    Attributes after each logging step (every rank holds the same values):
        metrics: ``dict[str, float]`` of what was logged.
        tokens_per_expert: ``dict[layer path, int64 CPU Tensor [E]]`` counts of the window.
        last_heatmap: path of the latest PNG, or None.

    Cost: per micro-batch a few small device ops per layer; per window one all-gather per state
    (4) and a single device-to-host copy of the reduced sums.
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        log_tokens_per_expert: bool = False,
        heatmap_every_n_steps: Optional[int] = None,
        heatmap_dir: Optional[Union[str, Path]] = None,
        prefix: str = "moe",
    ) -> None:
        check_positive_int_or_none("log_every_n_steps", log_every_n_steps)
        check_positive_int_or_none("heatmap_every_n_steps", heatmap_every_n_steps)
        if heatmap_every_n_steps is not None and not _MATPLOTLIB_AVAILABLE:
            # Asked for and impossible: fail before training rather than train without them.
            raise ValueError(
                f"MoEMonitor(heatmap_every_n_steps={heatmap_every_n_steps}) draws PNG heatmaps, but "
                f"{_MATPLOTLIB_HINT}; install it, or set heatmap_every_n_steps=None."
            )
        self.log_every_n_steps = log_every_n_steps
        self.log_tokens_per_expert = log_tokens_per_expert
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.heatmap_dir = heatmap_dir
        self.prefix = prefix
        self.metrics: dict[str, float] = {}
        self.tokens_per_expert: dict[str, Tensor] = {}
        self.last_heatmap: Optional[Path] = None
        self._layers: list[tuple[str, MoELayer]] = []
        self._window: Optional[RoutingWindow] = None
        self._layer_losses: list[set[str]] = []
        self._share_sizes: list[list[int]] = []
        self._every = 1
        self._hooks: list[Any] = []
        self._pending: list[tuple[int, Any, dict[str, Tensor]]] = []
        self._pipeline_group: Any = None
        self._stage_group: Any = None
        self._heatmap_every: Optional[int] = None
        self._last_step = 0

    # ------------------------------------------------------------------ lifecycle
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Here, not in `setup`: the model is built in `configure_model` and parallelized by the
        # strategy after the callbacks' `setup` ran.
        self._every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps))
        if self.heatmap_every_n_steps is not None and self.heatmap_every_n_steps % self._every:
            raise ValueError(
                f"MoEMonitor(heatmap_every_n_steps={self.heatmap_every_n_steps}) must be a multiple of the "
                f"logging interval {self._every}: heatmaps are drawn from the logged windows."
            )
        self._heatmap_every = self.heatmap_every_n_steps
        self._layers = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, MoELayer)]
        self._window = None
        self._last_step = trainer.global_step
        # Pipeline parallelism: the schedule runs several micro-batches per training step.
        self._pipeline_group = getattr(trainer.strategy, "pipeline_group", None)
        self._stage_group = getattr(trainer.strategy, "stage_group", None)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._pipeline_group is not None:
            self._hooks = [layer.register_forward_hook(partial(self._on_layer_forward, i))
                           for i, (_, layer) in enumerate(self._layers)]

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _on_layer_forward(self, index: int, layer: MoELayer, args: Any, output: Any) -> None:
        # Training forwards only: not validation (no grad), nor a forward recomputed in backward.
        if not (layer.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
            return
        # Kept (device tensors) until the step's micro-batches have run: the window's loss names
        # are those every layer computed.
        self._pending.append((index, layer.last_stats, dict(layer.router.latest_losses)))

    def _accumulate_pending(self, device: torch.device) -> None:
        if not self._pending:
            return
        if self._window is None:
            self._window = self._new_window(device)
        for index, stats, latest in self._pending:
            names = self._layer_losses[index]
            losses = [latest[n] if n in names else _zero_like(stats.num_dropped) for n in self._window.loss_names]
            self._window.update_layer(index, stats.tokens_per_expert_E, stats.num_dropped, losses, index == 0)
        self._pending = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pipelined = self._pipeline_group is not None
        if not self._layers and not pipelined:
            return
        if pipelined:
            self._accumulate_pending(pl_module.device)
        else:
            self._accumulate(pl_module.device)
        if trainer.global_step == self._last_step:
            return  # still accumulating gradients: the optimizer step has not happened
        self._last_step = trainer.global_step
        if trainer.global_step % self._every == 0:
            self._log_window(trainer)

    # ------------------------------------------------------------------ accumulation (no sync)
    def _accumulate(self, device: torch.device) -> None:
        stats = [layer.last_stats for _, layer in self._layers]
        if any(s is None for s in stats):
            raise RuntimeError(
                "MoEMonitor: an MoE layer has no routing statistics after a training step (it did not run "
                "a forward); every MoE layer must run in every step."
            )
        if self._window is None:
            self._window = self._new_window(device)
        losses = []
        for (_, layer), names in zip(self._layers, self._layer_losses):
            latest = layer.router.latest_losses
            # A loss a layer does not compute is summed as zero and never logged for it.
            losses.append(
                [latest[n] if n in names else _zero_like(stats[0].num_dropped) for n in self._window.loss_names]
            )
        self._window.update([s.tokens_per_expert_E for s in stats], [s.num_dropped for s in stats], losses)

    def _new_window(self, device: torch.device) -> RoutingWindow:
        self._layer_losses = [set(layer.router.latest_losses) for _, layer in self._layers]
        loss_names = sorted(set().union(*self._layer_losses))
        # Set by the strategy at setup (before training), so fixed from here on.
        self._share_sizes = [[_share_group_size(layer, n) for n in loss_names] for _, layer in self._layers]
        num_experts = [layer.config.num_experts for _, layer in self._layers]
        if self._pipeline_group is not None:  # summed over the stage's ranks, which hold the same layers
            alone = self._stage_group is None
            sync = dict(sync_on_compute=False) if alone else dict(process_group=self._stage_group)
            return RoutingWindow(num_experts, loss_names, **sync).to(device)
        return RoutingWindow(num_experts, loss_names).to(device)

    # ------------------------------------------------------------------ logging (syncs)
    def _log_window(self, trainer: Trainer) -> None:
        if self._pipeline_group is not None:
            self._log_pipeline_window(trainer)
            return
        window = self._window
        assert window is not None
        # Collective over all ranks (torchmetrics all-gathers each state), then one
        # device-to-host copy of the small reduced tensors: this is the logging step's sync.
        sums = {k: v.detach().cpu() for k, v in window.compute().items()}
        # torchmetrics squeezes one-element results to 0-dim (one MoE layer, one loss): restore the shapes
        sums = {k: v.reshape(getattr(window, k).shape) for k, v in sums.items()}
        window.reset()
        self._log_sums(trainer, sums, window.loss_names, window.num_experts, self._layers)

    def _log_pipeline_window(self, trainer: Trainer) -> None:
        """Reduce the window over the stage, then gather every stage's layers over the pipeline group."""
        import torch.distributed as dist

        part: dict[str, Any] = {"layers": []}
        window = self._window
        if window is not None:
            # Collective over the stage's ranks, then one device-to-host copy (the logging step's sync).
            sums = {k: v.detach().cpu() for k, v in window.compute().items()}
            sums = {k: v.reshape(getattr(window, k).shape) for k, v in sums.items()}
            window.reset()
            part["num_updates"] = int(sums["num_updates"])
            for i, (name, layer) in enumerate(self._layers):
                bias = layer.router.expert_bias
                part["layers"].append({
                    "name": name,
                    "counts": sums["tokens_per_expert_LE"][i, : window.num_experts[i]].clone(),
                    "dropped": int(sums["dropped_L"][i]),
                    "losses": {n: float(sums["loss_sums_LN"][i, j]) for j, n in enumerate(window.loss_names)
                               if n in self._layer_losses[i]},
                    "shares": {n: self._share_sizes[i][j] for j, n in enumerate(window.loss_names)},
                    # a device-to-host copy of the expert bias, at the logging step only
                    "bias": None if bias is None else bias.detach().float().cpu(),
                })
        # The stages' layers to every rank: one object all-gather over the pipeline group.
        parts: list[Any] = [None] * dist.get_world_size(self._pipeline_group)
        dist.all_gather_object(parts, part, group=self._pipeline_group)
        layers = sorted((layer for p in parts for layer in p["layers"]), key=lambda r: _layer_order(r["name"]))
        if not layers:
            return
        loss_names = sorted({n for layer in layers for n in layer["losses"]})
        num_experts = [layer["counts"].numel() for layer in layers]
        width = max(num_experts)
        sums = {
            "tokens_per_expert_LE": torch.stack([torch.nn.functional.pad(r["counts"], (0, width - r["counts"].numel()))
                                                 for r in layers]),
            "dropped_L": torch.tensor([r["dropped"] for r in layers], dtype=torch.int64),
            "loss_sums_LN": torch.tensor([[r["losses"].get(n, 0.0) for n in loss_names] for r in layers]),
            "num_updates": torch.tensor(max(p.get("num_updates", 0) for p in parts)),
        }
        layer_losses = [set(r["losses"]) for r in layers]
        share_sizes = [[r["shares"].get(n, 1) for n in loss_names] for r in layers]
        biases = [r["bias"] for r in layers]
        self._log_sums(trainer, sums, loss_names, num_experts, [(r["name"], None) for r in layers], biases,
                       (layer_losses, share_sizes))

    def _log_sums(self, trainer: Trainer, sums: dict[str, Tensor], loss_names: list[str], num_experts: list[int],
                  layers: list[tuple[str, Any]], biases: Optional[list[Optional[Tensor]]] = None,
                  losses_and_shares: Optional[tuple[list[set[str]], list[list[int]]]] = None) -> None:
        """Statistics of the reduced ``sums`` of ``layers`` (biases read from the layers unless given;
        ``losses_and_shares``: each layer's loss names and share sizes, unless this rank's)."""
        window = _WindowShape(loss_names, num_experts)
        names = [name for name, _ in layers]
        self.tokens_per_expert = {
            name: sums["tokens_per_expert_LE"][i, : window.num_experts[i]].clone() for i, name in enumerate(names)
        }
        self.metrics = self._statistics(sums, window, *(losses_and_shares or (self._layer_losses, self._share_sizes)))
        # Expert biases are identical on every rank (updated from reduced counts); reading
        # them is a device-to-host copy, done only here.
        if biases is None:
            biases = [layer.router.expert_bias for _, layer in layers]
        for name, bias in zip(names, biases):
            if bias is not None:
                bias = bias.detach().float().cpu()
                self.metrics[f"{self.prefix}/{name}/expert_bias_min"] = float(bias.min())
                self.metrics[f"{self.prefix}/{name}/expert_bias_max"] = float(bias.max())
        log_to_loggers(trainer, self.metrics)
        if self._heatmap_every is not None and trainer.global_step % self._heatmap_every == 0:
            self.last_heatmap = self._heatmap_dir(trainer) / f"expert_load_step{trainer.global_step:08d}.png"
            _write_heatmap_rank_zero(self.last_heatmap, self.tokens_per_expert, trainer.global_step)

    def _statistics(self, sums: dict[str, Tensor], window: Any, layer_losses: list[set[str]],
                    share_sizes: list[list[int]]) -> dict[str, float]:
        out: dict[str, float] = {}
        p = self.prefix
        contributions = max(1, int(sums["num_updates"]))  # micro-batches x ranks
        load_max, load_cv = [], []
        kept_total = dropped_total = 0
        for i, (name, counts_E) in enumerate(self.tokens_per_expert.items()):
            counts = counts_E.double()
            kept, dropped = int(counts_E.sum()), int(sums["dropped_L"][i])
            mean = counts.mean().item()
            out[f"{p}/{name}/tokens"] = float(kept)
            if mean > 0:
                out[f"{p}/{name}/load_max"] = counts.max().item() / mean
                out[f"{p}/{name}/load_min"] = counts.min().item() / mean
                out[f"{p}/{name}/load_cv"] = counts.std(unbiased=False).item() / mean
                load_max.append(out[f"{p}/{name}/load_max"])
                load_cv.append(out[f"{p}/{name}/load_cv"])
            if kept + dropped:
                out[f"{p}/{name}/dropped_frac"] = dropped / (kept + dropped)
            if self.log_tokens_per_expert:
                for e, c in enumerate(counts_E.tolist()):
                    out[f"{p}/{name}/tokens_per_expert/{e}"] = float(c)
            for j, loss_name in enumerate(window.loss_names):
                if loss_name in layer_losses[i]:
                    # Shares of one micro-batch's loss add up within their group first.
                    micro_batches = contributions / share_sizes[i][j]
                    out[f"{p}/{name}/{loss_name}"] = float(sums["loss_sums_LN"][i, j]) / micro_batches
            kept_total += kept
            dropped_total += dropped
        if load_max:
            out[f"{p}/load_max"] = max(load_max)
            out[f"{p}/load_cv"] = sum(load_cv) / len(load_cv)
        if kept_total + dropped_total:
            out[f"{p}/dropped_frac"] = dropped_total / (kept_total + dropped_total)
        return out

    def _heatmap_dir(self, trainer: Trainer) -> Path:
        if self.heatmap_dir is not None:
            return Path(self.heatmap_dir)
        # The first logger's directory, else default_root_dir (a broadcast: every rank is here).
        return Path(trainer.log_dir or trainer.default_root_dir) / "moe_heatmaps"


class _WindowShape:
    """What `_statistics` reads of a window: its loss names and per-layer expert counts."""

    def __init__(self, loss_names: list[str], num_experts: list[int]) -> None:
        self.loss_names, self.num_experts = loss_names, num_experts


def _layer_order(name: str) -> list[Any]:
    """Sort key of module paths with their numbers compared as numbers ("layers.10" after "layers.9")."""
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _share_group_size(layer: MoELayer, loss_name: str) -> int:
    """Ranks whose values of ``loss_name`` are shares of one loss (1: each value is a whole loss)."""
    attr = _SHARED_LOSS_GROUP_ATTR.get(loss_name)
    group = getattr(layer.router, attr, None) if attr else None
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def _zero_like(t: Tensor) -> Tensor:
    return t.new_zeros((), dtype=torch.float32)


def _require_matplotlib() -> None:
    if not _MATPLOTLIB_AVAILABLE:
        raise ModuleNotFoundError(f"expert-load heatmaps need matplotlib: {_MATPLOTLIB_HINT}.")


@rank_zero_only
def _write_heatmap_rank_zero(path: Path, tokens_per_expert: dict[str, Tensor], step: int) -> None:
    write_load_heatmap(path, tokens_per_expert, title=f"expert load (count / mean), step {step}")


def write_load_heatmap(path: Union[str, Path], tokens_per_expert: dict[str, Tensor], title: str = "") -> Path:
    """Draw ``{layer: counts [E]}`` as a layers x experts image of count / mean count; write ``path``
    atomically (a temporary file in the same directory, then a rename). Needs matplotlib."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    names = list(tokens_per_expert)
    max_experts = max(c.numel() for c in tokens_per_expert.values())
    load_LE = torch.full((len(names), max_experts), float("nan"), dtype=torch.float64)
    for i, counts in enumerate(tokens_per_expert.values()):
        counts = counts.double()
        mean = counts.mean()
        load_LE[i, : counts.numel()] = counts / mean if mean > 0 else counts
    # A Figure with an Agg canvas, not pyplot: no global backend switch, no GUI, thread-safe.
    fig = Figure(figsize=(min(24.0, 3.0 + 0.2 * max_experts), min(20.0, 1.5 + 0.3 * len(names))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(load_LE.numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="tokens / mean")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    if len(names) <= 64:
        ax.set_yticks(range(len(names)), names, fontsize=7)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


__all__ = ["MoEMonitor", "RoutingWindow", "write_load_heatmap"]
