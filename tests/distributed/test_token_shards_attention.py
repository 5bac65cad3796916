"""Attention over `TokenShards` (dynamic CP) equals one process's causal attention of each sequence
alone: outputs and the gradients of q, k, v (GQA), on a group of 4 ranks with both exchanges and on
ranks alone, with sequences short enough that some ranks hold none of their tokens."""

import pytest
import torch
import torch.nn.functional as F

from _launch import run_distributed

H, G, D = 4, 2, 8
LENGTHS = (1, 3, 37, 100)  # a 1-token sequence leaves 3 of 4 ranks without it


def _inputs():
    g = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, n, total, D, generator=g) for n in (H, G, G))
    w = torch.randn(1, H, total, D, generator=g)
    return q, k, v, w


def _reference():
    q, k, v, w = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    outs, start = [], 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                   enable_gqa=True))
        start += n
    out = torch.cat(outs, dim=2)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(rank, world_size, comm_type):
    import torch.distributed as dist

    from lightning_moe.parallel.context_parallel import TokenShards, context_parallel_attention
    from lightning_moe.parallel.dynamic_cp import Plan
    from lightning_moe.parallel.dynamic_cp_batch import PoolSequences, rank_share

    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    sequences = PoolSequences(list(LENGTHS), [0] * len(LENGTHS), starts)
    if world_size == 1:  # the rank alone with every sequence
        plan = Plan((1,), (0,), (0,) * len(LENGTHS), 0.0, 0.0)
        group = None
    else:
        plan = Plan((world_size,), (0,), (0,) * len(LENGTHS), 0.0, 0.0)
        group = dist.new_group(list(range(world_size)))
    share = rank_share(sequences, plan, rank)
    per_rank = [rank_share(sequences, plan, r).flat_index_T.numel() for r in range(world_size)]
    shards = TokenShards(
        group, share.index_T.unsqueeze(0), max(per_rank), share.sequence_tokens, share.first_chunk_tokens
    )
    q, k, v, w = (t.index_select(2, share.flat_index_T).clone() for t in _inputs())
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = context_parallel_attention(q, k, v, shards, comm_type, document_ids_BS=share.document_ids_T.unsqueeze(0))
    (out * w).sum().backward()
    return [t.numpy().copy() for t in (share.flat_index_T, out.detach(), q.grad, k.grad, v.grad)]  # numpy: picklable


@pytest.mark.parametrize("world_size, comm_type", [(4, "p2p"), (4, "allgather"), (1, "p2p")],
                         ids=["group4_p2p", "group4_allgather", "alone"])
def test_token_shards_attention_equals_each_sequence_alone(world_size, comm_type):
    results = run_distributed(_sharded, world_size, comm_type)
    expected = _reference()
    total = sum(LENGTHS)
    assembled = [torch.zeros(1, n, total, D) for n in (H, H, G, G)]
    for index, *parts in results:
        for full, part in zip(assembled, parts):
            full[:, :, torch.from_numpy(index)] = torch.from_numpy(part)
    for name, got, want in zip(("out", "dq", "dk", "dv"), assembled, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
