"""FP8 (emulated) through Trainer + MegatronMoEStrategy under EP=2: trains, loss falls, and the
checkpoint holds high-precision weights only."""

import torch
from torch.utils.data import DataLoader

from _launch import run_distributed
from _parity import MicroBatches, tiny_config


def fp8_ep2(rank, world_size, recipe):
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel
    from lightning_moe.precision import FP8Precision

    torch.manual_seed(0)
    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    strategy = MegatronMoEStrategy(expert_parallel_size=2, print_layout=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=40,
        plugins=[FP8Precision(recipe=recipe, backend="emulated", device="cpu")],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[Record()], num_sanity_val_steps=0, limit_val_batches=0,
    )
    data = MicroBatches(8)  # a small fixed set, revisited: the loss must fall
    indices = [i for i in range(8) if i % 2 == rank] * 20
    model = MoELanguageModel(tiny_config(), learning_rate=3e-3, warmup_steps=0, max_steps=40)
    trainer.fit(model, DataLoader(data, batch_size=None, sampler=indices))
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    dtypes = {str(v.dtype) for v in model.state_dict().values() if torch.is_floating_point(v)}
    return losses[0], sum(losses[-5:]) / 5, experts[0].quantization is not None, sorted(dtypes)


def test_fp8_emulated_trains_under_ep2():
    for first, last, quantized, dtypes in run_distributed(fp8_ep2, 2, "tensorwise", timeout=240):
        assert quantized
        assert last < first - 0.5, (first, last)
        assert dtypes == ["torch.float32"]
