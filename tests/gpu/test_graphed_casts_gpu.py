"""``FP8Recipe(graph_weight_casts=True)``: an FP8 MoE layer whose expert weight casts replay a CUDA
graph trains bit for bit as with the eager casts (delayed and rowwise recipes, bf16 and fp32
parameters, checkpointed micro-batches, evaluation), declines a replay while the previous one's
outputs are referenced, and captures again when a weight is a new tensor (CUDA, Hopper)."""

import pytest
import torch
from torch import nn

from lightning_moe.nn import MoEConfig, MoELayer
from lightning_moe.precision import FP8Precision, FP8Recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper GPU (the native FP8 casts)"),
]


def _layer(recipe: str, dtype: torch.dtype, graphed: bool, experts: int = 8):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=experts, router_topk=2, expert_alignment=16)
    layer = MoELayer(cfg).cuda().to(dtype)
    fp8 = FP8Recipe(recipe, fast_accumulation=("fprop", "dgrad", "wgrad"), graph_weight_casts=graphed)
    plugin = FP8Precision(recipe=fp8, backend="torch")
    plugin.convert_module(layer)
    return layer, plugin


def _data(count: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(count, 2, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)


def _end_of_step(layer, plugin, optimizer) -> list:
    grads = [p.grad.clone() for p in layer.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    if plugin.recipe.name == "delayed":
        plugin.update_delayed_scaling()
    return grads


def _train(recipe: str, dtype: torch.dtype, graphed: bool, steps: int = 4):
    """Outputs, token and parameter gradients and FP8 buffers over ``steps`` optimizer steps of 2
    micro-batches (the second under non-reentrant activation checkpointing), then an evaluation
    forward; and the layer's `GraphedWeightCasts` (None when not graphed)."""
    from torch.utils.checkpoint import checkpoint

    layer, plugin = _layer(recipe, dtype, graphed)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    data = _data(2 * steps + 1, dtype)
    seen = []
    for step in range(steps):
        for micro in range(2):
            x = data[2 * step + micro].clone().requires_grad_(True)
            with plugin.forward_context():
                y = layer(x) if micro == 0 else checkpoint(layer, x, use_reentrant=False)
            y.float().square().mean().backward()
            seen += [y.detach(), x.grad]
        seen += _end_of_step(layer, plugin, optimizer)
    with torch.no_grad(), plugin._eval_context():
        seen.append(layer(data[-1]))
    seen += [b.clone() for name, b in layer.named_buffers() if "fp8" in name]
    return seen, layer.experts.quantization.__dict__.get("_graphed_weight_casts")


def _assert_all_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_weight_casts_train_bit_for_bit(recipe, dtype):
    steps = 4
    graphed, casts = _train(recipe, dtype, True, steps)
    eager, none = _train(recipe, dtype, False, steps)
    assert none is None
    _assert_all_equal(graphed, eager)
    # Each step casts 3 times (a forward, a checkpointed forward and its recompute). The first
    # cast of a key runs eagerly, and delayed scaling casts eagerly until the first update.
    eager_casts = 1 + (3 if recipe == "delayed" else 0)
    assert (casts.captures, casts.busy, casts.replays) == (1, 0, 3 * steps - eager_casts)


def _double_forward_then_new_weight(graphed: bool):
    """Two warm-up steps; a step whose two micro-batches both run forward before one backward;
    a step after fc1's weight became a new tensor (same values, new memory), then two more."""
    layer, plugin = _layer("delayed", torch.bfloat16, graphed)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    data = _data(12, torch.bfloat16)
    seen = []

    def step(first: int, together: bool = False) -> None:
        xs = [data[first + i].clone().requires_grad_(True) for i in range(2)]
        if together:
            with plugin.forward_context():
                ys = [layer(x) for x in xs]
            sum(y.float().square().mean() for y in ys).backward()
        else:
            ys = []
            for x in xs:
                with plugin.forward_context():
                    ys.append(layer(x))
                ys[-1].float().square().mean().backward()
        seen.extend([y.detach() for y in ys] + [x.grad for x in xs])
        seen.extend(_end_of_step(layer, plugin, optimizer))

    step(0)
    step(2)
    step(4, together=True)
    casts = layer.experts.quantization.__dict__.get("_graphed_weight_casts")
    busy = None if casts is None else casts.busy
    experts = layer.experts
    experts.fc1_weight = nn.Parameter(experts.fc1_weight.detach().clone())
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    for first in (6, 8, 10):
        step(first)
    return seen, casts, busy


def test_replays_decline_while_outputs_are_referenced_and_recapture_for_new_weights():
    graphed, casts, busy = _double_forward_then_new_weight(True)
    eager, _, _ = _double_forward_then_new_weight(False)
    _assert_all_equal(graphed, eager)
    assert busy == 1  # the second forward of the together step: the first one's backward had not run
    assert casts.captures == 2 and casts.busy == 1
