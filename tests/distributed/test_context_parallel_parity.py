"""Context parallelism under the gold test: CP layouts train to the same losses and parameters as
one process (fp32, atol 1e-5) with the parity model (a dense and an MoE block; sigmoid routing,
expert bias, aux and z losses), for both key/value exchanges (cp_comm_type)."""

import functools

import pytest
import torch

from _launch import run_distributed
from _parity import SEQ, as_tensors, dp_representatives, step_losses, tiny_config, train

STEPS = 3

LAYOUTS = {  # name: (world size, strategy kwargs)
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2_allgather": (2, dict(context_parallel_size=2, cp_comm_type="allgather")),
    "cp4": (4, dict(context_parallel_size=4)),
    "cp4_allgather": (4, dict(context_parallel_size=4, cp_comm_type="allgather")),
    "cp2_ep2": (2, dict(context_parallel_size=2, expert_parallel_size=2)),
    "cp2_ep2_allgather": (2, dict(context_parallel_size=2, expert_parallel_size=2, cp_comm_type="allgather")),
    "tp2_cp2": (4, dict(tensor_parallel_size=2, context_parallel_size=2)),
    "tp2_cp2_allgather": (4, dict(tensor_parallel_size=2, context_parallel_size=2, cp_comm_type="allgather")),
    "cp2_dp2_fsdp": (4, dict(context_parallel_size=2, sharding="fsdp", expert_sharding="fsdp")),
    "cp2_dp2_fsdp_allgather": (4, dict(context_parallel_size=2, sharding="fsdp", expert_sharding="fsdp",
                                       cp_comm_type="allgather")),
}


def _dp(world: int, kwargs: dict) -> int:
    return world // (kwargs.get("tensor_parallel_size", 1) * kwargs.get("context_parallel_size", 1))


@functools.lru_cache(maxsize=None)
def reference(dp: int, config_key: str):
    config = _configs()[config_key]
    return as_tensors(run_distributed(train, 1, {}, 1, STEPS, dp, config, None, timeout=120)[0])


def _configs() -> dict:
    return {"moe": tiny_config(), "seq_aux": tiny_config(router_load_balancing_type="seq_aux_loss")}


def _check(layout: str, config_key: str = "moe") -> None:
    world, kwargs = LAYOUTS[layout]
    dp = _dp(world, kwargs)
    result = as_tensors(run_distributed(train, world, kwargs, dp, STEPS, 1, _configs()[config_key], None, timeout=180)[0])
    ref = reference(dp, config_key)
    torch.testing.assert_close(step_losses(result, dp_representatives(kwargs, world)), ref["rank_losses"][0],
                               rtol=0, atol=1e-5)
    assert result["state"].keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(layout):
    assert SEQ % (2 * LAYOUTS[layout][1]["context_parallel_size"]) == 0
    _check(layout)


def test_sequence_aux_loss_spans_the_cp_group():
    # Megatron's seq aux loss with CP: per-sequence counts summed over the CP group
    _check("cp2", "seq_aux")


def _uneven_labels(rank, world_size, cp, packed=False, comm_type="p2p"):
    """Labels ignored mostly early in each sequence, so the CP ranks hold different numbers of
    labelled tokens; returns per-step returned losses, the logged train/loss and the parameters.
    ``packed``: each row holds documents of lengths 5, 7 and 4 (document_ids, position_ids
    restarting per document, a document's last label ignored), as the packing data module yields."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from _parity import VOCAB, _module
    from lightning_moe import MegatronMoEStrategy

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (STEPS, 2, SEQ + 1), generator=g)
    batches = []
    for t in tokens:
        labels = t[:, 1:].clone()
        labels[:, : SEQ // 2][torch.rand(2, SEQ // 2, generator=g) < 0.7] = -100
        batch = {"input_ids": t[:, :-1], "labels": labels}
        if packed:
            lengths = torch.tensor([5, 7, 4])
            docs = torch.repeat_interleave(torch.arange(3), lengths).expand(2, SEQ)
            batch["document_ids"] = docs
            batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths.tolist()]).expand(2, SEQ)
            labels[:, lengths.cumsum(0) - 1] = -100
        batches.append(batch)
    returned, logged = [], []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            returned.append(float(outputs["loss"]))
            logged.append(float(trainer.callback_metrics["train/loss"]))

    strategy = MegatronMoEStrategy(context_parallel_size=cp, cp_comm_type=comm_type, print_layout=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, log_every_n_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Record()], num_sanity_val_steps=0,
    )
    trainer.fit(_module(tiny_config(), 0.5), DataLoader(batches, batch_size=None))
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank:
        return None
    return returned, logged, {k: v.detach().float().numpy().copy() for k, v in state.items() if torch.is_tensor(v)}


def test_uneven_labelled_tokens_per_cp_rank_give_the_global_token_mean():
    ref_returned, ref_logged, ref_state = run_distributed(_uneven_labels, 1, 1, timeout=120)[0]
    returned, logged, state = run_distributed(_uneven_labels, 2, 2, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(returned), torch.tensor(ref_returned), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(ref_returned), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(ref_logged), torch.tensor(ref_returned), rtol=0, atol=1e-6)
    for name, value in ref_state.items():
        torch.testing.assert_close(torch.from_numpy(state[name]), torch.from_numpy(value), rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_packed_documents_under_cp2_match_one_process(comm_type):
    ref_returned, _, ref_state = run_distributed(_uneven_labels, 1, 1, True, timeout=120)[0]
    returned, logged, state = run_distributed(_uneven_labels, 2, 2, True, comm_type, timeout=120)[0]
    torch.testing.assert_close(torch.tensor(returned), torch.tensor(ref_returned), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(ref_returned), rtol=0, atol=1e-5)
    for name, value in ref_state.items():
        torch.testing.assert_close(torch.from_numpy(state[name]), torch.from_numpy(value), rtol=0, atol=1e-5, msg=name)
