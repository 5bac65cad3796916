"""Delayed scaling: amax histories, the step-end update and the amax all-reduce."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_moe.precision import FP8GroupedGemm, FP8Linear, FP8Recipe, update_delayed_scaling


def _pair(recipe, seed=0):
    torch.manual_seed(seed)
    delayed = FP8Linear(64, 32, recipe=recipe)
    current = FP8Linear(64, 32, recipe="tensorwise")
    current.load_state_dict(delayed.state_dict())
    return delayed, current


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y, x.grad


def test_first_step_uses_current_scaling_then_history():
    recipe = FP8Recipe("delayed", amax_history_len=4)
    layer, reference = _pair(recipe)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    y, dx = _step(layer, x, dy)
    y_ref, dx_ref = _step(reference, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)  # no history yet: current amax

    update_delayed_scaling([layer], recipe)
    amax = torch.stack([x.abs().max(), layer.weight.abs().max(), dy.abs().max()])
    assert torch.allclose(layer.fp8_scale[:, 0], torch.tensor([448.0, 448.0, 57344.0]) / amax)
    assert torch.equal(layer.fp8_amax_history[1, :, 0], amax) and not layer.fp8_amax_history[0].any()

    # next step: 4x larger activations are scaled with last step's (too large) scale and saturate
    y2, _ = _step(layer, 4 * x, dy)
    y2_ref, _ = _step(reference, 4 * x, dy)
    assert not torch.allclose(y2, y2_ref)
    assert layer.fp8_amax_history[0, 0, 0] == 4 * x.abs().max()
    update_delayed_scaling([layer], recipe)
    assert torch.isclose(layer.fp8_scale[0, 0], 448.0 / (4 * x.abs().max()))  # max over the history


def test_history_window_margin_and_most_recent():
    recipe = FP8Recipe("delayed", amax_history_len=2, margin=1, amax_compute_algo="max")
    layer, _ = _pair(recipe)
    dy = torch.randn(8, 32)
    x = torch.randn(8, 64)
    for factor in (8.0, 1.0, 1.0):  # the 8x step leaves the 2-step window on the third update
        _step(layer, factor * x, dy)
        update_delayed_scaling([layer], recipe)
    assert torch.isclose(layer.fp8_scale[0, 0], 448.0 / x.abs().max() / 2)

    recent = FP8Recipe("delayed", amax_history_len=8, amax_compute_algo="most_recent")
    layer, _ = _pair(recent)
    for factor in (8.0, 1.0):
        _step(layer, factor * x, dy)
        update_delayed_scaling([layer], recent)
    assert torch.isclose(layer.fp8_scale[0, 0], 448.0 / x.abs().max())


def test_micro_batches_accumulate_the_max():
    recipe = FP8Recipe("delayed")
    layer, _ = _pair(recipe)
    x, dy = torch.randn(8, 64), torch.randn(8, 32)
    _step(layer, 3 * x, dy)
    _step(layer, x, dy)
    update_delayed_scaling([layer], recipe)
    assert torch.isclose(layer.fp8_scale[0, 0], 448.0 / (3 * x.abs().max()))


def test_grouped_delayed_has_one_history_per_expert_and_projection():
    """Per (projection, role, expert), as TE's separate fc1 / fc2 GroupedLinear modules: fc2's
    much smaller operands get their own scales, not fc1's."""
    recipe = FP8Recipe("delayed", amax_history_len=3)
    gemm = FP8GroupedGemm(recipe)
    x = torch.randn(48, 32, requires_grad=True)
    x.data[:16] *= 10
    w1 = torch.randn(3, 32, 16, requires_grad=True)
    w2 = (torch.randn(3, 16, 32) / 100).requires_grad_(True)
    offsets = torch.tensor([16, 32, 48], dtype=torch.int32)
    h = gemm.grouped_mm(x, w1, offsets, "fc1")
    a = h / 1000
    a.retain_grad()
    gemm.grouped_mm(a, w2, offsets, "fc2").sum().backward()
    assert gemm.fp8_amax_history.shape == (3, 3, 6)  # [history, role, fc1's 3 experts + fc2's 3]
    update_delayed_scaling([gemm], recipe)

    def per_expert(t):
        return torch.stack([t.detach()[i * 16 : (i + 1) * 16].abs().max() for i in range(3)])

    torch.testing.assert_close(gemm.fp8_scale[0, :3], 448.0 / per_expert(x))
    torch.testing.assert_close(gemm.fp8_scale[0, 3:], 448.0 / per_expert(a))
    torch.testing.assert_close(gemm.fp8_scale[1, :3], 448.0 / w1.detach().abs().amax(dim=(1, 2)))
    torch.testing.assert_close(gemm.fp8_scale[1, 3:], 448.0 / w2.detach().abs().amax(dim=(1, 2)))
    torch.testing.assert_close(gemm.fp8_scale[2, 3:], torch.full((3,), 57344.0))  # fc2's output gradient: ones
    torch.testing.assert_close(gemm.fp8_scale[2, :3], 57344.0 / per_expert(a.grad / 1000))  # fc1 output gradient


def test_e4m3_override_rescales_the_hybrid_history_scale():
    # The grouped native kernels cast gradients to E4M3 even under the hybrid recipe, whose
    # history scales target E5M2 (max 57344): used as they are, everything above amax / 128
    # saturated at 448.
    from lightning_moe.precision.delayed import ensure_delayed_state, register_delayed_buffers
    from lightning_moe.precision.formats import E4M3
    from lightning_moe.precision.operands import Layout, quantize_operand

    recipe = FP8Recipe("delayed")  # hybrid
    holder = torch.nn.Module()
    register_delayed_buffers(holder)
    state = ensure_delayed_state(holder, recipe, 2, torch.device("cpu"))
    torch.manual_seed(0)
    dy = torch.randn(32, 16)
    offsets = torch.tensor([16, 32], dtype=torch.int32)
    amax = torch.stack([dy[:16].abs().max(), dy[16:].abs().max()])
    state.scale[2] = 57344.0 / amax  # what update_delayed_scaling makes of this amax for E5M2
    q, scale_inv, rows, _ = quantize_operand(dy, recipe, "grad", Layout(row_offsets=offsets), state, True, E4M3)
    assert q.dtype == torch.float8_e4m3fn
    restored = q.float() * scale_inv[rows.ids]
    assert (q.float().abs().amax(1) < 448).float().mean() > 0.5  # not saturated
    # E4M3 keeps 3 mantissa bits (relative error <= 2^-4); its subnormals an absolute 2^-10 * scale_inv
    assert torch.allclose(restored, dy, rtol=0.07, atol=2**-8 * float(amax.max()) / 448)
    assert torch.equal(scale_inv[:2].reshape(-1), 1.0 / (state.scale[2] * 2.0**-7))  # E4M3 max / E5M2 max


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batched_update_equals_the_per_module_rule(algo):
    """One update over modules of different group counts (linears: 1, experts: E) equals TE's
    rule applied module by module: row 0 holds this step's amax; scale = fmt_max / amax /
    2^margin where the amax is positive and finite (else the old scale); the history rolls."""
    from lightning_moe.precision.delayed import ensure_delayed_state, register_delayed_buffers

    recipe = FP8Recipe("delayed", amax_history_len=5, margin=1, amax_compute_algo=algo)
    torch.manual_seed(0)
    modules = []
    for groups in (1, 4, 1, 7):
        module = torch.nn.Module()
        register_delayed_buffers(module)
        state = ensure_delayed_state(module, recipe, groups, torch.device("cpu"))
        state.amax_history.copy_(torch.rand(5, 3, groups) * 10)
        state.amax_history[:, :, 0] = 0.0  # a group never seen: keeps its old scale
        state.amax_history[2, 1, -1] = float("inf")  # an overflowing step in the history
        state.scale.copy_(torch.rand(3, groups) + 0.5)
        modules.append(module)
    expected = []
    fmt_max = torch.tensor([448.0, 448.0, 57344.0])[:, None]
    for module in modules:
        history, scale = module.fp8_amax_history.clone(), module.fp8_scale.clone()
        amax = history.amax(0) if algo == "max" else history[0]
        new = (fmt_max / amax).clamp(max=3.4028234663852886e38) / 2.0
        scale = torch.where((amax > 0) & torch.isfinite(amax), new, scale)
        history = torch.roll(history, 1, 0)
        history[0] = 0
        expected.append((history, scale))
    update_delayed_scaling(modules, recipe)
    for module, (history, scale) in zip(modules, expected):
        assert torch.equal(module.fp8_amax_history, history) and torch.equal(module.fp8_scale, scale)


def _reduce_worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    recipe = FP8Recipe("delayed")
    torch.manual_seed(0)
    layer = FP8Linear(16, 16, recipe=recipe)
    x = torch.ones(4, 16) * (rank + 1)  # rank 1 sees twice the amax
    layer(x).sum().backward()
    update_delayed_scaling([layer], recipe, group=dist.group.WORLD)
    scales = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(scales, layer.fp8_scale[:, 0].clone())
    assert torch.equal(scales[0], scales[1])
    assert torch.isclose(scales[0][0], torch.tensor(448.0 / world))
    dist.destroy_process_group()


def test_amax_reduction_over_process_group(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_reduce_worker, args=(2, str(tmp_path / "store")), nprocs=2, start_method="fork")


def test_evaluation_forwards_do_not_record_amax():
    from lightning_moe.precision.delayed import amax_recording_paused

    recipe = FP8Recipe("delayed", amax_history_len=4)
    layer, _ = _pair(recipe)
    _step(layer, torch.randn(16, 64), torch.randn(16, 32))
    before = layer.fp8_amax_history.clone()
    with torch.no_grad(), amax_recording_paused():
        layer(torch.randn(16, 64) * 100)
    assert torch.equal(layer.fp8_amax_history, before)
    layer(torch.randn(16, 64) * 100)  # a training forward records again
    assert not torch.equal(layer.fp8_amax_history, before)


def test_a_state_is_fresh_until_its_first_update():
    """`DelayedState.fresh` (the native casts' hint to find every amax by a pre-pass) holds from
    the buffers' allocation until `update_delayed_scaling`, for the module's state and for the
    projections' kept views; a reallocation (another expert count) makes the state fresh again."""
    from lightning_moe.precision.delayed import delayed_state

    recipe = FP8Recipe("delayed", amax_history_len=2)
    gemm = FP8GroupedGemm(recipe)
    offsets = torch.tensor([16, 32, 48], dtype=torch.int32)
    x, w = torch.randn(48, 32, requires_grad=True), torch.randn(3, 32, 16, requires_grad=True)
    gemm.grouped_mm(x, w, offsets, "fc1").sum().backward()
    assert delayed_state(gemm).fresh and gemm._delayed_state("fc1", 3, x.device).fresh
    update_delayed_scaling([gemm], recipe)
    assert not delayed_state(gemm).fresh and not gemm._delayed_state("fc1", 3, x.device).fresh
    assert (gemm.fp8_scale[:, :3] > 0).all()  # every group of fc1 has a scale now
    gemm.grouped_mm(x, w, offsets, "fc1").sum().backward()
    update_delayed_scaling(iter([gemm]), recipe)  # any iterable, consumed once
    assert not delayed_state(gemm).fresh
    assert gemm._delayed_state("fc1", 4, x.device).fresh  # buffers for 4 experts: reallocated
