"""Runs context parallelism on two GPUs (NCCL, fp32) against one GPU in a fresh process (CUDA must not
be initialised before the launcher forks) and prints the results as JSON on its ``RESULT`` line.

The parity model of the CPU tests (a dense and an MoE block; sigmoid routing, expert bias, aux and z
losses) with ``head_dim`` 16 (FlexAttention's compiled kernel, which one GPU runs for packed rows,
needs at least 16), three steps of SGD on rows of 256 tokens: plain causal rows, and packed rows of
documents (``document_ids``, ``position_ids`` restarting at each document, a document's last label
ignored, as ``LMDataModule(pack_sequences=True)`` yields them). For each, CP=1 on one device, and
CP2 with ``cp_comm_type`` ``"p2p"`` (ring) and ``"allgather"``: the returned loss of every step, the
gradients of the first step (full tensors, before the optimizer) and the parameters after the last.

``--cpu``: the same on CPU processes (gloo), a check of this runner's logic without GPUs; it also
prints the largest differences from CP=1 (``compare``).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

import torch  # noqa: E402

from _launch import run_distributed  # noqa: E402

SEQ, VOCAB, STEPS, LR = 256, 64, 3, 0.5
# Documents of each row (rows of SEQ tokens), per step: one long document, short and uneven ones
# (lengths not multiples of 2 x CP, so documents straddle the load-balanced chunks).
ROWS = (
    ((256,), (16, 48, 100, 92)),
    ((100, 30, 16, 110), (128, 128)),
    ((7, 249), (61, 67, 128)),
)
RUNS = {  # name: (world size, strategy kwargs)
    "cp1": (1, {}),
    "cp2_p2p": (2, dict(context_parallel_size=2, cp_comm_type="p2p")),
    "cp2_allgather": (2, dict(context_parallel_size=2, cp_comm_type="allgather")),
}


def config() -> dict:
    from _parity import tiny_config

    return {**tiny_config(), "head_dim": 16, "max_seq_length": SEQ}


def batches(packed: bool) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    out = []
    for rows in ROWS:
        tokens = torch.randint(0, VOCAB, (len(rows), SEQ + 1), generator=g)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
        if packed:
            docs, positions = [], []
            for r, lengths in enumerate(rows):
                assert sum(lengths) == SEQ
                batch["labels"][r, torch.tensor(lengths).cumsum(0) - 1] = -100  # no label in the next document
                docs.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
                positions.append(torch.cat([torch.arange(n) for n in lengths]))
            batch["document_ids"], batch["position_ids"] = torch.stack(docs), torch.stack(positions)
        out.append(batch)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train(rank: int, world_size: int, strategy_kwargs: dict, packed: bool, accelerator: str):
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from _parity import _module
    from lightning_moe import MegatronMoEStrategy

    torch.manual_seed(0)
    losses: list[float] = []
    grads: dict = {}

    class Record(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 0:  # the first step's gradients, reduced over DP x CP
                for name, p in pl_module.named_parameters():
                    if p.grad is not None:
                        grads[name] = _full(p.grad).detach().float().cpu().numpy().copy()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    strategy = MegatronMoEStrategy(print_layout=False, **strategy_kwargs)
    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy, max_steps=STEPS, precision="32-true",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Record()], num_sanity_val_steps=0,
    )
    trainer.fit(_module(config(), LR), DataLoader(batches(packed), batch_size=None))
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank:
        return None
    # numpy, not tensors: tensors sent through the launcher's pipe die with the child process
    return losses, grads, {k: v.detach().float().cpu().numpy().copy() for k, v in state.items() if torch.is_tensor(v)}


def run_all(cpu: bool) -> dict:
    common = dict(backend="gloo" if cpu else "nccl", timeout=300 if cpu else 600)
    accelerator = "cpu" if cpu else "cuda"
    out = {}
    for packed in (False, True):
        for name, (world, kwargs) in RUNS.items():
            losses, grads, state = run_distributed(train, world, kwargs, packed, accelerator, **common)[0]
            out[f"{'packed' if packed else 'plain'}_{name}"] = {
                "losses": losses,
                "grads": {k: v.tolist() for k, v in grads.items()},
                "state": {k: v.tolist() for k, v in state.items()},
            }
    return out


def compare(out: dict) -> dict:
    """Largest absolute differences of each CP2 run from CP=1 on the same rows (losses, first-step
    gradients, final parameters), and the names that one of the two lacks."""
    diffs = {}
    for rows in ("plain", "packed"):
        ref = out[f"{rows}_cp1"]
        for name in RUNS:
            if name == "cp1":
                continue
            run = out[f"{rows}_{name}"]
            row = {"losses": float((torch.tensor(run["losses"]) - torch.tensor(ref["losses"])).abs().max())}
            for key in ("grads", "state"):
                missing = sorted(set(run[key]) ^ set(ref[key]))
                common = [k for k in ref[key] if k in run[key]]
                row[key] = max(float((torch.tensor(run[key][k]) - torch.tensor(ref[key][k])).abs().max())
                               for k in common)
                row[f"{key}_mismatched_names"] = missing
                row[f"{key}_count"] = len(common)
            diffs[f"{rows}_{name}"] = row
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes (a check of the runner's logic)")
    args = parser.parse_args()
    out = run_all(args.cpu)
    if args.cpu:
        print("DIFFS " + json.dumps(compare(out), indent=1), file=sys.stderr)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
