"""The fused per-head RMSNorm + rotary embedding (`models.rotary.norm_rotary` on a GPU with Triton)
against the eager formulation (`RMSNorm` then `apply_rotary`): the output within one unit in the
last place, the input and norm-weight gradients, bf16 and fp32, with and without the norm, tables
``[S, hd]`` and ``[B, S, hd]``; Qwen3-30B-A3B's attention shape; and that a decoder takes the fused
path and matches the eager decoder."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _eager_and_fused(x, cos, sin, norm, dy):
    from lightning_moe.models import rotary
    from lightning_moe.models.layers import apply_rotary

    x_fused = x.detach().requires_grad_()
    assert rotary._fused(x_fused, cos, sin, norm)
    y = rotary.norm_rotary(x_fused, cos, sin, norm)
    y.backward(dy)
    dw = None if norm is None else norm.weight.grad
    if norm is not None:
        norm.weight.grad = None
    x_eager = x.detach().requires_grad_()
    want = apply_rotary(norm(x_eager) if norm is not None else x_eager, cos, sin)
    want.backward(dy)
    return (y, x_fused.grad, dw), (want, x_eager.grad, None if norm is None else norm.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("batch, seq, heads, hd, batched", [(2, 4096, 32, 128, False), (2, 1000, 4, 128, True),
                                                           (3, 77, 5, 64, False), (1, 33, 3, 80, True)])
def test_fused_norm_rotary_matches_eager(dtype, with_norm, batch, seq, heads, hd, batched):
    from lightning_moe.models.layers import RMSNorm, rotary_cos_sin

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, seq, heads * hd, device="cuda", generator=g).to(dtype).view(batch, seq, heads, hd)
    positions = torch.randint(0, 40_000, (batch, seq) if batched else (seq,), device="cuda", generator=g)
    cos, sin = rotary_cos_sin(positions, hd, 1_000_000.0)
    norm = None
    if with_norm:
        norm = RMSNorm(hd).cuda()
        with torch.no_grad():
            norm.weight.copy_(torch.rand(hd, device="cuda", generator=g) + 0.5)
    dy = torch.randn(batch, heads, seq, hd, device="cuda", generator=g).to(dtype).transpose(1, 2)
    (y, dx, dw), (want, want_dx, want_dw) = _eager_and_fused(x, cos, sin, norm, dy)
    eps = torch.finfo(dtype).eps
    y, want = y.detach().float(), want.detach().float()
    if with_norm:
        # The normed value is rounded to the activation dtype before the rotation, as eager rounds it;
        # the two sums of squares (and rsqrt's last bit) may put that rounding one unit apart, and the
        # rotation carries a unit of each term (x1 cos, x2 sin) into the output, which can be smaller
        # than its terms: the bound is a unit of the terms plus a unit of the output.
        normed = norm(x).detach().float().abs()
        half = normed.shape[-1] // 2
        swapped = torch.cat([normed[..., half:], normed[..., :half]], dim=-1)
        terms = normed * cos.abs().unsqueeze(-2) + swapped * sin.abs().unsqueeze(-2)  # |x1 cos| + |x2 sin|
        assert ((y - want).abs() <= eps * (want.abs() + terms) + 1e-6 * float(want.abs().max())).all()
    else:
        # one rounding of the same fp32 value, up to FMA contraction: one unit in the last place
        assert ((y - want).abs() <= eps * want.abs() + 1e-6 * float(want.abs().max())).all()
    # The norm's backward sums hd products per row in another order than eager: hd units of the largest.
    assert ((dx.float() - want_dx.float()).abs() <= hd * eps * float(want_dx.abs().max())).all()
    if with_norm:
        assert ((dw - want_dw).abs() <= 1e-4 * want_dw.abs().max()).all()


def test_the_weight_gradient_is_the_same_bits_every_run():
    from lightning_moe.models import rotary
    from lightning_moe.models.layers import RMSNorm, rotary_cos_sin

    x = torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(4096, device="cuda"), 128, 1_000_000.0)
    norm = RMSNorm(128).cuda()
    dy = torch.randn_like(x)
    grads = []
    for _ in range(3):
        rotary.norm_rotary(x, cos, sin, norm).backward(dy)
        grads.append(norm.weight.grad)
        norm.weight.grad = None
    assert all(torch.equal(grads[0], gr) for gr in grads[1:])


@pytest.mark.parametrize("qk_norm", [True, False])
def test_decoder_takes_the_fused_path_and_matches_eager(monkeypatch, qk_norm):
    from lightning_moe.models import MoEDecoder, ModelConfig, rotary

    calls = []
    original = rotary._FusedNormRotary.apply

    def counted(*args):
        calls.append(args[1] is not None)
        return original(*args)

    monkeypatch.setattr(rotary._FusedNormRotary, "apply", counted)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(rotary, "FUSED_KERNEL", fused)
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=256, qk_norm=qk_norm, first_k_dense_layers=1,
                          moe=dict(ffn_hidden_size=64, num_experts=4, router_topk=2))
        model = MoEDecoder(cfg).cuda()
        ids = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(ids, ids.roll(-1, dims=1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        if fused:
            assert len(calls) == 4 and all(c == qk_norm for c in calls)  # q and k of both layers
            calls.clear()
    assert not calls  # the eager run did not take it
    (loss, grads), (want_loss, want_grads) = results
    assert abs(float(loss) - float(want_loss)) <= 1e-2 * abs(float(want_loss))
    assert set(grads) == set(want_grads)
    for name, want in want_grads.items():
        assert (grads[name] - want).abs().max() <= 0.05 * want.abs().max() + 1e-6, name
