"""Context-parallel attention on gloo equals full causal attention on one process: outputs and
the gradients of q, k, v (GQA), for CP 2 and 4 and both exchange types; the load-balanced
sharding and its inverse; a sequence length that does not cut into 2 x CP chunks is refused."""

import pytest
import torch
import torch.nn.functional as F

from _launch import run_distributed

B, H, G, S, D = 2, 4, 2, 16, 8


def _inputs():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (H, G, G))
    w = torch.randn(B, H, S, D, generator=g)  # a non-uniform upstream gradient
    return q, k, v, w


def _reference():
    q, k, v, w = (t.clone() for t in _inputs())
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_attention(rank, world_size, comm_type):
    import torch.distributed as dist

    from lightning_moe.parallel.context_parallel import context_parallel_attention, shard_sequence, unshard_sequence

    group = dist.new_group(list(range(world_size)))
    q, k, v, w = (shard_sequence(t, world_size, rank, dim=2) for t in _inputs())
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = context_parallel_attention(q, k, v, group, comm_type)
    (out * w).sum().backward()

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.detach().contiguous())
        return unshard_sequence(parts, dim=2).numpy()

    return [gather(t) for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_matches_full_causal_attention(cp, comm_type):
    got = run_distributed(_cp_attention, cp, comm_type, timeout=60)[0]
    for name, want, have in zip(("out", "dq", "dk", "dv"), _reference(), got):
        torch.testing.assert_close(torch.from_numpy(have), want, rtol=0, atol=1e-5, msg=name)


def test_load_balanced_chunks_and_inverse():
    from lightning_moe.parallel.context_parallel import load_balanced_indices, shard_sequence, unshard_sequence

    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(1, 24)
    torch.testing.assert_close(unshard_sequence([shard_sequence(x, 3, r) for r in range(3)]), x)


def test_one_rank_is_plain_causal_attention():
    from lightning_moe.parallel.context_parallel import context_parallel_attention

    q, k, v, _ = _inputs()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(context_parallel_attention(q, k, v, None), want, rtol=0, atol=1e-5)


def test_indivisible_sequence_names_the_fix():
    from lightning_moe.parallel.context_parallel import shard_sequence

    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel_size = 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


def _documents():
    # packed rows: documents of lengths 5, 9, 2 and 16; per-token ids are sharded like the tokens
    return torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [0] * 16])


def _cp_document_attention(rank, world_size, comm_type):
    import torch.distributed as dist

    from lightning_moe.parallel.context_parallel import context_parallel_attention, shard_sequence, unshard_sequence

    q, k, v, w = (shard_sequence(t, world_size, rank, dim=2) for t in _inputs())
    docs = shard_sequence(_documents(), world_size, rank, dim=1)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, document_ids_BS=docs)
    (out * w).sum().backward()
    parts = {name: [torch.empty_like(t) for _ in range(world_size)] for name, t in (("out", out), ("dk", k.grad))}
    dist.all_gather(parts["out"], out.detach().contiguous())
    dist.all_gather(parts["dk"], k.grad.contiguous())
    return [unshard_sequence(parts[n], dim=2).numpy() for n in ("out", "dk")]


@pytest.mark.parametrize("comm_type", ["p2p", "allgather"])
def test_packed_documents_match_the_document_mask(comm_type):
    q, k, v, w = (t.clone() for t in _inputs())
    k.requires_grad_()
    docs = _documents()
    mask = ((docs.unsqueeze(2) == docs.unsqueeze(1)) & torch.ones(S, S, dtype=torch.bool).tril()).unsqueeze(1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (want * w).sum().backward()
    out, dk = run_distributed(_cp_document_attention, 4, comm_type, timeout=60)[0]
    torch.testing.assert_close(torch.from_numpy(out), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.from_numpy(dk), k.grad, rtol=0, atol=1e-5)
