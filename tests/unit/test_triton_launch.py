"""`kernels.launch`: which calls reuse a compiled kernel and how its launcher is called.

A stand-in for a Triton ``JITFunction`` records the plain ``kernel[grid](...)`` calls and
returns a stand-in compiled kernel that records direct launches, so the keying rules run on CPU
(the real kernels, launched both ways, are compared bit for bit in ``tests/gpu``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import launch as launch_module
from lightning_moe.kernels.launch import clear_launch_cache, launch


class _Compiled:
    def __init__(self, log: list) -> None:
        self.log = log
        self.function = "function-handle"
        self.packed_metadata = ("packed",)

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, *call):
        self.log.append(("direct", call))


class _Kernel:
    """``fn``'s signature is the kernel's; ``kernel[grid](...)`` logs and returns the compiled one."""

    def __init__(self, compiled_has_launcher: bool = True) -> None:
        self.log: list = []
        self.compiled_has_launcher = compiled_has_launcher

        def fn(x_ptr, n, scale, FLAG: bool = False, BLOCK: int = 64):
            raise AssertionError("never called")

        self.fn = fn

    def __getitem__(self, grid):
        def plain(*args, **kwargs):
            self.log.append(("plain", grid, args, kwargs))
            return _Compiled(self.log) if self.compiled_has_launcher else object()

        return plain


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", raising=False)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 1234))
    monkeypatch.setattr(launch_module, "_launch_hooks", lambda: ("enter-hook", None))
    clear_launch_cache()
    yield
    clear_launch_cache()


def _kinds(kernel: _Kernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_repeated_call_launches_the_kept_kernel_with_every_parameter_in_order():
    kernel = _Kernel()
    x = torch.zeros(64)
    launch(kernel, (3, 2), x, 100, 0.5, BLOCK=128, num_warps=4)
    launch(kernel, (3, 2), x, 100, 0.5, BLOCK=128, num_warps=4)
    assert _kinds(kernel) == ["plain", "direct"]
    call = kernel.log[1][1]
    # grid padded to 3 dims, the stream, the handles, no launch metadata, the hooks, then every
    # parameter of the signature: the defaults of those not passed, never the options
    assert call == (3, 2, 1, 1234, "function-handle", ("packed",), None, "enter-hook", None, x, 100, 0.5, False, 128)


def test_other_tensors_of_the_same_dtype_and_alignment_reuse_it():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.ones(32), 100, 0.5)
    assert _kinds(kernel) == ["plain", "direct"]
    assert kernel.log[1][1][9].shape == (32,)  # the new tensor is passed


@pytest.mark.parametrize(
    "second",
    [
        dict(args=(torch.zeros(64), 101, 0.5)),  # an integer: Triton specializes on its divisibility
        dict(args=(torch.zeros(64, dtype=torch.float64), 100, 0.5)),  # a dtype
        dict(args=(torch.zeros(65)[1:], 100, 0.5)),  # a pointer not 16-byte aligned
        dict(args=(torch.zeros(64), 100, 0.25)),  # any other value, exactly
        dict(args=(torch.zeros(64), 100, 0.5), kwargs=dict(FLAG=True)),  # a constexpr
        dict(args=(torch.zeros(64), 100, 0.5), kwargs=dict(num_warps=8)),  # a compile option
        dict(args=(torch.zeros(64), True, 0.5)),  # True and 1 compile differently
    ],
)
def test_anything_triton_may_specialize_on_takes_the_plain_path(second):
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 1 if second["args"][1] is True else 100, 0.5)
    launch(kernel, (1,), *second["args"], **second.get("kwargs", {}))
    assert _kinds(kernel) == ["plain", "plain"]


def test_misaligned_view_is_keyed_apart():
    assert torch.zeros(65)[1:].data_ptr() % 16 != 0  # the premise of the case above


def test_disabled_by_environment_or_interpreter(monkeypatch):
    kernel = _Kernel()
    for variable, value in (("LIGHTNING_MOE_FAST_TRITON_LAUNCH", "0"), ("TRITON_INTERPRET", "1")):
        monkeypatch.setenv(variable, value)
        launch(kernel, (1,), torch.zeros(64), 100, 0.5)
        launch(kernel, (1,), torch.zeros(64), 100, 0.5)
        monkeypatch.delenv(variable)
    assert _kinds(kernel) == ["plain"] * 4


def test_compiled_kernel_without_the_launcher_keeps_the_plain_path():
    kernel = _Kernel(compiled_has_launcher=False)
    for _ in range(3):
        launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    assert _kinds(kernel) == ["plain"] * 3


def test_callable_grid_keeps_the_plain_path():
    kernel = _Kernel()
    grid = lambda meta: (1,)  # noqa: E731
    launch(kernel, grid, torch.zeros(64), 100, 0.5)
    launch(kernel, grid, torch.zeros(64), 100, 0.5)
    assert _kinds(kernel) == ["plain", "plain"]


def test_missing_required_parameter_keeps_the_plain_path():
    # the plain call raises (here: it does not, being a stand-in), so such a key is never kept
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100)
    launch(kernel, (1,), torch.zeros(64), 100)
    assert _kinds(kernel) == ["plain", "plain"]
