"""CUDA C kernels of this package (``kernels/cuda/*.cu``), compiled at run time by NVRTC and launched
through the driver on the current stream (so CUDA-graph capture records them like any kernel).

NVRTC ships with PyTorch's CUDA wheels (``torch.cuda._utils`` loads it and the driver for
``torch.cuda._compile_kernel``). The compile call and the launch are our own: that helper needs the CUDA
toolkit's headers and passes every Python int as a 32-bit ``int``, and these kernels take 64-bit strides.
Each (source, kernel, macros, device) is compiled once per process (~0.1-0.3 s) and kept.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.cuda._utils import _check_cuda, _cuda_load_module, _get_gpu_rtc_library, _get_gpu_runtime_library

_SOURCES = Path(__file__).resolve().parent / "cuda"

# argument kinds of a kernel's signature: a tensor's address (None: a null pointer), int32, int64, fp32
_ARG_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float}


class CudaKernel:
    """One compiled kernel: ``launch(grid, block, args)`` with ``args`` matching ``signature`` (one
    letter an argument: ``p`` tensor or None, ``i`` int32, ``q`` int64, ``f`` fp32)."""

    def __init__(self, function: ctypes.c_void_p, module: ctypes.c_void_p, signature: str) -> None:
        self._function = function
        self._module = module  # kept: the function lives as long as its module is loaded
        self.signature = signature

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence,
               stream: Optional[torch.cuda.Stream] = None) -> None:
        if len(args) != len(self.signature):
            raise TypeError(f"CudaKernel.launch: {len(args)} arguments for the signature {self.signature!r}")
        values = []
        for kind, arg in zip(self.signature, args):
            if kind == "p":
                arg = 0 if arg is None else arg.data_ptr()
            values.append(_ARG_TYPES[kind](arg))
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
        stream = torch.cuda.current_stream() if stream is None else stream
        _check_cuda(_get_gpu_runtime_library().cuLaunchKernel(
            self._function, *grid, *block, 0, ctypes.c_void_p(stream.cuda_stream), pointers, None))


def _nvrtc_cubin(source: str, name: str, arch: str, options: list[str]) -> tuple[bytes, str]:
    """(cubin, lowered name) of kernel ``name`` in ``source`` for ``sm_<arch>``. Our own call sequence rather
    than ``torch.cuda._utils._nvrtc_compile``, which adds the CUDA toolkit's include directory and so needs
    ``CUDA_HOME``, absent where PyTorch came from its wheels alone; these sources include no header."""
    nvrtc = _get_gpu_rtc_library()

    def check(result: int, program: Optional[ctypes.c_void_p] = None) -> None:
        if result == 0:
            return
        log = ""
        if program is not None:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            buffer = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, buffer)
            log = buffer.value.decode(errors="replace")
        raise RuntimeError(f"NVRTC error {result} compiling {name}\n{log}")

    program = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        check(nvrtc.nvrtcAddNameExpression(program, name.encode()))
        flags = [f"--gpu-architecture=sm_{arch}", *options]
        array = (ctypes.c_char_p * len(flags))(*(flag.encode() for flag in flags))
        check(nvrtc.nvrtcCompileProgram(program, len(flags), array), program)
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, cubin))
        lowered = ctypes.c_char_p()
        check(nvrtc.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(lowered)))
        return cubin.raw, (lowered.value or name.encode()).decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


@functools.lru_cache(maxsize=None)
def compiled(source: str, kernel: str, signature: str, macros: tuple[tuple[str, int], ...],
             device: int) -> CudaKernel:
    """``kernel`` of ``kernels/cuda/<source>`` compiled for ``device``'s architecture with ``-D`` ``macros``.
    Raises RuntimeError (with NVRTC's log) where it does not compile, and whatever loading NVRTC or the
    module raises."""
    major, minor = torch.cuda.get_device_capability(device)
    cubin, lowered = _nvrtc_cubin((_SOURCES / source).read_text(), kernel, f"{major}{minor}",
                                  [f"-D{name}={value}" for name, value in macros] + ["-std=c++17"])
    with torch.cuda.device(device):
        loaded = _cuda_load_module(cubin, [lowered])[lowered]
    return CudaKernel(loaded.func, loaded.module, signature)
