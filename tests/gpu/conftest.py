"""Fixtures shared by the GPU tests: counting calls of a function the code under test makes."""

import pytest
import torch


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)`` replaces ``module.name`` by a wrapper that appends to the
    returned list on each call (undone after the test)."""

    def install(module, name: str) -> list:
        calls: list = []
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
        return calls

    return install


@pytest.fixture
def host_syncs(count_calls) -> list:
    """One entry per ``Tensor.tolist`` call (the per-expert products' host sync)."""
    return count_calls(torch.Tensor, "tolist")
