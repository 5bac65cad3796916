"""Multi-head latent attention under MoEDecoder.tensor_parallel_plan on 2 gloo ranks: outputs and
gradients equal one process's, with and without sequence parallelism, with and without the query
compression. Heads are split over the ranks; the replicated a-projections, their norms and the
shared rotary key must still receive the whole gradient (the last one through the plan's gradient sum).
"""

import copy

import torch
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset
from lightning_moe.parallel.tensor_parallel import apply_moe_token_split

WORLD_SIZE = 2
# Parameters the plan leaves replicated (plain tensors), whole on every rank.
REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def _config(q_lora_rank):
    # Block 0 dense, block 1 MoE; 4 heads (2 per rank), value width != query/key width.
    return get_preset(
        "tiny", num_layers=2, first_k_dense_layers=1, num_query_groups=None, attention_type="mla",
        q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    )


def _full_grad(param):
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _check_parity(rank, world_size, cfg, sequence_parallel):
    torch.manual_seed(0)
    reference = MoEDecoder(cfg)
    model = copy.deepcopy(reference)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(input_ids, -1, dims=1)
    ref_logits = reference(input_ids)
    causal_lm_loss(ref_logits, labels).backward()

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, model.tensor_parallel_plan(sequence_parallel=sequence_parallel))
    for moe in model.moe_layers():
        apply_moe_token_split(moe, mesh, sequence_parallel)
        moe.router.sequence_parallel_group = mesh.get_group()
    logits = model(input_ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    causal_lm_loss(logits, labels).backward()

    ref_params = dict(reference.named_parameters())
    moe_params = {id(p) for moe in model.moe_layers() for p in moe.parameters()}
    checked = 0
    for name, param in model.named_parameters():
        grad = _full_grad(param)
        if id(param) in moe_params:
            grad = grad.clone()
            torch.distributed.all_reduce(grad)  # each rank routed its own slice of the sequence
        else:
            replicated = any(f".attention.{part}." in name for part in REPLICATED)
            assert isinstance(param, DTensor) != replicated or (not sequence_parallel and "norm" in name), name
        torch.testing.assert_close(grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
        checked += 1
    return checked


def _check_cases(rank, world_size, cases):
    return [_check_parity(rank, world_size, cfg, sequence_parallel) for cfg, sequence_parallel in cases]


def test_mla_tp_plan_matches_single_process():
    cases = [(_config(32), True), (_config(32), False), (_config(None), True)]
    counts = run_distributed(_check_cases, WORLD_SIZE, cases)
    expected = [len(list(MoEDecoder(cfg).parameters())) for cfg, _ in cases]
    assert counts == [expected] * WORLD_SIZE
