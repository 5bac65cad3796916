"""The Transformer Engine experts backend equals the native grouped GEMM (bf16, CUDA, TE installed)."""

import copy

import pytest
import torch

from lightning_moe.nn import MoEConfig, MoELayer

pytestmark = pytest.mark.gpu


def test_te_experts_match_grouped_mm():
    pytest.importorskip("transformer_engine.pytorch")
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, router_topk=2, expert_backend="grouped_mm")
    native = MoELayer(cfg).cuda()
    native.experts.to(torch.bfloat16)
    te_layer = copy.deepcopy(native)
    te_layer.experts.backend = "te"
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for layer in (native, te_layer):
        xx = x.clone().requires_grad_(True)
        y = layer(xx)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append((xx.grad.float(), layer.experts.fc1_weight.grad.float(), layer.experts.fc2_weight.grad.float()))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(outs[1], outs[0]) < 1e-2
    for a, b in zip(grads[1], grads[0]):
        assert rel(a, b) < 2e-2


def _te_capability_ok():
    te = pytest.importorskip("transformer_engine.pytorch")
    return te


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_te_recipes_train_dense_layers_and_grouped_experts(recipe):
    """FP8Precision(backend="te") inside Lightning training steps: dense linears become te.Linear,
    the experts run te.GroupedLinear under the plugin's te.autocast, and the weights train."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.precision import FP8Precision

    _te_capability_ok()
    plugin = FP8Precision(recipe=recipe, backend="te")
    torch.manual_seed(0)
    module = MoELanguageModel(
        "tiny", overrides={"num_layers": 2, "moe": {"expert_backend": "te", "expert_alignment": 16}},
        learning_rate=3e-3, warmup_steps=1, max_steps=6,
    )

    class Record(Callback):
        def __init__(self):
            self.losses = []

        def on_train_start(self, trainer, pl_module):
            te_linears = [m for m in pl_module.modules() if getattr(m, "is_fp8_linear", False)]
            assert te_linears, "no linear became te.Linear"
            self.weight, self.before = te_linears[0].weight, te_linears[0].weight.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    record = Record()
    tokens = torch.randint(0, 256, (12, 2, 65))
    data = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    trainer = L.Trainer(
        accelerator="cuda", devices=1, strategy=MegatronMoEStrategy(print_layout=False), plugins=[plugin],
        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[record],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    summary = plugin.summary
    print(recipe, plugin.backend_description(), "losses", [round(x, 4) for x in record.losses])
    assert summary.te_experts and not summary.experts, "experts did not stay on te.GroupedLinear"
    te_modules = [m for layer in module.model.moe_layers() for m in layer.experts._te_modules.values()]
    assert len(te_modules) == 2 * 2  # fc1 and fc2 of both layers, one TE module each
    assert all(mod.fp8 for _, mod in te_modules), "te.GroupedLinear ran without FP8"
    assert all(torch.isfinite(torch.tensor(record.losses)))
    assert not torch.equal(record.weight.detach(), record.before), "te.Linear weights did not train"


@pytest.mark.parametrize("recipe,check", [("mxfp8", "is_mxfp8_available"), ("nvfp4", "is_nvfp4_available")])
def test_blackwell_recipes_report_te_reason_on_hopper(recipe, check):
    te = _te_capability_ok()
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs MXFP8 / NVFP4")
    from lightning_moe.precision import FP8Precision

    available, reason = getattr(te, check)(return_reason=True)
    assert not available and reason
    with pytest.raises(ValueError) as err:
        FP8Precision(recipe=recipe, backend="te")
    print(recipe, "->", err.value)
    assert reason in str(err.value)
