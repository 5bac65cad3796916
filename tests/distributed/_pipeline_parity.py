"""Pipeline-parallel parity harness: the `_parity` model and data through pipeline stages.

A pipeline run reads batches of ``microbatches`` of the `_parity` micro-batches: at ``step`` DP
rank ``r`` takes items ``(step * M + a) * dp + r`` for ``a < M`` (concatenated on dim 0), which
the pipeline schedule cuts back into the same micro-batches. The one-process reference reads the
items in order with ``M x dp`` accumulated micro-batches per step: the same tokens and the same
micro-batch partition per step (aux losses and expert-bias counts are per micro-batch). Besides
the per-step losses and final parameters, every parameter's gradient of the last step is
returned (full tensors, by name), gathered over all stages.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from _parity import MicroBatches, _module, tiny_config


class PipelineBatches(Dataset):
    """Item ``j`` of DP rank ``r``: micro-batches ``(j * M + a) * dp + r``, ``a < M``, concatenated."""

    def __init__(self, micro: MicroBatches, microbatches: int, dp: int, dp_rank: int) -> None:
        self.micro, self.m, self.dp, self.r = micro, microbatches, dp, dp_rank

    def __len__(self) -> int:
        return len(self.micro) // (self.m * self.dp)

    def __getitem__(self, j: int) -> dict:
        items = [self.micro[(j * self.m + a) * self.dp + self.r] for a in range(self.m)]
        return {k: torch.cat([item[k] for item in items]) for k in items[0]}


def layout_sizes(strategy_kwargs: dict) -> dict:
    """The strategy's ParallelLayout sizes (``virtual_pipeline_size`` is the strategy's own)."""
    return {k: v for k, v in strategy_kwargs.items() if k.endswith("_parallel_size")}


def dp_rank_of(strategy_kwargs: dict, rank: int, world_size: int) -> int:
    from lightning_moe.layout import ParallelLayout

    return ParallelLayout(world_size=world_size, **layout_sizes(strategy_kwargs)).rank_in_group("dp", rank)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor, by name, from every pipeline stage (collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            g = g.full_tensor()
        local[name] = g.detach().float().cpu().numpy().copy()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def _manual_module(config: dict, lr: float, clip: Optional[float]):
    from lightning_moe.models.lightning_module import MoELanguageModel

    class ManualSGD(MoELanguageModel):
        """Manual optimization: one model.loss per batch (the whole pipeline step), then the step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            loss = self.model.loss(batch["input_ids"], batch["labels"])
            self.manual_backward(loss)
            if clip is not None:
                self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            optimizer.step()
            return {"loss": loss}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return ManualSGD(config)


def train(
    rank: int,
    world_size: int,
    strategy_kwargs: dict,
    dp: int,
    steps: int = 3,
    microbatches: int = 2,
    config: Optional[dict] = None,
    clip: Optional[float] = None,
    lr: float = 0.5,
    ckpt_dir: Optional[str] = None,
    resume: Optional[str] = None,
    whole_batches: bool = False,
    validate: bool = False,
    accumulate_batches: int = 1,
    accelerator: str = "cpu",
    precision: str = "32-true",
    monitor: bool = False,
    export_path: Optional[str] = None,
    manual: bool = False,
) -> Optional[dict]:
    """One run (``world_size`` ranks; ``strategy_kwargs`` without pipeline sizes is the reference:
    call it with ``world_size=1, dp=1`` and ``microbatches = M x dp`` accumulated micro-batches).
    ``ckpt_dir``: save a checkpoint there at the end; ``resume``: start from that checkpoint and
    run ``steps`` more steps. ``whole_batches``: a run without pipeline reads each step's
    micro-batches as one batch (no accumulation, whose batch counters Lightning does not realign
    on a resume mid-epoch). ``validate``: after training, ``trainer.validate`` on 2 batches of
    ``microbatches`` micro-batches each (whole batches in every run), its ``val/loss`` returned.
    ``accumulate_batches``: a pipeline run accumulates gradients over this many batches per step
    (Lightning's ``accumulate_grad_batches``; the reference then takes ``A x M x dp`` micro-batches).
    ``accelerator`` / ``precision``: the Trainer's (the GPU test runs "cuda", "bf16-mixed").
    ``monitor``: train with a `MoEMonitor` logging every step; its last metrics are returned.
    ``export_path``: ``strategy.export_consolidated`` there after training. ``manual``: the module
    optimizes manually (zero_grad, ``model.loss``, manual_backward, clip, step in its training_step)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.callbacks import MoEMonitor

    torch.manual_seed(0)
    config = config or tiny_config()
    pipelined = strategy_kwargs.get("pipeline_parallel_size", 1) > 1
    batched = pipelined or whole_batches
    accumulate = accumulate_batches if pipelined else 1 if batched else microbatches
    start = 0
    if resume is not None:
        start = int(torch.load(f"{resume}/meta.pt", weights_only=True)["global_step"])
    # one fixed data set, whatever the run's length: a resumed run reads the items after the saved run's
    micro = MicroBatches(max(64, (start + steps) * accumulate_batches * microbatches * dp))
    strategy = MegatronMoEStrategy(print_layout=False, **strategy_kwargs)
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"].detach()) * trainer.accumulate_grad_batches)

    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy, max_steps=start + steps,
        accumulate_grad_batches=accumulate, gradient_clip_val=None if manual else clip, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[Record()] + ([MoEMonitor(log_every_n_steps=1)] if monitor else []),
    )
    model = _manual_module(config, lr, clip) if manual else _module(config, lr)
    dp_rank = dp_rank_of(strategy_kwargs, rank, world_size)
    if batched:
        data = PipelineBatches(micro, microbatches, dp, dp_rank)
        batches_per_step = accumulate_batches if pipelined else 1
        first, last = start * batches_per_step, (start + steps) * batches_per_step
        loader = DataLoader(data, batch_size=None, sampler=list(range(first, last)))
    else:
        first = start * microbatches
        loader = DataLoader(micro, batch_size=None, sampler=list(range(first, first + steps * microbatches)))
    trainer.fit(model, loader, ckpt_path=resume)
    if ckpt_dir is not None:
        trainer.save_checkpoint(ckpt_dir)
    if export_path is not None:
        strategy.export_consolidated(export_path)
    per_step = torch.tensor(losses).view(steps, -1).mean(1)
    gathered = [torch.zeros_like(per_step) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, per_step)
    grads = full_grads(strategy.model)
    # full tensors on every rank (cpu_offload would keep them on global rank 0 only, which holds one stage)
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True))
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(
        states, {k: v.detach().float().cpu().numpy().copy() for k, v in state.items() if torch.is_tensor(v)}
    )
    norm = None if strategy.last_grad_norm is None else float(strategy.last_grad_norm)
    val_loss = None
    if validate:
        val = PipelineBatches(MicroBatches(2 * microbatches * dp, seed=7), microbatches, dp, dp_rank)
        val_loss = trainer.validate(model, DataLoader(val, batch_size=None), verbose=False)[0]["val/loss"]
    if rank != 0:
        return None
    merged: dict = {}
    for part in states:
        merged.update(part)
    return {"rank_losses": torch.stack(gathered).numpy(), "state": merged, "grads": grads, "grad_norm": norm,
            "val_loss": val_loss, "monitor": dict(trainer.callbacks[1].metrics) if monitor else None}
