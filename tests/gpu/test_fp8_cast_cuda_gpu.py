"""The CUDA C delayed cast (`kernels/fp8_cast_cuda`, ``cuda/fp8_delayed_cast.cu``) writes the Triton tile
kernel's bytes: every output (row copy, row scales, transposed copy with its gaps, column scales, amax
record) for plain and gathered bf16 operands, in the weight gradient's aligned group layout and the plain
one, with and without the row copy and the record, on groups with and without history (the kernel's own
amax), empty groups, group edges off the 16-row grid, a tail, padding rows, NaN, inf and saturating
values; and the expert weights' layout (a per-group stride). CUDA, Hopper."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper GPU"),
]


@pytest.fixture
def both_kernels(monkeypatch):
    """``run(fn)`` -> (the CUDA kernel's outputs, the Triton kernel's), proving each path ran."""
    from lightning_moe.kernels import fp8_cast_cuda

    launched = []
    real = fp8_cast_cuda.launch_delayed_cast

    def counted(*args, **kwargs):
        launched.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_cast_cuda, "launch_delayed_cast", counted)

    def run(fn):
        monkeypatch.setattr(fp8_cast_cuda, "CUDA_CASTS", True)
        by_cuda = fn()
        assert launched, "the CUDA kernel did not run"
        launched.clear()
        monkeypatch.setattr(fp8_cast_cuda, "CUDA_CASTS", False)
        by_triton = fn()
        assert not launched
        return by_cuda, by_triton

    return run


def _assert_same_bytes(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and u.shape == v.shape, i
        assert torch.equal(u.view(torch.uint8) if u.element_size() == 1 else u.view(torch.int32),
                           v.view(torch.uint8) if v.element_size() == 1 else v.view(torch.int32)), f"output {i}"


def _layouts(rows: int) -> list:
    """(ends, aligned ends or None, transposed width): the aligned layout (ends on 16 rows, as the FP8 path
    pads groups) and unaligned ends in the plain one; both with an empty group and a tail."""
    aligned = torch.tensor([48, 48, 336, 704, rows - 76], device="cuda", dtype=torch.int32)
    sizes = torch.diff(aligned, prepend=aligned.new_zeros(1))
    aligned_ends = torch.cumsum((sizes + 127) // 128 * 128, 0).to(torch.int32)
    plain = torch.tensor([40, 40, 333, 701, rows - 71], device="cuda", dtype=torch.int32)
    return [(aligned, aligned_ends, int(aligned_ends[-1])), (plain, None, rows + 16)]


@pytest.mark.parametrize("warps_across", [1, 4])  # a block's warps stacked in rows / side by side in columns
@pytest.mark.parametrize("cols", [256, 136, 2048])
@pytest.mark.parametrize("gather", [False, True])
def test_cuda_cast_writes_the_triton_bytes(monkeypatch, both_kernels, cols, gather, warps_across):
    from lightning_moe.kernels import fp8_cast_cuda
    from lightning_moe.kernels import fp8_delayed_triton as fd

    monkeypatch.setattr(fp8_cast_cuda, "WARPS_ACROSS", warps_across)

    torch.manual_seed(cols + gather)
    rows, tokens = 1100, 400
    source_rows = tokens if gather else rows
    x = (torch.randn(source_rows, cols, device="cuda")
         * torch.logspace(-3, 3, source_rows, device="cuda")[:, None]).to(torch.bfloat16)
    x[7, 3], x[300, 5], x[301, 0] = float("nan"), float("inf"), float("-inf")
    src = torch.randint(0, tokens + 1, (rows,), device="cuda") if gather else None  # `tokens`: a padding row
    # 3.0 saturates the largest rows; 0 and NaN: no history (the kernel's own amax, or the pre-pass)
    scale = torch.tensor([3.0, 0.0, 0.0, 0.5, float("nan")], device="cuda")
    for ends, aligned_ends, width in _layouts(rows):
        for write_row in (True, False):
            for record in (True, False):
                def cast():
                    q_col = torch.full((cols, width), 0x55, device="cuda", dtype=torch.uint8)
                    q_col = q_col.view(torch.float8_e4m3fn)
                    amax = torch.full((5,), 0.25, device="cuda") if record else None
                    q, s_row, s_col = fd.delayed_cast(x, ends, scale, amax, write_row=write_row, out_col=q_col,
                                                      stride_out_col=width, aligned_ends=aligned_ends,
                                                      gather_rows=src)
                    return [t for t in (q, s_row, s_col, q_col, amax) if t is not None]

                _assert_same_bytes(*both_kernels(cast))


@pytest.mark.parametrize("experts,k,n", [(4, 128, 64), (8, 256, 520)])
def test_cuda_cast_of_expert_weights_writes_the_triton_bytes(both_kernels, experts, k, n):
    """Both weight layouts from one cast (`FP8GroupedGemm`'s weight cache), history and none."""
    from lightning_moe.kernels import fp8_delayed_triton as fd
    from lightning_moe.precision.native_casts import weight_as_groups

    torch.manual_seed(k)
    w = torch.randn(experts, k, n, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(experts, device="cuda") * 100
    scale[1] = 0.0
    for write_row in (True, False):
        def cast():
            rows, ends, q_ENK, stride_col, stride_group = weight_as_groups(w)
            record = torch.zeros(experts, device="cuda")
            q, s_row, s_col = fd.delayed_cast(rows, ends, scale, record, write_row=write_row, out_col=q_ENK,
                                              stride_out_col=stride_col, stride_out_group=stride_group)
            return [t for t in (q, s_row, s_col, q_ENK, record) if t is not None]

        _assert_same_bytes(*both_kernels(cast))


def test_cuda_cast_in_a_cuda_graph(both_kernels):
    """Captured and replayed on new data: the same bytes as the Triton kernel on that data."""
    from lightning_moe.kernels import fp8_delayed_triton as fd

    rows, cols = 1024, 512
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([256, 512, 768, 1024], device="cuda", dtype=torch.int32)
    scale = torch.full((4,), 8.0, device="cuda")

    def graphed():
        q_col = torch.zeros(cols, rows, device="cuda", dtype=torch.float8_e4m3fn)
        record = torch.zeros(4, device="cuda")
        fd.delayed_cast(x, ends, scale, record, out_col=q_col, stride_out_col=rows)  # compile, warm up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q, s_row, s_col = fd.delayed_cast(x, ends, scale, record, out_col=q_col, stride_out_col=rows)
        x.copy_(torch.randn_like(x) * 3)
        record.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return [q.clone(), s_row.clone(), s_col.clone(), q_col.clone(), record.clone()]

    def run():
        torch.manual_seed(0)
        return graphed()

    _assert_same_bytes(*both_kernels(run))
