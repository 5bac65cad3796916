"""When `models.rotary.norm_rotary` takes the fused kernel path, and that its eager path is
``apply_rotary(norm(x))`` (the kernel itself: `_interpreted_rotary.py` under Triton's interpreter)."""

import pytest
import torch

from lightning_moe.models import rotary
from lightning_moe.models.layers import ProjectionRMSNorm, RMSNorm, apply_rotary, rotary_cos_sin


def _inputs(batched=False):
    x = torch.randn(2, 5, 3, 8).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(10).view(2, 5) if batched else torch.arange(5), 8, 10000.0)
    return x, cos, sin


def test_cpu_takes_the_eager_path_which_is_norm_then_rotary():
    x, cos, sin = _inputs()
    norm = RMSNorm(8)
    assert not rotary._fused(x, cos, sin, norm)
    assert torch.equal(rotary.norm_rotary(x, cos, sin, norm), apply_rotary(norm(x), cos, sin))
    assert torch.equal(rotary.norm_rotary(x, cos, sin), apply_rotary(x, cos, sin))


def test_fused_path_only_for_plain_tensors(monkeypatch):
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)
    x, cos, sin = _inputs()
    norm = RMSNorm(8)
    assert rotary._fused(x, cos, sin, norm) and rotary._fused(x, cos, sin, None)
    assert rotary._fused(x, *_inputs(batched=True)[1:], norm)
    # With or without gradients: a checkpointed block's recompute must repeat its first forward's bits.
    with torch.no_grad():
        assert rotary._fused(x, cos, sin, norm)
    assert rotary._fused(x.detach(), cos, sin, None)
    assert not rotary._fused(x, cos.requires_grad_(), sin, norm)
    assert not rotary._fused(x, cos.detach().double(), sin, norm)
    assert not rotary._fused(x, cos.detach()[:4], sin[:4], norm)
    assert not rotary._fused(x, cos.detach(), sin, ProjectionRMSNorm(8))  # OLMoE's norm keeps its own forward
    monkeypatch.setattr(rotary, "FUSED_KERNEL", False)
    assert not rotary._fused(x, cos.detach(), sin, norm)


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_a_norm_with_hooks_keeps_the_eager_path(monkeypatch, hook):
    """The fused path does not call the norm module: tools hooking it must see it run."""
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)
    x, cos, sin = _inputs()
    norm = RMSNorm(8)
    seen = []
    register = norm.register_forward_hook if hook == "forward" else norm.register_forward_pre_hook
    handle = register(lambda *args: seen.append(1))
    assert not rotary._fused(x, cos, sin, norm)
    rotary.norm_rotary(x, cos, sin, norm)
    assert seen == [1]
    handle.remove()
    assert rotary._fused(x, cos, sin, norm)
