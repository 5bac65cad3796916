"""The delayed-scaling cast kernels and the float8 byte transpose compile for sm90: the E5M2 and
row-run variants and the main others. Triton's interpreter (the CPU tests' path) runs Python, not the
compiler, and accepts code the compiler refuses (two ``return`` statements of different float8 types
under a constexpr branch passed the interpreter and failed to compile on the GPU). Compiled ahead of
time here: Triton's compiler runs without a GPU."""

import pytest

triton = pytest.importorskip("triton")

from lightning_moe.kernels import fp8_delayed_triton as fd  # noqa: E402

ARG_TYPES = dict(x_ptr="*bf16", offsets_ptr="*i32", scale_ptr="*fp32", q_row_ptr="*fp8e4nv", s_row_ptr="*fp32",
                 q_col_ptr="*fp8e4nv", s_col_ptr="*fp32", record_ptr="*fp32", R="i32", C="i32", G="i32",
                 stride_qc="i32", stride_qg="i32", src_ptr="*i64", T="i32", aligned_ends_ptr="*i32",
                 prob_ptr="*fp32")


def _compile(fn, types: dict, constants: dict, warps: int) -> str:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as error:  # another Triton layout
        pytest.skip(f"this Triton cannot compile ahead of time here: {error}")
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("chunk_rows", [0, 256])
@pytest.mark.parametrize("x_dtype", ["*bf16", "*fp32"])
def test_plain_tile_cast_compiles_for_sm90(e5m2, chunk_rows, x_dtype):
    fp8 = "*fp8e5" if e5m2 else "*fp8e4nv"
    types = dict(ARG_TYPES, x_ptr=x_dtype, q_row_ptr=fp8, q_col_ptr=fp8)
    block_r, block_c, warps = fd.TILE_SHAPES["plain"]
    constants = dict(WRITE_ROW=True, WRITE_COL=True, RECORD=True, SWIGLU=False, BR=block_r, BC=block_c,
                     GROUP_AXIS=1, GATHER=False, ALIGN=0, ROW_PROBS=False, AMAX_ROWS=fd.amax_rows("plain", block_r),
                     CHUNK_ROWS=chunk_rows, E5M2=e5m2)
    ptx = _compile(fd._delayed_cast_kernel, types, constants, warps)
    # the conversions the format asks for, and no other
    assert ("e5m2" in ptx) == e5m2 and ("e4m3" in ptx) == (not e5m2)


@pytest.mark.parametrize("write_row, record, align", [(False, False, 0), (True, True, 128), (False, True, 128)])
def test_other_tile_cast_variants_compile_for_sm90(write_row, record, align):
    """The transposed copy alone (the dense input's in the backward), evaluation's cast (no record) and
    the weight-gradient kernel's aligned group layout, in row runs."""
    block_r, block_c, warps = fd.TILE_SHAPES["plain"]
    constants = dict(WRITE_ROW=write_row, WRITE_COL=True, RECORD=record, SWIGLU=False, BR=block_r, BC=block_c,
                     GROUP_AXIS=1, GATHER=False, ALIGN=align, ROW_PROBS=False,
                     AMAX_ROWS=fd.amax_rows("plain", block_r), CHUNK_ROWS=256, E5M2=False)
    _compile(fd._delayed_cast_kernel, ARG_TYPES, constants, warps)


@pytest.mark.parametrize("fmt_max", [448.0, 57344.0])
def test_missing_scales_kernel_compiles_for_sm90(fmt_max):
    types = dict(scale_ptr="*fp32", amax_ptr="*fp32", out_ptr="*fp32", G="i32")
    _compile(fd._fill_missing_scales_kernel, types, dict(BLOCK=1024, FMT_MAX=fmt_max), 4)


def test_tiled_byte_transpose_compiles_for_sm90():
    from lightning_moe.kernels import transpose_triton as tt

    types = dict(src_ptr="*u8", dst_ptr="*u8", R="i32", C="i32", R_OUT="i32")
    ptx = _compile(tt._transpose_bytes_kernel, types, dict(BR=tt._TILE, BC=tt._TILE), 4)
    assert "st.global" in ptx


@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("x_dtype", ["*bf16", "*fp32"])
def test_row_cast_compiles_for_sm90(e5m2, x_dtype):
    """The row copy alone (every dense operand's cast on the default path)."""
    types = dict(x_ptr=x_dtype, offsets_ptr="*i32", scale_ptr="*fp32", cur_amax_ptr="*fp32",
                 q_ptr="*fp8e5" if e5m2 else "*fp8e4nv", s_ptr="*fp32", record_ptr="*fp32", C="i32", G="i32",
                 src_ptr="*fp32", T="i32")
    ptx = _compile(fd._delayed_row_kernel, types, dict(SEARCH_STEPS=1, RECORD=True, E5M2=e5m2, BL=2048,
                                                        GATHER=False), 2)
    assert ("e5m2" in ptx) == e5m2 and ("e4m3" in ptx) == (not e5m2)
