"""The FP8 experts' gradients flow through autograd by default: fc1's output ``h`` is an ordinary
tensor of the graph between fc1's GEMM and fc2's fused SwiGLU cast, so hooks, ``retain_grad`` and
``torch.autograd.grad`` see its gradient. ``FP8Recipe.fuse_swiglu_backward`` (opt-in) hands that
gradient to fc1 already cast instead, and says so: ``h`` then receives none."""

from __future__ import annotations

import pytest
import torch
from _float8 import relative_error as _relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]


def _operands(experts: int = 8, tokens_per_expert: int = 64, k: int = 128, f: int = 128):
    torch.manual_seed(0)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * tokens_per_expert
    x = torch.randn(experts * tokens_per_expert, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(experts, k, 2 * f, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(experts, f, k, device="cuda") / f ** 0.5).to(torch.bfloat16).requires_grad_(True)
    return x, w1, w2, offsets


def _states(experts: int):
    from lightning_moe.precision.delayed import DelayedState

    return [DelayedState(torch.rand(4, 3, experts, device="cuda") + 0.5, torch.zeros(3, experts, device="cuda"))
            for _ in range(2)]


def _bf16_reference_grad_h(h: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor, dy: torch.Tensor):
    """d(sum(dy * swiglu(h) @ w2 per group))/dh in fp32 from the same ``h``."""
    h = h.detach().float().requires_grad_(True)
    gate, up = h.chunk(2, dim=1)
    act = torch.nn.functional.silu(gate) * up
    y = torch._grouped_mm(act, w2.detach().float(), offs=offsets)
    (grad,) = torch.autograd.grad(y, h, dy.float())
    return grad


@pytest.mark.parametrize("fast_wgrad", [False, True])
def test_hooks_retain_grad_and_autograd_grad_see_fc1_output_gradient_by_default(fast_wgrad):
    from lightning_moe.precision.recipes import FP8Recipe
    from lightning_moe.precision.scaled_mm import scaled_grouped_mm, scaled_grouped_mm_swiglu, swiglu_fusable

    recipe = FP8Recipe("delayed", fast_accumulation=("fprop", "dgrad", "wgrad") if fast_wgrad else None)
    assert not recipe.fuse_swiglu_backward  # the default
    x, w1, w2, offsets = _operands()
    states = _states(8)
    h = scaled_grouped_mm(x, w1, offsets, recipe, states[0])
    assert swiglu_fusable(h, w2, recipe, states[1])  # the fused SwiGLU cast runs: the case that matters
    hooked = []
    h.register_hook(lambda g: hooked.append(g.clone()))
    h.retain_grad()
    y = scaled_grouped_mm_swiglu(h, w2, offsets, recipe, states[1])
    dy = torch.randn_like(y)
    (by_grad,) = torch.autograd.grad(y, h, dy, retain_graph=True)
    h.grad = None  # (retain_grad fills it under autograd.grad too)
    y.backward(dy)
    assert h.grad is not None and len(hooked) == 2  # autograd.grad and backward each ran the hook
    assert torch.equal(h.grad, by_grad) and torch.equal(hooked[0], by_grad) and torch.equal(hooked[1], by_grad)
    # the right gradient: FP8 rounding of dy and w2 from the bf16 reference
    assert _relative_error(h.grad, _bf16_reference_grad_h(h, w2, offsets, dy)) < 0.05
    assert x.grad is not None and torch.isfinite(x.grad).all() and w1.grad is not None


def test_fused_swiglu_backward_is_opt_in_and_hands_the_gradient_past_autograd(count_calls):
    from lightning_moe.kernels import swiglu_grad_cast_triton
    from lightning_moe.precision.recipes import FP8Recipe
    from lightning_moe.precision.scaled_mm import scaled_grouped_mm, scaled_grouped_mm_swiglu

    grad_casts = count_calls(swiglu_grad_cast_triton, "delayed_swiglu_grad_cast")
    results = {}
    for fused in (False, True):
        recipe = FP8Recipe("delayed", fuse_swiglu_backward=fused)
        x, w1, w2, offsets = _operands()
        states = _states(8)
        h = scaled_grouped_mm(x, w1, offsets, recipe, states[0])
        h.retain_grad()
        y = scaled_grouped_mm_swiglu(h, w2, offsets, recipe, states[1])
        y.backward(torch.ones_like(y))
        assert (h.grad is None) == fused  # the documented cost of the opt-in
        results[fused] = (y.detach(), w1.grad, w2.grad)
    assert len(grad_casts) == 1  # only the opt-in ran the fused cast
    # fc1's gradient cast from the same bits either way: the same outputs and weight gradients
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
