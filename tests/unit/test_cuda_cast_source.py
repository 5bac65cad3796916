"""The CUDA C cast (``kernels/cuda/fp8_delayed_cast.cu``) off the GPU: every macro combination the library
compiles builds for sm90 without register spills at its register cap (where a CUDA compiler is installed;
the GPU tests run it), and the dispatch leaves CPU tensors and the kinds it does not cover to Triton."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lightning_moe.kernels import fp8_cast_cuda
from lightning_moe.kernels.cuda_launch import _SOURCES


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        if (root / "bin" / "nvcc").exists():
            return str(root / "bin" / "nvcc")
    return None


@pytest.mark.skipif(_nvcc() is None, reason="needs a CUDA compiler (nvcc)")
@pytest.mark.parametrize("gather", [0, 1])
@pytest.mark.parametrize("write_row,record,align", [(1, 1, 128), (1, 0, 0), (0, 1, 0)])
def test_cast_source_compiles_for_sm90_without_spills(tmp_path, gather, write_row, record, align):
    macros = {"GATHER": gather, "WRITE_ROW": write_row, "RECORD": record, "ALIGN": align,
              "MIN_BLOCKS": fp8_cast_cuda.MIN_BLOCKS, "WARPS_ACROSS": fp8_cast_cuda.WARPS_ACROSS}
    result = subprocess.run(
        [_nvcc(), "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", "-o", str(tmp_path / "cast.cubin"),
         *(f"-D{name}={value}" for name, value in macros.items()), str(_SOURCES / "fp8_delayed_cast.cu")],
        capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in result.stderr, result.stderr


def test_dispatch_leaves_cpu_tensors_and_uncovered_kinds_to_triton(monkeypatch):
    monkeypatch.setattr(fp8_cast_cuda, "CUDA_CASTS", True)
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    ends = torch.tensor([32], dtype=torch.int32)
    out_col = torch.empty(64, 32, dtype=torch.float8_e4m3fn)
    assert not fp8_cast_cuda.applies(x, 64, ends, False, out_col, False, None)  # a CPU tensor
    assert not fp8_cast_cuda.applies(x, 64, ends, True, out_col, False, None)  # the SwiGLU kind
    assert not fp8_cast_cuda.applies(x, 64, ends, False, None, False, None)  # the row copy alone
    assert not fp8_cast_cuda.applies(x.float(), 64, ends, False, out_col, False, None)  # fp32
