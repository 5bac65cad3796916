"""Router auxiliary losses: load balancing (per micro-batch, per sequence, global) and z-loss.

The formulas equal Megatron-Core's (``switch_load_balancing_loss_func``, ``z_loss_func`` and the
sequence/global variants that its ``TopKRouter`` builds from them). Every loss here already
includes its coefficient, as in Megatron, so the value is what the optimizer sees.

Losses do not go into the user's loss. ``AuxLossAutoScaler`` ties a loss to an activation on the
routing path; when that activation's gradient is computed, the loss receives ``scale`` as its
upstream gradient, which is exactly what ``(task_loss + scale * aux_loss).backward()`` would give.

Token counts may be partial sums over ranks that split the same sequences (sequence/context
parallelism) or the same global batch (global aux loss); :func:`all_reduce_counts` sums them the
way Megatron does, and the losses then treat their local scores as one slice of the full batch,
so that the sum of the per-rank losses is the loss of the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``x`` that back-propagates ``scale`` into ``loss``.

    ``AuxLossAutoScaler.apply(x, loss, scale)`` returns ``x`` unchanged; in backward it returns
    ``(grad_x, ones_like(loss) * scale)``. Megatron's ``MoEAuxLossAutoScaler`` keeps ``scale`` in
    class state; here the caller passes it, so two models (or two strategies) never share it.
    The training strategy sets it to the factor its main loss gradient is scaled by (for example
    ``1 / grad_accumulation_steps``), so aux-loss gradients follow the main loss.
    """

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor, scale: float | Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad_x: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (loss,) = ctx.saved_tensors
        return grad_x, torch.ones_like(loss) * ctx.scale, None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for ``None`` (nothing to reduce)."""
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_counts(counts: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum integer token counts over ``group`` (Megatron's ``reduce_from_tensor_model_parallel_region``).

    Returns a new tensor; the input is left as it was. With ``None`` or a one-rank group it returns
    the input itself, without communication.
    """
    if group_size(group) == 1:
        return counts
    reduced = counts.clone()
    dist.all_reduce(reduced, group=group)
    return reduced


def compute_routing_scores_for_aux_loss(logits_TE: Tensor, topk: int, score_function: str) -> tuple[Tensor, Tensor]:
    """Scores over all experts and the plain top-k choice that the load-balancing losses use.

    Equals Megatron's ``compute_routing_scores_for_aux_loss`` in sparse form: softmax scores, or
    sigmoid scores normalised over all experts, and the top-``topk`` experts of those scores. The
    choice ignores group limits, the expert bias and token dropping on purpose: the loss balances
    what the router's scores prefer, not what capacity let through.

    Args:
        logits_TE: router logits ``[T, E]``.
        topk: experts per token ``K``.
        score_function: "softmax" or "sigmoid".

    Returns:
        ``(experts_TK, scores_TE)``: int64 ``[T, K]`` chosen experts (Megatron returns the same
        choice as a dense ``[T, E]`` map) and fp32 ``[T, E]`` scores that carry gradient.
    """
    if score_function == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}.")
    experts_TK = torch.topk(scores_TE, k=topk, dim=1).indices
    return experts_TK, scores_TE


def tokens_per_expert(experts_TK: Tensor, num_experts: int, keep_TK: Tensor | None = None) -> Tensor:
    """Int64 ``[E]`` count of (kept) assignments per expert, computed on device without host sync.

    ``scatter_add_`` instead of ``bincount``: bincount reads the maximum index back to the host.
    """
    ones_TK = torch.ones_like(experts_TK) if keep_TK is None else keep_TK.to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=experts_TK.device)
    return counts_E.scatter_add_(0, experts_TK.reshape(-1), ones_TK.reshape(-1))


def tokens_per_sequence_expert(experts_BSK: Tensor, num_experts: int) -> Tensor:
    """Int64 ``[B, E]`` count of assignments per sequence and expert (no host sync)."""
    num_seqs = experts_BSK.shape[0]
    offsets_B11 = torch.arange(num_seqs, device=experts_BSK.device).view(-1, 1, 1) * num_experts
    flat_counts = tokens_per_expert(experts_BSK + offsets_B11, num_seqs * num_experts)
    return flat_counts.view(num_seqs, num_experts)


def switch_load_balancing_loss(
    scores_TE: Tensor,
    tokens_per_expert_E: Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """Switch-Transformer load-balancing loss, ``coeff * E * sum_i f_i * P_i`` (Megatron's formula).

    ``f_i = count_i / (N * K)`` is the fraction of assignments that went to expert ``i`` and
    ``P_i = sum_t scores[t, i] / N`` its mean score, with ``N = total_num_tokens``. When the
    scores are one rank's slice of a batch and ``tokens_per_expert_E``/``total_num_tokens``
    describe the whole batch, the result is that rank's share; the shares sum to the full loss.

    Args:
        scores_TE: fp32 ``[T, E]`` scores of the local tokens (carry gradient).
        tokens_per_expert_E: ``[E]`` assignment counts of the whole batch (no gradient).
        total_num_tokens: ``N``, tokens in the whole batch.
        topk: ``K``. num_experts: ``E``. coeff: loss coefficient.

    Returns:
        0-dim fp32 loss.
    """
    scores_per_expert_E = scores_TE.sum(dim=0)
    return torch.sum(scores_per_expert_E * tokens_per_expert_E) * (
        num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    )


def sequence_load_balancing_loss(
    scores_BSE: Tensor,
    tokens_per_seq_expert_BE: Tensor,
    seq_length: int,
    topk: int,
    coeff: float,
) -> Tensor:
    """Sequence-level load-balancing loss: the mean over the B sequences of each one's switch loss.

    Megatron's ``seq_aux_loss`` (DeepSeek-V2/V3): it folds the batch into the expert axis and
    divides the summed loss by the batch size; this computes the same number in batch-first form.

    Args:
        scores_BSE: fp32 ``[B, S_local, E]`` scores, one row per sequence.
        tokens_per_seq_expert_BE: ``[B, E]`` assignment counts over each whole sequence
            (summed over the ranks that hold slices of it).
        seq_length: tokens per whole sequence (``S_local`` times the sequence-splitting group size).
        topk: ``K``. coeff: loss coefficient.

    Returns:
        0-dim fp32 loss.
    """
    num_seqs, _, num_experts = scores_BSE.shape
    scores_per_seq_expert_BE = scores_BSE.sum(dim=1)
    total = torch.sum(scores_per_seq_expert_BE * tokens_per_seq_expert_BE) * (
        num_experts * coeff / (topk * seq_length * seq_length)
    )
    return total / num_seqs


def global_load_balancing_loss(
    scores_TE: Tensor,
    accumulated_tokens_per_expert_E: Tensor,
    num_accumulated: Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """Global-batch load-balancing loss (arXiv 2501.11873), as Megatron's ``global_aux_loss``.

    The assignment counts are summed over the data-parallel ranks and accumulated over the
    micro-batches of the current optimizer step; their running mean per micro-batch replaces the
    micro-batch counts of :func:`switch_load_balancing_loss`.

    Args:
        scores_TE: fp32 ``[T, E]`` scores of the local micro-batch.
        accumulated_tokens_per_expert_E: fp32 ``[E]`` counts summed over ranks and micro-batches
            so far (the current one included).
        num_accumulated: 0-dim count of micro-batches in that sum.
        total_num_tokens: tokens of one micro-batch over all reduced ranks.
        topk: ``K``. num_experts: ``E``. coeff: loss coefficient.
    """
    mean_tokens_per_expert_E = accumulated_tokens_per_expert_E / num_accumulated
    return switch_load_balancing_loss(scores_TE, mean_tokens_per_expert_E, total_num_tokens, topk, num_experts, coeff)


def z_loss(logits_TE: Tensor, coeff: float) -> Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``; keeps logits small.

    Args:
        logits_TE: fp32 ``[T, E]`` router logits.
        coeff: loss coefficient (Megatron divides the user's coefficient by the size of the group
            that splits sequences, so that the per-rank means add up to one mean).
    """
    return torch.mean(torch.square(torch.logsumexp(logits_TE, dim=-1))) * coeff
