"""Launch configurations of the fused FP8 quantizers, timed on the MoE block's operand shapes.

    python benchmarks/fp8_quant_tune.py           # rowwise and group-column kernels
    python benchmarks/fp8_quant_tune.py --dual    # the dual quantizer's two kernels
    python benchmarks/fp8_quant_tune.py --delayed # the delayed-scaling cast
    python benchmarks/fp8_quant_tune.py --delayed-variants  # its tile, amax and grid-order variants
    python benchmarks/fp8_quant_tune.py --delayed-fused  # its plain, gathered and SwiGLU operands, per TILE_SHAPES
    python benchmarks/fp8_quant_tune.py --delayed-fused --registers  # with the amax fold and register caps
    python benchmarks/fp8_quant_tune.py --delayed-fused --registers --models qwen3  # one benchmark shape

Prints GB/s (bytes read once + bytes written) per (kernel, shape, config), best first, and
writes ``benchmarks/results/fp8_quant_tune.json`` (``--dual``: ``fp8_quant_tune_dual.json``; the
run after the stores were vectorized is kept as ``fp8_quant_tune_dual_vec.json``; ``--delayed``:
``fp8_quant_tune_delayed.json``; ``--delayed-variants``: ``fp8_quant_tune_delayed_variants.json``,
both copies of every operand the FP8 block casts, each variant checked byte for byte against the
first); the defaults in ``lightning_moe/kernels/fp8_quant_triton.py`` and
``fp8_delayed_triton.py`` come from it.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Optional

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import cuda_time_ms, write_results  # noqa: E402
from lightning_moe.kernels import fp8_quant_triton as fq  # noqa: E402

# name: groups, rows per group, columns (bf16 input)
GROUP_COLUMN = {
    "mixtral_w1_fprop": (8, 4096, 28672),
    "mixtral_dh1_wgrad": (8, 4096, 28672),
    "mixtral_h_wgrad": (8, 2048, 14336),
    "qwen3_x_wgrad": (128, 1024, 2048),
    "qwen3_w1_fprop": (128, 2048, 1536),
}
ROWWISE = {"mixtral_w1_dgrad": (8 * 4096, 28672), "mixtral_h": (16384, 14336), "qwen3_x": (131072, 2048)}
# the dual quantizer (rowwise + group columns): name -> groups, rows per group, columns
DUAL = {"mixtral_w1": (8, 4096, 28672), "mixtral_dh1": (8, 2048, 28672), "qwen3_x": (128, 1024, 2048)}


def tune_dual() -> dict:
    """Amax and cast kernels of `dual_quantize` timed apart: GB/s over one read (amax) and one
    read plus two float8 writes (cast)."""
    out = {}
    for name, (groups, rows, cols) in DUAL.items():
        x = torch.randn(groups * rows, cols, device="cuda", dtype=torch.bfloat16)
        total = groups * rows
        offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        row_amax = torch.zeros(total, device="cuda")
        col_amax = torch.empty(groups, cols, device="cuda")
        q_row = torch.empty(total, cols, dtype=torch.float8_e4m3fn, device="cuda")
        q_col = torch.empty(cols, total, dtype=torch.float8_e4m3fn, device="cuda")
        s_row, s_col = torch.empty(total, device="cuda"), torch.empty(groups, cols, device="cuda")
        rows_out = []
        for br, bc, warps in itertools.product((64, 128, 256), (32, 64, 128, 256), (4, 8)):
            grid = (groups + 1, triton.cdiv(cols, bc))

            def amax():
                fq._dual_amax_kernel[grid](x, offsets, row_amax, col_amax, total, cols, groups,
                                           BR=br, BC=bc, num_warps=warps)

            def cast():
                fq._dual_cast_kernel[grid](x, offsets, row_amax, col_amax, q_row, s_row, q_col, s_col, total, cols,
                                           groups, total, 0, BR=br, BC=bc, num_warps=warps)
            row = {"BR": br, "BC": bc, "warps": warps}
            try:
                row["amax_ms"], _ = cuda_time_ms(amax, warmup=2, iters=5)
                row["cast_ms"], _ = cuda_time_ms(cast, warmup=2, iters=5)
            except Exception as error:  # a config that does not compile (registers, shared memory)
                row["error"] = str(error)[:100]
                rows_out.append(row)
                continue
            row["amax_gb_s"] = x.numel() * 2 / row["amax_ms"] / 1e6
            row["cast_gb_s"] = x.numel() * 4 / row["cast_ms"] / 1e6
            rows_out.append(row)
        ok = [r for r in rows_out if "error" not in r]
        out[name] = {"amax_best": sorted(ok, key=lambda r: r["amax_ms"])[:5],
                     "cast_best": sorted(ok, key=lambda r: r["cast_ms"])[:5], "all": rows_out}
        print(name, "amax", [(r["BR"], r["BC"], r["warps"], round(r["amax_gb_s"])) for r in out[name]["amax_best"][:3]],
              "cast", [(r["BR"], r["BC"], r["warps"], round(r["cast_gb_s"])) for r in out[name]["cast_best"][:3]],
              flush=True)
    return out


def _timed(row: dict, launch, iters: int = 5) -> bool:
    """``row["ms"]`` = median time of ``launch`` over ``iters`` runs; False, with ``row["error"]``,
    for a launch configuration that does not compile (registers, shared memory). With more than 5
    runs, 10 warm-up runs first: in the s29 sweep the first launch of each kind, timed after 2, ran
    15-40% slower than in s28's sweep, where it was not first (the GPU idles while each launch
    compiles)."""
    try:
        row["ms"], _ = cuda_time_ms(launch, warmup=2 if iters <= 5 else 10, iters=iters)
    except Exception as error:
        row["error"] = str(error)[:100]
        return False
    return True


def _check_and_rate(row: dict, outputs: list, reference: Optional[list], nbytes: float) -> list:
    """``row["bytes_equal"]`` (``outputs`` against ``reference``, the first timed configuration's,
    which this returns, taking ``outputs`` when there is none yet) and ``row["gb_s"]``."""
    if reference is None:
        reference = [t.clone() for t in outputs]
    row["bytes_equal"] = all(torch.equal(a, b) for a, b in zip(outputs, reference))
    row["gb_s"] = nbytes / row["ms"] / 1e6
    return reference


# the delayed-scaling cast: name -> groups, rows per group, columns, copies written
DELAYED = {"mixtral_w1_fprop": (8, 4096, 28672, "col"), "mixtral_dh1": (8, 2048, 28672, "both"),
           "qwen3_x": (128, 1024, 2048, "both"), "qwen3_w1_fprop": (128, 2048, 1536, "col")}


def tune_delayed() -> dict:
    """The delayed cast kernel (one read; the transposed copy, plus the row copy for "both"):
    GB/s over one read and the float8 writes."""
    from lightning_moe.kernels import fp8_delayed_triton as fd

    out = {}
    for name, (groups, rows, cols, copies) in DELAYED.items():
        total = groups * rows
        x = torch.randn(total, cols, device="cuda", dtype=torch.bfloat16)
        offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        scale = torch.full((groups,), 4.0, device="cuda")
        record = torch.zeros(groups, device="cuda")
        both = copies == "both"
        q_row = torch.empty(total, cols, dtype=torch.float8_e4m3fn, device="cuda")
        s_row = torch.empty(total, device="cuda")
        q_col = torch.empty(cols, total, dtype=torch.float8_e4m3fn, device="cuda")
        s_col = torch.empty(groups, cols, device="cuda")
        nbytes = x.numel() * (4 if both else 3)
        rows_out = []
        for br, bc, warps in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
            grid = (groups + 1 if both else groups, triton.cdiv(cols, bc))

            def cast():
                fd._delayed_cast_kernel[grid](x, offsets, scale, q_row, s_row, q_col, s_col, record, total,
                                              cols, groups, total, 0, record, 0, record, record, WRITE_ROW=both,
                                              WRITE_COL=True, RECORD=True, SWIGLU=False, BR=br, BC=bc,
                                              num_warps=warps)
            row = {"BR": br, "BC": bc, "warps": warps}
            rows_out.append(row)
            if _timed(row, cast):
                row["gb_s"] = nbytes / row["ms"] / 1e6
        rows_out.sort(key=lambda r: -r.get("gb_s", 0))
        out[name] = rows_out
        print(name, [(r["BR"], r["BC"], r["warps"], round(r.get("gb_s", 0))) for r in rows_out[:5]], flush=True)
    return out


# both copies of the FP8 block's operands: name -> groups, rows per group, columns. Weights are
# ``[E*K, N]`` with one group per expert (both layouts in one read); activations and gradients
# are token groups.
DELAYED_BOTH = {
    "mixtral_w1": (8, 4096, 28672), "mixtral_w2": (8, 14336, 4096), "mixtral_dh1": (8, 2048, 28672),
    "qwen3_x": (128, 1024, 2048), "qwen3_w1": (128, 2048, 1536), "qwen3_dh1": (128, 1024, 1536),
    "deepseek_w1": (32, 7168, 4096),
}


def tune_delayed_variants() -> dict:
    """`_delayed_cast_kernel` writing both copies, per (tile, warps, grid order): GB/s
    over one bf16 read and two float8 writes, beside a bf16 copy of the same tensor (read 2 +
    write 2 bytes per element, the bandwidth a streaming kernel reaches). Every variant's bytes
    must equal the first configuration's (the former launch shape). Groups here are 16-row
    aligned and all have a history scale, so the head / tail tiles and the missing-amax pass
    are not timed.

    The first three sweeps are kept as ``fp8_quant_tune_delayed_variants_{transpose_stages,amax2d,
    grid_order}.json``: explicitly transposed tiles and 3-stage loop pipelining (no gain), the 2-D
    amax (kept), the grid order (column blocks fastest, kept); the kernel options they compared
    were removed since, the last with the next tile's prefetch (fp8_cast_tma_tune_s20f.json), so
    this sweep now runs the prefetching kernel's tiles, warps and grid order."""
    from lightning_moe.kernels import fp8_delayed_triton as fd

    out = {}
    # (BR, BC, warps, group_axis); the first is the library's launch and the reference.
    configs = [(128, 64, 4, 1)] + [
        (br, bc, warps, group_axis)
        for group_axis in (0, 1)
        for (br, bc) in ((64, 128), (32, 128), (64, 64), (128, 128), (128, 64))
        for warps in (4, 8)
        if (br, bc, warps, group_axis) != (128, 64, 4, 1)]
    keys = ("BR", "BC", "warps", "group_axis")

    def cast_fn(x, offsets, scale, groups, config, write_row=True, write_col=True):
        """(launch, outputs) of one configuration on fresh output buffers."""
        br, bc, warps, group_axis = config
        total, cols = x.shape
        q_row = torch.empty(total, cols, dtype=torch.float8_e4m3fn, device="cuda")
        q_col = torch.empty(cols, total, dtype=torch.float8_e4m3fn, device="cuda")
        s_row, s_col = torch.empty(total, device="cuda"), torch.empty(groups, cols, device="cuda")
        record = torch.zeros(groups, device="cuda")
        grid = (groups + 1, triton.cdiv(cols, bc))[::-1 if group_axis else 1]

        def launch():
            fd._delayed_cast_kernel[grid](x, offsets, scale, q_row, s_row, q_col, s_col, record, total,
                                          cols, groups, total, 0, record, 0, record, record,
                                          WRITE_ROW=write_row,
                                          WRITE_COL=write_col,
                                          RECORD=True, SWIGLU=False, BR=br, BC=bc, GROUP_AXIS=group_axis,
                                          num_warps=warps)
        return launch, [q_row.view(torch.uint8), q_col.view(torch.uint8), s_row, s_col, record]

    for name, (groups, rows, cols) in DELAYED_BOTH.items():
        total = groups * rows
        x = torch.randn(total, cols, device="cuda", dtype=torch.bfloat16)
        offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        scale = torch.full((groups,), 4.0, device="cuda")
        nbytes = x.numel() * 4
        copy_out = torch.empty_like(x)
        copy_ms, _ = cuda_time_ms(lambda: copy_out.copy_(x), warmup=2, iters=5)
        reference = None
        rows_out = []
        for config in configs:
            launch, outputs = cast_fn(x, offsets, scale, groups, config)
            row = dict(zip(keys, config))
            rows_out.append(row)
            if not _timed(row, launch):
                continue
            reference = _check_and_rate(row, outputs, reference, nbytes)
        rows_out.sort(key=lambda r: -r.get("gb_s", 0))
        # Which store costs: one copy at a time (GB/s over 3 bytes per element), best config's tile.
        best = next(r for r in rows_out if r.get("bytes_equal"))
        one_copy = {}
        for copy in ("row", "col"):
            launch, _ = cast_fn(x, offsets, scale, groups, tuple(best[k] for k in keys),
                                write_row=copy == "row", write_col=copy == "col")
            ms, _ = cuda_time_ms(launch, warmup=2, iters=5)
            one_copy[copy] = x.numel() * 3 / ms / 1e6
        out[name] = {"bf16_copy_gb_s": nbytes / copy_ms / 1e6, "one_copy_gb_s": one_copy, "configs": rows_out}
        print(name, "copy", round(out[name]["bf16_copy_gb_s"]), "one copy", {k: round(v) for k, v in one_copy.items()},
              [tuple(r[k] for k in keys) + (round(r.get("gb_s", 0)), r.get("bytes_equal")) for r in rows_out[:6]],
              "baseline:", [round(r["gb_s"]) for r in rows_out
                            if tuple(r[k] for k in keys) == configs[0] and "gb_s" in r],
              "errors:", [(r["BR"], r["BC"], r["warps"], r["error"][:40]) for r in rows_out if "error" in r],
              "not equal:", [tuple(r[k] for k in keys) for r in rows_out if r.get("bytes_equal") is False], flush=True)
    return out


# The delayed cast's operand kinds as the FP8 block casts them, per benchmark shape (experts x rows
# per expert, hidden D, FFN F, tokens): "plain" fc2's output gradient [R, D]; "gather" fc1's input
# read through the permutation from the tokens [T, D]; "swiglu" fc2's input computed from fc1's
# output [R, 2F] with the routing probabilities (the weighted SwiGLU). Each writes the row copy and
# the transposed copy in the weight gradient's aligned layout, as the block does.
FUSED_SHAPES = {
    "qwen3": dict(groups=128, rows=1024, D=2048, F=768, tokens=16384),
    "mixtral": dict(groups=8, rows=2048, D=4096, F=14336, tokens=8192),
    "deepseek": dict(groups=32, rows=2048, D=7168, F=2048, tokens=8192),
}
# Launch shapes (rows, columns, warps) tried; outputs are checked against the first's.
# `cast_registers.py` compiles the same.
FUSED_CONFIGS = [(128, 64, 4), (128, 64, 8), (64, 64, 4), (64, 64, 8), (64, 32, 4), (64, 32, 8), (32, 64, 4),
                 (128, 32, 4), (128, 32, 8), (64, 128, 4), (64, 128, 8), (32, 128, 4)]
# --registers: launch shapes with the register options per kind, (rows, columns, warps, amax accumulator
# rows, register cap; 0 = off) (`fp8_delayed_triton.AMAX_FOLD_ROWS` / `MAX_REGISTERS`), s28's library launch
# first (the bytes' reference); s29 made the SwiGLU kinds' 64 x 32 x 8 capped launches below the library's.
# ptxas takes up to 255 registers per thread wherever it may, which holds a 4-warp cast to two programs
# per multiprocessor (Nsight Compute: 12% occupancy, latency bound); a cap buys programs at the price of
# spills. The capped rows are those offline compiles (`cast_registers.py`, s29) leave with at most ~250
# bytes spilled per thread at more resident warps than the library's launch (warps per multiprocessor in
# the comments: 65,536 registers / (cap x threads), rounded down, x warps).
REGISTER_CONFIGS: dict[str, list[tuple[int, int, int, int, int]]] = {
    # plain and gathered: the s29 sweep's small tiles all folded their amax onto 16 rows, which costs them a
    # layout conversion (1.5-2.7 ms at qwen3); unfolded, and with the amax by `max.f32` (c27bd67), offline
    # compiles put them at 63-100 registers with at most 8 bytes spilled (128 x 64 x 8 capped: 44)
    "plain": [(64, 128, 4, 16, 0),  # library: 255 registers (132 bytes spilled), 8 warps
              (64, 64, 8, 0, 0), (32, 64, 8, 0, 0), (128, 64, 8, 0, 128),  # 16 warps
              (64, 32, 4, 0, 0),  # 20
              (32, 32, 4, 0, 80), (32, 64, 8, 0, 80),  # 24
              (64, 32, 8, 0, 80)],  # 32
    "swiglu": [(64, 32, 4, 0, 0),  # s28's library launch: 128 registers, 16 warps
               (64, 64, 8, 0, 128), (64, 32, 8, 0, 0),  # 16
               (32, 32, 4, 0, 96),  # 20
               (64, 32, 8, 0, 80), (32, 64, 8, 0, 80), (32, 32, 4, 0, 80), (64, 64, 8, 0, 80),  # 24
               (64, 32, 8, 0, 64), (32, 64, 8, 0, 64), (32, 32, 4, 0, 64)],  # 32
    "swiglu_grad": [(32, 64, 4, 0, 0),  # s28's library launch: 255 registers, 328 bytes spilled, 8 warps
                    (64, 32, 8, 0, 128), (32, 32, 4, 0, 128), (32, 64, 8, 0, 128), (64, 64, 8, 0, 128),  # 16
                    (64, 32, 8, 0, 80),  # 24
                    (64, 32, 8, 0, 64)],  # 32
}
REGISTER_CONFIGS["gather"] = REGISTER_CONFIGS["plain"]


def _fused_cases(shape: dict, gen: torch.Generator) -> dict:
    """The four operand kinds of one benchmark shape: ``{kind: (x, cols, bytes moved, kwargs)}``."""
    groups, rows, tokens = shape["groups"], shape["rows"], shape["tokens"]
    total = groups * rows
    # Each expert's rows: a sorted sample of distinct tokens, as the permutation orders them.
    gather_rows = torch.stack([torch.randperm(tokens, device="cuda", generator=gen)[:rows].sort().values
                               for _ in range(groups)]).reshape(-1)
    d, f = shape["D"], shape["F"]
    written = 2 * total  # bytes per column: the two float8 copies
    return {
        "plain": (torch.randn(total, d, device="cuda", dtype=torch.bfloat16), d, (2 * total + written) * d, {}),
        "gather": (torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16), d, (2 * total + written) * d,
                   dict(gather_rows=gather_rows)),
        "swiglu": (torch.randn(total, 2 * f, device="cuda", dtype=torch.bfloat16), f, (4 * total + written) * f,
                   dict(swiglu=True, row_probs=torch.rand(total, device="cuda"))),
        # fc1's output gradient from fc1's output h and fc2's data gradient g (`swiglu_grad_cast_triton`):
        # reads h [R, 2F] and g [R, F] in bf16, writes both float8 copies of [R, 2F]
        "swiglu_grad": (torch.randn(total, 2 * f, device="cuda", dtype=torch.bfloat16), 2 * f,
                        (6 * total + 2 * written) * f,
                        dict(g=torch.randn(total, f, device="cuda", dtype=torch.bfloat16),
                             row_probs=torch.rand(total, device="cuda"))),
    }


def tune_delayed_fused(kinds: Optional[list[str]] = None, configs: Optional[dict[str, list]] = None,
                       models: Optional[list[str]] = None, iters: int = 5) -> dict:
    """`delayed_cast` on its plain, gathered and SwiGLU operands (and `delayed_swiglu_grad_cast`,
    kind "swiglu_grad"; ``kinds``: these alone) per launch shape
    (`fp8_delayed_triton.TILE_SHAPES`) at each of `FUSED_SHAPES`: GB/s over the bytes read (fc2's
    output gradient, the gathered token rows, or fc1's output and the probabilities) and the two
    float8 copies written. Every shape's outputs must equal those of the first launch tried (128 x 64
    x 4 warps; with ``configs``, ``{kind: [(rows, cols, warps, amax rows, register cap), ...]}``, the
    first of the kind's list). Keys: ``<model>_<kind>``."""
    from lightning_moe.kernels import fp8_delayed_triton as fd
    from lightning_moe.kernels.swiglu_grad_cast_triton import delayed_swiglu_grad_cast

    default = dict(fd.TILE_SHAPES)
    default_folds, default_caps = dict(fd.AMAX_FOLD_ROWS), dict(fd.MAX_REGISTERS)
    gen = torch.Generator("cuda").manual_seed(0)
    out = {}
    try:
        for model, shape in FUSED_SHAPES.items():
            if models and model not in models:
                continue
            groups = shape["groups"]
            total = groups * shape["rows"]
            offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * shape["rows"]
            scale = torch.full((groups,), 4.0, device="cuda")
            for kind, (x, cols, nbytes, kwargs) in _fused_cases(shape, gen).items():
                if kinds and kind not in kinds:
                    continue
                reference, rows_out = None, []
                for config in (configs or {}).get(kind, FUSED_CONFIGS):
                    fd.TILE_SHAPES[kind] = config[:3]
                    # a bare (rows, columns, warps): the library's fold and cap at the library's shape, neither
                    # elsewhere
                    library_shape = tuple(config[:3]) == tuple(default[kind])
                    fd.AMAX_FOLD_ROWS[kind] = config[3] if len(config) > 3 else \
                        default_folds.get(kind, 0) if library_shape else 0
                    fd.MAX_REGISTERS[kind] = config[4] if len(config) > 4 else \
                        default_caps.get(kind, 0) if library_shape else 0
                    q_col = torch.empty(cols, total, dtype=torch.float8_e4m3fn, device="cuda")
                    record = torch.zeros(groups, device="cuda")
                    results: list = []

                    def cast():
                        if kind == "swiglu_grad":
                            results[:] = delayed_swiglu_grad_cast(x, kwargs["g"], kwargs["row_probs"], offsets, scale,
                                                                  record, q_col, total, offsets)
                        else:
                            results[:] = fd.delayed_cast(x, offsets, scale, record, out_col=q_col,
                                                         stride_out_col=total, aligned_ends=offsets, **kwargs)

                    row = {"BR": config[0], "BC": config[1], "warps": config[2], "amax_rows": fd.AMAX_FOLD_ROWS[kind],
                           "max_registers": fd.MAX_REGISTERS[kind]}
                    rows_out.append(row)
                    if not _timed(row, cast, iters):
                        continue
                    outputs = [results[0].view(torch.uint8), results[1], q_col.view(torch.uint8), results[2], record]
                    reference = _check_and_rate(row, outputs, reference, nbytes)
                fd.TILE_SHAPES[kind] = default[kind]
                rows_out.sort(key=lambda r: -r.get("gb_s", 0))
                out[f"{model}_{kind}"] = rows_out
                print(model, kind, [(r["BR"], r["BC"], r["warps"], r["amax_rows"], r["max_registers"],
                                     round(r.get("ms", 0), 4), round(r.get("gb_s", 0)), r.get("bytes_equal"))
                                    for r in rows_out], flush=True)
    finally:
        fd.TILE_SHAPES.update(default)
        fd.AMAX_FOLD_ROWS.clear()
        fd.AMAX_FOLD_ROWS.update(default_folds)
        fd.MAX_REGISTERS.clear()
        fd.MAX_REGISTERS.update(default_caps)
    return out


def main() -> None:
    if "--delayed-fused" in sys.argv:
        # --kinds KIND...: those operand kinds alone, written under fp8_quant_tune_delayed_fused_<kinds>
        # --registers: REGISTER_CONFIGS instead, 20 timed runs each (fp8_quant_tune_registers[_<kinds>])
        # --models MODEL...: those benchmark shapes of FUSED_SHAPES alone (default: all)
        def listed(flag: str) -> Optional[list[str]]:
            if flag not in sys.argv:
                return None
            after = sys.argv[sys.argv.index(flag) + 1:]
            return after[:next((i for i, a in enumerate(after) if a.startswith("--")), len(after))]

        kinds, models = listed("--kinds"), listed("--models")
        registers = "--registers" in sys.argv
        name = ("fp8_quant_tune_registers" if registers else "fp8_quant_tune_delayed_fused") + \
            ("_" + "_".join(kinds) if kinds else "") + ("_" + "_".join(models) if models else "")
        results = tune_delayed_fused(kinds, REGISTER_CONFIGS if registers else None, models, 20 if registers else 5)
        write_results(name, {"results": results})
        return
    if "--delayed-variants" in sys.argv:
        write_results("fp8_quant_tune_delayed_variants", {"results": tune_delayed_variants()})
        return
    if "--dual" in sys.argv:
        write_results("fp8_quant_tune_dual", {"results": tune_dual()})
        return
    if "--delayed" in sys.argv:
        write_results("fp8_quant_tune_delayed", {"results": tune_delayed()})
        return
    results = {"group_column": {}, "rowwise": {}}
    for name, (groups, rows, cols) in GROUP_COLUMN.items():
        x = torch.randn(groups * rows, cols, device="cuda", dtype=torch.bfloat16)
        offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows
        out = torch.empty(cols, groups * rows, dtype=torch.float8_e4m3fn, device="cuda")
        scale = torch.empty(groups, cols, device="cuda")
        nbytes = x.numel() * 3
        rows_out = []
        for br, bc, warps in itertools.product((32, 64, 128), (32, 64, 128), (4, 8)):
            def run():
                fq._group_column_kernel[(groups, triton.cdiv(cols, bc))](
                    x, offsets, out, scale, cols, groups * rows, 0, BR=br, BC=bc, num_warps=warps)
            try:
                ms, _ = cuda_time_ms(run, warmup=2, iters=5)
            except Exception as error:  # a config that does not compile (shared memory)
                rows_out.append({"BR": br, "BC": bc, "warps": warps, "error": str(error)[:100]})
                continue
            rows_out.append({"BR": br, "BC": bc, "warps": warps, "ms": ms, "gb_s": nbytes / ms / 1e6})
        rows_out.sort(key=lambda r: -r.get("gb_s", 0))
        results["group_column"][name] = rows_out
        print(name, [(r["BR"], r["BC"], r["warps"], round(r.get("gb_s", 0))) for r in rows_out[:4]], flush=True)
    for name, (rows, cols) in ROWWISE.items():
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(rows, device="cuda")
        nbytes = x.numel() * 3
        rows_out = []
        for bl, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8, 16)):
            def run():
                fq._rowwise_kernel[(rows,)](x, q, s, cols, BL=bl, num_warps=warps)
            ms, _ = cuda_time_ms(run, warmup=2, iters=5)
            rows_out.append({"BL": bl, "warps": warps, "ms": ms, "gb_s": nbytes / ms / 1e6})
        rows_out.sort(key=lambda r: -r["gb_s"])
        results["rowwise"][name] = rows_out
        print(name, [(r["BL"], r["warps"], round(r["gb_s"])) for r in rows_out[:4]], flush=True)
    write_results("fp8_quant_tune", {"results": results})


if __name__ == "__main__":
    main()
