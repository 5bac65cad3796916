"""The weighted SwiGLU (`kernels.swiglu_triton.weighted_swiglu`) and the MoE layer's combine through
it, on CPU under Triton's interpreter. Run as a script with ``TRITON_INTERPRET=1``; prints one line
per case ending in "equal" (within the stated tolerance) and exits non-zero on the first mismatch.

``kernel``: ``p * silu(gate) * up`` and its gradients in ``h`` and ``p`` against the eager
formulation's autograd (fp32: 1e-6 relative; bf16: two units of the largest value, as the
interpreter's bf16 casts truncate), with and without a rows end (rows from it on: no output, no
``grad_h``, ``grad_p`` 0), a partial last row block.
``layer``: an fp32 `MoELayer` with the Triton paths forced on, the probabilities in the SwiGLU and
the rows summed after fc2, against the same layer with the dispatcher's weighted combine
(`experts.WEIGHTED_SWIGLU_COMBINE` off): output, input, router and expert weight gradients (fp32
1e-5 relative: the products are the same up to the order of one multiplication); with ``moe_act`` recomputed (the weighted SwiGLU
run again once in the backward), bit-equal to the weighted run.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_moe.kernels.swiglu_triton import weighted_swiglu  # noqa: E402


def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rel: float = 1e-6) -> None:
    got, want = got.detach().float(), want.detach().float()
    scale = float(want.abs().max()) or 1.0
    tol = 2 * torch.finfo(torch.bfloat16).eps * scale if dtype == torch.bfloat16 else rel * scale
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if got.shape != want.shape or err > tol:
        print(f"{name}: max error {err:.3g} over {tol:.3g} (shapes {tuple(got.shape)} {tuple(want.shape)})")
        sys.exit(1)
    print(f"{name}: equal")


def kernel() -> None:
    torch.manual_seed(0)
    rows, ffn = 37, 48
    for dtype in (torch.float32, torch.bfloat16):
        for end in (None, 29):
            h = torch.randn(rows, 2 * ffn).to(dtype).requires_grad_()
            p = torch.rand(rows, requires_grad=True)
            g = torch.randn(rows, ffn).to(dtype)
            end_t = None if end is None else torch.tensor(end)
            live = rows if end is None else end
            out = weighted_swiglu(h, p, end_t)
            grad_h, grad_p = torch.autograd.grad(out, (h, p), g)
            h32 = h.detach().float().requires_grad_()
            p32 = p.detach().requires_grad_()
            gate, up = h32.chunk(2, dim=1)
            want = p32[:, None] * (F.silu(gate) * up)
            want_h, want_p = torch.autograd.grad(want, (h32, p32), g.float())
            case = f"kernel {str(dtype).replace('torch.', '')} end={end}"
            _close(f"{case} output", out[:live], want[:live].to(dtype), dtype)
            _close(f"{case} grad_h", grad_h[:live], want_h[:live].to(dtype), dtype)
            _close(f"{case} grad_p", grad_p[:live], want_p[:live], torch.float32, rel=1e-5)
            if end is not None and bool(grad_p[live:].ne(0).any()):
                print(f"{case}: grad_p of rows past the end is not 0")
                sys.exit(1)


def layer() -> None:
    from _triton_on_cpu import force_triton_paths

    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.nn import experts as experts_module

    force_triton_paths()

    from lightning_moe.kernels import swiglu_triton

    calls = {"weighted": 0}
    unspied = swiglu_triton.weighted_swiglu

    def spy(*args):
        calls["weighted"] += 1
        return unspied(*args)

    swiglu_triton.weighted_swiglu = spy
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, router_topk=2, hidden_size=32, ffn_hidden_size=24)
    layer = MoELayer(cfg)
    x = torch.randn(2, 9, 32)
    results = []
    for weighted, recompute in ((True, False), (False, False), (True, True)):
        experts_module.WEIGHTED_SWIGLU_COMBINE = weighted
        layer.experts.recompute_activation = recompute
        calls["weighted"] = 0
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        y = out[0] if isinstance(out, tuple) else out
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
        if calls["weighted"] != int(weighted) * (2 if recompute else 1):
            print(f"layer: the weighted SwiGLU ran {calls['weighted']} times with WEIGHTED_SWIGLU_COMBINE={weighted}")
            sys.exit(1)
    (y1, gx1, gp1), (y0, gx0, gp0), (yr, gxr, gpr) = results
    same = torch.equal(yr, y1) and torch.equal(gxr, gx1) and all(torch.equal(gpr[n], gp1[n]) for n in gp1)
    print(f"layer recompute moe_act: {'equal' if same else 'differs'}")
    if not same:
        sys.exit(1)
    _close("layer output", y1, y0, torch.float32, rel=1e-5)
    _close("layer input gradient", gx1, gx0, torch.float32, rel=1e-5)
    for name in gp0:
        _close(f"layer {name} gradient", gp1[name], gp0[name], torch.float32, rel=1e-5)


if __name__ == "__main__":
    {"kernel": kernel, "layer": layer}[sys.argv[1]]()
