"""`CUDAGraphs(scope="moe")` on two GPUs with expert parallelism (EP=2, NCCL), in a fresh process
(CUDA must not be initialised before the launcher forks); prints the results as JSON.

- the dropless all-gather dispatch captured (its collectives and the sync-free plan inside the MoE
  layers' graphs) against the same run eager: per-step losses and the final state, bit for bit,
  and the peak memory of a step after the capture against the eager step's;
- the same with the dense layers FSDP-sharded over the two ranks (the MoE layers' parameters stay
  outside FSDP, so the MoE layers inside the FSDP blocks are captured);
- the dropless all-to-all dispatch captured on its static path (sizes fixed by the token count):
  bit for bit against the eager all-to-all run, within 1.25x of its peak; with a budget too small
  for the routing (expert_rank_capacity_factor=0.3) every window overflows and runs again eagerly,
  and the fit is still the eager one; with no factor it is refused at setup, the fix named.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

import torch  # noqa: E402
from _launch import run_distributed  # noqa: E402
from _parity import MicroBatches, _module, tiny_config  # noqa: E402

STEPS = 8


def train(rank: int, world_size: int, dispatcher: str, graphed: bool, sharding: str = "ddp",
          factor: float | None = 1.25) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.callbacks import CUDAGraphs

    torch.manual_seed(0)
    losses, peaks = [], []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.synchronize()  # host sync: the step's peak measured from an idle device
            torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach().clone())
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())

    strategy = MegatronMoEStrategy(expert_parallel_size=2, token_dispatcher=dispatcher, sharding=sharding,
                                   expert_sharding="ddp")
    callbacks = [Record()] + ([CUDAGraphs(scope="moe", warmup_steps=2, expert_rank_capacity_factor=factor)]
                              if graphed else [])
    trainer = L.Trainer(accelerator="cuda", devices=world_size, strategy=strategy, max_steps=STEPS,
                        precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
                        num_sanity_val_steps=0)
    dataset = MicroBatches(STEPS * world_size)
    loader = DataLoader(dataset, batch_size=None, sampler=[i for i in range(len(dataset)) if i % world_size == rank])
    try:
        trainer.fit(_module(tiny_config(), 0.5), loader)
    except ValueError as error:
        return {"refused": str(error)}
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    captured = callbacks[-1].captured if graphed else []
    reruns = callbacks[-1].reruns if graphed else 0
    return {"losses": [float(x) for x in losses], "peak": max(peaks[-2:]), "captured": captured, "reruns": reruns,
            # numpy, not tensors: tensors sent through the launcher's pipe die with the child process
            "state": {k: v.detach().float().numpy().copy() for k, v in state.items()} if rank == 0 else None}


def main() -> None:
    common = dict(backend="nccl", timeout=600)
    eager = run_distributed(train, 2, "allgather", False, **common)
    graphed = run_distributed(train, 2, "allgather", True, **common)
    fsdp_eager = run_distributed(train, 2, "allgather", False, "fsdp", **common)
    fsdp_graphed = run_distributed(train, 2, "allgather", True, "fsdp", **common)
    a2a_eager = run_distributed(train, 2, "alltoall", False, **common)
    a2a_graphed = run_distributed(train, 2, "alltoall", True, **common)
    a2a_overflow = run_distributed(train, 2, "alltoall", True, "ddp", 0.3, **common)
    a2a_refused = run_distributed(train, 2, "alltoall", True, "ddp", None, **common)

    def same_state(a: dict, b: dict) -> bool:
        return bool(a.keys() == b.keys() and all((a[k] == v).all() for k, v in b.items()))

    out = {
        "eager_losses": [r["losses"] for r in eager], "graphed_losses": [r["losses"] for r in graphed],
        "eager_peak": [r["peak"] for r in eager], "graphed_peak": [r["peak"] for r in graphed],
        "captured": graphed[0]["captured"], "same_state": same_state(graphed[0]["state"], eager[0]["state"]),
        "fsdp_eager_losses": [r["losses"] for r in fsdp_eager], "fsdp_graphed_losses": [r["losses"] for r in fsdp_graphed],
        "fsdp_captured": fsdp_graphed[0]["captured"],
        "fsdp_same_state": same_state(fsdp_graphed[0]["state"], fsdp_eager[0]["state"]),
        "a2a_eager_losses": [r["losses"] for r in a2a_eager], "a2a_graphed_losses": [r["losses"] for r in a2a_graphed],
        "a2a_eager_peak": [r["peak"] for r in a2a_eager], "a2a_graphed_peak": [r["peak"] for r in a2a_graphed],
        "a2a_captured": a2a_graphed[0]["captured"], "a2a_reruns": [r["reruns"] for r in a2a_graphed],
        "a2a_same_state": same_state(a2a_graphed[0]["state"], a2a_eager[0]["state"]),
        "a2a_overflow_reruns": [r["reruns"] for r in a2a_overflow],
        "a2a_overflow_same_state": same_state(a2a_overflow[0]["state"], a2a_eager[0]["state"]),
        "alltoall": [r.get("refused") for r in a2a_refused],
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
