"""Token permutation: group the (token, expert) assignments of a batch by expert and back.

The layout is described by a `PermutationPlan` built from the routing result on the device,
with no host sync: every expert's rows are contiguous in the permuted buffer, in token order,
optionally padded to an alignment (quantized GEMMs) or to the expert capacity. The buffer has
a static number of rows ``R`` known from shapes alone, so shapes never depend on the routing:

- dropless, unpadded: ``R = T*K`` (every row holds a token);
- padded to ``alignment``: ``R = T*K + E*(alignment-1)`` rounded up to a multiple of
  ``alignment`` (an upper bound; unused rows are zero);
- padded to capacity: ``R = E*C``.

Rows that hold no token are zero. Rows after the last group (the slack of a buffer sized for
the worst case) are left out of the expert GEMMs by the "grouped_mm" backend and join the last
group elsewhere (zero input gives zero output through a bias-free MLP). A plan with
``rows_end`` leaves that slack unwritten on CUDA, for experts that never read it.

Both directions are gathers (no scatter-add, no atomics) in forward and backward:
``permute`` gathers token rows, its backward gathers each token's ``K`` row gradients and sums
them; ``unpermute`` gathers each token's ``K`` expert outputs and reduces them with the routing
probabilities in one batched matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_moe.kernels import use_triton


@dataclass
class PermutationPlan:
    """Where every (token, expert) assignment lives in the permuted buffer.

    Attributes:
        row_assignment_R: int64 [R], the flat assignment ``t*K + k`` each row holds; ``T*K``
            (a zero entry) for padding rows.
        row_token_R: int64 [R], the token each row holds; ``T`` (a zero row) for padding.
        dest_TK: int64 [T, K], the row of each assignment; ``R`` (a zero row) when dropped.
        group_sizes_E: int64 [E], rows per expert including padding (device tensor).
        tokens_per_expert_E: int64 [E], real (kept) assignments per expert.
        num_tokens: T. num_rows: R.
        dense_rows: True when every row holds a token and nothing is dropped (the fast path:
            no sentinel rows are needed).
        padding_rows: False when every row holds a token (dropped assignments allowed), so
            ``permute`` can gather without appending a zero row.
        rows_end: optional 0-dim device index, at least every group's end: rows from it on
            are left unwritten by ``permute`` and by ``unpermute``'s backward (on CUDA). Set
            only when the experts never read those rows (see ``GroupedExperts.forward``'s
            ``tail_unwritten``); None: every row is written.
    """

    row_assignment_R: Tensor
    row_token_R: Tensor
    dest_TK: Tensor
    group_sizes_E: Tensor
    tokens_per_expert_E: Tensor
    num_tokens: int
    num_rows: int
    dense_rows: bool
    padding_rows: bool = True
    rows_end: Optional[Tensor] = None


def plan_permutation(
    experts_TK: Tensor,
    num_experts: int,
    keep_TK: Optional[Tensor] = None,
    alignment: int = 1,
    capacity: Optional[int] = None,
    pad_to_capacity: bool = False,
    num_rows: Optional[int] = None,
    dropped_marked: bool = False,
    spare_rows: bool = False,
) -> PermutationPlan:
    """Build the permutation plan for ``experts_TK`` (int64 or int32 [T, K]) on its device, sync-free.

    Expert ids must lie in ``[0, num_experts)`` (``num_experts`` itself marks a dropped one under
    ``dropped_marked``); they are not checked, since that would read the device.

    ``keep_TK`` (bool [T, K]) marks assignments that survived capacity dropping. Instead, with
    ``dropped_marked`` the caller has already set every dropped assignment's expert to
    ``num_experts`` (one elementwise op less). With ``pad_to_capacity`` every expert gets
    exactly ``capacity`` rows rounded up to a multiple of ``alignment`` (at most ``capacity`` of
    them hold tokens); otherwise each expert's group is rounded up to a multiple of
    ``alignment``.

    ``num_rows`` overrides the static buffer size when the caller already knows on the host how
    many rows the kept assignments need (the expert-parallel dispatchers read it with their
    split sizes): it must be at least the sum of the (aligned) group sizes. Without it, a buffer
    sized for ``T*K`` carries every unused row after the last group (the "grouped_mm" backend
    leaves them out of its GEMMs; the others hand them to the last expert). With ``alignment``
    1 and no capacity padding it must equal the number of kept assignments exactly, unless
    ``spare_rows``: ``num_rows`` is then a static bound, and the rows after the kept ones hold no
    token (a buffer sized before the routing is known, as inside a CUDA graph).

    Every MoE layer builds a plan per micro-batch, so the number of device ops matters (each is
    a kernel launch): the sort returns the expert of every sorted assignment with its order,
    expert boundaries come from a binary search of the sorted experts (no atomics), and without
    padding every kept assignment's row is simply its sorted position.
    """
    num_rows_override = num_rows
    num_tokens, topk = experts_TK.shape
    num_assign = num_tokens * topk
    device = experts_TK.device
    flat_expert_N = experts_TK.reshape(-1)
    if keep_TK is not None:
        # Dropped assignments get the sentinel expert E so that they sort to the end.
        flat_expert_N = torch.where(keep_TK.reshape(-1), flat_expert_N, num_experts)
    # 32-bit keys: CUDA's radix sort then makes 4 passes over them instead of 8.
    sorted_expert_N, order_N = torch.sort(flat_expert_N.to(torch.int32), stable=True)
    # bounds[e]: sorted position of expert e's first assignment (e = E: of the first dropped one).
    bounds = torch.searchsorted(
        sorted_expert_N, torch.arange(num_experts + 1, device=device, dtype=sorted_expert_N.dtype)
    )
    tokens_per_expert_E = bounds[1 : num_experts + 1] - bounds[:num_experts]

    rows_per_expert = None
    if pad_to_capacity:
        if capacity is None:
            raise ValueError("pad_to_capacity needs a capacity.")
        rows_per_expert = round_up(capacity, alignment)  # quantized GEMMs need aligned groups
        num_rows = num_experts * rows_per_expert
    elif alignment > 1:
        # An upper bound, itself rounded up: padding rows join the last group, whose end must
        # stay aligned too (quantized grouped GEMMs check every group boundary).
        num_rows = round_up(num_assign + num_experts * (alignment - 1), alignment)
    else:
        num_rows = num_assign
    if num_rows_override is not None:
        num_rows = num_rows_override
    padding_rows = pad_to_capacity or alignment > 1 or num_rows_override is None or spare_rows

    def group_sizes() -> Tensor:
        if rows_per_expert is not None:
            return torch.full((num_experts,), rows_per_expert, dtype=torch.long, device=device)
        return round_up(tokens_per_expert_E, alignment) if alignment > 1 else tokens_per_expert_E

    dense_rows = keep_TK is None and not dropped_marked and num_rows == num_assign and not pad_to_capacity
    if dense_rows:
        # Fast path: row j of the buffer is the j-th assignment in expert order.
        positions_N = torch.arange(num_assign, device=device)
        dest_TK = torch.empty_like(order_N).scatter_(0, order_N, positions_N)
        return PermutationPlan(
            row_assignment_R=order_N,
            row_token_R=order_N // topk,
            dest_TK=dest_TK.view(num_tokens, topk),
            group_sizes_E=group_sizes(),
            tokens_per_expert_E=tokens_per_expert_E,
            num_tokens=num_tokens,
            num_rows=num_rows,
            dense_rows=True,
            padding_rows=False,
        )
    by_group_start = pad_to_capacity or alignment > 1 or num_rows > num_assign
    if by_group_start and use_triton(flat_expert_N):
        # Two kernels for the rows by group start (the torch branch below: ~15 launches).
        from lightning_moe.kernels.plan_triton import plan_rows

        dest_N, row_assignment_R, group_sizes_E = plan_rows(sorted_expert_N, order_N, bounds, num_experts,
                                                            alignment, rows_per_expert, num_rows)
    else:
        group_sizes_E = group_sizes()
        positions_N = torch.arange(num_assign, device=device)
        dropped_sorted_N = positions_N >= bounds[num_experts]  # dropped assignments sort last
        if not by_group_start:
            # Groups without padding start where their sorted assignments start, so every kept
            # assignment's row is its sorted position; rows from the kept count on hold no token.
            dest_sorted_N = positions_N.masked_fill(dropped_sorted_N, num_rows)
            row_assignment_R = order_N.masked_fill(dropped_sorted_N, num_assign)[:num_rows]
        else:
            # Row of the j-th sorted assignment: start of its expert's (padded) group + rank in expert.
            zero = torch.zeros(1, dtype=torch.long, device=device)
            group_start = torch.cat([zero, torch.cumsum(group_sizes_E, 0)])  # [E+1]; entry E = rows used
            expert_N = sorted_expert_N.clamp(max=num_experts - 1)  # dropped ones masked below
            dest_sorted_N = group_start[expert_N] + positions_N - bounds[expert_N]
            dest_sorted_N = dest_sorted_N.masked_fill(dropped_sorted_N, num_rows)
            # One spare slot at index R absorbs the writes of dropped assignments; padding rows
            # keep the sentinel assignment T*K, whose token (T*K) // K = T is the zero row.
            row_assignment = torch.full((num_rows + 1,), num_assign, dtype=torch.long, device=device)
            row_assignment.scatter_(0, dest_sorted_N, order_N)
            row_assignment_R = row_assignment[:num_rows]
        dest_N = torch.empty_like(dest_sorted_N).scatter_(0, order_N, dest_sorted_N)
    return PermutationPlan(
        row_assignment_R=row_assignment_R,
        row_token_R=row_assignment_R // topk,
        dest_TK=dest_N.view(num_tokens, topk),
        group_sizes_E=group_sizes_E,
        tokens_per_expert_E=tokens_per_expert_E,
        num_tokens=num_tokens,
        num_rows=num_rows,
        dense_rows=False,
        padding_rows=padding_rows,
    )


def round_up(n, multiple: int):
    """``n`` rounded up to a multiple of ``multiple`` (a Python int or an integer tensor)."""
    return (n + multiple - 1) // multiple * multiple


def _with_zero_row(x_ND: Tensor) -> Tensor:
    """[N, D] -> [N+1, D] with a zero last row, the target of sentinel indices."""
    return torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])])


def gather_token_rows(x_TD: Tensor, plan: PermutationPlan) -> Tensor:
    """``[R, D]``: row ``r`` is token ``row_token[r]``'s, zeros for padding rows (rows past
    ``plan.rows_end`` are left unwritten on the Triton path)."""
    if plan.rows_end is not None and use_triton(x_TD):
        from lightning_moe.kernels.permute_triton import gather_rows_until

        return gather_rows_until(x_TD, plan.row_token_R, plan.rows_end)
    source = x_TD if not plan.padding_rows else _with_zero_row(x_TD)
    return source.index_select(0, plan.row_token_R)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, plan: PermutationPlan) -> Tensor:
        ctx.plan = plan
        return gather_token_rows(x_TD, plan)

    @staticmethod
    def backward(ctx, grad_RD: Tensor):
        return permute_backward(grad_RD, ctx.plan), None


def permute_backward(grad_RD: Tensor, plan: PermutationPlan, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """The gradient of :func:`permute`: each token's K row gradients summed, [R, D] -> [T, D], in
    ``out_dtype``: ``grad``'s (None) or fp32, the bits of ``grad.float()`` summed, without writing
    the widened rows on a GPU (the kernel sums in fp32 either way)."""
    if out_dtype not in (None, grad_RD.dtype, torch.float32):
        raise ValueError(f"permute_backward sums into the gradient's dtype or fp32, not {out_dtype}")
    grad_RD = grad_RD.contiguous()
    if use_triton(grad_RD):
        from lightning_moe.kernels.combine_triton import combine

        return combine(grad_RD, plan.dest_TK, out_dtype=out_dtype)  # unweighted: each token's rows summed
    if out_dtype is not None:
        grad_RD = grad_RD.to(out_dtype)
    source = grad_RD if plan.dense_rows else _with_zero_row(grad_RD)
    num_tokens, topk = plan.dest_TK.shape
    grad_TKD = source.index_select(0, plan.dest_TK.reshape(-1)).view(num_tokens, topk, source.shape[1])
    return grad_TKD.sum(1)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan) -> Tensor:
        ctx.plan = plan
        ctx.probs_dtype = probs_TK.dtype
        ctx.fused = use_triton(y_RD)
        if ctx.fused:
            from lightning_moe.kernels.combine_triton import combine

            ctx.save_for_backward(y_RD, probs_TK)
            return combine(y_RD, plan.dest_TK, probs_TK)
        num_tokens, topk = plan.dest_TK.shape
        source = y_RD if plan.dense_rows else _with_zero_row(y_RD)
        y_TKD = source.index_select(0, plan.dest_TK.reshape(-1)).view(num_tokens, topk, source.shape[1])
        weights_T1K = probs_TK.to(y_RD.dtype).unsqueeze(1)
        ctx.save_for_backward(y_TKD, weights_T1K)
        return torch.bmm(weights_T1K, y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        plan: PermutationPlan = ctx.plan
        grad_TD = grad_TD.contiguous()
        if ctx.fused:
            from lightning_moe.kernels.combine_triton import combine_backward

            y_RD, probs_TK = ctx.saved_tensors
            grad_y, grad_w = combine_backward(
                y_RD, plan.dest_TK, probs_TK, grad_TD, plan.num_rows,
                row_token_R=plan.row_token_R if plan.padding_rows else None, need_grad_w=ctx.needs_input_grad[1],
                # anomaly mode checks every gradient for NaN, so no row is left unwritten then
                rows_end=None if torch.is_anomaly_enabled() else plan.rows_end,
            )
            return grad_y, (grad_w.to(ctx.probs_dtype) if grad_w is not None else None), None
        y_TKD, weights_T1K = ctx.saved_tensors
        grad_probs_TK = None
        if ctx.needs_input_grad[1]:
            grad_probs_TK = torch.bmm(y_TKD, grad_TD.unsqueeze(2)).squeeze(2).to(ctx.probs_dtype)
        grad_y = None
        if ctx.needs_input_grad[0]:
            # Row r gets probs[t, k] * grad[t] for the assignment (t, k) it holds: gathers only.
            weighted_TKD = weights_T1K.transpose(1, 2) * grad_TD.unsqueeze(1)
            flat = weighted_TKD.reshape(-1, grad_TD.shape[1])
            source = flat if plan.dense_rows else _with_zero_row(flat)
            grad_y = source.index_select(0, plan.row_assignment_R)
        return grad_y, grad_probs_TK, None


class _SumRows(torch.autograd.Function):
    """Each token's rows summed, unweighted (the combine after experts that applied the routing
    probabilities themselves); saves nothing: the backward hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, y_RD: Tensor, plan: PermutationPlan) -> Tensor:
        ctx.plan = plan
        return permute_backward(y_RD, plan)

    @staticmethod
    def backward(ctx, grad_TD: Tensor):
        return gather_token_rows(grad_TD.contiguous(), ctx.plan), None


def sum_rows(y_RD: Tensor, plan: PermutationPlan) -> Tensor:
    """``out[t] = sum_k y[dest[t,k]]``: the combine of expert outputs already weighted by their
    routing probabilities (`DeferredCombine.apply_unweighted`). [R, D] -> [T, D]."""
    return _SumRows.apply(y_RD, plan)


def permute(x_TD: Tensor, plan: PermutationPlan) -> Tensor:
    """Gather token rows into expert order: [T, D] -> [R, D] (padding rows are zero)."""
    return _Permute.apply(x_TD, plan)


@dataclass
class DeferredPermutation:
    """``permute(tokens_TD, plan)`` not yet carried out: what a dispatcher hands to experts that
    can read the permutation's rows straight into their first GEMM's input cast
    (``GroupedExperts.takes_deferred_permutation``), so the permuted rows are never written in the
    tokens' dtype. `materialize` carries it out (with autograd) for every other consumer."""

    tokens_TD: Tensor
    plan: PermutationPlan

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows

    def materialize(self) -> Tensor:
        """``[R, D]``: the permuted rows, as `permute` makes them."""
        return permute(self.tokens_TD, self.plan)


def unpermute(y_RD: Tensor, probs_TK: Tensor, plan: PermutationPlan) -> Tensor:
    """Combine expert outputs back to tokens: ``out[t] = sum_k probs[t,k] * y[dest[t,k]]``.

    [R, D] -> [T, D]; dropped assignments contribute zero. On CUDA one Triton kernel gathers and
    reduces each token's K rows with fp32 accumulation (no [T, K, D] intermediate); elsewhere
    the weighted sum runs as one batched matmul in ``y``'s dtype. bf16 activations make no
    fp32 round trip either way.
    """
    return _Unpermute.apply(y_RD, probs_TK, plan)


def row_probs(probs_TK: Tensor, plan: PermutationPlan) -> Tensor:
    """Routing probability of each permuted row: [R] (0 for padding rows), differentiable."""
    flat = torch.cat([probs_TK.reshape(-1), probs_TK.new_zeros(1)])
    return flat[plan.row_assignment_R]


@dataclass
class DeferredCombine:
    """``unpermute(y, probs_TK, plan)`` not yet carried out: what a dispatcher hands to experts
    that can end in the combine themselves (``GroupedExperts.takes_deferred_combine``). Their
    fused FP8 path weights each row by its probability before the second projection, as
    Megatron-Core's experts do (the projection is linear, so this is the same function up to
    rounding), and sums each token's rows after it; the backward then needs no combine pass of
    its own. `apply` carries it out on expert outputs ``[R, D]``, as every other path does."""

    plan: PermutationPlan
    probs_TK: Tensor

    def apply(self, y_RD: Tensor) -> Tensor:
        """``[T, D]``: the combine of expert outputs, as `unpermute` makes it."""
        return unpermute(y_RD, self.probs_TK, self.plan)

    def row_probs(self) -> Tensor:
        """fp32 ``[R]``: each permuted row's routing probability (0 for padding rows),
        differentiable into ``probs_TK``: the weights of a weighted activation."""
        return row_probs(self.probs_TK, self.plan).float()

    def apply_unweighted(self, y_RD: Tensor) -> Tensor:
        """``[T, D]``: the combine of expert outputs whose rows the experts already weighted by
        `row_probs` (a weighted SwiGLU before the second projection): each token's rows summed."""
        return sum_rows(y_RD, self.plan)
