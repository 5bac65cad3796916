"""In-place gradient accumulation for FP8 weights on a Hopper GPU (the native backend): under
``ComputeWeightCache(accumulate_grads_in_place=True)`` (``MegatronMoEStrategy``'s default) the FP8
GEMMs' backward adds each weight gradient into the parameter's fp32 ``.grad`` once it has one, and
autograd's ``AccumulateGrad`` adds nothing.

- the Triton weight-gradient kernel's epilogue add (beta = 1) at the library's launch (fp32, TMA
  stores, fast and split accumulation) against its plain output added as autograd adds it;
- grouped experts (uneven groups, an empty expert in each micro-batch) and a dense FP8 linear, delayed
  and rowwise recipes, over 3 micro-batches: ``.grad`` bit for bit against autograd's accumulation,
  and the experts' fp32 adds (``CUDAFunctor_add<float>`` kernels) gone from the profile.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper (sm90) GPU"),
]


# `fp8_grouped_gemm_triton.WGRAD_PREFETCH_OLD`, `WGRAD_FP32_STORE_WHOLE`, `WGRAD_COLUMNS_FIRST`, `TMA_REDUCE`
@pytest.mark.parametrize("prefetch_old, store_halves, columns_first, reduce",
                         [(False, True, False, False), (True, True, False, False), (True, False, False, False),
                          (True, False, True, False), (False, False, False, True)])
@pytest.mark.parametrize("precise", [False, True])
def test_wgrad_kernel_adds_into_the_gradient_with_autograds_bits(monkeypatch, precise, prefetch_old, store_halves,
                                                                 columns_first, reduce):
    from lightning_moe.kernels import fp8_grouped_gemm_triton
    from lightning_moe.precision.native_gemms import group_weight_gradient

    monkeypatch.setattr(fp8_grouped_gemm_triton, "WGRAD_PREFETCH_OLD", prefetch_old)
    monkeypatch.setattr(fp8_grouped_gemm_triton, "WGRAD_FP32_STORE_WHOLE", not store_halves)
    monkeypatch.setattr(fp8_grouped_gemm_triton, "WGRAD_COLUMNS_FIRST", columns_first)
    monkeypatch.setattr(fp8_grouped_gemm_triton, "TMA_REDUCE", reduce)
    g = torch.Generator(device="cuda").manual_seed(0)
    m, n = 2048, 1536
    layouts = [[256, 256, 768, 1280], [0, 512, 512, 1024], [512, 1024, 1536, 1536]]  # an empty expert in each
    unfused = fused = None
    for ends in layouts:
        r = ends[-1]
        a = torch.randn(m, r, device="cuda", generator=g).to(torch.float8_e4m3fn)
        b = torch.randn(n, r, device="cuda", generator=g).to(torch.float8_e4m3fn)
        sa = torch.rand(4, m, device="cuda", generator=g) + 0.5
        sb = torch.rand(4, n, device="cuda", generator=g) + 0.5
        ends_t = torch.tensor(ends, device="cuda", dtype=torch.int32)
        args = (a, sa, b, sb, ends_t, None)
        dw = group_weight_gradient(*args, fast=not precise, aligned_ends=ends_t, out_dtype=torch.float32)
        unfused = dw if unfused is None else unfused.add_(dw)
        if fused is None:
            fused = dw.clone()
        else:
            out = group_weight_gradient(*args, fast=not precise, aligned_ends=ends_t, out_dtype=torch.float32,
                                        accumulate_into=fused)
            assert out is None
    assert torch.equal(fused.view(torch.int32), unfused.view(torch.int32))


def _model(recipe_name: str):
    from lightning_moe.nn.experts import GroupedExperts
    from lightning_moe.precision import FP8Recipe
    from lightning_moe.precision.modules import FP8GroupedGemm, FP8Linear

    torch.manual_seed(0)
    recipe = FP8Recipe(recipe_name)
    proj = FP8Linear(256, 256, bias=False, recipe=recipe, backend="torch", device="cuda")
    experts = GroupedExperts(4, 256, 128).cuda()
    experts.quantization = FP8GroupedGemm(recipe, "torch")
    return torch.nn.ModuleDict({"proj": proj, "experts": experts})


def _micro_batches():
    g = torch.Generator(device="cuda").manual_seed(1)
    sizes = [[32, 0, 48, 16], [0, 64, 16, 16], [16, 16, 0, 80]]  # multiples of 16; one empty expert each
    return [(torch.randn(128, 256, device="cuda", generator=g), torch.tensor(s, device="cuda")) for s in sizes]


def _run(recipe_name: str, in_place: bool, profile: bool = False):
    from lightning_moe.nn.compute_weights import ComputeWeightCache

    model, cache = _model(recipe_name), ComputeWeightCache(accumulate_grads_in_place=in_place)
    model.zero_grad(set_to_none=True)
    adds = 0
    for i, (x, sizes) in enumerate(_micro_batches()):
        prof = None
        if profile and i > 0:
            from torch.profiler import ProfilerActivity

            prof = torch.profiler.profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        with cache.active(), torch.autocast("cuda", dtype=torch.bfloat16):
            y = model["experts"](model["proj"](x), sizes)
        y.float().square().mean().backward()
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            adds += sum(1 for e in prof.events() if "CUDAFunctor_add<float>" in e.name
                        and e.device_type == torch.autograd.DeviceType.CUDA)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, adds


@pytest.mark.parametrize("recipe_name", ["delayed", "rowwise"])
def test_fp8_layer_grads_added_in_place_have_autograds_bits_and_no_fp32_add_kernels(recipe_name):
    plain, plain_adds = _run(recipe_name, False, profile=True)
    fused, fused_adds = _run(recipe_name, True, profile=True)
    for name, want in plain.items():
        assert torch.equal(fused[name].view(torch.int32), want.view(torch.int32)), name
    # autograd's AccumulateGrad adds for fc1 and fc2 in micro-batches 2 and 3 are gone (the dense
    # weight's add stays a pass of its own under delayed scaling: _scaled_mm has no beta)
    assert plain_adds - fused_adds >= 4, (plain_adds, fused_adds)
