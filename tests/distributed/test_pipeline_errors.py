"""Pipeline combinations not supported fail on every rank alike with a message naming the fix
(2 gloo processes, pipeline_parallel_size=2): a model without the split hook, a training_step
whose loss carries a graph of its own (returned, or given to manual_backward), a Hugging Face
export of a model split into stages."""

import pytest
import torch
from torch.utils.data import DataLoader

from _launch import run_distributed
from _parity import MicroBatches, tiny_config


def _fit(rank, world_size, scenario):
    import lightning as L

    from lightning_moe import MegatronMoEStrategy
    from lightning_moe.models.lightning_module import MoELanguageModel

    class NoHook(L.LightningModule):
        def configure_model(self):
            self.model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))

        def training_step(self, batch, batch_idx):
            return self.model(batch["input_ids"]).float().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class ExtraTerm(MoELanguageModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = scenario != "manual_extra_term"

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(batch["input_ids"], batch["labels"])
            loss = loss + 1e-3 * sum(p.square().sum() for p in self.model.parameters())
            if not self.automatic_optimization:
                self.manual_backward(loss)
            return loss

    module = NoHook() if scenario == "no_hook" else ExtraTerm(tiny_config()) if "extra_term" in scenario else \
        MoELanguageModel(tiny_config())
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size,
        strategy=MegatronMoEStrategy(pipeline_parallel_size=2, print_layout=False),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )
    try:
        trainer.fit(module, DataLoader(MicroBatches(2), batch_size=None))
        if scenario == "save_hf":  # what MoELanguageModel.save_hf writes with; refused before anything is written
            from lightning_moe.models.hf import save_hf_weights

            save_hf_weights(module.model, f"/nonexistent/{rank}", "qwen3_moe")
    except (ValueError, RuntimeError) as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "scenario,needle",
    [
        ("no_hook", "needs a model with the pipeline split hook"),
        ("extra_term", "a loss with a gradient graph of its own"),
        ("manual_extra_term", "this loss has a gradient graph of its own"),
        ("save_hf", "save_hf is not supported under pipeline parallelism"),
    ],
)
def test_refused_on_every_rank(scenario, needle):
    messages = run_distributed(_fit, 2, scenario, timeout=120)
    assert all(message is not None and needle in message for message in messages), messages
