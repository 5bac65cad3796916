"""DynamicContextParallel under the gold test: on packed batches of documents from 16 to 512 tokens,
4 gloo processes with dynamic CP (sub-groups of 1, 2 and 4 ranks chosen per micro-batch) return
the losses and train to the parameters of static CP4 and of one process (fp32, atol 1e-5), also
with EP=2 folded over the CP ranks, with either key/value exchange, and with the router's aux,
global-aux, seq-aux and z losses (counted per replica or row, normalised by its tokens, not the
rank's); DP2 x CP2 with those losses trains as static DP2 x CP2."""

import functools

import pytest
import torch

from _launch import run_distributed

SEQ, VOCAB, STEPS = 512, 64, 2
# Documents per row (each row S = 512 tokens): one long document, mixes of short and middle ones.
ROWS = (
    ((512,), (16, 48, 200, 248)),
    ((100, 30, 16, 366), (256, 256)),
)
# Attention-dominated with a costly exchange: the 512-token step runs at CP4, the next mixes a CP2
# group for the 366-token document with two ranks running the rest alone.
COST = dict(attention_s_per_token_pair=1e-6, linear_s_per_token=1e-6, cp_s_per_token=1e-7, cp_s_per_exchange=5e-3)
MEMORY_LIMIT = 512


def _config(losses: str = "") -> dict:
    moe = dict(
        num_experts=8, router_topk=2, ffn_hidden_size=32, router_score_function="sigmoid",
        router_enable_expert_bias=True, router_bias_update_rate=1e-2, router_load_balancing_type="none",
        aux_loss_coeff=0.0, z_loss_coeff=None,
    )
    # large coefficients: a wrong normalisation would show in the router weights
    if losses == "aux":
        moe.update(router_load_balancing_type=["aux_loss", "global_aux_loss"], aux_loss_coeff=[0.5, 0.5],
                   z_loss_coeff=0.1)
    elif losses == "seq_aux":
        moe.update(router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.5, z_loss_coeff=0.1)
    return dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, first_k_dense_layers=1, moe=moe, max_seq_length=SEQ,
    )


def _batches(spec=ROWS) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for rows in spec:
        tokens = torch.randint(0, VOCAB, (len(rows), SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        docs, positions = [], []
        for r, lengths in enumerate(rows):
            assert sum(lengths) == SEQ
            ends = torch.tensor(lengths).cumsum(0)
            labels[r, ends - 1] = -100  # a document's last token does not predict the next document
            docs.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
            positions.append(torch.cat([torch.arange(n) for n in lengths]))
        batches.append({"input_ids": tokens[:, :-1], "labels": labels, "document_ids": torch.stack(docs),
                        "position_ids": torch.stack(positions)})
    return batches


def _train(rank, world_size, strategy_kwargs, dynamic, accelerator="cpu", losses="", spec=ROWS):
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from _parity import _module
    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.callbacks import DynamicContextParallel, MoEThroughput
    from lightning_moe.parallel.dynamic_cp import CostModel

    torch.manual_seed(0)
    returned, plans, logged = [], [], []
    throughput = MoEThroughput(log_every_n_steps=1)
    callbacks = [throughput]
    tokens_per_step, logged_loss = [], []
    dynamic_cp = None
    if dynamic:
        dynamic_cp = DynamicContextParallel(memory_limit_tokens=MEMORY_LIMIT, cost_model=CostModel(**COST))
        callbacks.append(dynamic_cp)

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            returned.append(float(outputs["loss"]))
            logged_loss.append(float(trainer.callback_metrics["train/loss"]))
            tokens_per_step.append(throughput.tokens_per_sec * throughput.step_time_s)
            if dynamic_cp is not None:
                plans.append(dynamic_cp.last_plan.sequences_per_cp_size())
                logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("dynamic_cp/")})

    strategy = MegatronMoEStrategy(print_layout=False, **strategy_kwargs)
    trainer = L.Trainer(
        accelerator=accelerator, devices=world_size, strategy=strategy, max_steps=STEPS, log_every_n_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[*callbacks, Record()], num_sanity_val_steps=0,
    )
    batches = _batches(spec)
    dp = world_size // strategy_kwargs.get("context_parallel_size", 1)
    if dp > 1:  # replica r reads its rows of every batch (rank = cp rank + CP x dp rank)
        rows = len(batches[0]["input_ids"]) // dp
        replica = rank // strategy_kwargs["context_parallel_size"]
        batches = [{k: v[replica * rows:(replica + 1) * rows] for k, v in b.items()} for b in batches]
    trainer.fit(_module(_config(losses), 0.5), DataLoader(batches, batch_size=None))
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank:
        return None
    params = {k: v.detach().float().numpy().copy() for k, v in state.items() if torch.is_tensor(v)}
    return returned, (plans, tokens_per_step, logged_loss), logged, params


@functools.lru_cache(maxsize=None)
def _run(world_size: int, kwargs: tuple, dynamic: bool, losses: str = "", spec: tuple = ROWS):
    return run_distributed(_train, world_size, dict(kwargs), dynamic, "cpu", losses, spec, timeout=240)[0]


def _assert_same(result, reference):
    returned, _, _, state = result
    ref_returned, _, _, ref_state = reference
    torch.testing.assert_close(torch.tensor(returned), torch.tensor(ref_returned), rtol=0, atol=1e-5)
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(torch.from_numpy(state[name]), torch.from_numpy(value), rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "kwargs",
    [
        (("context_parallel_size", 4),),
        (("context_parallel_size", 4), ("cp_comm_type", "allgather")),
        (("context_parallel_size", 4), ("expert_parallel_size", 2)),
    ],
    ids=["cp4", "cp4_allgather", "cp4_ep2"],
)
def test_dynamic_cp_matches_static_cp4_and_one_process(kwargs):
    single = _run(1, (), False)
    static = _run(4, kwargs, False)
    dynamic = _run(4, kwargs, True)
    _assert_same(static, single)
    _assert_same(dynamic, single)
    _assert_same(dynamic, static)
    (plans, tokens, logged_loss), logged = dynamic[1], dynamic[2]
    torch.testing.assert_close(torch.tensor(logged_loss), torch.tensor(dynamic[0]), rtol=0, atol=1e-5)
    assert tokens == pytest.approx([SEQ * len(rows) for rows in ROWS])  # MoEThroughput: each token once
    # the plans really mix CP sizes: some sequences alone on a rank, some over a sub-group
    used = {size for plan in plans for size in plan}
    assert used == {1, 2, 4}, plans
    for plan, metrics, rows in zip(plans, logged, ROWS):
        assert sum(plan.values()) == sum(len(r) for r in rows)
        assert {int(k.removeprefix("dynamic_cp/sequences_cp")): v for k, v in metrics.items()
                if "sequences_cp" in k} == {c: float(plan.get(c, 0)) for c in (1, 2, 4)}
        assert metrics["dynamic_cp/modelled_speedup"] >= 1.0


def test_dynamic_cp_over_dp2_x_cp2_gives_the_token_mean_of_both_replicas():
    # each replica reads one row per step; the sequences of both are planned over the 4 ranks, and
    # the loss is the token mean over both rows: one process reading the two rows as one batch
    kwargs = (("context_parallel_size", 2),)
    single = _run(1, (), False)
    dynamic = _run(4, kwargs, True)
    _assert_same(dynamic, single)
    plans, tokens, logged_loss = dynamic[1]
    # train/loss as MoELanguageModel logs it: the same token mean of both replicas
    torch.testing.assert_close(torch.tensor(logged_loss), torch.tensor(dynamic[0]), rtol=0, atol=1e-5)
    assert any(1 in plan or 4 in plan for plan in plans), plans
    assert tokens == pytest.approx([SEQ * len(rows) for rows in ROWS])  # both replicas' tokens, once


@pytest.mark.parametrize(
    "kwargs",
    [(("context_parallel_size", 4),), (("context_parallel_size", 4), ("expert_parallel_size", 2))],
    ids=["cp4", "cp4_ep2"],
)
def test_router_aux_global_aux_and_z_losses_match_static_cp4_and_one_process(kwargs):
    # the ranks hold different numbers of tokens: losses normalised by the local count would differ
    single = _run(1, (), False, "aux")
    static = _run(4, kwargs, False, "aux")
    dynamic = _run(4, kwargs, True, "aux")
    _assert_same(static, single)
    _assert_same(dynamic, single)
    _assert_same(dynamic, static)
    assert any(1 in plan for plan in dynamic[1][0]), dynamic[1][0]
    # the losses reach the router: its weights differ from a run without them
    plain = _run(1, (), False)
    router = next(name for name in single[3] if name.endswith("router.weight"))
    assert abs(single[3][router] - plain[3][router]).max() > 1e-4


# Two replicas with as many labelled tokens each per step (the static DP2 x CP2 token mean is then
# the pool's): step 1 two documents per row, step 2 four.
EQUAL_ROWS = (((16, 496), (200, 312)), ((100, 30, 16, 366), (256, 128, 64, 64)))


@pytest.mark.parametrize("losses", ["aux", "seq_aux"])
def test_router_losses_over_dp2_x_cp2_match_static_dp2_x_cp2(losses):
    # replicas' documents mix on the ranks: the aux loss is counted per replica, seq aux per row
    kwargs = (("context_parallel_size", 2),)
    static = _run(4, kwargs, False, losses, EQUAL_ROWS)
    dynamic = _run(4, kwargs, True, losses, EQUAL_ROWS)
    # parameters only: static DP2 x CP2 returns replica 0's loss, dynamic the pool's
    state, ref_state = dynamic[3], static[3]
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(torch.from_numpy(state[name]), torch.from_numpy(value), rtol=0, atol=1e-5, msg=name)
    assert any(1 in plan or 4 in plan for plan in dynamic[1][0]), dynamic[1][0]


def test_seq_aux_loss_matches_static_cp4_and_one_process():
    kwargs = (("context_parallel_size", 4),)
    single = _run(1, (), False, "seq_aux")
    dynamic = _run(4, kwargs, True, "seq_aux")
    _assert_same(dynamic, single)
    _assert_same(_run(4, kwargs, False, "seq_aux"), single)
