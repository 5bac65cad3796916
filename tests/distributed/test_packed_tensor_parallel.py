"""A packed batch (document_ids, per-document positions) under the decoder's tensor-parallel plan
on 2 gloo ranks, with and without sequence parallelism: logits and gradients equal one process's
(GQA with qk-norm and MLA; the document mask reaches every attention through the plan's hooks)."""

import copy

import torch
import torch.distributed as dist
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe.models import MoEDecoder, get_preset
from lightning_moe.parallel.tensor_parallel import apply_moe_token_split


def _configs():
    gqa = get_preset("tiny", num_layers=2, first_k_dense_layers=1, qk_norm=True)
    mla = get_preset("tiny", num_layers=2, first_k_dense_layers=1, num_query_groups=None, attention_type="mla",
                     q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    return [gqa, mla]


def _packed_batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 256, (2, 16), generator=g)
    labels = torch.randint(0, 256, (2, 16), generator=g)
    document_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 1 + [1] * 15])
    return input_ids, labels, document_ids


def _check(rank, world_size, cfg, sequence_parallel):
    torch.manual_seed(0)
    reference = MoEDecoder(cfg)
    model = copy.deepcopy(reference)
    input_ids, labels, document_ids = _packed_batch()
    ref_logits = reference(input_ids, document_ids=document_ids)
    reference.loss(input_ids, labels, document_ids=document_ids).backward()

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, model.tensor_parallel_plan(sequence_parallel=sequence_parallel))
    for moe in model.moe_layers():
        apply_moe_token_split(moe, mesh, sequence_parallel)
        moe.router.sequence_parallel_group = mesh.get_group()
    logits = model(input_ids, document_ids=document_ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    model.loss(input_ids, labels, document_ids=document_ids).backward()

    ref_params = dict(reference.named_parameters())
    moe_params = {id(p) for moe in model.moe_layers() for p in moe.parameters()}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if id(param) in moe_params:  # a per-slice share under the token split
            grad = grad.clone()
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
    return True


def _check_cases(rank, world_size, cases):
    return [_check(rank, world_size, cfg, sp) for cfg, sp in cases]


def test_packed_batch_under_tensor_parallelism_matches_one_process():
    cases = [(cfg, sp) for cfg in _configs() for sp in (True, False)]
    assert run_distributed(_check_cases, 2, cases) == [[True] * len(cases)] * 2
