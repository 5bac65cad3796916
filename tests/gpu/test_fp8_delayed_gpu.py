"""The one-read delayed-scaling casts equal the generic delayed path bit for bit: the cast
itself (bf16 and fp32 inputs), and whole training steps of the native grouped GEMM (with and
without the FP8 weight cache, a checkpointed micro-batch, an evaluation forward) and of the dense
linear (hybrid and E4M3 formats): scales, amax histories, outputs and gradients (CUDA, Hopper)."""

import pytest
import torch
from _float8 import same_bits

from lightning_moe.precision import FP8GroupedGemm, FP8Recipe, update_delayed_scaling
from lightning_moe.precision.delayed import DelayedState
from lightning_moe.precision.formats import E4M3
from lightning_moe.precision.operands import Layout, quantize_operand

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delayed_cast_equals_the_generic_delayed_quantizer(dtype):
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

    torch.manual_seed(0)
    rows, cols = 300, 96
    x = (torch.randn(rows, cols, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]).to(dtype)
    x[7, 3], x[8, 5] = float("nan"), float("inf")
    # an empty group, unaligned ends, groups with and without history, 12 tail rows
    offsets = torch.tensor([40, 40, 173, 250, 288], device="cuda", dtype=torch.int32)
    scale = torch.tensor([3.0, 0.0, 0.0, 0.5, 20.0], device="cuda")
    recipe = FP8Recipe("delayed", fmt="e4m3")
    history = torch.zeros(2, 3, 5, device="cuda")
    ref_state = DelayedState(history.clone(), torch.zeros(3, 5, device="cuda"))
    ref_state.scale[0] = scale
    q_ref, s_ref, row_axis, _ = quantize_operand(x, recipe, "input", Layout(row_offsets=offsets), ref_state, True, E4M3)

    padded = -(-rows // 16) * 16
    q_col = torch.full((cols, padded), 0x55, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    record = torch.zeros(5, device="cuda")
    q, s_row, s_col = delayed_cast(x, offsets, scale, record, out_col=q_col, stride_out_col=padded)
    end = 288
    # Rows past the last group (no GEMM reads them) are cast with scale 1 by the tile kernel
    # (saturating, as every cast here).
    tail_ref = x[end:].float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert same_bits(q[:end], q_ref[:end]) and same_bits(q[end:], tail_ref)
    assert torch.equal(s_row[:end], s_ref.reshape(-1)[row_axis.ids][:end]) and (s_row[end:] == 1).all()
    assert torch.equal(q_col.view(torch.uint8)[:, :end], q.view(torch.uint8)[:end].t())
    assert (q_col.view(torch.uint8)[:, end:] == 0x55).all()  # past the last group: untouched
    assert torch.equal(s_col, s_ref[:5, 0][:, None].expand(5, cols))  # the empty group's too
    assert torch.equal(record, ref_state.amax_history[0, 0])

    # The row copy alone (its own kernel: whole rows, each row's group by binary search).
    record_rows = torch.zeros(5, device="cuda")
    q_rows, s_rows, none = delayed_cast(x, offsets, scale, record_rows)
    assert none is None and same_bits(q_rows, q_ref) and torch.equal(s_rows, s_ref.reshape(-1)[row_axis.ids])
    assert torch.equal(record_rows, record)


def _train(gemm, x, w, offsets, steps, cache=None):
    """``steps`` optimizer steps of 2 micro-batches (the second under non-reentrant activation
    checkpointing), then an evaluation forward (no grad, amax recording paused); returns every
    output and gradient, and the delayed state after each update."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.precision.delayed import amax_recording_paused
    from lightning_moe.precision.weight_cache import caching_fp8_weights

    def forward(x_mb):
        return gemm.grouped_mm(x_mb, w, offsets, projection="fc1")

    seen = []
    end = int(offsets[-1])  # the grouped kernel leaves rows past the last group unspecified
    for step in range(steps):
        w.grad = None
        for micro in range(2):
            x_mb = (x * (1 + step + micro)).detach().requires_grad_(True)
            with caching_fp8_weights(cache):
                y = forward(x_mb) if micro == 0 else checkpoint(forward, x_mb, use_reentrant=False)
            y.float().square().sum().backward()
            seen += [y[:end], x_mb.grad[:end]]
        seen.append(w.grad.clone())
        with torch.no_grad(), amax_recording_paused():
            seen.append(forward(x * 3)[:end])
        torch.cuda.set_sync_debug_mode("error")  # the per-step update must not stall the host
        try:
            update_delayed_scaling([gemm], gemm.recipe)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if cache is not None:
            cache.clear()
        with torch.no_grad():
            w.mul_(1.5)  # a large "optimizer step": the next step's weight amax grows
        seen += [gemm.fp8_scale.clone(), gemm.fp8_amax_history.clone()]
    return seen


@pytest.mark.parametrize("experts", [4, 40])  # per-expert GEMMs, torch's grouped kernel
@pytest.mark.parametrize("cache", [False, True])
def test_delayed_training_identical_with_fused_and_generic_casts(monkeypatch, experts, cache):
    """The casts compared, on torch's GEMMs: where our Triton grouped kernels run, the fused path's fp32
    weight gradient is unrounded by design and the generic one's bf16 (test_fp8_grouped_triton_gpu.py)."""
    from lightning_moe.precision import native_gemms, scaled_mm
    from lightning_moe.precision.weight_cache import FP8WeightCache

    monkeypatch.setattr(native_gemms, "TRITON_GROUPED_GEMM", False)

    torch.manual_seed(0)
    ends = torch.linspace(0, 1, experts + 1)[1:] ** 2 * 700 // 16 * 16  # uneven; with 40 the first is empty
    offsets = ends.to(device="cuda", dtype=torch.int32)
    x = torch.randn(720, 128, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(experts, 128, 64, device="cuda")
    results = []
    for fused in (True, False):
        w = w0.clone().requires_grad_(True)
        gemm = FP8GroupedGemm("delayed", backend="torch")  # hybrid: E4M3 in the grouped kernels
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(scaled_mm, "fused_delayed", lambda *args: False)
            results.append(_train(gemm, x, w, offsets, steps=3, cache=FP8WeightCache() if cache else None))
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), i
    scales = results[0][-2][:, :experts]  # [role, fc1's experts]: experts without tokens have no input / grad history
    routed = torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0
    assert (scales[1] > 0).all() and (scales[[0, 2]][:, routed] > 0).all() and torch.isfinite(results[0][-3]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts,k,n", [(4, 128, 64), (8, 256, 512)])
def test_one_delayed_cast_writing_both_weight_layouts(experts, k, n, dtype):
    """The single cast that writes both weight layouts (the weight cache's) against the two
    single-layout casts; fp32 master weights once got wrong transposed bytes here."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.precision.native_casts import weight_as_groups

    torch.manual_seed(0)
    w = torch.randn(experts, k, n, device="cuda", dtype=dtype)
    scale = torch.zeros(experts, device="cuda")
    rows, ends, q_one, stride_col, stride_group = weight_as_groups(w)
    q_row, s_row, s_col = delayed_cast(rows, ends, scale, None, out_col=q_one, stride_out_col=stride_col,
                                       stride_out_group=stride_group)
    _, _, q_two, _, _ = weight_as_groups(w)
    _, _, s_col_two = delayed_cast(rows, ends, scale, None, write_row=False, out_col=q_two,
                                   stride_out_col=stride_col, stride_out_group=stride_group)
    q_row_two, s_row_two, _ = delayed_cast(rows, ends, scale, None)
    assert torch.equal(s_col, s_col_two) and torch.equal(s_row, s_row_two)
    assert same_bits(q_row, q_row_two)
    bad = (q_one.view(torch.uint8) != q_two.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} forward-layout bytes differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])  # hybrid: E5M2 gradients from the row kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_delayed_training_identical_with_fused_and_generic_casts(monkeypatch, fmt, dtype):
    from lightning_moe.precision import FP8Linear, scaled_mm

    torch.manual_seed(0)
    x = torch.randn(200, 128, device="cuda", dtype=dtype)
    x[3, 7] = float("nan")  # ignored by the amax, NaN in the output either way
    results = []
    for fused in (True, False):
        torch.manual_seed(1)
        layer = FP8Linear(128, 64, recipe=FP8Recipe("delayed", fmt=fmt), backend="torch", device="cuda")
        seen = []
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(scaled_mm, "fused_delayed", lambda *args: False)
            for step in range(3):
                layer.zero_grad(set_to_none=True)
                for micro in range(2):
                    x_mb = (x[4:] * (1 + step + micro)).requires_grad_(True)
                    y = layer(x_mb)
                    y.float().square().sum().backward()
                    seen += [y, x_mb.grad]
                seen += [layer.weight.grad.clone(), layer.bias.grad.clone()]
                update_delayed_scaling([layer], layer.recipe)
                with torch.no_grad():
                    layer.weight.mul_(1.5)
                seen += [layer.fp8_scale.clone(), layer.fp8_amax_history.clone()]
            y_nan = layer(x)  # the NaN row: the amax ignores it
            seen.append(torch.nan_to_num(y_nan, nan=7.0))
        results.append(seen)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), i
    assert (results[0][-3] > 0).all()  # the last fp8_scale: every role has a scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_fused_cast_equals_the_cast_of_the_swiglu_output(dtype):
    """``delayed_cast(h, swiglu=True)`` writes the bits of casting the Triton SwiGLU's output:
    groups with and without history, empty and unaligned groups, a tail, NaN and inf in ``h``."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.swiglu_triton import swiglu

    torch.manual_seed(0)
    rows, cols = 700, 200
    h = torch.randn(rows, 2 * cols, device="cuda", dtype=dtype) * 3
    h[5, 7], h[17, cols + 3] = float("nan"), float("inf")
    offsets = torch.tensor([0, 37, 37, 350, 690], device="cuda", dtype=torch.int32)  # rows 690.. are the tail
    scale = torch.tensor([0.0, 2.0, 0.0, 0.5, float("nan")], device="cuda")  # 0 / NaN: no history
    results = []
    for fused, operand in ((True, h), (False, swiglu(h))):
        q_col = torch.zeros(cols, 704, device="cuda", dtype=torch.float8_e4m3fn)
        record = torch.zeros(5, device="cuda")
        q, s_row, s_col = delayed_cast(operand, offsets, scale, record, out_col=q_col, stride_out_col=704,
                                       swiglu=fused)
        results.append((q, s_row, s_col, q_col, record))
    (q, s_row, s_col, q_col, record), (q_ref, s_row_ref, s_col_ref, q_col_ref, record_ref) = results
    assert same_bits(q, q_ref) and same_bits(q_col, q_col_ref)
    assert torch.equal(s_row, s_row_ref) and torch.equal(s_col, s_col_ref) and torch.equal(record, record_ref)


def _train_delayed_layer(experts: int, dtype: torch.dtype) -> list:
    """Everything a delayed-FP8 MoE layer produces over 3 optimizer steps of 2 micro-batches (the
    second checkpointed) and an evaluation forward: outputs, token and parameter gradients, and
    the FP8 buffers (scales, amax histories)."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.precision import FP8Precision

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=experts, router_topk=2, expert_alignment=16)
    layer = MoELayer(cfg).cuda().to(dtype)
    plugin = FP8Precision(recipe="delayed", backend="torch")
    plugin.convert_module(layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    data = torch.randn(7, 2, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(dtype)
    seen = []
    for step in range(3):
        for micro in range(2):
            x = data[2 * step + micro].clone().requires_grad_(True)
            with plugin.forward_context():
                y = layer(x) if micro == 0 else checkpoint(layer, x, use_reentrant=False)
            y.float().square().mean().backward()
            seen += [y.detach(), x.grad]
        seen += [p.grad.clone() for p in layer.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        plugin.update_delayed_scaling()
    with torch.no_grad(), plugin._eval_context():
        seen.append(layer(data[6]))
    seen += [b.clone() for name, b in layer.named_buffers() if "fp8" in name]
    return seen


def _assert_all_equal(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


@pytest.mark.parametrize("experts", [4, 40])  # per-expert GEMMs, the grouped kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_fused_into_the_fc2_cast_trains_identically(monkeypatch, count_calls, experts, dtype):
    """FP8 delayed experts with the SwiGLU computed inside fc2's input cast train bit for bit as
    with the SwiGLU kernel's output cast separately (`_train_delayed_layer`)."""
    from lightning_moe.nn.experts import GroupedExperts
    from lightning_moe.precision import scaled_mm

    # the combine stays the dispatcher's (test_fp8_combine_gpu.py covers the one fused into fc2)
    monkeypatch.setattr(GroupedExperts, "takes_deferred_combine", lambda self, tokens: False)
    fused_calls = count_calls(scaled_mm, "scaled_grouped_mm_swiglu")
    fused = _train_delayed_layer(experts, dtype)
    assert len(fused_calls) == 3 * 3  # the plain and the checkpointed forward, and its recompute; not evaluation
    with monkeypatch.context() as m:
        m.setattr(FP8GroupedGemm, "grouped_mm_swiglu", lambda self, *args, **kwargs: None)
        plain = _train_delayed_layer(experts, dtype)
    assert len(fused_calls) == 9
    _assert_all_equal(fused, plain)


@pytest.mark.parametrize("transposed", [True, False])  # both copies (tile kernel), the row copy alone
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gathered_cast_equals_the_cast_of_the_permuted_rows(dtype, transposed):
    """``delayed_cast(x, gather_rows=src)`` writes the bits of casting ``x[src]`` (zero rows
    where ``src`` is the padding sentinel): groups with and without history, empty and
    unaligned groups, a tail, NaN and inf among the tokens."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast

    torch.manual_seed(0)
    tokens, rows, cols = 300, 700, 200
    x = torch.randn(tokens, cols, device="cuda", dtype=dtype) * 3
    x[5, 7], x[17, 3] = float("nan"), float("inf")
    src = torch.randint(0, tokens + 1, (rows,), device="cuda")  # `tokens`: a padding row
    permuted = torch.cat([x, x.new_zeros(1, cols)])[src]
    offsets = torch.tensor([0, 37, 37, 350, 690], device="cuda", dtype=torch.int32)  # rows 690.. are the tail
    scale = torch.tensor([0.0, 2.0, 0.0, 0.5, float("nan")], device="cuda")  # 0 / NaN: no history
    results = []
    for operand, gather in ((x, src), (permuted, None)):
        q_col = torch.zeros(cols, 704, device="cuda", dtype=torch.float8_e4m3fn) if transposed else None
        record = torch.zeros(5, device="cuda")
        q, s_row, s_col = delayed_cast(operand, offsets, scale, record, out_col=q_col,
                                       stride_out_col=704 if transposed else 0, gather_rows=gather)
        results.append((q, s_row, s_col, q_col, record))
    (q, s_row, s_col, q_col, record), (q_ref, s_row_ref, s_col_ref, q_col_ref, record_ref) = results
    assert same_bits(q, q_ref) and torch.equal(s_row, s_row_ref) and torch.equal(record, record_ref)
    if transposed:
        assert same_bits(q_col, q_col_ref) and torch.equal(s_col, s_col_ref)


@pytest.mark.parametrize("experts", [4, 40])  # per-expert GEMMs, the grouped kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_permutation_read_inside_the_fc1_cast_trains_identically(monkeypatch, count_calls, experts, dtype):
    """FP8 delayed experts reading the permutation inside fc1's input cast (the dispatcher hands
    over the tokens and the plan) train bit for bit as with the permuted rows written first
    (`_train_delayed_layer`, token gradients included)."""
    from lightning_moe.nn.experts import GroupedExperts
    from lightning_moe.precision import scaled_mm

    monkeypatch.setattr(GroupedExperts, "takes_deferred_combine", lambda self, tokens: False)  # as above
    gathered_calls = count_calls(scaled_mm, "scaled_grouped_mm_gathered")
    gathered = _train_delayed_layer(experts, dtype)
    assert len(gathered_calls) == 3 * 3 + 1  # plain and checkpointed forwards, the recompute, evaluation
    with monkeypatch.context() as m:
        m.setattr(GroupedExperts, "takes_deferred_permutation", lambda self, tokens: False)
        plain = _train_delayed_layer(experts, dtype)
    assert len(gathered_calls) == 10
    _assert_all_equal(gathered, plain)


def test_amax_prepass_only_while_the_state_is_fresh(monkeypatch):
    """A layer's first training step (no scale yet) finds the amaxes by the pre-pass; after the
    first update the tile casts run alone (one launch each), and evaluation (recording paused)
    runs the pre-pass again, as its groups may have no history."""
    import lightning_moe.kernels.fp8_delayed_triton as fd
    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.precision import FP8Precision

    kernels = []
    real = fd.launch
    monkeypatch.setattr(fd, "launch", lambda kernel, *a, **k: kernels.append(kernel) or real(kernel, *a, **k))
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, router_topk=2, expert_alignment=16)
    layer = MoELayer(cfg).cuda().to(torch.bfloat16)
    plugin = FP8Precision(recipe="delayed", backend="torch")
    plugin.convert_module(layer)
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def prepasses_of_a_step() -> int:
        kernels.clear()
        with plugin.forward_context():
            layer(x).float().square().mean().backward()
        return sum(k is fd._missing_amax_kernel for k in kernels)

    fresh = prepasses_of_a_step()
    plugin.update_delayed_scaling()
    later = prepasses_of_a_step()
    assert fresh >= 4 and later < fresh  # the tile casts' pre-passes are gone
    assert later == sum(k is fd._delayed_row_kernel for k in kernels)  # those left belong to row casts
    kernels.clear()
    with torch.no_grad(), plugin._eval_context():
        layer(x)
    assert any(k is fd._missing_amax_kernel for k in kernels)
    assert any(k is fd._fill_missing_scales_kernel for k in kernels)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("group_counts", [(256, 3), (256,)])  # concatenated; one module's own buffers
def test_delayed_scaling_update_kernel_gives_the_torch_update_bits(monkeypatch, algo, margin, group_counts):
    """`update_delayed_scaling` on CUDA (one update kernel per block) against its torch formulation on
    the same histories (TE's default length, one module or two of other group counts, zeros,
    infinities, NaNs and subnormal amaxes), bit for bit, buffers updated in place."""
    from lightning_moe.kernels import delayed_update_triton
    from lightning_moe.precision.delayed import _updated

    from lightning_moe.precision import delayed

    monkeypatch.setattr(delayed, "FUSED_SCALE_UPDATE", True)
    launched = []
    kernel = delayed_update_triton.delayed_update
    monkeypatch.setattr(delayed_update_triton, "delayed_update",
                        lambda *args: launched.append(args) or kernel(*args))
    recipe = FP8Recipe("delayed", margin=margin, amax_compute_algo=algo)
    gen = torch.Generator("cuda").manual_seed(margin)
    modules = []
    for groups in group_counts:
        module = torch.nn.Module()
        history = torch.rand(recipe.amax_history_len, 3, groups, device="cuda", generator=gen) * 100
        history[:, 0, 0] = 0.0
        history[5, 1, 1 % groups] = float("inf")
        history[0, 2, 2 % groups] = float("nan")
        history[:, 2, 0] = 1e-40
        module.fp8_amax_history = history
        module.fp8_scale = torch.rand(3, groups, device="cuda", generator=gen) + 0.5
        modules.append(module)
    expected = [_updated(m.fp8_amax_history.clone(), m.fp8_scale.clone(), recipe) for m in modules]
    addresses = [(m.fp8_amax_history.data_ptr(), m.fp8_scale.data_ptr()) for m in modules]
    update_delayed_scaling(modules, recipe)
    assert len(launched) == 1  # the kernel, once for the block
    for module, (scale, history), address in zip(modules, expected, addresses):
        assert (module.fp8_amax_history.data_ptr(), module.fp8_scale.data_ptr()) == address  # in place
        assert torch.equal(module.fp8_scale.view(torch.int32), scale.view(torch.int32))
        assert torch.equal(module.fp8_amax_history.view(torch.int32), history.view(torch.int32))


