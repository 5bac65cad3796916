"""The experts' first projection reading the permutation inside its own autograd node
(`GroupedExperts.gathers_first_projection`), on CPU under Triton's interpreter. Run as a script
with ``TRITON_INTERPRET=1``; prints one line per case ending in "equal" and exits non-zero on the
first mismatch.

A `MoELayer` with the Triton paths forced on runs with `experts.GATHERED_FIRST_PROJECTION` on and
off, in fp32 and in bf16, with the dispatcher's combine and with the probabilities in the SwiGLU:
output, input, router and expert weight gradients are bit-equal (the same gather and GEMMs, the
rows gathered again for the weight gradient). With it on, one tensor of the permuted rows' size
``[T*K, D]`` fewer is saved for backward (fc1 keeps the tokens ``[T, D]``). With
``layernorm``-style recompute of the tokens (`OutputRecompute` around the layer's input), the
tokens fc1 keeps are a recipe, and the gradients stay bit-equal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402


@contextlib.contextmanager
def saved_shapes() -> Iterator[list]:
    """The shapes of the tensors autograd saves inside the block (hooks installed inside it, such
    as a recompute's, see their own tensors instead)."""
    shapes: list = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield shapes


def main() -> None:
    from _triton_on_cpu import force_triton_paths

    from lightning_moe.nn import MoEConfig, MoELayer
    from lightning_moe.nn import experts as experts_module
    from lightning_moe.nn.saved_tensors import OutputRecompute

    force_triton_paths()

    tokens, topk, hidden = 18, 2, 32
    for dtype in (torch.float32, torch.bfloat16):
        for weighted in (True, False):
            torch.manual_seed(0)
            cfg = MoEConfig(num_experts=4, router_topk=topk, hidden_size=hidden, ffn_hidden_size=24)
            layer = MoELayer(cfg).to(dtype)
            x = torch.randn(2, tokens // 2, hidden).to(dtype)
            experts_module.WEIGHTED_SWIGLU_COMBINE = weighted
            results, row_sized = [], []
            for gathered, recompute in ((True, False), (False, False), (True, True)):
                experts_module.GATHERED_FIRST_PROJECTION = gathered
                layer.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                with saved_shapes() as shapes:
                    with OutputRecompute(recompute) as outputs:
                        y = layer(outputs.run(torch.mul, xi, 1.0))
                y = y[0] if isinstance(y, tuple) else y
                (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
                results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
                row_sized.append(shapes.count((tokens * topk, hidden)))
            (y1, gx1, gp1), (y0, gx0, gp0), (yr, gxr, gpr) = results
            if row_sized[0] != row_sized[1] - 1:  # the recompute run's hooks are its own (innermost)
                print(f"{str(dtype).replace('torch.', '')} weighted={weighted}: {row_sized[0]} tensors of the rows' "
                      f"size saved gathered, {row_sized[1]} not: fc1 still keeps the permuted rows")
                sys.exit(1)
            for label, (ya, gxa, gpa) in (("off", (y0, gx0, gp0)), ("recompute", (yr, gxr, gpr))):
                same = torch.equal(ya, y1) and torch.equal(gxa, gx1) and all(torch.equal(gpa[n], gp1[n]) for n in gp1)
                print(f"gathered {str(dtype).replace('torch.', '')} weighted={weighted} against {label}: "
                      f"{'equal' if same else 'differs'}")
                if not same:
                    sys.exit(1)


if __name__ == "__main__":
    main()
