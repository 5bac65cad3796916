"""The FP8 grouped GEMM kernels' default launch shapes (`kernels.fp8_grouped_gemm_triton`) compile
for sm90 without spilling registers to the stack, and their programs per multiprocessor fit its
register file together: compiled ahead of time here (Triton's compiler
and the ptxas it ships run without a GPU) and read with cuobjdump. Split accumulation keeps a second
fp32 tile in registers; a launch shape that spilled ran the split data gradient at 350 TFLOP/s
against 850 without spills on an H100."""

import os
import re
import shutil
import subprocess

import pytest

triton = pytest.importorskip("triton")

from lightning_moe.kernels import fp8_grouped_gemm_triton as kernels  # noqa: E402


def _tools():
    try:
        import triton.backends.nvidia as nvidia
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:  # another Triton layout
        pytest.skip(f"this Triton cannot compile ahead of time here: {error}")
    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump beside Triton's ptxas")
    return ASTSource, GPUTarget, cuobjdump


REGISTER_FILE = 65536  # 32-bit registers per sm90 multiprocessor


def _resources(fn, signature: dict, constants: dict, warps: int, stages: int, fp_fusion: bool = True) -> tuple:
    """(stack bytes, registers a thread) of ``fn`` compiled for sm90."""
    ASTSource, GPUTarget, cuobjdump = _tools()
    compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": fp_fusion})
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"lightning_moe_{fn.__name__}_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.remove(path)
    stack, registers = re.search(r"STACK:(\d+)", usage), re.search(r"REG:(\d+)", usage)
    assert stack is not None and registers is not None, usage
    return int(stack.group(1)), int(registers.group(1))


def _fits(tiles: tuple, resources: tuple) -> bool:
    """No stack, and the table's programs per multiprocessor fit its register file together."""
    stack, registers = resources
    warps, per_multiprocessor = tiles[3], tiles[5]
    return stack == 0 and registers * warps * 32 * per_multiprocessor <= REGISTER_FILE


def _fprop(tiles: tuple, precise: bool, k: int = 4096) -> tuple:
    bm, bn, bk, warps, stages, _ = tiles
    stages = stages if stages is not None else (4 if k < 2048 else 3)  # the wrapper's rule
    signature = {"a_desc": f"tensordesc<fp8e4nv[{bm},{bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn},{bk}]>",
                 "out_ptr": "*bf16", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "ends_ptr": "*i32",
                 "E": "i32", "R": "i32", "N_OUT": "i32", "stride_out": "i32"}
    constants = {"K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_E": 8, "NUM_PROGRAMS": 132,
                 "NUM_STAGES": stages, "FLATTEN": True, "WARP_SPECIALIZE": False, "PRECISE": precise}
    signature.update({name: "constexpr" for name in constants})
    return _resources(kernels._grouped_fprop_kernel, signature, constants, warps, stages)


def _wgrad(tiles: tuple, precise: bool, fp32_accumulate: bool, prefetch_old: bool = False) -> tuple:
    bm, bn, bk, warps, stages, _ = tiles
    dtype = "fp32" if fp32_accumulate else "bf16"
    halves = not (kernels.WGRAD_FP32_STORE_WHOLE and fp32_accumulate)  # the wrapper's default
    signature = {"a_desc": f"tensordesc<fp8e4nv[{bm},{bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn},{bk}]>",
                 "out_ptr": f"*{dtype}", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32", "ends_ptr": "*i32",
                 "E": "i32", "M": "i32", "N": "i32", "out_desc": f"tensordesc<{dtype}[1,{bm},{bn // 2 if halves else bn}]>"}
    constants = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "NUM_PROGRAMS": 132, "NUM_STAGES": stages,
                 "TMA_STORE": True, "FLATTEN": True, "WARP_SPECIALIZE": False, "PRECISE": precise,
                 "ACCUMULATE": fp32_accumulate, "TMA_REDUCE": fp32_accumulate and kernels.TMA_REDUCE,
                 "PREFETCH_OLD": prefetch_old, "STORE_HALVES": halves,
                 "COLUMNS_FIRST": kernels.WGRAD_COLUMNS_FIRST}
    signature.update({name: "constexpr" for name in constants})
    # the accumulating epilogue compiles without fused multiply-adds (`grouped_mm_wgrad`)
    return _resources(kernels._grouped_wgrad_kernel, signature, constants, warps, stages,
                      fp_fusion=not fp32_accumulate)


def test_the_default_forward_launch_shapes_do_not_spill():
    assert _fits(kernels.FPROP_TILES, _fprop(kernels.FPROP_TILES, precise=False))
    assert _fits(kernels.FPROP_PRECISE_TILES, _fprop(kernels.FPROP_PRECISE_TILES, precise=True))
    # the check sees a spill: the fast path's tile under split accumulation
    assert not _fits(kernels.FPROP_TILES, _fprop(kernels.FPROP_TILES, precise=True))


def test_the_default_weight_gradient_launch_shape_for_fp32_gradients_does_not_spill():
    # the default recipe's weight gradient: split accumulation added into an fp32 .grad, TMA stores
    wide = kernels.WGRAD_FP32_OR_PRECISE_TILES
    assert _fits(wide, _wgrad(wide, precise=True, fp32_accumulate=True))
    assert _fits(kernels.WGRAD_TILES, _wgrad(kernels.WGRAD_TILES, precise=False, fp32_accumulate=False))
    # the check sees two programs that cannot share a multiprocessor's registers
    assert not _fits(wide[:5] + (2,), _wgrad(wide, precise=True, fp32_accumulate=True))
    # `WGRAD_PREFETCH_OLD` (the default): the old values' registers held through the contraction fit too
    assert _fits(wide, _wgrad(wide, precise=True, fp32_accumulate=True, prefetch_old=True))


def test_stages_not_given_fit_shared_memory_beside_the_epilogues_staging():
    # (block_m, block_n, block_k, warps, stages, programs): stages left to the wrapper's rule, which
    # keeps the operand stages and the epilogue's staging within sm90's 227 KB; programs given, so no
    # device is asked for its multiprocessors
    given = (None, None, None, None, None, 132)
    wide = kernels.WGRAD_FP32_OR_PRECISE_TILES
    # fp32 128 x 128 tiles: 4 stages of 32 KB beside half a tile (32 KB) or a whole one (64 KB)
    assert kernels._launch_shape(given, wide, 4, 0, staged_fraction=0.5)[4] == 4
    assert kernels._launch_shape(given, wide, 4, 0, staged_fraction=1.0)[4] == 4
    # bf16 128 x 256 tiles: a whole tile's 64 KB of staging leaves room for 3 stages of 48 KB, not 4
    assert kernels._launch_shape(given, kernels.WGRAD_TILES, 2, 0, staged_fraction=0.5)[4] == 4
    assert kernels._launch_shape(given, kernels.WGRAD_TILES, 2, 0, staged_fraction=1.0)[4] == 3
    # stages the caller gives are kept (the compiler reports what does not fit)
    assert kernels._launch_shape(given[:4] + (4, 132), kernels.WGRAD_TILES, 2, 0, staged_fraction=1.0)[4] == 4
