"""Layout parity harness: the same tiny MoE model, seed and data through Trainer + strategy.

A run of ``steps`` optimizer steps, ``accumulate`` micro-batches each, on ``world_size``
processes. The data are pre-cut micro-batches: item ``i = (step*accumulate + a)*dp + r`` is
micro-batch ``a`` of DP rank ``r`` at ``step``. The reference is one process that reads all
items in order with ``accumulate * dp`` micro-batches per step, so it sees exactly the same
tokens per step and the same micro-batch partition (aux losses and expert-bias counts are
per micro-batch quantities, as in Megatron). Returns per-step mean losses and the full final
state dict (rank 0).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, MICRO = 64, 16, 2


def tiny_config(**moe_overrides: Any) -> dict:
    moe = dict(
        num_experts=8, router_topk=2, ffn_hidden_size=32,
        router_score_function="sigmoid", router_enable_expert_bias=True, router_bias_update_rate=1e-2,
        router_load_balancing_type="aux_loss", aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
    )
    moe.update(moe_overrides)
    return dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, first_k_dense_layers=1, moe=moe, max_seq_length=SEQ,
    )


class MicroBatches(Dataset):
    def __init__(self, count: int, seed: int = 123) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (count, MICRO, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        t = self.tokens[i]
        return {"input_ids": t[:, :-1], "labels": t[:, 1:]}


def _module(config: dict, lr: float):
    from lightning_moe.models.lightning_module import MoELanguageModel

    class SGDModel(MoELanguageModel):
        """SGD keeps parity sharp: Adam would amplify rounding in near-zero gradients."""

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return SGDModel(config)


class _Recorder:
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []


def train(
    rank: int,
    world_size: int,
    strategy_kwargs: dict,
    dp: int,
    steps: int = 5,
    accumulate: int = 1,
    config: Optional[dict] = None,
    clip: Optional[float] = None,
    lr: float = 0.5,
    precision: str = "32-true",
    accelerator: str = "cpu",
    plugins: Optional[Callable[[], list]] = None,
    collect: Optional[Callable[[Any, Any], Any]] = None,
) -> Optional[dict]:
    """Run in every process (forked by ``run_distributed``). ``plugins``: builds the Trainer's
    plugins (``precision`` is then left to them); ``collect(strategy, model)``: called on every
    rank after training (it may run collectives), rank 0's value is returned as "collected"."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_moe import MegatronMoEStrategy

    torch.manual_seed(0)
    config = config or tiny_config()
    ref_accumulate = accumulate
    num_items = steps * accumulate * dp
    dataset = MicroBatches(num_items)
    strategy = MegatronMoEStrategy(print_layout=False, **strategy_kwargs)
    recorder = _Recorder()

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # Lightning hands back the loss divided by the accumulation count.
            recorder.losses.append(float(outputs["loss"].detach()) * trainer.accumulate_grad_batches)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=ref_accumulate, gradient_clip_val=clip,
        precision=None if plugins else precision, plugins=plugins() if plugins else None,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Record()], num_sanity_val_steps=0,
    )
    model = _module(config, lr)
    dp_rank = strategy_dp_rank(strategy_kwargs, rank, world_size)
    indices = [i for i in range(num_items) if i % dp == dp_rank]
    loader = DataLoader(dataset, batch_size=None, sampler=indices)
    trainer.fit(model, loader)
    # Mean loss per step over this rank's micro-batches; the caller averages over DP ranks.
    per_step = torch.tensor(recorder.losses).view(steps, accumulate).mean(1).to(strategy.root_device)
    gathered = [torch.zeros_like(per_step) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, per_step)
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    norm = None if strategy.last_grad_norm is None else float(strategy.last_grad_norm)
    collected = collect(strategy, model) if collect else None
    if rank != 0:
        return None
    # numpy, not tensors: tensors sent through a multiprocessing pipe travel as shared-memory
    # handles that die with the child process.
    return {
        "rank_losses": torch.stack(gathered).cpu().numpy(),
        "state": {k: v.detach().float().cpu().numpy().copy() for k, v in state.items() if torch.is_tensor(v)},
        "grad_norm": norm,
        "collected": collected,
    }


def as_tensors(result: dict) -> dict:
    return {
        "rank_losses": torch.from_numpy(result["rank_losses"]),
        "state": {k: torch.from_numpy(v) for k, v in result["state"].items()},
        "grad_norm": result["grad_norm"],
    }


def strategy_dp_rank(strategy_kwargs: dict, rank: int, world_size: int) -> int:
    from lightning_moe.layout import ParallelLayout

    sizes = {k: v for k, v in strategy_kwargs.items() if k.endswith("_size")}
    return ParallelLayout(world_size=world_size, **sizes).rank_in_group("dp", rank)


def step_losses(result: dict, dp_ranks: list[int]) -> torch.Tensor:
    """Global per-step loss: mean over one rank per DP replica."""
    return result["rank_losses"][dp_ranks].mean(0)


def dp_representatives(strategy_kwargs: dict, world_size: int) -> list[int]:
    from lightning_moe.layout import ParallelLayout

    sizes = {k: v for k, v in strategy_kwargs.items() if k.endswith("_size")}
    layout = ParallelLayout(world_size=world_size, **sizes)
    seen: dict[int, int] = {}
    for r in range(world_size):
        seen.setdefault(layout.rank_in_group("dp", r), r)
    return [seen[i] for i in sorted(seen)]


os.environ.setdefault("OMP_NUM_THREADS", "1")
