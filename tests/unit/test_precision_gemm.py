"""Emulated FP8 / NVFP4 GEMMs: accuracy, gradients, grouped semantics, and bad inputs."""

import pytest
import torch

from lightning_moe.precision import (
    FP8GroupedGemm,
    FP8Linear,
    FP8Recipe,
    _te,
    dequantize_fp8,
    fp8_grouped_mm,
    fp8_linear,
    quantize_fp8,
    resolve_backend,
)

FP8_RECIPES = ["tensorwise", "rowwise", "blockwise", "delayed", "mxfp8"]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(m=96, k=256, n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


@pytest.mark.parametrize("name", FP8_RECIPES + ["nvfp4"])
def test_linear_forward_backward_error(name):
    x, w, b = _inputs()
    layer = FP8Linear(256, 128, recipe=name)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xq = x.clone().requires_grad_()
    y = layer(xq)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = xr @ wr.T + b
    dy = torch.randn_like(y_ref)
    y.backward(dy)
    y_ref.backward(dy)
    errors = [_rel(y - b, y_ref - b), _rel(xq.grad, xr.grad), _rel(layer.weight.grad, wr.grad)]
    low, high = (0.05, 0.25) if name == "nvfp4" else (0.01, 0.07)  # E4M3 ~3.7%, E5M2 grads ~6%
    assert all(low < e < high for e in errors), errors
    assert torch.allclose(layer.bias.grad, dy.sum(0))


def test_linear_tensorwise_is_exactly_quantize_then_matmul():
    """Hybrid format: E4M3 operands forward, E5M2 gradients; one scale per tensor."""
    x, w, _ = _inputs(64, 128, 64, seed=1)
    x.requires_grad_()
    wp = w.clone().requires_grad_()
    y = fp8_linear(x, wp, "tensorwise")
    dy = torch.randn_like(y)
    y.backward(dy)

    def qdq(t, fmt="e4m3"):
        return dequantize_fp8(*quantize_fp8(t, fmt, "tensorwise"))

    assert torch.allclose(y, qdq(x) @ qdq(w).T, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, qdq(dy, "e5m2") @ qdq(w), rtol=1e-5, atol=1e-5)
    assert torch.allclose(wp.grad, qdq(dy, "e5m2").T @ qdq(x.detach()), rtol=1e-5, atol=1e-5)


def test_linear_autocast_dtype_and_leading_dims():
    x = torch.randn(2, 5, 64)
    layer = FP8Linear(64, 32, recipe="blockwise")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 32)
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.abs().sum() > 0


def _grouped_ref(x, w, offsets):
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(x[start:end] @ w[e])
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("name", FP8_RECIPES + ["nvfp4"])
def test_grouped_mm_error_and_grads(name):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(128, 64, generator=g), torch.randn(4, 64, 96, generator=g) / 8
    offsets = torch.tensor([32, 48, 48, 128], dtype=torch.int32)  # an empty expert too
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = FP8GroupedGemm(name).grouped_mm(xq, wq, offsets)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = _grouped_ref(xr, wr, offsets)
    dy = torch.randn_like(y_ref)
    y.backward(dy)
    y_ref.backward(dy)
    errors = [_rel(y, y_ref), _rel(xq.grad, xr.grad), _rel(wq.grad, wr.grad)]
    low, high = (0.05, 0.25) if name == "nvfp4" else (0.01, 0.07)
    assert all(low < e < high for e in errors), errors
    assert not wq.grad[2].any()  # the empty expert gets no gradient


@pytest.mark.parametrize("scaling,block", [("tensorwise", None), ("blockwise", (1, 128))])
def test_grouped_mm_quantizes_each_expert_separately(scaling, block):
    """Per-expert semantics: scales and blocks never mix two experts' tokens (group sizes
    that are not multiples of the 128-token block included)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(256, 128, generator=g), torch.randn(3, 128, 128, generator=g)
    x[:100] *= 50  # expert 0's tokens are much larger
    offsets = torch.tensor([100, 250, 256], dtype=torch.int32)
    recipe = "tensorwise" if scaling == "tensorwise" else "blockwise"
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(xq, wq, offsets, recipe)
    dy = torch.randn_like(y)
    y.backward(dy)

    def qdq(t, fmt, tile=block):
        return dequantize_fp8(*quantize_fp8(t, fmt, scaling, tile), scaling, tile)

    grad_fmt = "e5m2" if recipe == "tensorwise" else "e4m3"
    w_tile = None if block is None else (128, 128)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        xe, dye = x[start:end], dy[start:end]
        we_t = qdq(w[e].T, "e4m3", w_tile)  # [N, K] tiles over the contraction K
        assert torch.allclose(y[start:end], qdq(xe, "e4m3") @ we_t.T, rtol=1e-5, atol=1e-4)
        dx_ref = qdq(dye, grad_fmt) @ qdq(w[e], "e4m3", w_tile).T
        assert torch.allclose(xq.grad[start:end], dx_ref, rtol=1e-5, atol=1e-4)
        dw_ref = qdq(xe.T.contiguous(), "e4m3") @ qdq(dye.T.contiguous(), grad_fmt).T
        assert torch.allclose(wq.grad[e], dw_ref, rtol=1e-5, atol=1e-3)
        start = end


def test_nvfp4_grouped_needs_16_token_groups():
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(2, 32, 32)
    y = fp8_grouped_mm(x, w, torch.tensor([24, 64], dtype=torch.int32), "nvfp4")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        y.sum().backward()


# ------------------------------------------------------------------------- bad inputs
def test_unknown_recipe_lists_known_ones():
    with pytest.raises(ValueError, match="tensorwise, rowwise, blockwise, delayed, mxfp8, nvfp4"):
        FP8Recipe("float8")
    with pytest.raises(ValueError, match="Unknown FP8 backend"):
        resolve_backend("tensorwise", "cutlass")
    with pytest.raises(ValueError, match="fmt"):
        FP8Recipe("tensorwise", fmt="e5m2")
    from lightning_moe.precision import FP8Precision

    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        FP8Precision(device="gpu")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "blockwise"])
def test_no_torch_kernel_names_alternatives(name):
    with pytest.raises(ValueError, match=r"backend='te'.*backend='emulated'") as err:
        resolve_backend(name, "torch")
    if name != "blockwise":
        assert "Blackwell" in str(err.value)


def test_torch_backend_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only message")
    with pytest.raises(ValueError, match="CUDA.*backend='emulated'"):
        resolve_backend("tensorwise", "torch")
    with pytest.raises(ValueError, match="CUDA"):
        fp8_linear(torch.randn(2, 16), torch.randn(16, 16), "rowwise", "torch")


def test_te_backend_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(_te, "available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install lightning-moe\[te\]"):
        resolve_backend("tensorwise", "te", device="cuda")
    with pytest.raises(ValueError, match="no 'rowwise' recipe"):
        resolve_backend("rowwise", "te", device="cuda")
    with pytest.raises(ValueError, match="FP8Precision"):
        fp8_linear(torch.randn(2, 16), torch.randn(16, 16), "tensorwise", "te")


def test_te_unsupported_gpu_carries_te_reason(monkeypatch):
    reason = "Device compute capability 10.0 or higher required for NVFP4 execution."
    monkeypatch.setattr(_te, "available", lambda: True)
    monkeypatch.setattr(_te, "supports", lambda recipe: (False, reason))
    with pytest.raises(ValueError, match="Backends that can: 'emulated'") as err:
        resolve_backend("nvfp4", "te", device="cuda")
    assert reason in str(err.value)
    # "auto" falls back instead of failing
    assert resolve_backend("nvfp4", "auto", device="cuda") == "emulated"


def test_auto_on_hopper_without_te_picks_the_native_kernels(monkeypatch):
    from lightning_moe.precision import recipes

    monkeypatch.setattr(_te, "available", lambda: False)
    monkeypatch.setattr(recipes, "cuda_capability", lambda device=None: (9, 0))
    for name in ("tensorwise", "rowwise", "delayed"):
        assert resolve_backend(name, "auto", device="cuda") == "torch"
        assert resolve_backend(name, "auto", device="cuda", grouped=True) == "torch"
    for name in ("blockwise", "mxfp8", "nvfp4"):  # no native kernels
        assert resolve_backend(name, "auto", device="cuda") == "emulated"
    monkeypatch.setattr(recipes, "cuda_capability", lambda device=None: (8, 9))  # Ada: no grouped FP8
    assert resolve_backend("delayed", "auto", device="cuda", grouped=True) == "emulated"


def test_plugin_defaults_to_delayed_scaling_on_the_native_kernels(monkeypatch):
    """`FP8Precision()` is Megatron-Core's default recipe, and on a Hopper GPU without
    Transformer Engine it runs the native kernels (the delayed casts), not the emulation."""
    from lightning_moe.precision import FP8Precision, recipes

    monkeypatch.setattr(_te, "available", lambda: False)
    monkeypatch.setattr(recipes, "cuda_capability", lambda device=None: (9, 0))
    plugin = FP8Precision(device="cuda")
    assert plugin.recipe.name == "delayed" and plugin.backend == "torch"
    assert FP8Precision(device="cpu").backend == "emulated"


def test_auto_on_cpu_is_emulated():
    for name in ("tensorwise", "rowwise", "blockwise", "delayed", "mxfp8", "nvfp4"):
        assert resolve_backend(name, "auto", device="cpu") == "emulated"


def test_delayed_needs_state():
    with pytest.raises(ValueError, match="amax-history"):
        fp8_linear(torch.randn(4, 16), torch.randn(16, 16), "delayed")


@pytest.mark.parametrize("name", ["tensorwise", "blockwise", "delayed"])
def test_grouped_mm_no_tokens_and_ragged_token_count(name):
    gemm, w = FP8GroupedGemm(name), torch.randn(2, 32, 16, requires_grad=True)
    empty = torch.zeros(0, 32, requires_grad=True)
    gemm.grouped_mm(empty, w, torch.zeros(2, dtype=torch.int32)).sum().backward()
    assert w.grad is not None and not w.grad.any()
    x = torch.randn(13, 32, requires_grad=True)  # 13 rows: not a multiple of the 16-byte stride
    gemm.grouped_mm(x, w, torch.tensor([5, 13], dtype=torch.int32)).sum().backward()
    assert x.grad.shape == x.shape and w.grad.isfinite().all()


def test_fast_accumulation_defaults_and_validation():
    assert FP8Recipe("rowwise").fast_accumulation == ("fprop",)  # Transformer Engine's default
    assert FP8Recipe("tensorwise").fast("fprop") and not FP8Recipe("tensorwise").fast("wgrad")
    assert FP8Recipe("blockwise").fast_accumulation == ()
    everywhere = FP8Recipe("rowwise", fast_accumulation=["fprop", "dgrad", "wgrad"])
    assert everywhere.fast("dgrad") and everywhere.fast("wgrad")
    assert "fast accumulation: fprop/dgrad/wgrad" in everywhere.describe()
    with pytest.raises(ValueError, match="'fprop', 'dgrad' and 'wgrad'"):
        FP8Recipe("rowwise", fast_accumulation=("forward",))
    with pytest.raises(ValueError, match="split accumulation"):
        FP8Recipe("blockwise", fast_accumulation=("fprop",))


def test_te_delayed_scaling_rejects_a_custom_accumulation():
    from lightning_moe.precision import _te

    with pytest.raises(ValueError, match="DelayedScaling fixes the accumulation"):
        _te.te_recipe(FP8Recipe("delayed", fast_accumulation=("fprop", "wgrad")))
