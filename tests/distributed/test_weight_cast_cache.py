"""`MegatronMoEStrategy(cache_weight_casts=True)` under bf16 autocast with expert and tensor
parallelism (replicated parameters, so fp32 master weights reach the casts): the weights' local
shards (DTensor ``to_local`` views) are cast once per optimizer step, and training gives the same
losses and parameters, bit for bit, as a cast in every micro-batch."""

import pytest
import torch

from _launch import run_distributed
from _parity import as_tensors, train

LAYOUTS = {
    "ep2": dict(expert_parallel_size=2),
    "tp2": dict(tensor_parallel_size=2),
}


def _casts_made(strategy, model) -> int:
    return len(_CASTS)


_CASTS: list = []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_casts_train_bit_identically(layout, monkeypatch):
    import lightning_moe.nn.compute_weights as compute_weights

    real = compute_weights._cast
    # inherited by the forked ranks: each counts the casts it makes
    monkeypatch.setattr(compute_weights, "_cast", lambda w, dtype, **kw: _CASTS.append(1) or real(w, dtype, **kw))
    base = dict(LAYOUTS[layout], sharding="ddp", expert_sharding="ddp")
    dp = 2 // base.get("tensor_parallel_size", 1)
    runs, casts = {}, {}
    for cached in (True, False):
        kwargs = dict(base, cache_weight_casts=cached)
        result = run_distributed(train, 2, kwargs, dp, 3, 2, None, 1.0, 0.5, "bf16-mixed", "cpu", None, _casts_made,
                                 timeout=180)[0]
        casts[cached] = result["collected"]
        runs[cached] = as_tensors(result)
    # 3 optimizer steps of 2 micro-batches: half the casts (the expert weights' local shards included)
    assert casts[True] > 0 and 2 * casts[True] == casts[False]
    assert torch.equal(runs[True]["rank_losses"], runs[False]["rank_losses"])
    assert runs[True]["state"].keys() == runs[False]["state"].keys()
    for name, value in runs[True]["state"].items():
        assert torch.equal(value, runs[False]["state"][name]), name
