"""`CUDAGraphs` with the dropless all-to-all under `MegatronMoEStrategy(expert_parallel_size=2)`, two
gloo processes: the capture is an eager stand-in whose replays run the dispatcher's static path (as
the graphs would on GPUs); a window that overflows its budget on either rank runs again eagerly on
both before the strategy reduces the gradients, and the fit (losses of the other steps, final
state, router counts) equals the eager all-to-all fit bit for bit. The two-GPU capture itself:
tests/gpu/test_cuda_graphs_callback_gpu.py."""

from __future__ import annotations

import pytest
import torch
from _launch import run_distributed
from _parity import MicroBatches, _module, tiny_config

STEPS, ACCUMULATE = 5, 2
OVERFLOW_REPLAY = 2 * ACCUMULATE  # step 3's first micro-batch (one warm-up step, one MoE layer)


def _train(rank, world_size, graphed, overflow, sharding="ddp"):
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    import lightning_moe.callbacks.cuda_graphs as callback_module
    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.callbacks import CUDAGraphs
    from lightning_moe.nn import MoELayer

    class Replays:
        def __init__(self, modules, forwards, accumulate_grads):
            self.modules, self.forwards, self.count = modules, forwards, 0
            self.accumulate_grads = accumulate_grads

        def replay(self, slot, *tensors):
            # every rank has the same budget (the sizes of the exchange depend on it): a tiny one
            # overflows the slots; "rank 1" flags an overflow on rank 1 alone after a normal pass
            at_overflow = self.count == OVERFLOW_REPLAY
            budget = 0.05 if at_overflow and overflow == "budget" else 2.0
            self.count += 1
            dispatchers = [m.dispatcher for m in self.modules if isinstance(m, MoELayer)]
            for d in dispatchers:
                d.static_budget = budget
            try:
                out = self.forwards[slot](*tensors)
            finally:
                for d in dispatchers:
                    d.static_budget = None
            if at_overflow:
                flags = [int(d.overflow) for d in dispatchers]
                assert flags == ([1] if overflow == "budget" else [0]), flags
                if overflow == "rank 1" and rank == 1:
                    dispatchers[0].overflow.fill_(1)
            return out

        def clear_stale_grads(self):
            pass

        def release(self):
            pass

    callback_module.capture_modules = (
        lambda modules, samples, iters, accumulate, forwards: Replays(modules, forwards, accumulate))

    class OnCPU(CUDAGraphs):
        def _uses_cuda(self, trainer):
            return True

    losses, counts = [], []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            counts.append([b.clone() for n, b in pl_module.named_buffers() if n.endswith("local_tokens_per_expert")])

    torch.manual_seed(0)
    graphs = OnCPU(scope="moe", warmup_steps=1) if graphed else None
    strategy = MegatronMoEStrategy(expert_parallel_size=2, token_dispatcher="alltoall", sharding=sharding,
                                   expert_sharding="ddp")
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                        accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[Record()] + ([graphs] if graphs else []), num_sanity_val_steps=0)
    dataset = MicroBatches(STEPS * ACCUMULATE * world_size)
    loader = DataLoader(dataset, batch_size=None, sampler=[i for i in range(len(dataset)) if i % world_size == rank])
    trainer.fit(_module(tiny_config(), 0.5), loader)
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "counts": [[c.tolist() for c in window] for window in counts],
            "state": {k: v.detach().numpy().copy() for k, v in state.items()} if rank == 0 else None,
            "reruns": graphs.reruns if graphs else 0, "captured": graphs.captured if graphs else []}


@pytest.mark.parametrize("overflow, sharding", [("budget", "ddp"), ("rank 1", "ddp"), ("budget", "fsdp")])
def test_an_overflowing_window_runs_again_on_every_rank(overflow, sharding):
    """"budget": both ranks' slots overflow at step 3 (garbage first pass); "rank 1": only rank 1's
    flag is set, and the all-reduce makes rank 0 run the window again too; "fsdp": the dense layers
    FSDP-sharded around the captured MoE layers."""
    eager = run_distributed(_train, 2, False, None, sharding)
    graphed = run_distributed(_train, 2, True, overflow, sharding)
    assert [r["captured"] for r in graphed] == [["model.layers.1.mlp"]] * 2
    assert [r["reruns"] for r in graphed] == [1, 1]
    step = 1 + OVERFLOW_REPLAY // ACCUMULATE  # replays start at step 1, after the warm-up step
    rerun = slice(step * ACCUMULATE, (step + 1) * ACCUMULATE)  # that step's closure losses: its first pass's
    for ours, reference in zip(graphed, eager):
        assert ours["counts"] == reference["counts"]
        assert ours["losses"][:rerun.start] + ours["losses"][rerun.stop:] == \
            reference["losses"][:rerun.start] + reference["losses"][rerun.stop:]
        if overflow == "budget":
            assert ours["losses"][rerun.start] != reference["losses"][rerun.start]
    ours, reference = graphed[0]["state"], eager[0]["state"]
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        assert (ours[key] == value).all(), key
