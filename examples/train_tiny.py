"""Train the `tiny` MoE on the embedded corpus with the Python API (no YAML, no CLI).

    python examples/train_tiny.py                          # 1 process on CPU (or 1 GPU, bf16)
    python examples/train_tiny.py --devices 2 --ep 2       # 2 processes, 4 experts each

The same run as `lightning-moe fit --config examples/configs/tiny_cpu.yaml`, written out: a
Trainer with `MegatronMoEStrategy`, the `MoELanguageModel` LightningModule, the `LMDataModule`
and the two MoE callbacks. Prints the validation loss next to the corpus's unigram entropy.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_moe import MegatronMoEStrategy
from lightning_moe.callbacks import MoEMonitor, MoEProgressBar, MoEThroughput
from lightning_moe.data import LMDataModule, load_corpus, unigram_entropy_nats
from lightning_moe.models import MoELanguageModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs, or CPU processes without a GPU)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides 8 experts and --devices)")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--out", default="runs", help="directory for logs and checkpoints")
    args = parser.parse_args()

    seed_everything(1234)
    gpu = torch.cuda.is_available()
    model = MoELanguageModel(
        "tiny", overrides={"max_seq_length": args.seq_length}, learning_rate=args.learning_rate, warmup_steps=30
    )
    data = LMDataModule(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
    trainer = Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=args.devices,
        strategy=MegatronMoEStrategy(expert_parallel_size=args.ep),
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=args.max_steps,
        val_check_interval=100,
        limit_val_batches=32,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        gradient_clip_val=1.0,
        logger=CSVLogger(args.out, name="train_tiny"),
        callbacks=[
            MoEProgressBar(),
            MoEMonitor(heatmap_every_n_steps=100),
            MoEThroughput(),
            ModelCheckpoint(save_last="link"),
        ],
    )
    trainer.fit(model, datamodule=data)
    val = trainer.callback_metrics.get("val/loss")
    if trainer.is_global_zero and val is not None:
        entropy = unigram_entropy_nats(load_corpus().val_tokens)
        print(f"validation loss {float(val):.3f} nats/byte; unigram entropy of the validation split {entropy:.3f}")


if __name__ == "__main__":
    main()
