"""MoEDecoder.tensor_parallel_plan on 2 gloo ranks: outputs and gradients equal one process's.

MoE blocks are outside the plan; they get the strategy's token split (``apply_moe_token_split``),
as under ``MegatronMoEStrategy``, so the whole model is checked end to end.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset
from lightning_moe.parallel.tensor_parallel import apply_moe_token_split

WORLD_SIZE = 2


def _dense_config():
    # Every block dense, GQA 4/2 heads and qk-norm: all TP styles of the plan are exercised.
    return get_preset("tiny", num_layers=2, first_k_dense_layers=2, qk_norm=True)


def _moe_config():
    # First block dense, second MoE, with aux and z losses (their per-slice shares must add up).
    return get_preset("tiny", num_layers=2, first_k_dense_layers=1, qk_norm=True)


def _full_grad(param):
    grad = param.grad
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _projection_norm_config():
    # OLMoE's qk-norm over whole projections and Qwen2-MoE's q/k/v biases, dense and MoE blocks.
    return get_preset("tiny", num_layers=2, first_k_dense_layers=1, qk_norm=True, qk_norm_scope="projection",
                      add_qkv_bias=True)


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
        # The MoE block routes this rank's sequence slice; its losses are shared over the TP group.
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
            # Router and experts see only this rank's tokens: their gradient is a per-slice share.
            grad = grad.clone()
            dist.all_reduce(grad)
        else:
            # Everything else is in the plan, except the norms without sequence parallelism
            # (they then see the whole replicated sequence and need no reduction).
            assert isinstance(param, DTensor) or (not sequence_parallel and "norm" in name), name
        torch.testing.assert_close(grad, ref_params[name].grad, atol=1e-5, rtol=1e-5, msg=name)
        checked += 1
    return checked


def _check_cases(rank, world_size, cases):
    return [_check_parity(rank, world_size, cfg, sequence_parallel) for cfg, sequence_parallel in cases]


def test_tp_plan_matches_single_process():
    """Dense and dense+MoE models (per-head and whole-projection qk-norms, q/k/v biases), with and
    without sequence parallelism.

    One launch for the six cases: each new process pays ~2 s for DTensor's first dispatches.
    """
    configs = (_dense_config(), _moe_config(), _projection_norm_config())
    cases = [(cfg, sp) for cfg in configs for sp in (True, False)]
    counts = run_distributed(_check_cases, WORLD_SIZE, cases)
    expected = [len(list(MoEDecoder(cfg).parameters())) for cfg, _ in cases]
    assert counts == [expected] * WORLD_SIZE


def test_plan_refuses_tied_embeddings():
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        MoEDecoder(get_preset("tiny", num_layers=1, tie_word_embeddings=True)).tensor_parallel_plan()
