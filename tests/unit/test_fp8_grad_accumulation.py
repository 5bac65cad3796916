"""In-place gradient accumulation for FP8 weights (Megatron-Core's gradient-accumulation fusion):
under ``ComputeWeightCache(accumulate_grads_in_place=True)`` (``MegatronMoEStrategy``'s default)
the FP8 GEMMs' backward adds each weight gradient into the parameter's existing fp32 ``.grad``
and hands autograd none, so ``AccumulateGrad`` runs no fp32 add. The same bits as autograd's
accumulation.

On CPU the emulated backend runs (its weight gradients take the same switch and the same test,
`nn.compute_weights.accumulation_grad`); the native backend's Triton epilogue is checked under
Triton's interpreter (tests/unit/_interpreted_wgrad.py) and on a GPU
(tests/gpu/test_fp8_grad_accumulation_gpu.py).
"""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_moe.precision.gemm as gemm
from lightning_moe.nn.compute_weights import ComputeWeightCache, in_place_accumulation_target
from lightning_moe.nn.experts import GroupedExperts
from lightning_moe.precision import FP8Recipe
from lightning_moe.precision.modules import FP8GroupedGemm, FP8Linear

RECIPES = ["tensorwise", "delayed"]


def _model(recipe: str) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    proj = FP8Linear(32, 32, bias=False, recipe=FP8Recipe.of(recipe), backend="emulated")
    experts = GroupedExperts(4, 32, 16)  # SwiGLU: fc1 [E, D, 2, F] used through a view
    experts.quantization = FP8GroupedGemm(FP8Recipe.of(recipe), "emulated")
    return torch.nn.ModuleDict({"proj": proj, "experts": experts})


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    # uneven groups, an empty expert in each micro-batch (a different one), rows past the groups
    sizes = [[5, 0, 7, 3], [0, 9, 2, 1], [4, 4, 0, 6]]
    return [(torch.randn(16, 32, generator=gen), torch.tensor(s)) for s in sizes]


def _accumulate(model: torch.nn.ModuleDict, cache: ComputeWeightCache, data) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for x, sizes in data:
        with cache.active():
            y = model["experts"](model["proj"](x), sizes)
        y.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_weight_gradients_added_in_place_give_the_same_bits(monkeypatch, recipe):
    model, data = _model(recipe), _micro_batches()
    plain = _accumulate(model, ComputeWeightCache(), data)
    added = []
    real = gemm.accumulate_widened_
    monkeypatch.setattr(gemm, "accumulate_widened_", lambda dst, src: added.append(tuple(dst.shape)) or real(dst, src))
    model, cache = _model(recipe), ComputeWeightCache(accumulate_grads_in_place=True)
    model.zero_grad(set_to_none=True)
    first = {}
    for i, (x, sizes) in enumerate(data):
        with cache.active():
            y = model["experts"](model["proj"](x), sizes)
        y.float().square().mean().backward()
        if i == 0:
            first = {name: p.grad for name, p in model.named_parameters()}
    for (name, p), want in zip(model.named_parameters(), plain):
        assert torch.equal(p.grad.view(torch.int32), want.view(torch.int32)), name
        assert p.grad is first[name], name  # the first micro-batch's gradient, added into
    # three FP8 weights, in the second and third micro-batches (the first has no .grad yet)
    assert len(added) == 3 * 2
    assert (32, 32) in added and tuple(model["experts"].fc1_weight.shape) in added


def test_the_switch_is_the_active_cache_and_a_hook_keeps_autograds_accumulation():
    model, data = _model("tensorwise"), _micro_batches()
    w, fc1 = model["proj"].weight, model["experts"].fc1_weight
    assert in_place_accumulation_target(w) is None  # no cache active
    with ComputeWeightCache().active():
        assert in_place_accumulation_target(w) is None  # accumulate_grads_in_place off
    with ComputeWeightCache(accumulate_grads_in_place=True).active():
        assert in_place_accumulation_target(w) is w
        assert in_place_accumulation_target(fc1.flatten(-2)) is fc1  # a view of all of it
        assert in_place_accumulation_target(fc1[:2]) is None  # a view of part
        with torch.no_grad():
            assert in_place_accumulation_target(w) is None
    plain = _accumulate(model, ComputeWeightCache(), data)
    seen = []
    w.register_hook(lambda g: seen.append(g is not None))
    in_place = _accumulate(model, ComputeWeightCache(accumulate_grads_in_place=True), data)
    assert seen == [True] * 3  # the hooked weight's gradient went through autograd every time
    for a, b in zip(plain, in_place):
        assert torch.equal(a, b)


class _Tokens(Dataset):
    def __init__(self, n: int, seq: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 64, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "labels": torch.roll(ids, -1)}


def _fit(accumulate_grads_in_place: bool | None) -> tuple[list[torch.Tensor], int]:
    from lightning.pytorch import Trainer

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.precision import FP8Precision

    torch.manual_seed(0)
    module = MoELanguageModel("tiny", overrides={"num_layers": 2, "vocab_size": 64}, max_steps=2)
    strategy = MegatronMoEStrategy(print_layout=False, accumulate_grads_in_place=accumulate_grads_in_place)
    plugin = FP8Precision(recipe=FP8Recipe("delayed"), backend="emulated")
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, plugins=[plugin], max_steps=2,
        accumulate_grad_batches=3, gradient_clip_val=1.0, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    added = []
    real = gemm.accumulate_widened_
    gemm.accumulate_widened_ = lambda dst, src: added.append(dst.shape) or real(dst, src)
    try:
        trainer.fit(module, DataLoader(_Tokens(12, 16), batch_size=2))
    finally:
        gemm.accumulate_widened_ = real
        if torch.distributed.is_initialized():  # the strategy's 1-rank process group
            torch.distributed.destroy_process_group()
    return [p.detach().clone() for p in module.parameters()], len(added)


def test_strategy_option_governs_the_fp8_weights_with_the_same_training():
    in_place, added = _fit(None)  # default: on with cache_weight_casts
    plain, none_added = _fit(False)
    assert added > 0 and none_added == 0
    for a, b in zip(in_place, plain):
        assert torch.equal(a, b)
