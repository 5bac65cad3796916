"""FP8 / NVFP4 quantizers: scales follow TE's rules, values are bit-exact against torch's
casts (FP8) and an independent table-lookup reference (NVFP4); Hadamard transform."""

import pytest
import torch

from lightning_moe.precision import (
    dequantize_fp8,
    dequantize_nvfp4,
    hadamard_transform_matrix,
    quantize_fp8,
    quantize_nvfp4,
    random_hadamard_transform,
)

FLT_MAX = torch.finfo(torch.float32).max
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _bits(x):
    return x.float().contiguous().view(torch.int32)


def _x(*shape, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale * torch.exp(torch.randn(*shape, generator=g))


def _torch_fp8(x_scaled, dtype=torch.float8_e4m3fn, fmax=448.0):
    return x_scaled.clamp(-fmax, fmax).to(dtype)


def test_tensorwise_scale_and_values_match_torch_cast():
    x = _x(64, 200)
    q, scale = quantize_fp8(x, "e4m3", "tensorwise")
    s = torch.tensor(448.0) / x.abs().amax()
    assert scale.shape == () and _bits(scale) == _bits(1.0 / s)
    assert torch.equal(q.view(torch.uint8), _torch_fp8(x * s).view(torch.uint8))
    q5, _ = quantize_fp8(x, "e5m2", "tensorwise")
    s5 = torch.tensor(57344.0) / x.abs().amax()
    assert torch.equal(q5.view(torch.uint8), _torch_fp8(x * s5, torch.float8_e5m2, 57344.0).view(torch.uint8))
    back = dequantize_fp8(q, scale)
    assert ((back - x).norm() / x.norm()) < 0.04


def test_rowwise_and_leading_dims():
    x = _x(3, 8, 96, seed=1)
    q, scale = quantize_fp8(x, "e4m3", "rowwise")
    assert scale.shape == (3, 8, 1)
    s = 448.0 / x.abs().amax(-1, keepdim=True)
    assert torch.equal(q.view(torch.uint8), _torch_fp8(x * s).view(torch.uint8))
    assert ((dequantize_fp8(q, scale, "rowwise") - x).norm() / x.norm()) < 0.04


def test_blockwise_1x128_power_of_two_scales_with_partial_block():
    x = _x(16, 300, seed=2)  # 128 + 128 + 44
    q, scale = quantize_fp8(x, "e4m3", "blockwise", (1, 128))
    assert scale.shape == (16, 3)
    mant, _ = torch.frexp(scale)
    assert (mant == 0.5).all()  # powers of two
    for j, (lo, hi) in enumerate([(0, 128), (128, 256), (256, 300)]):
        block = x[:, lo:hi]
        s = 448.0 / block.abs().amax(-1, keepdim=True)
        s = torch.exp2(torch.floor(torch.log2(s)))  # largest power of two <= s
        assert torch.equal(scale[:, j : j + 1], 1.0 / s)
        assert torch.equal(q[:, lo:hi].view(torch.uint8), _torch_fp8(block * s).view(torch.uint8))


def test_blockwise_128x128_tiles():
    x = _x(200, 256, seed=3)
    q, scale = quantize_fp8(x, "e4m3", "blockwise", (128, 128))
    assert scale.shape == (2, 2)
    for i, rows in enumerate([slice(0, 128), slice(128, 200)]):
        for j, cols in enumerate([slice(0, 128), slice(128, 256)]):
            tile = x[rows, cols]
            s = torch.exp2(torch.floor(torch.log2(448.0 / tile.abs().amax())))
            assert scale[i, j] == 1.0 / s
            assert torch.equal(q[rows, cols].view(torch.uint8), _torch_fp8(tile * s).view(torch.uint8))
    assert ((dequantize_fp8(q, scale, "blockwise", (128, 128)) - x).norm() / x.norm()) < 0.04


def test_mxfp8_e8m0_scales():
    x = _x(8, 128, seed=4)
    q, scale = quantize_fp8(x, "e4m3", "mxfp8")
    assert scale.shape == (8, 4)
    amax = x.reshape(8, 4, 32).abs().amax(-1)
    expected = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    assert torch.equal(scale, expected)
    assert torch.equal(scale.to(torch.float8_e8m0fnu).float(), scale)  # representable in E8M0
    s = (1.0 / scale).repeat_interleave(32, 1)
    assert torch.equal(q.view(torch.uint8), _torch_fp8(x * s).view(torch.uint8))
    assert q.float().abs().max() <= 448


def test_zero_inf_nan_rules():
    zeros = torch.zeros(4, 32)
    q, scale = quantize_fp8(zeros, "e4m3", "rowwise")
    assert torch.equal(scale, torch.ones(4, 1)) and not q.float().any()
    # amax ignores NaN: the scale is the one without the NaN, the NaN stays NaN
    x = _x(4, 32, seed=5)
    with_nan = x.clone()
    with_nan[1, 3] = float("nan")
    q_nan, s_nan = quantize_fp8(with_nan, "e4m3", "tensorwise")
    x_no_nan = x.clone()
    x_no_nan[1, 3] = 0.0
    _, s_ref = quantize_fp8(x_no_nan, "e4m3", "tensorwise")
    assert s_nan == s_ref and torch.isnan(q_nan[1, 3].float())
    # an inf amax leaves the scale at 1 (TE); inf itself saturates to the format's max
    with_inf = x.clone()
    with_inf[0, 0] = float("inf")
    q_inf, s_inf = quantize_fp8(with_inf, "e5m2", "tensorwise")
    assert s_inf == 1.0 and q_inf[0, 0].float() == 57344.0
    assert torch.equal(q_inf[1:].view(torch.uint8), _torch_fp8(x[1:], torch.float8_e5m2, 57344.0).view(torch.uint8))
    # a tiny amax gives a scale of FLT_MAX instead of inf
    _, s_tiny = quantize_fp8(torch.full((2, 2), 1e-45), "e4m3", "tensorwise")
    assert s_tiny == 1.0 / torch.tensor(FLT_MAX)


def test_unknown_scaling_and_format():
    with pytest.raises(ValueError, match="Unknown FP8 scaling"):
        quantize_fp8(torch.ones(2, 2), "e4m3", "columnwise")
    with pytest.raises(ValueError, match="Unknown FP8 format"):
        quantize_fp8(torch.ones(2, 2), "e3m4")


# ----------------------------------------------------------------------------- NVFP4
def _e2m1_nearest_even(a):
    dist = (a[:, None] - E2M1_GRID[None, :]).abs()
    tied = dist == dist.min(1, keepdim=True).values
    score = tied.float() * 2 + (torch.arange(8) % 2 == 0).float()[None, :]
    return E2M1_GRID[score.argmax(1)]


def _e2m1_stochastic(a, rand):
    lower = E2M1_GRID[(E2M1_GRID[None, :] <= a[:, None]).sum(1) - 1]
    upper = E2M1_GRID[torch.clamp((E2M1_GRID[None, :] < a[:, None]).sum(1), max=7)]
    frac = torch.where(upper > lower, (a - lower) / (upper - lower), torch.zeros_like(a))
    return torch.where(rand < frac, upper, lower)


def reference_nvfp4(x, block_2d=False, rand=None):
    """Straightforward two-level NVFP4 (TE's recipe), block by block, torch's E4M3 cast."""
    x = x.float()
    rows, cols = x.shape
    finite_abs = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    g_amax = finite_abs.max()
    enc = torch.tensor(2688.0) / g_amax
    enc = torch.where(torch.isinf(enc), torch.tensor(FLT_MAX), enc)
    enc = torch.where(enc == 0, torch.tensor(1.0), enc)
    dec = 1.0 / enc
    values = torch.empty_like(x)
    br = 16 if block_2d else 1
    n_scales = torch.empty(rows // br, cols // 16)
    for i in range(0, rows, br):
        for j in range(0, cols, 16):
            block = x[i : i + br, j : j + 16]
            b_amax = finite_abs[i : i + br, j : j + 16].max()
            b_dec = torch.clamp(torch.clamp(b_amax * (enc * torch.tensor(1.0 / 6.0)), max=FLT_MAX), max=448.0)
            b_dec = b_dec.to(torch.float8_e4m3fn).float()
            n_scales[i // br, j // 16] = b_dec
            b_enc = torch.clamp(1.0 / (b_dec * dec), max=FLT_MAX)
            scaled = torch.clamp(block * b_enc, -6.0, 6.0).reshape(-1)
            mag = scaled.abs()
            if rand is None:
                q = _e2m1_nearest_even(mag)
            else:
                q = _e2m1_stochastic(mag, rand[i : i + br, j : j + 16].reshape(-1))
            values[i : i + br, j : j + 16] = torch.copysign(q, scaled).reshape(block.shape)
    return values, n_scales, dec


def _nvfp4_inputs():
    x = _x(64, 128, seed=6)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 5] = 1e4  # a block with an outlier
    x[2, :] *= 1e-6  # tiny values
    x[3, 7] = -0.0
    return x


@pytest.mark.parametrize("block_2d", [False, True])
def test_nvfp4_matches_reference(block_2d):
    x = _nvfp4_inputs()
    q = quantize_nvfp4(x, block_2d=block_2d)
    values, scales, dec = reference_nvfp4(x, block_2d)
    assert torch.equal(_bits(q.values), _bits(values))
    assert torch.equal(q.block_scale.float(), scales)
    assert q.block_scale.dtype == torch.float8_e4m3fn
    assert _bits(q.global_scale) == _bits(dec)
    assert set(q.values.abs().unique().tolist()) <= set(E2M1_GRID.tolist())
    err = (dequantize_nvfp4(q, block_2d) - x).norm() / x.norm()
    assert err < 0.2


def test_nvfp4_stochastic_rounding_matches_reference():
    x = _nvfp4_inputs()
    q = quantize_nvfp4(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(7))
    rand = torch.rand(x.shape, generator=torch.Generator().manual_seed(7))
    values, _, _ = reference_nvfp4(x, rand=rand)
    assert torch.equal(_bits(q.values), _bits(values))


def test_nvfp4_edge_cases():
    zero = quantize_nvfp4(torch.zeros(2, 32))
    assert not zero.values.any() and not dequantize_nvfp4(zero).any()
    x = _x(4, 32, seed=8)
    x[0, 0] = float("inf")
    x[1, 1] = float("nan")
    q = quantize_nvfp4(x)
    values, scales, dec = reference_nvfp4(x)
    ok = ~torch.isnan(x)
    assert torch.equal(_bits(q.values[ok]), _bits(values[ok]))
    assert torch.isnan(q.values[1, 1]) and q.values[0, 0] == 6.0
    assert torch.equal(q.block_scale.float(), scales) and _bits(q.global_scale) == _bits(dec)


# -------------------------------------------------------------------------- Hadamard
def test_hadamard_is_orthogonal_and_seeded():
    t = hadamard_transform_matrix(16, seed=3)
    assert torch.allclose(t @ t.T, torch.eye(16), atol=1e-6)
    assert set(t.abs().unique().tolist()) == {0.25}
    assert torch.equal(t, hadamard_transform_matrix(16, seed=3))
    assert not torch.equal(t, hadamard_transform_matrix(16, seed=4))


def test_hadamard_transform_preserves_products_and_spreads_outliers():
    a, b = _x(8, 64, seed=9), _x(12, 64, seed=10)
    ta, tb = random_hadamard_transform(a, seed=1), random_hadamard_transform(b, seed=1)
    assert torch.allclose(ta @ tb.T, a @ b.T, rtol=1e-4, atol=1e-3)
    spike = torch.zeros(1, 16)
    spike[0, 3] = 16.0
    assert torch.allclose(random_hadamard_transform(spike).abs(), torch.full((1, 16), 4.0))
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(torch.ones(2, 20))
