"""Variants of the delayed-scaling FP8 cast against ``kernels.fp8_delayed_triton._delayed_cast_kernel``
(pointer loads, one tile in flight per program), all writing both copies of the MoE block's
operands.

The pointer-load kernel reaches 2.5-3.0 TB/s where a bf16 copy of the same tensor reaches
4.0-4.25 (``fp8_quant_tune_delayed_variants_grid_order.json``), and writing one copy alone is no
faster: the reads are the bound, not the transposed store. This measures whether keeping more
tiles in flight per program closes that gap, and whether splitting each group's rows over more
programs helps (groups of uneven size leave a tail of long programs). Each configuration's bytes
are checked against the current kernel's.

s20d / s20e (``fp8_cast_tma_tune_s20d/e.json``) ran both kernels with masks on the groups' own
bounds, which the compiler cannot prove constant over 16-row runs: the transposed stores went
out a byte at a time (0.65-1.08 TB/s, the pointer variant without prefetch included). Here the
bounds are the 16-row multiples the library's kernel uses (`_aligned_body`).

    python benchmarks/fp8_cast_tma_tune.py [--tag s20d]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_pipelined_ms, write_results  # noqa: E402
from lightning_moe.kernels.fp8_quant_triton import _abs_ignoring_nan, _group_bounds  # noqa: E402

# name: groups, rows (split unevenly, +-50%, 16-row aligned), columns
SHAPES = {
    "qwen3_x": (128, 131072, 2048),
    "qwen3_dh1": (128, 131072, 1536),
    "qwen3_w1": (128, 128 * 2048, 1536),  # [E * K, N], one group per expert (even)
}


@triton.jit
def _prefetch_cast_kernel(x_ptr, offsets_ptr, scale_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, record_ptr,
                          R, C, G, stride_qc, BR: tl.constexpr, BC: tl.constexpr, PREFETCH: tl.constexpr,
                          SPLIT: tl.constexpr):
    # Program (column block, group, part): rows [lo, hi) of the group, the part-th of SPLIT runs
    # of whole tiles, by pointer loads; PREFETCH: the next tile's load is issued before this
    # tile is cast (two tiles in flight per program, the next one held in bf16).
    c0 = tl.program_id(0) * BC
    group = tl.program_id(1)
    part = tl.program_id(2)
    cols = c0 + tl.arange(0, BC)
    cmask = cols < C
    in_group = group < G
    start, end = _group_bounds(offsets_ptr, group, G, R)
    scale = tl.load(scale_ptr + group, mask=in_group, other=1.0)
    scale_inv = tl.math.div_rn(1.0, scale)
    # Bounds the compiler can prove multiples of 16 (the groups here are 16-row aligned), so
    # the masks are constant over 16-row runs and the transposed stores go out 16 bytes at a time.
    first = start // 16 * 16
    last = end // 16 * 16
    chunk = tl.cdiv(tl.cdiv(last - first, SPLIT), BR) * BR
    lo = first + part * chunk
    hi = tl.minimum(lo + chunk, last)
    col_scale = tl.zeros_like(cols).to(tl.float32) + scale
    amax = tl.zeros([BR, BC], dtype=tl.float32)
    offs = tl.arange(0, BR)
    rows = lo + offs
    ahead = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                    mask=((rows >= first) & (rows < hi))[:, None] & cmask[None, :], other=0.0)
    for r0 in range(lo, hi, BR):
        rows = r0 + offs
        rmask = (rows >= first) & (rows < hi)
        m = rmask[:, None] & cmask[None, :]
        if PREFETCH:
            x = ahead.to(tl.float32)
            nxt = rows + BR
            ahead = tl.load(x_ptr + nxt[:, None].to(tl.int64) * C + cols[None, :],
                            mask=(nxt < hi)[:, None] & cmask[None, :], other=0.0)
        else:
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(q_row_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], (x * scale).to(tl.float8e4nv), mask=m)
        tl.store(q_col_ptr + cols[None, :].to(tl.int64) * stride_qc + rows[:, None],
                 (x * col_scale[None, :]).to(tl.float8e4nv), mask=m & in_group)
        amax = tl.maximum(amax, _abs_ignoring_nan(x))
    if tl.program_id(0) == 0:
        for r in range(lo, hi, 1024):
            rr = r + tl.arange(0, 1024)
            tl.store(s_row_ptr + rr, tl.zeros([1024], dtype=tl.float32) + scale_inv, mask=(rr < hi) & (rr >= first))
    tl.store(s_col_ptr + group.to(tl.int64) * C + cols, tl.zeros([BC], dtype=tl.float32) + scale_inv,
             mask=cmask & in_group)
    tl.atomic_max(record_ptr + group, tl.max(tl.max(amax, 1), 0), mask=in_group)


@triton.jit
def _tma_cast_kernel(x_desc, offsets_ptr, scale_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, record_ptr,
                     R, C, G, stride_qc, BR: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr,
                     SPLIT: tl.constexpr):
    # Program (column block, group, part): rows [lo, hi) of the group, the part-th of SPLIT
    # runs of whole tiles, read by TMA (rows of the next group come in and are masked).
    c0 = tl.program_id(0) * BC
    group = tl.program_id(1)
    part = tl.program_id(2)
    cols = c0 + tl.arange(0, BC)
    cmask = cols < C
    in_group = group < G
    start, end = _group_bounds(offsets_ptr, group, G, R)
    start, end = start.to(tl.int32), end.to(tl.int32)  # TMA coordinates are 32-bit
    scale = tl.load(scale_ptr + group, mask=in_group, other=1.0)
    scale_inv = tl.math.div_rn(1.0, scale)
    # Bounds the compiler can prove multiples of 16 (the groups here are 16-row aligned), so
    # the masks are constant over 16-row runs and the transposed stores go out 16 bytes at a time.
    first = start // 16 * 16
    last = end // 16 * 16
    chunk = tl.cdiv(tl.cdiv(last - first, SPLIT), BR) * BR
    lo = first + part * chunk
    hi = tl.minimum(lo + chunk, last)
    col_scale = tl.zeros_like(cols).to(tl.float32) + scale
    amax = tl.zeros([BR, BC], dtype=tl.float32)
    for r0 in tl.range(lo, hi, BR, num_stages=STAGES):
        x = x_desc.load([r0, c0]).to(tl.float32)
        rows = r0 + tl.arange(0, BR)
        rmask = (rows >= first) & (rows < hi)
        m = rmask[:, None] & cmask[None, :]
        x = tl.where(m, x, 0.0)
        tl.store(q_row_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], (x * scale).to(tl.float8e4nv), mask=m)
        tl.store(q_col_ptr + cols[None, :].to(tl.int64) * stride_qc + rows[:, None],
                 (x * col_scale[None, :]).to(tl.float8e4nv), mask=m & in_group)
        amax = tl.maximum(amax, _abs_ignoring_nan(x))
    if tl.program_id(0) == 0:
        for r in range(lo, hi, 1024):
            rr = r + tl.arange(0, 1024)
            tl.store(s_row_ptr + rr, tl.zeros([1024], dtype=tl.float32) + scale_inv, mask=(rr < hi) & (rr >= first))
    tl.store(s_col_ptr + group.to(tl.int64) * C + cols, tl.zeros([BC], dtype=tl.float32) + scale_inv,
             mask=cmask & in_group)
    tl.atomic_max(record_ptr + group, tl.max(tl.max(amax, 1), 0), mask=in_group)


def _ends(groups: int, rows: int, even: bool) -> torch.Tensor:
    if even:
        return torch.arange(1, groups + 1, dtype=torch.int32) * (rows // groups)
    g = torch.Generator().manual_seed(0)
    weights = 0.5 + torch.rand(groups, generator=g)
    sizes = (weights / weights.sum() * rows).floor().long() // 16 * 16
    return sizes.cumsum(0).to(torch.int32)


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from lightning_moe.kernels import fp8_delayed_triton as fd

    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    results = {}
    for name, (groups, rows, cols) in SHAPES.items():
        offsets = _ends(groups, rows, even=name.endswith("w1")).cuda()
        total = int(offsets[-1])
        x = torch.randn(total, cols, device="cuda", dtype=torch.bfloat16)
        scale = torch.rand(groups, device="cuda") + 2.0
        nbytes = x.numel() * 4  # bf16 read, two float8 writes

        def outputs():
            return (torch.zeros(total, cols, dtype=torch.float8_e4m3fn, device="cuda"),
                    torch.zeros(total, device="cuda"),
                    torch.zeros(cols, total, dtype=torch.float8_e4m3fn, device="cuda"),
                    torch.zeros(groups, cols, device="cuda"), torch.zeros(groups, device="cuda"))

        ref = outputs()
        cur_amax = torch.zeros(groups + 1, device="cuda")

        def current():
            q_row, s_row, q_col, s_col, record = ref
            fd._delayed_cast_kernel[(triton.cdiv(cols, 128), groups)](
                x, offsets, scale, cur_amax, q_row, s_row, q_col, s_col, record, total, cols, groups, total, 0,
                record, 0, record, WRITE_ROW=True, WRITE_COL=True, RECORD=True, SWIGLU=False, BR=64, BC=128,
                AMAX_2D=True, GROUP_AXIS=1, num_warps=4)

        current()
        copy_out = torch.empty_like(x)
        copy_ms = cuda_time_pipelined_ms(lambda: copy_out.copy_(x), iters=args.iters)
        ms = cuda_time_pipelined_ms(current, iters=args.iters)
        case = {"shape_G_R_C": [groups, total, cols], "bf16_copy_tb_s": x.numel() * 4 / copy_ms / 1e9,
                "current": {"ms": ms, "tb_s": nbytes / ms / 1e9}}
        print(f"{name}: copy {case['bf16_copy_tb_s']:.2f} TB/s, current {ms:.3f} ms {nbytes / ms / 1e9:.2f} TB/s",
              flush=True)
        configs = [("ptr", *c) for c in itertools.product(((32, 128), (64, 128), (128, 64)), (4, 8), (0, 1), (1, 4))]
        configs += [("tma", *c) for c in itertools.product(((64, 128), (128, 64), (128, 128)), (4, 8), (1, 3), (1, 4))]
        for kind, (br, bc), warps, depth, split in configs:
            # depth: the pointer kernel's PREFETCH (0 / 1), the TMA kernel's pipeline stages
            key = f"{kind}_{br}x{bc}_w{warps}_{'prefetch' if kind == 'ptr' else 'stages'}{depth}_split{split}"
            got = outputs()
            desc = TensorDescriptor(x, [total, cols], [cols, 1], [br, bc]) if kind == "tma" else None

            def ours():
                q_row, s_row, q_col, s_col, record = got
                grid = (triton.cdiv(cols, bc), groups, split)
                if kind == "ptr":
                    _prefetch_cast_kernel[grid](x, offsets, scale, q_row, s_row, q_col, s_col, record, total, cols,
                                                groups, total, BR=br, BC=bc, PREFETCH=depth, SPLIT=split,
                                                num_warps=warps)
                else:
                    _tma_cast_kernel[grid](desc, offsets, scale, q_row, s_row, q_col, s_col, record, total, cols,
                                           groups, total, BR=br, BC=bc, STAGES=depth, SPLIT=split, num_warps=warps)

            try:
                ours()
                same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                           for a, b in zip(got, ref))
                ms = cuda_time_pipelined_ms(ours, iters=args.iters)
            except Exception as exc:  # a configuration the compiler refuses (shared memory, registers)
                case[key] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                continue
            case[key] = {"ms": ms, "tb_s": nbytes / ms / 1e9, "bytes_equal": same}
        best = sorted((k for k in case if isinstance(case[k], dict) and "tb_s" in case[k] and k != "current"),
                      key=lambda k: case[k]["ms"])[:6]
        print("  best:", [(k, round(case[k]["tb_s"], 2), case[k]["bytes_equal"]) for k in best], flush=True)
        print("  errors:", [k for k in case if isinstance(case[k], dict) and "error" in case[k]][:6], flush=True)
        results[name] = case
    write_results("fp8_cast_tma_tune" + (f"_{args.tag}" if args.tag else ""), {"cases": results})


if __name__ == "__main__":
    main()
