"""The combine fused into the FP8 experts' second projection (`DeferredCombine`): the routing
probabilities weight the SwiGLU's rows inside fc2's input cast, each token's rows are summed
after the GEMM, and the backward's gradient cast gathers the tokens' gradient itself."""

from __future__ import annotations

import pytest
import torch
from _float8 import relative_error as _relative_error
from _float8 import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighted_swiglu_backward_matches_autograd(dtype):
    """``weighted_swiglu_backward`` against autograd of ``p * silu(gate) * up`` in fp64; rows
    of a width that is not a multiple of the column block, a zero probability."""
    from lightning_moe.kernels.swiglu_triton import weighted_swiglu_backward

    torch.manual_seed(0)
    rows, f = 333, 200
    h = (torch.randn(rows, 2 * f, device="cuda") * 2).to(dtype)
    p = torch.rand(rows, device="cuda")
    p[7] = 0.0
    g = torch.randn(rows, f, device="cuda").to(dtype)
    grad_h, grad_p = weighted_swiglu_backward(h, g, p)

    h64, p64 = h.double().requires_grad_(True), p.double().requires_grad_(True)
    gate, up = h64.chunk(2, dim=1)
    (torch.nn.functional.silu(gate) * up * p64[:, None]).backward(g.double())
    assert grad_h.dtype == dtype and grad_p.dtype == torch.float32
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert _relative_error(grad_h, h64.grad) < bound
    assert _relative_error(grad_p, p64.grad) < 1e-5  # fp32 math on the stored inputs either way
    assert torch.all(grad_h[7] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_weighted_swiglu_cast_equals_the_cast_of_the_weighted_rows(dtype):
    """``delayed_cast(h, swiglu=True, row_probs=p)`` writes the bits of casting ``swiglu(h) * p``.
    With powers of two as probabilities the weighting is exact on either side (the rounding to
    ``h``'s dtype commutes with it), so the bits must agree; groups with and without history,
    an empty group, a tail."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.swiglu_triton import swiglu

    torch.manual_seed(0)
    rows, cols = 700, 200
    h = (torch.randn(rows, 2 * cols, device="cuda") * 3).to(dtype)
    p = torch.exp2(-torch.randint(0, 6, (rows,), device="cuda").float())
    offsets = torch.tensor([0, 37, 37, 350, 690], device="cuda", dtype=torch.int32)
    scale = torch.tensor([0.0, 2.0, 0.0, 0.5, 0.0], device="cuda")
    results = []
    for operand, weights in ((h, p), (swiglu(h) * p[:, None].to(dtype), None)):
        q_col = torch.zeros(cols, 704, device="cuda", dtype=torch.float8_e4m3fn)
        record = torch.zeros(5, device="cuda")
        q, s_row, s_col = delayed_cast(operand, offsets, scale, record, out_col=q_col, stride_out_col=704,
                                       swiglu=weights is not None, row_probs=weights)
        results.append((q, s_row, s_col, q_col, record))
    (q, s_row, s_col, q_col, record), (q_ref, s_row_ref, s_col_ref, q_col_ref, record_ref) = results
    assert same_bits(q, q_ref) and same_bits(q_col, q_col_ref)
    assert torch.equal(s_row, s_row_ref) and torch.equal(s_col, s_col_ref) and torch.equal(record, record_ref)


def _routed(tokens: int, experts: int, topk: int, seed: int):
    """A plan of random routing (16-row aligned groups) and power-of-two probabilities."""
    from lightning_moe.nn.permutation import plan_permutation

    gen = torch.Generator("cuda").manual_seed(seed)
    experts_TK = torch.rand(tokens, experts, device="cuda", generator=gen).argsort(1)[:, :topk]
    probs_TK = torch.exp2(-torch.randint(0, 4, (tokens, topk), device="cuda", generator=gen).float())
    return plan_permutation(experts_TK, experts, alignment=16), probs_TK


@pytest.mark.parametrize("experts", [4, 40])  # per-expert GEMMs, the grouped kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combined_second_projection_equals_its_unfused_composition(experts, dtype):
    """``scaled_grouped_mm_swiglu(h, w, ..., combine=)`` against the same function composed of
    the pieces it fuses: ``(swiglu(h) * p) @ w`` (FP8, the same delayed state) then an
    unweighted `unpermute`. Power-of-two probabilities make the weighting exact, so the output
    and the gradients of ``h`` and ``w`` have the same bits; the probabilities' gradient (a
    reduction in another order, over ``h``'s values before the rounding) agrees to fp32 noise."""
    from lightning_moe.kernels.swiglu_triton import swiglu
    from lightning_moe.nn.grouped_gemm import group_offsets
    from lightning_moe.nn.permutation import DeferredCombine, row_probs, unpermute
    from lightning_moe.precision.delayed import DelayedState
    from lightning_moe.precision.recipes import FP8Recipe
    from lightning_moe.precision.scaled_mm import scaled_grouped_mm, scaled_grouped_mm_swiglu

    torch.manual_seed(0)
    tokens, topk, f, n = 256, 2, 128, 256
    plan, probs_TK = _routed(tokens, experts, topk, seed=1)
    offsets = group_offsets(plan.group_sizes_E, plan.num_rows)
    recipe = FP8Recipe.of("delayed")
    h0 = (torch.randn(plan.num_rows, 2 * f, device="cuda") * 2).to(dtype)
    w0 = (torch.randn(experts, f, n, device="cuda") / f ** 0.5).to(dtype)
    g = torch.randn(tokens, n, device="cuda").to(dtype)
    history = torch.rand(4, 3, experts, device="cuda") + 0.5
    outs = []
    for fused in (True, False):
        state = DelayedState(history.clone(), torch.zeros(3, experts, device="cuda"))
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        p = probs_TK.clone().requires_grad_(True)
        if fused:
            y = scaled_grouped_mm_swiglu(h, w, offsets, recipe, state, combine=DeferredCombine(plan, p))
        else:
            weighted = swiglu(h) * row_probs(p, plan).to(dtype)[:, None]
            y = unpermute(scaled_grouped_mm(weighted, w, offsets, recipe, state), torch.ones_like(p), plan)
        y.backward(g)
        outs.append((y.detach(), h.grad, w.grad, p.grad, state.amax_history.clone()))
    (y, dh, dw, dp, amax), (y_ref, dh_ref, dw_ref, dp_ref, amax_ref) = outs
    assert y.shape == (tokens, n)
    assert torch.equal(y, y_ref) and torch.equal(dw, dw_ref) and torch.equal(amax, amax_ref)
    # in bf16 the unfused SwiGLU backward receives ``dx * p`` rounded; exact for powers of two
    assert torch.equal(dh, dh_ref)
    assert _relative_error(dp, dp_ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def _layer_step(deferred: bool, monkeypatch, experts: int = 40, checkpointed: bool = False, fp8: bool = True,
                master_fp32: bool = False, fast_wgrad: bool = False, handoff: bool = True):
    """Output, token gradient and parameter gradients of one FP8-delayed MoE layer step, with
    the combine fused into the experts (``deferred``) or run by the dispatcher; ``checkpointed``:
    under activation checkpointing (the forward recomputed in the backward); ``fp8=False``: the
    bf16 layer, as a reference; ``master_fp32``: the experts hold the same (bf16-representable)
    weights in fp32, as bf16-mixed training holds master weights; ``fast_wgrad``: fast accumulation
    in every product (the weight gradient then takes our Triton kernel); ``handoff=False``: fc1's
    output gradient written in bf16 by fc2's backward and cast by fc1's (``FP8Recipe.fuse_swiglu_backward``
    off, the default)."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.nn.experts import GroupedExperts
    from lightning_moe.precision import FP8Precision, FP8Recipe

    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=experts, router_topk=4, expert_alignment=16)
    layer = MoELayer(cfg).cuda()
    layer.experts.to(torch.bfloat16)
    if master_fp32:
        layer.experts.float()
    recipe = FP8Recipe("delayed", fast_accumulation=("fprop", "dgrad", "wgrad") if fast_wgrad else None,
                       fuse_swiglu_backward=handoff)
    plugin = FP8Precision(recipe=recipe, backend="torch")
    if fp8:
        plugin.convert_module(layer)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with monkeypatch.context() as m:
        if not deferred:
            m.setattr(GroupedExperts, "takes_deferred_combine", lambda self, tokens: False)
        with plugin.forward_context():
            y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        y.float().square().mean().backward()
    return [y.detach(), x.grad] + [q.grad for q in layer.parameters()]


def test_layer_with_the_combine_in_the_experts_matches_the_dispatchers_combine(monkeypatch, count_calls):
    """The MoE layer takes the fused combine by default (FP8 delayed on CUDA, training) and
    computes the same step as with the dispatcher's combine, within FP8 rounding (the two
    quantize differently weighted fc2 inputs): against the bf16 layer, each result's error is
    within 10% (+0.005) of the other path's."""
    from lightning_moe.kernels import swiglu_grad_cast_triton, swiglu_triton

    weighted = count_calls(swiglu_triton, "weighted_swiglu_backward")
    grad_casts = count_calls(swiglu_grad_cast_triton, "delayed_swiglu_grad_cast")
    fused = _layer_step(True, monkeypatch)
    assert len(grad_casts) == 1 and not weighted  # the SwiGLU's backward inside fc1's gradient cast
    _layer_step(True, monkeypatch, handoff=False)
    assert len(grad_casts) == 1 and len(weighted) == 1
    plain = _layer_step(False, monkeypatch)
    assert len(grad_casts) == 2 and len(weighted) == 1
    reference = _layer_step(False, monkeypatch, fp8=False)
    assert len(fused) == len(plain) == len(reference)
    for i, (a, b, ref) in enumerate(zip(fused, plain, reference)):
        assert a.shape == b.shape == ref.shape and torch.isfinite(a).all(), i
        error, plain_error = _relative_error(a, ref), _relative_error(b, ref)
        assert error < 0.15 and error <= 1.1 * plain_error + 0.005, (i, error, plain_error)


def test_fused_combine_under_activation_checkpointing_is_exact(monkeypatch):
    """A checkpointed layer with the combine in the experts (its forward recomputed in the
    backward, the saved plan's tensors made again) gives the same bits as without checkpointing."""
    plain = _layer_step(True, monkeypatch)
    recomputed = _layer_step(True, monkeypatch, checkpointed=True)
    for i, (a, b) in enumerate(zip(plain, recomputed)):
        assert torch.equal(a, b), i


def test_fp32_master_weights_get_in_fp32_the_gradient_bf16_weights_get_rounded(monkeypatch):
    """Experts holding fp32 master weights: the FP8 weight-gradient kernel writes their gradient
    in fp32 (no bf16 copy widened by a second pass). Every other result of the step equals the
    bf16-weight layer's bit for bit, and the expert gradients round to its gradients."""
    import lightning_moe.kernels.fp8_grouped_gemm_triton as kernels

    out_dtypes = []
    real = kernels.grouped_mm_wgrad
    monkeypatch.setattr(kernels, "grouped_mm_wgrad",
                        lambda *a, **k: out_dtypes.append(k.get("out_dtype", torch.bfloat16)) or real(*a, **k))
    bf16 = _layer_step(True, monkeypatch, fast_wgrad=True)
    assert out_dtypes == [torch.bfloat16] * 2
    fp32 = _layer_step(True, monkeypatch, master_fp32=True, fast_wgrad=True)
    assert out_dtypes[2:] == [torch.float32] * 2
    widened = 0
    for i, (a, b) in enumerate(zip(fp32, bf16)):
        if a.dtype == b.dtype:
            assert torch.equal(a, b), i
        else:
            assert (a.dtype, b.dtype) == (torch.float32, torch.bfloat16), i
            assert torch.equal(a.to(torch.bfloat16), b), i
            widened += 1
            assert not torch.equal(a, b.float()), i  # bits bf16 would drop
    assert widened == 2  # fc1 and fc2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("aligned", [False, True])
def test_swiglu_grad_cast_equals_the_swiglu_backward_then_the_cast(dtype, weighted, aligned):
    """`delayed_swiglu_grad_cast(h, g, p)` writes the bytes, scales and amax record of casting
    `weighted_swiglu_backward(h, g, p)` (`swiglu_backward` without ``p``) with `delayed_cast`,
    in the plain and the weight-gradient kernel's aligned transposed layout; groups with and without
    history, an empty group, a tail after the last group, a width that is no multiple of the column
    block; the probabilities' gradient to fp32 rounding (another summation order)."""
    from lightning_moe.kernels.fp8_delayed_triton import delayed_cast
    from lightning_moe.kernels.swiglu_grad_cast_triton import delayed_swiglu_grad_cast
    from lightning_moe.kernels.swiglu_triton import swiglu_backward, weighted_swiglu_backward
    from lightning_moe.precision.native_casts import transposed_out, wgrad_aligned_ends

    torch.manual_seed(0)
    rows, f = 720, 200
    h = (torch.randn(rows, 2 * f, device="cuda") * 3).to(dtype)
    g = (torch.randn(rows, f, device="cuda") * torch.logspace(-3, 1, rows, device="cuda")[:, None]).to(dtype)
    p = torch.rand(rows, device="cuda") if weighted else None
    offsets = torch.tensor([0, 48, 48, 352, 704], device="cuda", dtype=torch.int32)
    scale = torch.tensor([0.0, 2.0, 0.0, 0.5, 0.0], device="cuda")
    ends = wgrad_aligned_ends(offsets) if aligned else None
    groups = offsets.numel() if aligned else 0
    if weighted:
        grad_h, grad_p_ref = weighted_swiglu_backward(h, g, p)
    else:
        grad_h, grad_p_ref = swiglu_backward(h, g), None
    results = []
    for fused in (True, False):
        q_col = transposed_out(h, 2 * f, rows=rows, aligned_groups=groups)
        q_col.view(torch.uint8).fill_(0x55)  # a marker for what no cast writes
        record = torch.zeros(offsets.numel(), device="cuda")
        if fused:
            q, s_row, s_col, grad_p = delayed_swiglu_grad_cast(h, g, p, offsets, scale, record, q_col,
                                                               q_col.shape[1], ends)
        else:
            (q, s_row, s_col), grad_p = delayed_cast(grad_h, offsets, scale, record, out_col=q_col,
                                                     stride_out_col=q_col.shape[1], aligned_ends=ends), grad_p_ref
        results.append((q, s_row, s_col, q_col, record, grad_p))
    (q, s_row, s_col, q_col, record, grad_p), (q_ref, s_row_ref, s_col_ref, q_col_ref, record_ref, grad_p_ref) = results
    assert same_bits(q, q_ref) and torch.equal(s_row, s_row_ref) and torch.equal(s_col, s_col_ref)
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert torch.equal(record, record_ref) and (record[sizes > 0] > 0).all()
    assert same_bits(q_col, q_col_ref), "transposed copy"  # the aligned gaps' zeros included
    end = int(ends[-1]) if aligned else int(offsets[-1])
    assert end == (896 if aligned else 704) and (q_col.view(torch.uint8)[:, end:] == 0x55).all()
    if weighted:
        assert grad_p.shape == (rows,) and _relative_error(grad_p, grad_p_ref) < 1e-6
    else:
        assert grad_p is None


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("deferred,fast_wgrad,master_fp32", [(True, False, False), (True, True, False),
                                                             (False, True, False), (True, True, True)])
def test_layer_step_with_fc1_gradient_handed_over_cast(monkeypatch, count_calls, deferred, fast_wgrad, master_fp32,
                                                       checkpointed):
    """fc1's output gradient cast inside fc2's backward (``FP8Recipe.fuse_swiglu_backward``) against
    the bf16 gradient written by the SwiGLU's backward and cast by fc1's: the output and the
    experts' weight gradients have the same bits (the same float8 operands; with ``fast_wgrad`` in
    the weight-gradient kernel's aligned layout). The probabilities' gradient is summed in another
    order, so the router's weight and the tokens' gradient agree to that rounding."""
    from lightning_moe.kernels import swiglu_grad_cast_triton

    grad_casts = count_calls(swiglu_grad_cast_triton, "delayed_swiglu_grad_cast")
    handed = _layer_step(deferred, monkeypatch, fast_wgrad=fast_wgrad, master_fp32=master_fp32,
                         checkpointed=checkpointed)
    assert len(grad_casts) == 1  # the handoff ran (once, also with the forward recomputed)
    unhanded = _layer_step(deferred, monkeypatch, fast_wgrad=fast_wgrad, master_fp32=master_fp32,
                           checkpointed=checkpointed, handoff=False)
    assert len(grad_casts) == 1
    from lightning_moe.nn import MoEConfig, MoELayer

    names = ["output", "input"] + [name for name, _ in MoELayer(MoEConfig(
        hidden_size=256, ffn_hidden_size=512, num_experts=40, router_topk=4, expert_alignment=16)).named_parameters()]
    assert len(names) == len(handed) == len(unhanded)
    for name, a, b in zip(names, handed, unhanded):
        if name == "output" or "experts" in name:
            assert torch.equal(a, b), name
        else:
            assert _relative_error(a, b) < 1e-3, (name, _relative_error(a, b))


def test_fc1_output_with_a_second_consumer_raises(count_calls):
    """fc1's output fed to fc2's fused SwiGLU cast and to anything else (a second fused fc2 call
    too): its backward would get that gradient beside the handed-over copies, and says so instead
    of dropping either."""
    from lightning_moe.kernels import swiglu_grad_cast_triton
    from lightning_moe.nn.grouped_gemm import group_offsets
    from lightning_moe.precision.delayed import DelayedState
    from lightning_moe.precision.recipes import FP8Recipe
    from lightning_moe.precision.scaled_mm import scaled_grouped_mm, scaled_grouped_mm_swiglu

    torch.manual_seed(0)
    plan, _ = _routed(128, 8, 2, seed=3)
    offsets = group_offsets(plan.group_sizes_E, plan.num_rows)
    recipe = FP8Recipe("delayed", fuse_swiglu_backward=True)
    x = torch.randn(plan.num_rows, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(8, 128, 256, device="cuda") / 128 ** 0.5).to(torch.bfloat16).requires_grad_(True)
    w2 = (torch.randn(8, 128, 128, device="cuda") / 128 ** 0.5).to(torch.bfloat16).requires_grad_(True)
    states = [DelayedState(torch.rand(4, 3, 8, device="cuda") + 0.5, torch.zeros(3, 8, device="cuda"))
              for _ in range(2)]
    grad_casts = count_calls(swiglu_grad_cast_triton, "delayed_swiglu_grad_cast")
    h = scaled_grouped_mm(x, w1, offsets, recipe, states[0])
    y = scaled_grouped_mm_swiglu(h, w2, offsets, recipe, states[1])
    y.float().sum().backward()  # fc2 alone consumes h: handed over
    assert len(grad_casts) == 1 and x.grad is not None and torch.isfinite(x.grad).all()
    for second_consumer in (lambda h: h.float().square().sum(),
                            lambda h: scaled_grouped_mm_swiglu(h, w2, offsets, recipe, states[1]).float().sum()):
        h = scaled_grouped_mm(x, w1, offsets, recipe, states[0])
        y = scaled_grouped_mm_swiglu(h, w2, offsets, recipe, states[1])
        with pytest.raises(RuntimeError, match="received a gradient from a consumer besides"):
            (y.float().sum() + second_consumer(h)).backward()
