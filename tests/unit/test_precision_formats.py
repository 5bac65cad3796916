"""The emulated rounding is bit-exact: FP8 against torch's float8 casts, E2M1 against a
table lookup written here."""

import pytest
import torch

from lightning_moe.precision.formats import E2M1, E4M3, E5M2, round_to_format


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def _edge_values(fmt) -> torch.Tensor:
    """Zeros, subnormals, ties, the saturation boundary, infinities and NaN of ``fmt``."""
    sub = 2.0 ** (fmt.min_exp - fmt.mantissa_bits)  # smallest subnormal
    values = [0.0, -0.0, sub, sub / 2, sub * 1.5, sub * 2.5, sub * 0.49, 2.0**fmt.min_exp, fmt.max,
              fmt.max * 1.03, fmt.max * 1.07, fmt.max * 1.2, 1e30, float("inf"), float("nan"), 1.0 + 2**-4,
              1.0 + 3 * 2**-4, 3.0 * 2**-10, 1e-30]
    return torch.tensor(values + [-v for v in values])


def _random_values(n: int = 200_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # log-uniform magnitudes over the whole FP8 range and beyond (subnormal to overflow)
    mag = torch.exp2(torch.empty(n).uniform_(-20, 18, generator=g))
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return mag * sign


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_rounding_matches_torch_cast(fmt):
    x = torch.cat([_random_values(), _edge_values(fmt)])
    ours = round_to_format(x, fmt)
    finite = ~torch.isnan(x)
    # torch casts round to nearest-even; saturate first, as TE's satfinite cast does.
    expected = x.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float()
    assert torch.equal(_bits(ours[finite]), _bits(expected[finite]))
    assert torch.isnan(ours[~finite]).all()
    # the values also survive a round trip through the real dtype unchanged
    assert torch.equal(_bits(ours[finite]), _bits(ours[finite].to(fmt.torch_dtype).float()))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_saturation_and_special_values(fmt):
    x = torch.tensor([fmt.max * 4, -fmt.max * 4, float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    y = round_to_format(x, fmt)
    assert y[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert torch.isnan(y[4])
    assert _bits(y[5:]).tolist() == _bits(torch.tensor([0.0, -0.0])).tolist()
    # in-range values match torch without any clamping (E4M3 torch casts saturate too)
    inside = _random_values(10_000)
    inside = inside[inside.abs() <= fmt.max]
    assert torch.equal(_bits(round_to_format(inside, fmt)), _bits(inside.to(fmt.torch_dtype).float()))


def test_fp8_subnormals_exact():
    for fmt in (E4M3, E5M2):
        sub = 2.0 ** (fmt.min_exp - fmt.mantissa_bits)
        k = torch.arange(0, 2 ** (fmt.mantissa_bits + 1) * 4, dtype=torch.float32)
        x = k * sub / 4  # quarter steps between subnormals: ties and near-ties
        assert torch.equal(_bits(round_to_format(x, fmt)), _bits(x.to(fmt.torch_dtype).float()))


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def reference_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value by table lookup; ties go to the neighbour with an even mantissa
    (index even in the grid), magnitudes above 6 saturate."""
    a = x.abs().clamp(max=6.0)
    dist = (a[:, None] - E2M1_GRID[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # among tied candidates prefer the even code index
    idx = torch.arange(8)
    score = candidates.float() * 2 + (idx % 2 == 0).float()[None, :]
    choice = score.argmax(dim=1)
    return torch.copysign(E2M1_GRID[choice], x)


def test_e2m1_round_to_nearest_even_matches_table():
    g = torch.Generator().manual_seed(1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.randn(50_000, generator=g) * 3, ties, -ties, E2M1_GRID, torch.tensor([7.0, 100.0, -9.0, 0.1])])
    assert torch.equal(_bits(round_to_format(x, E2M1)), _bits(reference_e2m1(x)))
    assert round_to_format(torch.tensor([0.25, 0.75, 2.5, 5.0]), E2M1).tolist() == [0.0, 1.0, 2.0, 4.0]


def test_e2m1_stochastic_rounding_neighbours_and_mean():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(20_000, generator=g) * 12 - 6
    rand = torch.rand(x.shape, generator=g)
    y = round_to_format(x, E2M1, rand)
    # reference: pick the upper neighbour when rand < fraction of the way there
    a = x.abs()
    lower = E2M1_GRID[(E2M1_GRID[None, :] <= a[:, None]).sum(1) - 1]
    upper = E2M1_GRID[torch.clamp((E2M1_GRID[None, :] < a[:, None]).sum(1), max=7)]
    frac = torch.where(upper > lower, (a - lower) / (upper - lower), torch.zeros_like(a))
    expected = torch.copysign(torch.where(rand < frac, upper, lower), x)
    assert torch.equal(y, expected)
    # unbiased: repeated rounding of one value averages to it
    v = torch.full((200_000,), 2.3)
    mean = round_to_format(v, E2M1, torch.rand(v.shape, generator=g)).mean().item()
    assert abs(mean - 2.3) < 0.01
