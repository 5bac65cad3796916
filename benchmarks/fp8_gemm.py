"""FP8 GEMMs, forward + backward: native torch FP8 beside Transformer Engine and bf16 (one H200).

    python benchmarks/fp8_gemm.py                  # dense and grouped shapes, every available backend

For each shape, the same random operands (fp32 masters, bf16 activations) run:

- ``bf16``: ``F.linear`` / ``torch._grouped_mm`` in bf16 (the reference of the error columns);
- ``torch/<recipe>``: our native FP8 path (`fp8_linear` / `fp8_grouped_mm`, backend "torch":
  ``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` with our quantizers), recipes tensorwise
  (hybrid and all-E4M3) and rowwise (dense) and rowwise-per-group (grouped);
- ``te/<recipe>``: ``te.Linear`` / ``te.GroupedLinear`` under ``te.autocast`` (tensorwise =
  current scaling, blockwise, delayed), when Transformer Engine is installed.

Reported per case: median ms of forward + backward (CUDA events, >= 10 runs after warm-up),
TFLOP/s (3 x 2 x M x K x N), and the relative error of the output and of both gradients against
bf16. Writes ``benchmarks/results/fp8_gemm.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_ms, relative_error, write_results  # noqa: E402

DENSE = {"dense_16k_4096_14336": dict(M=16384, K=4096, N=14336)}
GROUPED = {
    # mixtral_8x7b fc1: 8 experts, 4096 -> 2 x 14336, 2 x 4096 tokens x top-2
    "grouped_mixtral_fc1": dict(E=8, M=16384, K=4096, N=28672),
    # qwen3_30b_a3b fc1: 128 experts, 2048 -> 2 x 768, 4 x 4096 tokens x top-8
    "grouped_qwen3_fc1": dict(E=128, M=131072, K=2048, N=1536),
}


def _run(fn, inputs, dy):
    """Forward + backward once; returns (y, grads of the inputs that require grad)."""
    for t in inputs:
        t.grad = None
    y = fn()
    y.backward(dy)
    return y.float(), [t.grad.float() for t in inputs]


def _measure(name: str, fn, inputs, dy, reference, flops: float, iters: int) -> dict:
    try:
        return _measure_or_raise(name, fn, inputs, dy, reference, flops, iters)
    except Exception as err:  # noqa: BLE001 - one failing backend must not hide the others' numbers
        print(f"  {name:22s} failed: {err!r}", flush=True)
        return {"error": repr(err)}


def _measure_or_raise(name: str, fn, inputs, dy, reference, flops: float, iters: int) -> dict:
    y, grads = _run(fn, inputs, dy)
    errors = {}
    if reference is not None:
        ref_y, ref_grads = reference
        errors = {"rel_err_out": relative_error(y, ref_y)}
        for label, g, rg in zip(("rel_err_dx", "rel_err_dw"), grads, ref_grads):
            errors[label] = relative_error(g, rg)
    ms, _ = cuda_time_ms(lambda: _run(fn, inputs, dy), warmup=3, iters=iters)
    row = {"median_ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, **errors}
    err = " ".join(f"{k[8:]} {v:.2e}" for k, v in errors.items())
    print(f"  {name:22s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s {err}", flush=True)
    return row


def _te_module():
    """``transformer_engine.pytorch``, or None (reported) when it is missing or broken."""
    from lightning_moe.precision import _te

    if not _te.available():
        print(f"Transformer Engine unavailable: {_te.import_error()}")
        return None
    return _te._module()


def _te_recipes() -> dict:
    """TE recipe objects as `FP8Precision(backend="te")` builds them, for the recipes this GPU runs."""
    from lightning_moe.precision import _te
    from lightning_moe.precision.recipes import FP8Recipe

    recipes = {name: FP8Recipe.of(name) for name in ("tensorwise", "delayed", "blockwise")}
    return {name: _te.te_recipe(r) for name, r in recipes.items() if _te.supports(r)[0]}


def dense_case(c: dict, iters: int) -> dict:
    from lightning_moe.precision.gemm import fp8_linear

    m, k, n = c["M"], c["K"], c["N"]
    flops = 3 * 2 * m * k * n
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") / k**0.5).requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = {}
    bf16 = lambda: F.linear(x, w.to(torch.bfloat16))  # noqa: E731
    reference = _run(bf16, [x, w], dy)
    out["bf16"] = _measure("bf16", bf16, [x, w], dy, None, flops, iters)
    from lightning_moe.precision.recipes import FP8Recipe

    # tensorwise: TE's default hybrid format (E5M2 gradients, ~6% error on dx / dw);
    # tensorwise-e4m3: E4M3 everywhere (the rowwise recipe's format too).
    recipes = {"tensorwise": "tensorwise", "tensorwise-e4m3": FP8Recipe("tensorwise", fmt="e4m3"), "rowwise": "rowwise"}
    for label, recipe in recipes.items():
        fn = lambda r=recipe: fp8_linear(x, w, r, backend="torch")  # noqa: E731
        out[f"torch/{label}"] = _measure(f"torch/{label}", fn, [x, w], dy, reference, flops, iters)
    te = _te_module()
    if te is not None:
        layer = te.Linear(k, n, bias=False, params_dtype=torch.float32, device="cuda")
        with torch.no_grad():
            layer.weight.copy_(w)
        for name, recipe in _te_recipes().items():

            def fn(recipe=recipe):
                with torch.autocast("cuda", dtype=torch.bfloat16), te.autocast(enabled=True, recipe=recipe):
                    return layer(x)

            out[f"te/{name}"] = _measure(f"te/{name}", fn, [x, layer.weight], dy, reference, flops, iters)
    return out


def grouped_case(c: dict, iters: int) -> dict:
    from lightning_moe.nn._te import te_grouped_linear
    from lightning_moe.precision.gemm import fp8_grouped_mm

    te_modules: dict = {}  # one te.GroupedLinear per recipe (TE modules keep FP8 state)

    e, m, k, n = c["E"], c["M"], c["K"], c["N"]
    flops = 3 * 2 * m * k * n
    sizes = [m // e] * e  # balanced groups, multiples of 16
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, k, n, device="cuda") / k**0.5).requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = {}
    bf16 = lambda: torch._grouped_mm(x, w.to(torch.bfloat16), offs=offsets)  # noqa: E731
    reference = _run(bf16, [x, w], dy)
    out["bf16"] = _measure("bf16", bf16, [x, w], dy, None, flops, iters)
    fn = lambda: fp8_grouped_mm(x, w, offsets, "rowwise", backend="torch")  # noqa: E731
    out["torch/rowwise"] = _measure("torch/rowwise", fn, [x, w], dy, reference, flops, iters)
    te = _te_module()
    if te is not None:
        bf16_te = lambda: te_grouped_linear(x, w, sizes, te_modules, "bf16")  # noqa: E731
        out["te/bf16"] = _measure("te/bf16", bf16_te, [x, w], dy, reference, flops, iters)
        for name, recipe in _te_recipes().items():

            def fn(recipe=recipe, name=name):
                with te.autocast(enabled=True, recipe=recipe):
                    return te_grouped_linear(x, w, sizes, te_modules, name)

            out[f"te/{name}"] = _measure(f"te/{name}", fn, [x, w], dy, reference, flops, iters)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tag", default="fp8_gemm", help="results file name")
    parser.add_argument("--cases", nargs="+", default=list(DENSE) + list(GROUPED), choices=list(DENSE) + list(GROUPED))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm.py needs a CUDA GPU")
    torch.manual_seed(0)
    results = {}
    for name in args.cases:
        print(name, flush=True)
        try:
            results[name] = dense_case(DENSE[name], args.iters) if name in DENSE else grouped_case(GROUPED[name], args.iters)
        except Exception as err:  # noqa: BLE001 - one failing backend must not hide the others' numbers
            print(f"  failed: {err!r}", flush=True)
            results[name] = {"error": repr(err)}
        torch.cuda.empty_cache()
    write_results(args.tag, {"results": results})


if __name__ == "__main__":
    main()
