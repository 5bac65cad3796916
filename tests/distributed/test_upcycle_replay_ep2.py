"""Upcycling and router replay under MegatronMoEStrategy with EP=2 on 2 gloo ranks: the upcycled,
expert-parallel model's logits equal the dense model's, and a replayed forward sends every token
to the experts recorded for it although the routers' weights changed."""

import torch
from _launch import run_distributed

WORLD = 2
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _run(rank, world_size):
    import copy

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models import MoELanguageModel, upcycle
    from lightning_moe.nn import RouterReplay

    torch.manual_seed(0)
    module = MoELanguageModel(dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   num_query_groups=2, ffn_hidden_size=48, max_seq_length=16))
    module.configure_model()
    dense = copy.deepcopy(module.model).eval()
    with torch.no_grad():
        want = dense(IDS)
    upcycle(module, num_experts=4, router_topk=2, granularity=2)
    report = {}

    class Check(Callback):
        def on_validation_end(self, trainer, pl_module):
            model = pl_module.model.eval()
            report["sharded"] = any(isinstance(p, DTensor) for n, p in model.named_parameters() if "experts" in n)
            with torch.no_grad():
                report["error"] = (model(IDS) - want).abs().max().item()
                with RouterReplay.record(model) as replay:
                    model(IDS)
                routers = [m.router for m in model.moe_layers()]
                for router in routers:
                    weight = router.weight.to_local() if isinstance(router.weight, DTensor) else router.weight
                    weight.add_(torch.randn_like(weight))
                seen = []
                handles = [r.register_forward_hook(lambda m, a, out: seen.append(out.experts_TK)) for r in routers]
                model(IDS)
                report["changed_without_replay"] = any(
                    not torch.equal(got, rec[0]) for got, rec in zip(seen, replay.experts.values()))
                seen.clear()
                with replay.replay(model):
                    model(IDS)
                for h in handles:
                    h.remove()
                report["replayed_equal"] = all(torch.equal(got, rec[0]) for got, rec in zip(seen, replay.experts.values()))

    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=MegatronMoEStrategy(expert_parallel_size=2, print_layout=False),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Check()], use_distributed_sampler=False,
    )
    batch = {"input_ids": IDS, "labels": torch.roll(IDS, -1, dims=1)}
    trainer.validate(module, dataloaders=DataLoader([batch], batch_size=None), verbose=False)
    return report


def test_upcycled_model_under_ep2_matches_the_dense_model_and_replays(tmp_path):
    for report in run_distributed(_run, WORLD, timeout=120):
        assert report["sharded"], report
        assert report["error"] < 1e-5, report
        assert report["changed_without_replay"] and report["replayed_equal"], report
