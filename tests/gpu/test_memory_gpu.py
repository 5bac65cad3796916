"""Activation offload and recompute on a CUDA GPU: the same gradients as the plain run (bf16
autocast, fp32 master weights, bit for bit under deterministic algorithms), a lower peak of
allocated memory, no host sync in the offload's copies, and FP8 delayed (native) recompute keeping
the plain gradients."""

import _deterministic
import pytest
import torch

from lightning_moe.callbacks import ActivationOffload
from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def deterministic_algorithms():
    """Bit-for-bit comparisons need deterministic kernels (`_deterministic`)."""
    with _deterministic.deterministic_algorithms():
        yield


SEQ, BATCH = 1024, 2


def _config(**overrides):
    moe = {"num_experts": 16, "router_topk": 4, "ffn_hidden_size": 512, "expert_alignment": 16}
    return get_preset("small", **{"num_layers": 4, "first_k_dense_layers": 0, "moe": moe, "max_seq_length": SEQ,
                                  **overrides})


def _step(cfg, offload=None, sync_check: bool = False):
    torch.manual_seed(0)
    model = MoEDecoder(cfg).cuda()
    callback = None
    if offload is not None:
        callback = ActivationOffload(offload, keep_last_layers=1, min_offload_bytes=0).attach(model)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # warm-up: kernels and the host allocator's blocks
        causal_lm_loss(model(ids), labels).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if sync_check:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(ids), labels)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if callback is not None:
        assert callback.live_host_bytes == 0
        callback.detach()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, peak


def _assert_same(plain, other):
    assert torch.equal(plain[0], other[0])
    for name, grad in plain[1].items():
        assert torch.equal(grad, other[1][name]), name


@pytest.mark.parametrize("offload", [["expert_fc1", "moe_act"], ["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                                  "mlp_norm", "expert_fc1", "moe_act"]],
                         ids=["experts", "all"])
@pytest.mark.usefixtures("deterministic_algorithms")
def test_offload_keeps_gradients_and_lowers_the_peak(offload):
    plain = _step(_config())
    offloaded = _step(_config(), offload)
    _assert_same(plain, offloaded)
    assert offloaded[2] < plain[2], (offloaded[2], plain[2])


def test_offload_copies_do_not_sync_the_host():
    try:
        _step(_config(), sync_check=True)
    except RuntimeError as error:
        pytest.skip(f"the plain step syncs by itself, so the offload's copies cannot be checked alone: {error}")
    _step(_config(), ["expert_fc1", "moe_act", "attn_norm"], sync_check=True)


@pytest.mark.parametrize("overrides", [{"recompute": ["moe_act", "layernorm"]}, {"recompute_every_n_layers": 1}],
                         ids=["moe_act+layernorm", "whole_layers"])
@pytest.mark.usefixtures("deterministic_algorithms")
def test_recompute_keeps_gradients_and_lowers_the_peak(overrides):
    plain = _step(_config())
    recomputed = _step(_config(**overrides))
    _assert_same(plain, recomputed)
    assert recomputed[2] < plain[2], (recomputed[2], plain[2])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU")
@pytest.mark.usefixtures("deterministic_algorithms")
def test_fp8_delayed_native_recompute_keeps_gradients():
    from lightning_moe.precision import FP8Precision

    def run(every):
        torch.manual_seed(0)
        model = MoEDecoder(_config(recompute_every_n_layers=every)).cuda()
        plugin = FP8Precision(recipe="delayed", backend="torch")
        plugin.convert_module(model)
        ids = torch.randint(0, 1000, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(2):  # the second step casts with the first step's scales
            model.zero_grad(set_to_none=True)
            with plugin.forward_context():
                loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
            loss.backward()
            plugin.update_delayed_scaling()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    _assert_same(run(None), run(1))
