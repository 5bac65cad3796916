"""Permutation plans and the gather-only permute/unpermute against direct definitions."""

import pytest
import torch

from lightning_moe.nn.permutation import permute, plan_permutation, row_probs, unpermute


def _random_routing(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    probs = torch.rand(T, K, generator=g, dtype=torch.float64)
    return experts, probs


@pytest.mark.parametrize("alignment", [1, 8, 16])
@pytest.mark.parametrize("drop", [False, True])
def test_plan_groups_rows_by_expert_in_token_order(alignment, drop):
    T, K, E = 37, 3, 6
    experts, _ = _random_routing(T, K, E, seed=alignment + drop)
    keep = torch.rand(T, K, generator=torch.Generator().manual_seed(3)) > 0.3 if drop else None
    plan = plan_permutation(experts, E, keep_TK=keep, alignment=alignment)
    kept = keep if keep is not None else torch.ones(T, K, dtype=torch.bool)
    counts = torch.bincount(experts[kept], minlength=E)
    assert torch.equal(plan.tokens_per_expert_E, counts)
    assert torch.all(plan.group_sizes_E % alignment == 0)
    assert torch.all(plan.group_sizes_E >= counts)
    starts = torch.cumsum(plan.group_sizes_E, 0) - plan.group_sizes_E
    for e in range(E):
        tokens = [t for t in range(T) for k in range(K) if experts[t, k] == e and kept[t, k]]
        rows = plan.row_token_R[starts[e] : starts[e] + plan.group_sizes_E[e]].tolist()
        assert rows[: len(tokens)] == tokens
        assert all(r == T for r in rows[len(tokens) :])  # padding rows point at the zero row
    # Rows after the last group hold no token either (the zero row), never a dropped one.
    assert torch.all(plan.row_token_R[int(plan.group_sizes_E.sum()):] == T)
    for t in range(T):
        for k in range(K):
            if kept[t, k]:
                assert plan.row_token_R[plan.dest_TK[t, k]] == t
            else:
                assert plan.dest_TK[t, k] == plan.num_rows


@pytest.mark.parametrize("drop", [False, True])
def test_plan_with_exact_row_count(drop):
    """A caller that knows the kept count (the expert-parallel dispatchers) gets a buffer of
    exactly that many rows, every one holding a token, in expert and then token order."""
    T, K, E = 29, 2, 5
    experts, _ = _random_routing(T, K, E, seed=7 + drop)
    keep = torch.rand(T, K, generator=torch.Generator().manual_seed(8)) > 0.4 if drop else None
    kept = keep if keep is not None else torch.ones(T, K, dtype=torch.bool)
    plan = plan_permutation(experts, E, keep_TK=keep, num_rows=int(kept.sum()))
    assert plan.num_rows == int(kept.sum()) == len(plan.row_token_R)
    pairs = sorted((int(experts[t, k]), t) for t in range(T) for k in range(K) if kept[t, k])
    assert plan.row_token_R.tolist() == [t for _, t in pairs]
    assert torch.all(plan.dest_TK[~kept] == plan.num_rows)


def test_pad_to_capacity_gives_static_rows():
    T, K, E, C = 20, 2, 4, 6
    experts, _ = _random_routing(T, K, E, seed=0)
    keep = torch.zeros(T, K, dtype=torch.bool)
    for e in range(E):  # keep the first C assignments of each expert (position policy)
        idx = (experts == e).nonzero()[:C]
        keep[idx[:, 0], idx[:, 1]] = True
    plan = plan_permutation(experts, E, keep_TK=keep, capacity=C, pad_to_capacity=True)
    assert plan.num_rows == E * C
    assert torch.equal(plan.group_sizes_E, torch.full((E,), C))
    # Quantized GEMMs need aligned groups: capacity 6 becomes 8 rows per expert, 2 of them zero.
    aligned = plan_permutation(experts, E, keep_TK=keep, alignment=8, capacity=C, pad_to_capacity=True)
    assert aligned.num_rows == E * 8 and torch.equal(aligned.group_sizes_E, torch.full((E,), 8))
    x = torch.randn(T, 3)
    rows = permute(x, aligned).view(E, 8, 3)
    assert torch.equal(rows[:, :C], permute(x, plan).view(E, C, 3)) and not rows[:, C:].any()


@pytest.mark.parametrize("alignment,drop", [(1, False), (1, True), (8, False), (16, True)])
def test_permute_unpermute_match_definition_with_gradients(alignment, drop):
    T, K, E, D = 29, 4, 7, 5
    experts, probs = _random_routing(T, K, E, seed=11)
    keep = torch.rand(T, K, generator=torch.Generator().manual_seed(5)) > 0.25 if drop else None
    plan = plan_permutation(experts, E, keep_TK=keep, alignment=alignment)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    p = probs.clone().requires_grad_(True)
    x_R = permute(x, plan)
    assert x_R.shape == (plan.num_rows, D)
    w = torch.randn(plan.num_rows, D, dtype=torch.float64)
    y_R = x_R * w  # an arbitrary per-row "expert"
    out = unpermute(y_R, p, plan)
    kept = keep if keep is not None else torch.ones(T, K, dtype=torch.bool)
    ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if kept[t, k]:
                ref[t] += p[t, k] * x[t] * w[plan.dest_TK[t, k]]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn(T, D, dtype=torch.float64)
    gx, gp = torch.autograd.grad(out, (x, p), g)
    rx, rp = torch.autograd.grad(ref, (x, p), g)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-12)
    torch.testing.assert_close(gp, rp, rtol=0, atol=1e-12)


def test_row_probs_and_gradcheck():
    T, K, E = 6, 2, 3
    experts, probs = _random_routing(T, K, E, seed=2)
    plan = plan_permutation(experts, E, alignment=8)
    rp = row_probs(probs, plan)
    for t in range(T):
        for k in range(K):
            assert rp[plan.dest_TK[t, k]] == probs[t, k]
    x = torch.randn(T, 3, dtype=torch.float64, requires_grad=True)
    p = probs.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: unpermute(permute(a, plan) * 1.5, b, plan), (x, p))


@pytest.mark.parametrize("alignment", [8, 16, 128])
def test_aligned_buffer_ends_on_an_aligned_boundary(alignment):
    """Quantized grouped GEMMs check every group end, the last one (the buffer size) included:
    T*K + E*(alignment-1) is not a multiple of the alignment in general (mixtral: 16384 + 8*15)."""
    experts_TK = torch.randint(0, 8, (8192, 2))
    plan = plan_permutation(experts_TK, 8, alignment=alignment)
    assert plan.num_rows % alignment == 0
    assert plan.num_rows >= int(plan.group_sizes_E.sum())
    ends = torch.cumsum(plan.group_sizes_E, 0)
    assert bool((ends % alignment == 0).all())


@pytest.mark.parametrize("alignment,capacity", [(1, None), (8, None), (1, 5), (8, 5)])
def test_dropped_marked_equals_keep_mask(alignment, capacity):
    """Marking dropped assignments with the sentinel expert E (``dropped_marked``, int32 ids, as
    the all-gather dispatcher's lookup table gives them) builds the same plan as a keep mask."""
    T, K, E = 41, 3, 7
    experts, _ = _random_routing(T, K, E, seed=alignment)
    keep = torch.rand(T, K, generator=torch.Generator().manual_seed(5)) > 0.25
    if capacity is not None:  # keep at most `capacity` assignments per expert, in token order
        for e in range(E):
            rows = ((experts == e) & keep).nonzero()[capacity:]
            keep[rows[:, 0], rows[:, 1]] = False
    kw = dict(alignment=alignment, capacity=capacity, pad_to_capacity=capacity is not None)
    masked = plan_permutation(experts, E, keep_TK=keep, **kw)
    marked = plan_permutation(torch.where(keep, experts, E).to(torch.int32), E, dropped_marked=True, **kw)
    for field in ("row_assignment_R", "row_token_R", "dest_TK", "group_sizes_E", "tokens_per_expert_E"):
        assert torch.equal(getattr(masked, field), getattr(marked, field)), field
    assert (masked.num_rows, masked.dense_rows, masked.padding_rows) == (
        marked.num_rows, marked.dense_rows, marked.padding_rows)
    assert not marked.dense_rows


def test_permute_backward_into_fp32_sums_the_widened_rows():
    """``permute_backward(grad, plan, out_dtype=fp32)``: the bits of widening the rows first (a
    gathered fc1's gradient into an fp32 residual stream). On CPU that is how it sums; the GPU
    kernel's sum without the widened copy is compared in `tests/gpu/test_kernels_gpu.py`. Another
    dtype is refused: the kernel would round its sum once, unlike rounding each row first."""
    from lightning_moe.nn.permutation import permute_backward

    torch.manual_seed(0)
    experts = torch.randint(0, 4, (12, 2), dtype=torch.int32)
    plan = plan_permutation(experts, 4, alignment=8)
    grad = torch.randn(plan.num_rows, 16).to(torch.bfloat16)
    out = permute_backward(grad, plan, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, permute_backward(grad.float(), plan))
    assert permute_backward(grad, plan).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gradient's dtype or fp32"):
        permute_backward(grad, plan, out_dtype=torch.float16)
