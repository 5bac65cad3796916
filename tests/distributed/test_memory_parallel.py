"""Activation offload and recomputation under expert, expert-tensor and tensor parallelism, FSDP and
context parallelism (2 gloo ranks).

On each rank the parallelized model's gradients with every `ActivationOffload` part and every
`ModelConfig.recompute` module, alone and combined, and with whole-layer recompute, equal those of
the same layout without them, bit for bit (fp32): the all-to-all dispatch and the TP collectives
recomputed in backward, and DTensors offloaded as their local shards, change no value.
"""

import pytest
import torch
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_moe.callbacks.activation_offload import OFFLOAD_MODULES, ActivationOffload
from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset
from lightning_moe.models.recompute import RECOMPUTE_MODULES
from lightning_moe.parallel.expert_parallel import expert_parallel_layer
from lightning_moe.parallel.tensor_parallel import apply_moe_token_split

MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
       "router_score_function": "sigmoid", "router_enable_expert_bias": True, "aux_loss_coeff": 1e-2,
       "z_loss_coeff": 1e-3}
SELECTIVE = [n for n in RECOMPUTE_MODULES if n != "mla_up_proj"]
VARIANTS = (
    [({"offload": [name]}) for name in OFFLOAD_MODULES]
    + [({"recompute": [name]}) for name in SELECTIVE]
    # combined: the pairs that work together (ActivationOffload refuses a part that a recompute name covers)
    + [{"offload": ["core_attn", "attn_proj", "expert_fc1"], "recompute": [n for n in SELECTIVE if n != "moe"]},
       {"offload": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"], "recompute": ["moe", "core_attn"]},
       {"recompute_every_n_layers": 2, "recompute": ["layernorm", "moe_act"],
        "offload": ["core_attn", "attn_proj", "expert_fc1"]},
       # Megatron-Core's pairing: the activation's input offloaded, its output recomputed
       {"offload": ["expert_fc1", "moe_act"], "recompute": ["moe_act"]}]
)


def _grads(rank: int, layout: str, variant: dict) -> tuple[dict, int]:
    overrides = {k: v for k, v in variant.items() if k != "offload"}
    cfg = get_preset("tiny", num_layers=3, first_k_dense_layers=1, qk_norm=True, moe=MOE, **overrides)
    torch.manual_seed(0)
    model = MoEDecoder(cfg)
    if layout == "etp":  # each expert's FFN dimension split over the 2 ranks
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "etp"))
        for layer in model.moe_layers():
            expert_parallel_layer(layer, mesh, "alltoall")
    elif layout == "ep":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(layout,))
        for layer in model.moe_layers():
            expert_parallel_layer(layer, mesh, "alltoall")
    else:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(layout,))
        parallelize_module(model, mesh, model.tensor_parallel_plan(sequence_parallel=True))
        for layer in model.moe_layers():
            apply_moe_token_split(layer, mesh, True)
            layer.router.sequence_parallel_group = mesh.get_group()
    offload = None
    if "offload" in variant:
        offload = ActivationOffload(variant["offload"], keep_last_layers=0, min_offload_bytes=0).attach(model)
    # EP ranks hold different tokens; TP ranks the same ones
    seed = 1 + (rank if layout == "ep" else 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
    held = offload.live_host_bytes if offload is not None else 0
    loss.backward()
    if offload is not None:
        assert offload.live_host_bytes == 0
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.to_local() if isinstance(grad, DTensor) else grad
    buffers = {name: b.clone() for name, b in model.named_buffers() if b is not None}
    return (loss.detach(), grads, buffers), held


def _check(rank: int, world_size: int, layout: str) -> list[str]:
    plain, _ = _grads(rank, layout, {})
    failures = []
    for variant in VARIANTS:
        (loss, grads, buffers), held = _grads(rank, layout, variant)
        if "offload" in variant and held <= 0:
            failures.append(f"{variant}: nothing offloaded")
        if not torch.equal(loss, plain[0]):
            failures.append(f"{variant}: loss")
        failures += [f"{variant}: grad {n}" for n, g in plain[1].items() if g is None or not torch.equal(g, grads[n])]
        failures += [f"{variant}: buffer {n}" for n, b in plain[2].items() if not torch.equal(b, buffers[n])]
    return failures


@pytest.mark.parametrize("layout", ["ep", "etp", "tp"])
def test_offload_and_recompute_keep_the_gradients_under_parallelism(layout):
    assert run_distributed(_check, 2, layout, timeout=300) == [[], []]


def _fit(rank: int, world_size: int, variant: dict, context_parallel: bool = False) -> dict:
    """Three optimizer steps of 2 micro-batches through Trainer + MegatronMoEStrategy with FSDP over
    DP=2 (dense blocks and experts), or context parallelism over 2 ranks (the same micro-batches on
    both), with ``variant``'s offload and recompute; rank 0's full state."""
    import lightning as L
    from _parity import MicroBatches, tiny_config
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models import MoELanguageModel

    class SGDModel(MoELanguageModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    config = {**tiny_config(), **{k: v for k, v in variant.items() if k != "offload"}}
    callbacks = []
    if "offload" in variant:
        callbacks.append(ActivationOffload(variant["offload"], keep_last_layers=0, min_offload_bytes=0))
    layout = {"context_parallel_size": 2} if context_parallel else {"sharding": "fsdp", "expert_sharding": "fsdp"}
    strategy = MegatronMoEStrategy(print_layout=False, **layout)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, accumulate_grad_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=callbacks, num_sanity_val_steps=0,
    )
    model = SGDModel(config)
    indices = list(range(6)) if context_parallel else [i for i in range(12) if i % 2 == rank]
    loader = DataLoader(MicroBatches(12), batch_size=None, sampler=indices)
    trainer.fit(model, loader)
    if callbacks:
        assert callbacks[0].live_host_bytes == 0
    state = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items() if torch.is_tensor(v)} if rank == 0 else {}


@pytest.mark.parametrize("variant", [
    {"offload": list(OFFLOAD_MODULES)},
    {"recompute": ["moe", "layernorm", "core_attn", "mlp"]},
    {"recompute_every_n_layers": 2, "offload": ["expert_fc1"]},
], ids=["offload", "selective", "whole_layers"])
def test_fsdp_with_accumulation_trains_to_the_plain_parameters(variant):
    plain = run_distributed(_fit, 2, {}, timeout=300)[0]
    other = run_distributed(_fit, 2, variant, timeout=300)[0]
    assert plain.keys() == other.keys()
    for name, value in plain.items():
        assert (value == other[name]).all(), name


@pytest.mark.parametrize("variant", [
    {"offload": ["core_attn", "attn_proj", "expert_fc1", "moe_act"], "recompute": ["core_attn", "layernorm"]},
    {"recompute_every_n_layers": 1},
], ids=["offload_selective", "whole_layers"])
def test_context_parallel_trains_to_the_plain_parameters(variant):
    """CP=2 (the p2p ring): the ring's exchanges are recomputed in backward with the attention."""
    plain = run_distributed(_fit, 2, {}, True, timeout=300)[0]
    other = run_distributed(_fit, 2, variant, True, timeout=300)[0]
    assert plain.keys() == other.keys()
    for name, value in plain.items():
        assert (value == other[name]).all(), name
