"""The chunked LM head (`ModelConfig.lm_head_chunk_tokens`, `nn.linear_cross_entropy`) under the gold
test: with a chunk of 5 tokens (7 chunks of a 32-token micro-batch, the last partial; 4 of a
context-parallel rank's 16) the strategy's layouts train to the losses and parameters of one process
with the unchunked head (fp32, atol 1e-5): expert parallelism (FSDP), context parallelism (the
loss a token mean over the CP group), FSDP and DDP data parallelism (DDP accumulating two
micro-batches), and tied embeddings under EP."""

import functools

import pytest
import torch

from _launch import run_distributed
from _parity import as_tensors, dp_representatives, step_losses, tiny_config, train

STEPS = 3
CHUNK = 5
_CHUNKED_CALLS: list[int] = []  # appended to in the forked ranks: calls of the chunked loss


def _counting(chunked):
    def counted(*args, **kwargs):
        _CHUNKED_CALLS.append(1)
        return chunked(*args, **kwargs)
    return counted


def _chunked_calls(strategy, model) -> int:
    return len(_CHUNKED_CALLS)

LAYOUTS = {  # name: (world size, strategy kwargs, accumulate, tied)
    "ep2": (2, dict(expert_parallel_size=2), 1, False),
    "ep2_tied": (2, dict(expert_parallel_size=2), 1, True),
    "cp2": (2, dict(context_parallel_size=2), 1, False),
    "dp2_fsdp": (2, dict(sharding="fsdp", expert_sharding="fsdp"), 1, False),
    "dp2_ddp": (2, dict(sharding="ddp", expert_sharding="ddp"), 2, False),
}


def _config(chunk, tied):
    return {**tiny_config(), "lm_head_chunk_tokens": chunk, "tie_word_embeddings": tied}


@functools.lru_cache(maxsize=None)
def reference(dp: int, accumulate: int, tied: bool):
    return as_tensors(run_distributed(train, 1, {}, 1, STEPS, accumulate * dp, _config(None, tied), None,
                                      timeout=120)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_head_matches_the_unchunked_one_process(layout, monkeypatch):
    from lightning_moe.nn import linear_cross_entropy

    world, kwargs, accumulate, tied = LAYOUTS[layout]
    dp = world // kwargs.get("context_parallel_size", 1)
    ref = reference(dp, accumulate, tied)
    monkeypatch.setattr(linear_cross_entropy, "_chunked", _counting(linear_cross_entropy._chunked))
    raw = run_distributed(train, world, kwargs, dp, STEPS, accumulate, _config(CHUNK, tied), None, 0.5, "32-true",
                          "cpu", None, _chunked_calls, timeout=180)[0]
    assert raw["collected"] == STEPS * accumulate  # every training micro-batch took the chunked head
    result = as_tensors(raw)
    torch.testing.assert_close(step_losses(result, dp_representatives(kwargs, world)), ref["rank_losses"][0],
                               rtol=0, atol=1e-5)
    assert result["state"].keys() == ref["state"].keys()
    assert ("model.lm_head.weight" in ref["state"]) != tied
    for name, value in ref["state"].items():
        torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)
