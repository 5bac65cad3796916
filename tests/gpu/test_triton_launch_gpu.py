"""Kernels launched through `kernels.launch` (the kept compiled kernel, without the JIT's
binding) compute exactly what the plain ``kernel[grid](...)`` launch computes: MoE layer
training steps in bf16 and under native FP8 (delayed and rowwise casts, the SwiGLU-fused cast,
combine, permutation, tail kernels), and a quantizer on a pointer that is not 16-byte aligned
after an aligned one (CUDA, Hopper)."""

import copy

import pytest
import torch

from lightning_moe.kernels import launch as launch_module
from lightning_moe.nn import MoEConfig, MoELayer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]


@pytest.fixture
def direct_launches(monkeypatch):
    """Counts launches that took a kept kernel (``"direct"``), and names the kernels kept
    (``"kept"``) and those launched directly (``"reused"``)."""
    count = {"direct": 0, "kept": set(), "reused": set()}
    original_call = launch_module._CompiledLaunch.__call__
    original_of = launch_module._CompiledLaunch.of.__func__

    def counting(self, *args, **kwargs):
        count["direct"] += 1
        count["reused"].add(self.compiled.name)
        return original_call(self, *args, **kwargs)

    def recording(cls, compiled, *args, **kwargs):
        entry = original_of(cls, compiled, *args, **kwargs)
        if entry is not None:
            count["kept"].add(compiled.name)
        return entry

    monkeypatch.setattr(launch_module._CompiledLaunch, "__call__", counting)
    monkeypatch.setattr(launch_module._CompiledLaunch, "of", classmethod(recording))
    launch_module.clear_launch_cache()
    yield count
    launch_module.clear_launch_cache()


def _steps(layer, precision, x, steps=3):
    """Outputs, input and parameter gradients of ``steps`` training steps (delayed scaling's
    update after each), and the FP8 state at the end."""
    from lightning_moe.precision import FP8Precision, FP8Recipe, update_delayed_scaling
    from lightning_moe.precision.modules import fp8_modules

    context, recipe = None, None
    if precision != "bf16":
        recipe = FP8Recipe(precision)
        plugin = FP8Precision(recipe=recipe, backend="torch")
        plugin.convert_module(layer)
        context = plugin.forward_context
    seen = []
    for step in range(steps):
        layer.zero_grad(set_to_none=True)
        x_step = (x * (1 + step)).detach().requires_grad_(True)
        if context is None:
            y = layer(x_step)
        else:
            with context():
                y = layer(x_step)
        y.float().square().sum().backward()
        seen += [y, x_step.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
        if recipe is not None and recipe.name == "delayed":
            update_delayed_scaling(fp8_modules(layer), recipe)
    seen += [b.clone() for b in layer.buffers()]
    return seen


@pytest.mark.parametrize("precision", ["bf16", "delayed", "rowwise"])
def test_layer_steps_identical_with_and_without_kept_kernels(monkeypatch, direct_launches, precision):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=40, router_topk=4,
                    router_score_function="softmax", expert_backend="grouped_mm",
                    expert_alignment=1 if precision == "bf16" else 16)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)

    monkeypatch.setenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "0")
    plain = _steps(layer, precision, x)
    assert direct_launches["direct"] == 0
    monkeypatch.setenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "1")
    kept = _steps(twin, precision, x)
    # every kernel the first step kept is launched directly by the later ones
    assert direct_launches["kept"] and direct_launches["reused"] == direct_launches["kept"]
    assert len(plain) == len(kept)
    for a, b in zip(plain, kept):
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() and a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.is_floating_point() and b.element_size() == 1 else b)


def test_unaligned_pointer_after_an_aligned_one(monkeypatch, direct_launches):
    from lightning_moe.kernels.fp8_quant_triton import rowwise_quantize

    torch.manual_seed(0)
    rows, cols = 64, 200
    flat = torch.randn(rows * cols + 1, device="cuda", dtype=torch.bfloat16)
    aligned = flat[:-1].view(rows, cols)
    unaligned = flat[1:].view(rows, cols)  # 2 bytes past a 16-byte boundary
    assert unaligned.data_ptr() % 16 != 0

    monkeypatch.setenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "0")
    expected = [rowwise_quantize(t) for t in (aligned, unaligned)]
    monkeypatch.setenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "1")
    for _ in range(2):  # the second round takes the kept kernels, one per alignment
        for t, (q_ref, s_ref) in zip((aligned, unaligned), expected):
            q, s = rowwise_quantize(t)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert direct_launches["direct"] == 2
