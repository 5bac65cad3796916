"""A delayed dense linear's one-read casts (`native_casts`) on CPU under Triton's interpreter,
against the generic delayed quantizer (`quantize_operand`). Run as a script with
``TRITON_INTERPRET=1``; prints one line per case ending in "equal" and exits non-zero on the first
mismatch.

The interpreter's float8 conversion rounds some values unlike torch's (see `_interpreted_casts.py`),
so bytes are compared with the interpreter's own row cast: the input's both-layout cast
(`dense_input_both_layouts`, in row runs) holds the row cast's bytes and, transposed, zero padding
columns. Scales and the amax history rows equal the generic path's exactly (they depend on amaxes
only), for hybrid (E5M2 gradients) and E4M3, a state with scales and a fresh one (current amaxes),
bf16 and fp32 operands with a NaN and rows not a multiple of 16. On a GPU the training test compares
every byte with the generic path (`test_fp8_delayed_gpu.py`).

And `scaled_mm.DENSE_TRANSPOSED_COPIES` (the input cast in both layouts in the forward, the weight's
transposed copy from the weight cache): the same outputs, gradients and amax records bit for bit as
the backward's transposes over two micro-batches under one cache, the second taking the cached copy
(`test_fp8_dense_transposed_gpu.py` on a GPU); so too with the experiments: the output gradient cast
in both layouts by the tile kernel (`DENSE_GRAD_BOTH_LAYOUTS`, also checked alone against the row
cast, with and without a scale for the gradient) and the one-group casts in row runs
(`fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS`, 600 rows: three runs of 256); and the tiled float8
transposes, the default (`native_gemms.TILED_FP8_TRANSPOSES`, with the copies on and off, and the bytes of
`transpose_bytes` alone at shapes off its tile).
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402


def main() -> None:
    from _triton_on_cpu import force_triton_paths

    force_triton_paths()
    from lightning_moe.kernels import fp8_delayed_triton
    from lightning_moe.precision import FP8Recipe
    from lightning_moe.precision.delayed import SLOTS, DelayedState
    from lightning_moe.precision.native_casts import dense_grad_both_layouts, dense_input_both_layouts, dense_operand
    from lightning_moe.precision.operands import quantize_operand

    def state(fresh: bool) -> DelayedState:
        scale = torch.zeros(3, 1) if fresh else torch.tensor([[40.0], [60.0], [3000.0]])
        return DelayedState(torch.zeros(4, 3, 1), scale, fresh)

    def bytes_of(q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.uint8)

    def check(case: str, ok: bool) -> None:
        print(f"dense {case}: {'equal' if ok else 'differs'}")
        if not ok:
            sys.exit(1)

    torch.manual_seed(0)
    rows, k, n = 600, 128, 64  # over two of the one-group tile cast's 256-row runs, not a multiple of 16
    fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = 256  # the transposed casts in row runs (the experiment)
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in ("hybrid", "e4m3"):
            for fresh in (False, True):
                recipe = FP8Recipe("delayed", fmt=fmt)
                x = (torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
                x[5, 9] = float("nan")
                dy = (torch.randn(rows, n) * 1e-3).to(dtype)
                fast, generic = state(fresh), state(fresh)
                # the forward's cast of the input (records its amax in both)
                q_x, _ = dense_operand(x, recipe, fast, "input", True)
                _, gx, _, _ = quantize_operand(x, recipe, "input", state=generic, native=True)
                # the input in both layouts by the tile kernel (`DENSE_TRANSPOSED_COPIES`' forward cast),
                # recording the same amax again: a max
                q_x2, sx, qx_t = dense_input_both_layouts(x, fast)
                qdy, sdy = dense_operand(dy, recipe, fast, "grad", True)
                _, gdy, _, _ = quantize_operand(dy, recipe, "grad", state=generic, native=True)
                case = f"{str(dtype).replace('torch.', '')} {fmt} {'fresh' if fresh else 'history'}"
                padded = -(-rows // 16) * 16
                check(f"{case} layouts", qx_t.shape == (k, padded) and qx_t.dtype == torch.float8_e4m3fn
                      and torch.equal(bytes_of(q_x2), bytes_of(q_x)))
                check(f"{case} input bytes", torch.equal(bytes_of(qx_t)[:, :rows], bytes_of(q_x).t())
                      and bool((bytes_of(qx_t)[:, rows:] == 0).all()))
                check(f"{case} scales", all(torch.equal(a.reshape(-1)[:1].float(), b.reshape(-1)[:1].float())
                                            and a.numel() == 1 for a, b in ((sdy, gdy), (sx, gx))))
                check(f"{case} amax records", torch.equal(fast.amax_history, generic.amax_history))
                # the gradient in both layouts by the tile kernel (recording the same amax again: a
                # max), in row runs and one program per column block
                for chunk in (256, 0):
                    fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = chunk
                    qdy2, sdy2, qdy2_t = dense_grad_both_layouts(dy, recipe, fast)
                    check(f"{case} gradient both layouts (runs of {chunk})",
                          torch.equal(bytes_of(qdy2), bytes_of(qdy)) and qdy2_t.dtype == qdy.dtype
                          and qdy2_t.shape == (n, padded) and torch.equal(bytes_of(qdy2_t)[:, :rows], bytes_of(qdy).t())
                          and bool((bytes_of(qdy2_t)[:, rows:] == 0).all()) and torch.equal(sdy2, sdy.reshape(-1)[:1])
                          and torch.equal(fast.amax_history, generic.amax_history))
                if not fresh:
                    # a gradient without a scale in a state that has the others: the tile kernel's own
                    # amax (one program per column block) or the pre-pass (row runs), E5M2 under hybrid
                    for chunk in (256, 0):
                        fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = chunk
                        no_grad_scale, row_copy = state(False), state(False)
                        no_grad_scale.scale[SLOTS["grad"]] = 0.0
                        row_copy.scale[SLOTS["grad"]] = 0.0
                        q_both, s_both, q_both_t = dense_grad_both_layouts(dy, recipe, no_grad_scale)
                        q_row, s_rowcopy = dense_operand(dy, recipe, row_copy, "grad", True)
                        check(f"{case} gradient both layouts without its scale (runs of {chunk})",
                              torch.equal(bytes_of(q_both), bytes_of(q_row)) and torch.equal(s_both, s_rowcopy)
                              and torch.equal(bytes_of(q_both_t)[:, :rows], bytes_of(q_row).t())
                              and torch.equal(no_grad_scale.amax_history, row_copy.amax_history))
                fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = 256
    fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = 0

    transposed_copies_train_the_same(check)
    tiled_transposes(check)


def transposed_copies_train_the_same(check) -> None:
    """`scaled_mm.DENSE_TRANSPOSED_COPIES`: the input cast in both layouts in the forward and the
    weight's transposed copy from the weight cache give the same output, gradients and amax records
    as the backward's transposes, over two micro-batches under one cache (the second takes the
    cached copies), for a fresh state and one with scales, hybrid and E4M3; so too with the
    experiments `scaled_mm.DENSE_GRAD_BOTH_LAYOUTS` and `fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS`."""
    from lightning_moe import kernels
    from lightning_moe.kernels import fp8_delayed_triton
    from lightning_moe.precision import FP8Recipe, FP8WeightCache, caching_fp8_weights, native_gemms, scaled_mm
    from lightning_moe.precision.delayed import DelayedState

    from lightning_moe.kernels import transpose_triton

    forced = kernels.use_triton
    accepted = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
    tiled_calls = []
    transpose_bytes = transpose_triton.transpose_bytes

    def counted(*args, **kwargs):
        tiled_calls.append(1)
        return transpose_bytes(*args, **kwargs)

    transpose_triton.transpose_bytes = counted

    def state(fresh: bool) -> DelayedState:
        scale = torch.zeros(3, 1) if fresh else torch.tensor([[40.0], [60.0], [3000.0]])
        return DelayedState(torch.zeros(4, 3, 1), scale, fresh)

    def run(on: bool, fmt: str, fresh: bool, grad_both: bool = False, chunk: int = 0, tiled: bool = False):
        scaled_mm.DENSE_TRANSPOSED_COPIES = on
        scaled_mm.DENSE_GRAD_BOTH_LAYOUTS = grad_both
        fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS = chunk
        native_gemms.TILED_FP8_TRANSPOSES = tiled
        # the interpreter's stand-in for `use_triton` takes float tensors; the transposes are of float8 ones
        kernels.use_triton = (lambda t: t.dtype in accepted) if tiled else forced
        torch.manual_seed(1)
        w = (torch.randn(96, 64) / 8).requires_grad_(True)
        st, cache, seen = state(fresh), FP8WeightCache(), []
        with caching_fp8_weights(cache):
            for rows in (40, 600):  # the second: rows not a multiple of 16, over several 256-row runs
                x = torch.randn(rows, 64, dtype=torch.bfloat16, requires_grad=True)
                y = scaled_mm.scaled_linear(x, w, None, FP8Recipe("delayed", fmt=fmt), st, weight_key="w")
                y.float().square().sum().backward()
                seen += [y.detach(), x.grad]
        return seen + [w.grad, st.amax_history.clone()], cache.hits

    defaults = (scaled_mm.DENSE_TRANSPOSED_COPIES, scaled_mm.DENSE_GRAD_BOTH_LAYOUTS,
                fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS, native_gemms.TILED_FP8_TRANSPOSES)
    try:
        for fmt in ("hybrid", "e4m3"):
            for fresh in (False, True):
                plain, plain_hits = run(False, fmt, fresh)
                for variant, options in (("", {"on": True}),
                                         (" with the gradient's and row runs", {"on": True, "grad_both": True,
                                                                                "chunk": 256}),
                                         (" tiled", {"on": True, "tiled": True}),
                                         (" off, tiled", {"on": False, "tiled": True})):
                    tiled_calls.clear()
                    copies, copies_hits = run(fmt=fmt, fresh=fresh, **options)
                    name = f"transposed copies{variant} {fmt} {'fresh' if fresh else 'history'}"
                    # bits, NaN included (E4M3 gradients past the history's scale overflow to NaN)
                    same = all(torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))
                               for a, b in zip(plain, copies))
                    check(f"{name} train the same", same)
                    # the second micro-batch took the row copy and the transposed copy from the cache
                    check(f"{name} cached", copies_hits == plain_hits + options["on"])
                    if options.get("tiled"):
                        # two micro-batches: with the copies, the weight's once (then cached) and the
                        # gradient's each time; without, the gradient's, the input's and the weight's
                        check(f"{name} took the tiled transposes", len(tiled_calls) == (3 if options["on"] else 6))
    finally:
        (scaled_mm.DENSE_TRANSPOSED_COPIES, scaled_mm.DENSE_GRAD_BOTH_LAYOUTS,
         fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS, native_gemms.TILED_FP8_TRANSPOSES) = defaults
        kernels.use_triton = forced
        transpose_triton.transpose_bytes = transpose_bytes


def tiled_transposes(check) -> None:
    """`kernels.transpose_triton.transpose_bytes`: the bytes of ``q.t().contiguous()``, zero columns
    up to the padding, for shapes off the 128-byte tile and both float8 formats."""
    from lightning_moe.kernels.transpose_triton import transpose_bytes

    torch.manual_seed(2)
    for rows, cols in ((600, 64), (37, 200), (128, 128), (1, 300)):
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8).view(dtype)
            for multiple in (1, 16):
                out = transpose_bytes(q, multiple).view(torch.uint8)
                padded = -(-rows // multiple) * multiple
                ok = (out.shape == (cols, padded) and torch.equal(out[:, :rows], q.view(torch.uint8).t())
                      and bool((out[:, rows:] == 0).all()))
                check(f"tiled transpose {rows}x{cols} {str(dtype).replace('torch.', '')} to {multiple}", ok)


if __name__ == "__main__":
    main()
