"""The per-head RMSNorm + rotary kernel (`kernels.rotary_triton` through `models.rotary.norm_rotary`)
run on CPU under Triton's interpreter, against the eager formulation (`RMSNorm` then `apply_rotary`)
and its autograd gradients. Run as a script with ``TRITON_INTERPRET=1``; prints one line per case
and exits non-zero on the first mismatch.

``kernel``: bf16, fp16 and fp32 (fp16 and fp32 within one unit in the last place, elementwise;
bf16 looser: the interpreter's bf16 casts truncate), with and without the norm, ``cos``/``sin`` ``[S, hd]`` and
``[B, S, hd]``, a head width that is no power of two, row counts that leave the last block
partial, strided rows, a strided output gradient, the weight gradient over several programs.
``model``: a tiny decoder's loss and gradients with the fused path forced on against the eager
path (per-head qk-norm, no qk-norm, MLA, packed documents).
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from lightning_moe.kernels import rotary_triton as kernel  # noqa: E402
from lightning_moe.models import rotary  # noqa: E402
from lightning_moe.models.layers import RMSNorm, apply_rotary, rotary_cos_sin  # noqa: E402


def _ulp_close(got, want, dtype, scale=None) -> bool:
    """Elementwise within one unit in the last place of ``want`` in ``dtype`` (``scale``: of that
    value instead). bf16: within two units of the largest value, as the interpreter's bf16 casts
    truncate where the GPU's round to nearest (fp16 and fp32 round as on the GPU)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    got, want = got.detach().float(), want.detach().float()
    if dtype == torch.bfloat16:
        scale = 2 * float(want.abs().max())
    ref = want.abs() if scale is None else torch.full_like(want, scale)
    tol = torch.finfo(dtype).eps * ref + (1e-6 * float(want.abs().max()) if dtype == torch.float32 else 0.0)
    bad = (got - want).abs() > tol
    if bad.any():
        print("  worst", float(((got - want).abs() - tol).max()), "of", int(bad.sum()), "elements", flush=True)
    return not bool(bad.any())


def check(batch, seq, heads, hd, dtype, with_norm, batched_tables, strided) -> bool:
    g = torch.Generator().manual_seed(batch * 1000 + seq * 10 + heads + hd)
    if strided:  # rows of a wider projection: the row strides are not the packed ones
        x = torch.randn(batch, seq, heads, hd + 6, generator=g).to(dtype)[..., 3:hd + 3]
    else:
        x = torch.randn(batch, seq, heads * hd, generator=g).to(dtype).view(batch, seq, heads, hd)
    positions = torch.randint(0, 500, (batch, seq) if batched_tables else (seq,), generator=g)
    cos, sin = rotary_cos_sin(positions, hd, 10000.0)
    norm = None
    if with_norm:
        norm = RMSNorm(hd, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(hd, generator=g) + 0.5)  # away from 1: a skipped weight shows
    # the output gradient through a transpose, as attention's [B, H, S, d] gradient comes back
    dy = torch.randn(batch, heads, seq, hd, generator=g).to(dtype).transpose(1, 2)

    x_fused = x.detach().requires_grad_()
    assert rotary._fused(x_fused, cos, sin, norm), "the fused path was not taken"
    y = rotary.norm_rotary(x_fused, cos, sin, norm)
    y.backward(dy)
    dw = None if norm is None else norm.weight.grad.clone()
    if norm is not None:
        norm.weight.grad = None

    x_eager = x.detach().requires_grad_()
    want = apply_rotary(norm(x_eager) if norm is not None else x_eager, cos, sin)
    want.backward(dy)
    ok = _ulp_close(y, want, dtype)
    # the input gradient rounds at the same points as eager; its differences stay at one unit of its largest
    ok = _ulp_close(x_fused.grad, x_eager.grad, dtype, scale=float(x_eager.grad.abs().max())) and ok
    if norm is not None:
        # fp32 sums of the same products in another order (bf16: of products whose rounded factor
        # the interpreter truncates)
        want_dw = norm.weight.grad
        rel = torch.finfo(torch.bfloat16).eps if dtype == torch.bfloat16 else 1e-5
        dw_ok = bool(((dw - want_dw).abs() <= rel * want_dw.abs().max()).all())
        if not dw_ok:
            print("  weight gradient off by", float((dw - want_dw).abs().max()), "of", float(want_dw.abs().max()))
        ok = ok and dw_ok
    return ok


def _model_case(name: str, fused: bool, **fields):
    from lightning_moe.models import MoEDecoder, ModelConfig

    rotary.FUSED_KERNEL = fused
    torch.manual_seed(0)
    moe = dict(ffn_hidden_size=16, num_experts=4, router_topk=2)
    model = MoEDecoder(ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   ffn_hidden_size=48, first_k_dense_layers=1, moe=moe, **fields))
    with torch.no_grad():  # norm weights away from 1 so a skipped norm shows
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(pname))) + 0.5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 13), generator=g)
    labels = torch.randint(0, 64, (2, 13), generator=g)
    documents = None
    if name.endswith("packed"):
        documents = torch.tensor([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4])
    calls = []
    original = rotary._FusedNormRotary.apply

    def counted(*args):
        calls.append(args[1] is not None)
        return original(*args)

    rotary._FusedNormRotary.apply = counted
    try:
        loss = model.loss(ids, labels, document_ids=documents)
        loss.backward()
    finally:
        rotary._FusedNormRotary.apply = original
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls


def check_model(name: str, **fields) -> bool:
    loss, grads, calls = _model_case(name, True, **fields)
    want_loss, want_grads, eager_calls = _model_case(name, False, **fields)
    rotary.FUSED_KERNEL = True
    if not calls or eager_calls:  # the fused path ran (q and k of each layer) only when on
        print("  fused calls", calls, "eager run's", eager_calls, flush=True)
        return False
    if fields.get("qk_norm") and not all(calls):
        return False
    ok = abs(float(loss) - float(want_loss)) <= 1e-6 * abs(float(want_loss))
    for n, want in want_grads.items():
        got = grads.get(n)
        if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()) + 1e-9):
            print("  gradient", n, None if got is None else float((got - want).abs().max()), flush=True)
            ok = False
    return ok and set(grads) == set(want_grads)


def main() -> None:
    rotary.use_triton = lambda t: True  # the kernel path on CPU tensors, run by the interpreter
    which = sys.argv[1] if len(sys.argv) > 1 else "kernel"
    if which == "kernel":
        kernel.ELEMENTS_PER_PROGRAM = 64  # a few rows per program: partial last blocks
        kernel.MAX_BACKWARD_PROGRAMS = 3  # the backward's programs loop over several row blocks
        cases = [(2, 5, 3, 16, torch.bfloat16, True, False, False),
                 (2, 7, 2, 16, torch.float32, True, True, False),
                 (1, 9, 3, 12, torch.bfloat16, False, False, True),
                 (3, 4, 1, 6, torch.float32, False, True, False),
                 (2, 6, 4, 8, torch.float16, True, True, True),
                 (2, 3, 2, 16, torch.bfloat16, True, True, True)]
        for case in cases:
            ok = check(*case)
            batch, seq, heads, hd, dtype, with_norm, batched, strided = case
            print("rotary", (batch, seq, heads, hd), dtype, "norm" if with_norm else "no-norm",
                  "[B,S,hd]" if batched else "[S,hd]", "strided" if strided else "dense",
                  "equal" if ok else "DIFFERENT", flush=True)
            if not ok:
                sys.exit(1)
    else:
        for name, fields in [("model qk_norm", dict(qk_norm=True)), ("model no-norm", {}),
                             ("model qk_norm packed", dict(qk_norm=True, num_query_groups=2)),
                             ("model mla", dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8,
                                                qk_rope_head_dim=8, v_head_dim=8))]:
            ok = check_model(name, **fields)
            print(name, "equal" if ok else "DIFFERENT", flush=True)
            if not ok:
                sys.exit(1)


if __name__ == "__main__":
    main()
