"""`kernels.launch`: which calls reuse a compiled kernel and how its launcher is called.

A stand-in for a Triton ``JITFunction`` records the plain ``kernel[grid](...)`` calls and
returns a stand-in compiled kernel that records direct launches, so the keying rules run on CPU
(the real kernels, launched both ways, are compared bit for bit in ``tests/gpu``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_moe.kernels import launch as launch_module
from lightning_moe.kernels.launch import cdiv, clear_launch_cache, launch, next_power_of_2


class _Compiled:
    def __init__(self, log: list) -> None:
        self.log = log
        self.function = "function-handle"
        self.packed_metadata = ("packed",)

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, *call):
        self.log.append(("direct", call))


class _Param:
    def __init__(self, is_constexpr: bool) -> None:
        self.is_constexpr = is_constexpr


class _Kernel:
    """``fn``'s signature is the kernel's (``FLAG`` and ``BLOCK`` are constexprs, as ``params``
    says); ``kernel[grid](...)`` logs and returns the compiled one."""

    def __init__(self, compiled_has_launcher: bool = True) -> None:
        self.log: list = []
        self.compiled_has_launcher = compiled_has_launcher
        self.pre_run_hooks: list = []

        def fn(x_ptr, n, scale, FLAG: bool = False, BLOCK: int = 64):
            raise AssertionError("never called")

        self.fn = fn
        self.params = [_Param(False), _Param(False), _Param(False), _Param(True), _Param(True)]

    def __getitem__(self, grid):
        def plain(*args, **kwargs):
            self.log.append(("plain", grid, args, kwargs))
            return _Compiled(self.log) if self.compiled_has_launcher else object()

        return plain


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", raising=False)
    monkeypatch.setattr(launch_module, "triton_version_tested", lambda: True)  # whatever Triton is installed
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 1234))
    monkeypatch.setattr(launch_module, "_launch_hooks", lambda: ("enter-hook", None))
    monkeypatch.setattr(launch_module, "_compilation_state", lambda kernel: ("settings",))
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


def test_an_empty_grid_compiles_once_and_then_launches_nothing():
    """A zero-size grid (a call that only compiles and loads the kernel) goes through the plain
    path the first time; with the kernel kept, later empty calls launch nothing, and a call with
    a real grid launches the kept kernel."""
    kernel = _Kernel()
    x = torch.zeros(64)
    launch(kernel, (0, 4), x, 100, 0.5)
    launch(kernel, (0, 4), x, 100, 0.5)
    launch(kernel, (5, 0), x, 100, 0.5)
    assert _kinds(kernel) == ["plain"]
    launch(kernel, (5, 4), x, 100, 0.5)
    assert _kinds(kernel) == ["plain", "direct"] and kernel.log[1][1][:3] == (5, 4, 1)


def test_other_tensors_of_the_same_dtype_and_alignment_reuse_it():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.ones(32), 100, 0.5)
    assert _kinds(kernel) == ["plain", "direct"]
    assert kernel.log[1][1][9].shape == (32,)  # the new tensor is passed


@pytest.mark.parametrize(
    "second",
    [
        dict(args=(torch.zeros(64), 112, 0.5)),  # an integer that becomes divisible by 16
        dict(args=(torch.zeros(64), 1, 0.5)),  # an integer that becomes 1
        dict(args=(torch.zeros(64), 2**31, 0.5)),  # an integer past int32
        dict(args=(torch.zeros(64, dtype=torch.float64), 100, 0.5)),  # a dtype
        dict(args=(torch.zeros(65)[1:], 100, 0.5)),  # a pointer not 16-byte aligned
        dict(args=(torch.zeros(64), 100, 0.25)),  # any float, exactly
        dict(args=(torch.zeros(64), 100, 0.5), kwargs=dict(FLAG=True)),  # a constexpr
        dict(args=(torch.zeros(64), 100, 0.5), kwargs=dict(BLOCK=128)),  # a constexpr integer, exactly
        dict(args=(torch.zeros(64), 100, 0.5), kwargs=dict(num_warps=8)),  # a compile option
        dict(args=(torch.zeros(64), True, 0.5)),  # True and an integer compile differently
    ],
)
def test_anything_triton_may_specialize_on_takes_the_plain_path(second):
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5, BLOCK=64)
    kwargs = {"BLOCK": 64, **second.get("kwargs", {})}
    launch(kernel, (1,), *second["args"], **kwargs)
    assert _kinds(kernel) == ["plain", "plain"]


def test_keyword_true_and_one_are_keyed_apart_and_a_float_keyword_by_its_bits():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5, FLAG=True)
    launch(kernel, (1,), torch.zeros(64), 100, 0.5, FLAG=1)
    launch(kernel, (1,), torch.zeros(64), 100, 0.5, FLAG=float("nan"))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5, FLAG=float("nan"))
    assert _kinds(kernel) == ["plain", "plain", "plain", "direct"]


def test_a_parameter_is_keyed_as_its_tensor():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.nn.Parameter(torch.ones(64)), 100, 0.5)
    launch(kernel, (1,), torch.nn.Parameter(torch.ones(64, dtype=torch.float64)), 100, 0.5)
    assert _kinds(kernel) == ["plain", "direct", "plain"]


def test_empty_hook_chains_are_not_called_and_no_metadata_is_built(monkeypatch):
    class _Chain:  # Triton 3.6's HookChain: never None, empty when no profiler is attached
        def __init__(self, calls):
            self.calls = calls

        def __call__(self, *args):
            for call in self.calls:
                call(*args)

    built = []

    class _Metadata(_Compiled):
        def launch_metadata(self, grid, stream, *values):
            built.append(grid)
            return "metadata"

    kernel = _Kernel()
    compiled = _Metadata(kernel.log)
    monkeypatch.setattr(_Kernel, "__getitem__", lambda self, grid: (lambda *a, **k: compiled))
    monkeypatch.setattr(launch_module, "_launch_hooks", lambda: (_Chain([]), _Chain([])))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    call = kernel.log[-1][1]
    assert call[6:9] == (None, None, None) and built == []  # metadata, enter hook, exit hook
    seen = []
    monkeypatch.setattr(launch_module, "_launch_hooks", lambda: (_Chain([seen.append]), _Chain([])))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    call = kernel.log[-1][1]
    assert call[6] == "metadata" and call[7] is not None and call[8] is None and built == [(1,)]


def test_host_grid_helpers_equal_tritons_definitions():
    # triton.cdiv is (a + b - 1) // b; triton.next_power_of_2 is the smallest power of 2 >= n, 0 for 0.
    for a in range(-40, 2000):
        for b in (1, 3, 16, 64, 128):
            assert cdiv(a, b) == (a + b - 1) // b
    assert next_power_of_2(0) == 0
    for n in range(1, 5000):
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)
    try:  # and Triton's own, where it is installed
        import triton
    except ImportError:
        return
    for n in [*range(-3, 3000), *(2**k + d for k in range(12, 63) for d in (-1, 0, 1))]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_runtime_integers_with_the_same_specialization_reuse_it():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.zeros(64), 37, 0.5)  # neither 1 nor a multiple of 16, int32
    launch(kernel, (1,), torch.zeros(64), 48, 0.5)  # a multiple of 16: another kernel
    launch(kernel, (1,), torch.zeros(64), 4096, 0.5)
    assert _kinds(kernel) == ["plain", "direct", "plain", "direct"]
    assert kernel.log[1][1][10] == 37 and kernel.log[3][1][10] == 4096  # the values are passed


def test_nan_floats_key_alike():
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, float("nan"))
    launch(kernel, (1,), torch.zeros(64), 100, float("nan"))
    assert _kinds(kernel) == ["plain", "direct"]


@pytest.mark.parametrize("odd", [(1, 2), [1, 2], object()])
def test_arguments_of_other_kinds_take_the_plain_path(odd):
    kernel = _Kernel()
    for _ in range(2):
        launch(kernel, (1,), torch.zeros(64), 100, odd)
    assert _kinds(kernel) == ["plain", "plain"]


def test_another_device_or_compilation_setting_is_another_key(monkeypatch):
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (1, 1234))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    monkeypatch.setattr(launch_module, "_compilation_state", lambda kernel: ("debug on",))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    assert _kinds(kernel) == ["plain", "plain", "plain"]


def test_the_current_stream_is_launched_on(monkeypatch):
    kernel = _Kernel()
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    monkeypatch.setattr(launch_module, "_device_and_stream", lambda: (0, 999))
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    assert kernel.log[1][0] == "direct" and kernel.log[1][1][3] == 999


def test_kernel_with_pre_run_hooks_takes_the_plain_path():
    kernel = _Kernel()
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(2):
        launch(kernel, (1,), torch.zeros(64), 100, 0.5)
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


@pytest.mark.parametrize("version,tested", [("3.6.0", True), ("3.5.1", True), ("3.9.0", False), ("4.0.0", False)])
def test_an_untested_triton_takes_the_plain_path(monkeypatch, version, tested):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.undo()  # the fixture's stand-in for the version check: the real check here
    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LIGHTNING_MOE_FAST_TRITON_LAUNCH", raising=False)
    launch_module.triton_version_tested.cache_clear()
    try:
        assert launch_module.fast_launch_enabled() is tested
    finally:
        launch_module.triton_version_tested.cache_clear()


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


def test_plain_path_while_torch_compile_traces(monkeypatch):
    kernel = _Kernel()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    launch(kernel, (1,), torch.zeros(64), 100, 0.5)
    assert _kinds(kernel) == ["plain", "plain"]


class TensorDescriptor:
    """Stand-in for Triton's host-side TMA descriptor (keyed by class name and module)."""

    __module__ = "triton.tools.tensor_descriptor"

    def __init__(self, base, shape, strides, block_shape, padding="zero"):
        self.base, self.shape, self.strides, self.block_shape, self.padding = base, shape, strides, block_shape, padding
        self.round_f32_to_tf32 = False

    __hash__ = None  # a dataclass with eq: unhashable, as Triton's is


def _desc(rows=256, cols=128, block=(64, 64), base=None, padding="zero"):
    base = torch.zeros(rows, cols) if base is None else base
    return TensorDescriptor(base, [rows, cols], [cols, 1], list(block), padding)


def test_tma_descriptors_over_other_tensors_of_the_same_kind_reuse_it():
    kernel = _Kernel()
    launch(kernel, (1,), _desc(), 100, 0.5)
    second = _desc(rows=512)  # another size of the same integer class
    launch(kernel, (1,), second, 100, 0.5)
    assert _kinds(kernel) == ["plain", "direct"]
    assert kernel.log[1][1][9] is second  # the launcher builds the hardware descriptor from it


@pytest.mark.parametrize("other", [
    dict(block=(64, 128)),  # the box
    dict(base=torch.zeros(256, 128, dtype=torch.float64)),  # the dtype
    dict(base=torch.zeros(256 * 128 + 1)[1:].view(256, 128)),  # an unaligned base
    dict(rows=257),  # a size of another integer class
    dict(padding="nan"),
])
def test_tma_descriptors_are_keyed_by_more_than_triton_specializes_on(other):
    """Triton specializes on the base's dtype and the box; the key adds the base's alignment, the
    integer class of every size and stride, and the padding: a new key takes the plain path."""
    kernel = _Kernel()
    launch(kernel, (1,), _desc(), 100, 0.5)
    launch(kernel, (1,), _desc(**other), 100, 0.5)
    assert _kinds(kernel) == ["plain", "plain"]
