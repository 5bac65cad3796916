"""Distributed checkpoints: save under EP2 x EDP2, resume under EP4, DP4 and one process with
the exact loss curve of an uninterrupted run; a save killed midway leaves the previous
checkpoint loadable."""

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from _launch import DistributedTestError, run_distributed
from _parity import MicroBatches, dp_representatives, strategy_dp_rank, tiny_config

WORLD, STEPS, SAVE_AT, DP_MAX = 4, 5, 3, 4


class StepBatchSampler(Sampler):
    """Yields, per optimizer step, this DP rank's share of the step's micro-batches.

    Step ``s`` holds items ``s*DP_MAX + a*DP + r``; a rank of a DP-``dp`` layout takes
    ``DP_MAX/dp`` of them as ONE batch, so every layout sees the same tokens per step with
    no gradient accumulation (Lightning's batch counters then stay aligned when a run resumes
    in another layout). A resumed run sets ``start_step`` to the restored global step.
    """

    def __init__(self, dp: int, dp_rank: int) -> None:
        self.dp, self.dp_rank, self.start_step = dp, dp_rank, 0

    def __iter__(self):
        for step in range(self.start_step, STEPS):
            yield [step * DP_MAX + a * self.dp + self.dp_rank for a in range(DP_MAX // self.dp)]

    def __len__(self) -> int:
        return STEPS - self.start_step


def collate(items):
    return {k: torch.cat([it[k] for it in items]) for k in items[0]}


def run(rank, world_size, kwargs, dp, max_steps, save_dir, resume_from, crash_stage):
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel

    torch.manual_seed(0)
    strategy = MegatronMoEStrategy(print_layout=False, **kwargs)
    sampler = StepBatchSampler(dp, strategy_dp_rank(kwargs, rank, world_size))
    losses = []

    saved_steps = set()

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            sampler.start_step = trainer.global_step  # restored step when resuming

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            step = trainer.global_step  # advanced by the optimizer step that just finished, if any
            if save_dir is not None and step in (SAVE_AT - 1, SAVE_AT) and step not in saved_steps:
                saved_steps.add(step)
                if crash_stage is not None and step == SAVE_AT:
                    def crash(stage):
                        if stage == crash_stage:
                            os._exit(17)  # a kill in the middle of the save, on every rank

                    strategy._crash_hook = crash
                trainer.save_checkpoint(str(Path(save_dir) / f"step{step}"))

    # seq_aux_loss and z-loss are means over sequences/tokens: their gradients do not depend
    # on how a step's tokens are split into batches, unlike the batch-level aux_loss.
    config = tiny_config(router_load_balancing_type="seq_aux_loss")
    model = MoELanguageModel(config, learning_rate=1e-3, warmup_steps=0, max_steps=100, weight_decay=0.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps,
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[Record()], num_sanity_val_steps=0, limit_val_batches=0,
    )
    loader = DataLoader(MicroBatches(STEPS * DP_MAX), batch_sampler=sampler, collate_fn=collate)
    trainer.fit(model, loader, ckpt_path=resume_from)
    per_step = torch.tensor(losses)
    gathered = [torch.zeros_like(per_step) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, per_step)
    return torch.stack(gathered).numpy()


def _global(losses, kwargs, world):
    return torch.from_numpy(losses)[dp_representatives(kwargs, world)].mean(0)


SAVE_LAYOUT = dict(expert_parallel_size=2)
RESUME = {
    "ep4": (WORLD, dict(expert_parallel_size=4), 4),
    "dp4": (WORLD, dict(), 4),
    "one_process": (1, dict(), 1),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("ckpt")
    losses = run_distributed(run, WORLD, SAVE_LAYOUT, 4, STEPS, str(save_dir), None, None, timeout=240)[0]
    return save_dir, _global(losses, SAVE_LAYOUT, WORLD)


@pytest.mark.parametrize("target", list(RESUME))
def test_resume_in_another_layout_continues_the_loss_curve(saved, target):
    save_dir, uninterrupted = saved
    assert (save_dir / "latest").read_text().strip() == f"step{SAVE_AT}"
    world, kwargs, dp = RESUME[target]
    losses = run_distributed(run, world, kwargs, dp, STEPS, None, str(save_dir / f"step{SAVE_AT}"), None, timeout=240)[0]
    resumed = _global(losses, kwargs, world)
    assert len(resumed) == STEPS - SAVE_AT
    torch.testing.assert_close(resumed, uninterrupted[SAVE_AT:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("crash_stage", ["after_shards", "before_rename"])
def test_killed_save_keeps_previous_checkpoint(tmp_path, crash_stage):
    with pytest.raises(DistributedTestError):
        run_distributed(run, WORLD, SAVE_LAYOUT, 4, STEPS, str(tmp_path), None, crash_stage, timeout=240)
    # The save of step SAVE_AT died; step SAVE_AT-1 and the pointer to it are intact.
    assert (tmp_path / "latest").read_text().strip() == f"step{SAVE_AT - 1}"
    assert not (tmp_path / f"step{SAVE_AT}").exists()
    losses = run_distributed(run, 1, {}, 1, SAVE_AT, None, str(tmp_path), None, timeout=240)[0]
    assert torch.isfinite(torch.from_numpy(losses)).all() and losses.shape[1] == 1


def test_etp_checkpoint_resumes_in_ep4(tmp_path):
    """SwiGLU experts split over ETP2 x EP2 save and reshard into EP4 (weights and Adam states)."""
    etp = dict(expert_parallel_size=2, expert_tensor_parallel_size=2)
    losses = run_distributed(run, WORLD, etp, 4, STEPS, str(tmp_path), None, None, timeout=240)[0]
    uninterrupted = _global(losses, etp, WORLD)
    resumed = run_distributed(run, WORLD, dict(expert_parallel_size=4), 4, STEPS, None, str(tmp_path), None, timeout=240)[0]
    torch.testing.assert_close(
        _global(resumed, dict(expert_parallel_size=4), WORLD), uninterrupted[SAVE_AT:], rtol=0, atol=1e-5
    )
