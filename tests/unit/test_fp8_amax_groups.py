"""The nested-autocast hooks that put Transformer Engine experts under their own amax group."""

import contextlib

import pytest
import torch

from lightning_moe.precision._te import run_under_expert_autocast


class _Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return x + 1


def test_forward_runs_inside_the_context_and_leaves_it_on_errors():
    events = []

    @contextlib.contextmanager
    def context():
        events.append("enter")
        yield
        events.append("exit")

    module = _Boom()
    run_under_expert_autocast(module, context)
    run_under_expert_autocast(module, context)  # a second fit: installed once
    module(torch.zeros(1))
    assert events == ["enter", "exit"]
    module.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.zeros(1))
    assert events == ["enter", "exit", "enter", "exit"]


def test_no_context_means_plain_forward():
    module = _Boom()
    run_under_expert_autocast(module, lambda: None)
    assert module(torch.zeros(1)).item() == 1
