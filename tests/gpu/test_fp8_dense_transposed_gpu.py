"""`scaled_mm.DENSE_TRANSPOSED_COPIES` on a GPU: a delayed dense linear whose forward casts its input
in both layouts (one read) and whose weight's transposed FP8 copy comes from the weight cache trains
with the same bits as the backward's transposes (fp32 master weights under bf16 inputs, hybrid and
E4M3, a fresh state and one with scales, three micro-batches under one cache), and makes fewer
float8 copies; so too with the experiments `scaled_mm.DENSE_GRAD_BOTH_LAYOUTS` (the output gradient
in both layouts by one read), `fp8_delayed_triton.SINGLE_GROUP_CHUNK_ROWS` (the one-group casts
in row runs on the Triton kernel), and with `native_gemms.TILED_FP8_TRANSPOSES` (the default: the
transposes left by the tiled byte transpose, none by torch's copy), also with the transposed copies off.
The plain run sets every constant off."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (the native FP8 casts)")]


def _train(on: bool, fmt: str, fresh: bool, monkeypatch, grad_both: bool = False, chunk: int = 0,
           tiled: bool = False):
    from lightning_moe.kernels import fp8_delayed_triton
    from lightning_moe.precision import FP8Recipe, FP8WeightCache, caching_fp8_weights, native_gemms, scaled_mm
    from lightning_moe.precision.delayed import DelayedState

    monkeypatch.setattr(native_gemms, "TILED_FP8_TRANSPOSES", tiled)
    monkeypatch.setattr(scaled_mm, "DENSE_TRANSPOSED_COPIES", on)
    monkeypatch.setattr(scaled_mm, "DENSE_GRAD_BOTH_LAYOUTS", grad_both)
    monkeypatch.setattr(fp8_delayed_triton, "SINGLE_GROUP_CHUNK_ROWS", chunk)
    torch.manual_seed(0)
    w = (torch.randn(1536, 2048, device="cuda") / 48).requires_grad_(True)
    scale = torch.zeros(3, 1, device="cuda") if fresh else torch.tensor([[40.0], [60.0], [3000.0]], device="cuda")
    state = DelayedState(torch.zeros(4, 3, 1, device="cuda"), scale, fresh)
    cache, seen = FP8WeightCache(), []
    copies = 0
    with caching_fp8_weights(cache), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for rows in (4096, 4001, 4096):  # the second not a multiple of 16: the transposes' padding
            x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = scaled_mm.scaled_linear(x, w, None, FP8Recipe("delayed", fmt=fmt), state, weight_key="w")
            (y.float().square().mean() * 1e-3).backward()
            seen += [y.detach(), x.grad]
    torch.cuda.synchronize()
    copies = sum(e.count for e in prof.key_averages() if "float8_copy" in e.key)
    return seen + [w.grad, state.amax_history.clone()], copies


@pytest.mark.parametrize("on, grad_both, chunk, tiled", [(True, False, 0, False), (True, True, 256, False),
                                                        (True, True, 0, False), (True, False, 0, True),
                                                        (False, False, 0, True)])
@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_transposed_copies_train_with_the_same_bits_and_fewer_copies(monkeypatch, fmt, fresh, on, grad_both, chunk,
                                                                      tiled):
    plain, plain_copies = _train(False, fmt, fresh, monkeypatch)
    copies, fewer = _train(on, fmt, fresh, monkeypatch, grad_both, chunk, tiled)
    for i, (a, b) in enumerate(zip(plain, copies)):
        assert torch.equal(a.float().view(torch.int32), b.float().view(torch.int32)), i
    # 3 micro-batches: 3 transposes each before (weight, gradient, input); after, the gradient's each
    # time (unless cast in both layouts) and the weight's once (the weight cache); none by torch's
    # copy where the tiled kernel takes them
    assert plain_copies == 9 and fewer == (0 if tiled else 1 if grad_both else 4), (plain_copies, fewer)


@pytest.mark.parametrize("rows, cols", [(4001, 2048), (128, 4096), (37, 200), (8192, 512)])
@pytest.mark.parametrize("multiple", [1, 16])
def test_tiled_transpose_writes_torchs_bytes(rows, cols, multiple):
    from lightning_moe.kernels.transpose_triton import transpose_bytes

    q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda").view(torch.float8_e5m2)
    torch.full((cols * (rows + 16),), 7, dtype=torch.uint8, device="cuda")  # freed bytes the output may reuse
    out = transpose_bytes(q, multiple).view(torch.uint8)
    padded = -(-rows // multiple) * multiple
    assert out.shape == (cols, padded)
    assert torch.equal(out[:, :rows], q.view(torch.uint8).t())
    assert bool((out[:, rows:] == 0).all())
