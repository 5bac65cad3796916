"""The FP8 weight-gradient kernel (`kernels.fp8_grouped_gemm_triton.grouped_mm_wgrad`) run on CPU
under Triton's interpreter: its tiles stored by TMA (``tma_store=True``) against the plain masked
stores and with split accumulation, in bf16 and fp32, with an expert without tokens and ``M``, ``N`` no multiples of the tile
(the descriptor must clip each tile at its expert's rows and the output's columns); and the fp32
gradient added into an existing one by the kernel (``accumulate_into``) over three micro-batches
against the plain outputs added as autograd adds them, bit for bit (also with the old values loaded
before each tile's contraction, ``prefetch_old``, the tile stored whole, ``store_halves=False``, and
an expert's tiles dealt along the rows first, ``columns_first``). Run as a
script with ``TRITON_INTERPRET=1`` (see `_interpreted_casts.py`); prints one line per case and
exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from lightning_moe.kernels import fp8_grouped_gemm_triton as kernels  # noqa: E402


def check(m: int, n: int, out_dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(m * n)
    aligned_ends = torch.tensor([128, 128, 384], dtype=torch.int32)  # the second expert has no tokens
    a = torch.randn(m, 384, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, 384, generator=gen).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(3, m, generator=gen) + 0.5, torch.rand(3, n, generator=gen) + 0.5
    outs = [kernels.grouped_mm_wgrad(a, sa, b, sb, aligned_ends, block_m=32, block_n=64, block_k=128, num_warps=4,
                                     num_stages=2, programs=3, out_dtype=out_dtype, tma_store=tma)
            for tma in (False, True)]
    # Split accumulation (the recipe's default for weight gradients) takes the same tiles; the
    # interpreter sums in fp32 either way, so the bits match.
    outs.append(kernels.grouped_mm_wgrad(a, sa, b, sb, aligned_ends, block_m=32, block_n=64, block_k=128,
                                         num_warps=4, num_stages=2, programs=3, out_dtype=out_dtype, precise=True))
    return torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]) and bool((outs[1][1] == 0).all())


def check_accumulate(m: int, n: int, tma: bool, precise: bool, prefetch_old: bool = False,
                     store_halves: bool = True, columns_first: bool = False) -> bool:
    """Three micro-batches' weight gradients added by the kernel into an fp32 ``.grad``
    (``accumulate_into``, beta = 1) against the plain fp32 outputs added as autograd's
    ``AccumulateGrad`` adds them (the first taken as it is, then ``grad += dw``): uneven groups, an
    expert without tokens in each micro-batch, a different one each time."""
    gen = torch.Generator().manual_seed(7 * m + n)
    layouts = [[128, 128, 384], [256, 384, 384], [0, 256, 512]]  # aligned ends: an empty expert in each
    micro = []
    for ends in layouts:
        r = ends[-1]
        a = (torch.randn(m, r, generator=gen) * 4).to(torch.float8_e4m3fn)
        b = (torch.randn(n, r, generator=gen) * 4).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(3, m, generator=gen) + 0.5, torch.rand(3, n, generator=gen) + 0.5
        micro.append((a, sa, b, sb, torch.tensor(ends, dtype=torch.int32)))
    options = dict(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=2, programs=3,
                   out_dtype=torch.float32, tma_store=tma, precise=precise)
    unfused = None
    for a, sa, b, sb, ends in micro:
        dw = kernels.grouped_mm_wgrad(a, sa, b, sb, ends, **options)
        unfused = dw if unfused is None else unfused.add_(dw)
    first = micro[0]
    fused = kernels.grouped_mm_wgrad(*first, store_halves=store_halves, columns_first=columns_first, **options)
    for a, sa, b, sb, ends in micro[1:]:
        out = kernels.grouped_mm_wgrad(a, sa, b, sb, ends, accumulate_into=fused, prefetch_old=prefetch_old,
                                       store_halves=store_halves, columns_first=columns_first, **options)
        assert out is fused
    return torch.equal(fused.view(torch.int32), unfused.view(torch.int32))


def main() -> None:
    for m, n, dtype in [(64, 96, torch.bfloat16), (48, 96, torch.float32), (40, 72, torch.bfloat16)]:
        same = check(m, n, dtype)
        print("wgrad tma", m, n, dtype, "equal" if same else "DIFFERENT", flush=True)
        if not same:
            sys.exit(1)
    # (m, n, tma, precise, prefetch_old, store_halves, columns_first); the last two: the whole tile
    # stored through one staging buffer, and an expert's tiles dealt along the rows first
    for m, n, tma, precise, prefetch, halves, columns in [
            (48, 96, False, False, False, True, False), (40, 72, False, True, False, True, False),
            (48, 96, True, True, False, True, False), (40, 72, True, True, True, True, False),
            (48, 96, False, False, True, True, False), (40, 72, True, True, True, False, False),
            (48, 96, True, True, True, False, True)]:
        same = check_accumulate(m, n, tma, precise, prefetch, halves, columns)
        print("wgrad accumulate", m, n, f"tma={tma}", f"precise={precise}", f"prefetch_old={prefetch}",
              f"store_halves={halves}", f"columns_first={columns}", "equal" if same else "DIFFERENT", flush=True)
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
