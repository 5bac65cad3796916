"""`MoELanguageModel`: the reference decoder as a LightningModule (causal LM, AdamW, warmup + cosine).

Batches are ``{"input_ids": [B, S], "labels": [B, S]}`` with labels already shifted and -100 for
ignored positions (what :class:`~lightning_moe.data.datamodule.LMDataModule` yields); a packed
batch (``LMDataModule(pack_sequences=True)``) adds ``position_ids`` and ``document_ids`` ``[B, S]``,
which reach the decoder (attention within documents, see `lightning_moe.models.document_mask`). The decoder is
built in :meth:`configure_model` so that a strategy can create it on the meta device and
parallelize it before materialising. Hooks stay minimal: no host syncs beyond Lightning's own
logging.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import IGNORE_INDEX, MoEDecoder
from lightning_moe.models.hf.reader import is_hf_checkpoint_dir
from lightning_moe.models.presets import apply_overrides, get_preset
from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.resume import record_mid_epoch_stop

HF_SOURCE_KEY = "hf_source"  # checkpoint entry: the HF architecture and config.json imported from
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def resolve_model_config(
    config: Union[str, ModelConfig, dict[str, Any]], overrides: Optional[dict[str, Any]] = None
) -> ModelConfig:
    """A :class:`ModelConfig` from a preset name, a Hugging Face checkpoint directory (its
    ``config.json``), a config, or a dict of its fields, plus overrides.

    Overrides of a preset are applied before its derived values are filled in (``hidden_size``
    carries over to the MoE layer); overrides of a config or dict apply to its values as they are.
    """
    overrides = overrides or {}
    if isinstance(config, str) and is_hf_checkpoint_dir(config):
        from lightning_moe.models.hf import model_config_fields, read_hf_config

        return ModelConfig(**apply_overrides(model_config_fields(read_hf_config(config)), overrides))
    if isinstance(config, str):
        return get_preset(config, **overrides)
    if isinstance(config, ModelConfig):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError(f"config must be a preset name, a ModelConfig or a dict, got {type(config).__name__}.")
    return ModelConfig(**apply_overrides(config, overrides))


def warmup_cosine_lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` (the first step already trains), then cosine decay
    from 1 to ``min_lr_ratio`` at ``max_steps``, constant afterwards.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: ``decay`` (weight matrices, expert weights, embeddings) and ``no_decay``.

    No decay for vectors (norm weights, biases), router parameters (the gate ``[E, D]``; decaying
    it pulls the logits together and flattens routing) and shared-expert gates. Embeddings are
    decayed, as Megatron-Core does by default.

    The two groups are the same in every parallel layout (a checkpoint resumes in another one);
    where a group mixes DTensor and plain parameters, :class:`~lightning_moe.MegatronMoEStrategy`
    steps it kind by kind so that torch's ``foreach`` kernels still run.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, MoELayer):
            no_decay_ids.update(id(p) for p in module.router.parameters())
            if module.shared_experts is not None and module.shared_experts.gate_weight is not None:
                no_decay_ids.add(id(module.shared_experts.gate_weight))
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or id(param) in no_decay_ids else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def _can_fuse(params: list[nn.Parameter]) -> bool:
    """Fused AdamW (one kernel for all parameters) needs plain CUDA tensors; sharded DTensor
    parameters (FSDP, EP) keep torch's default implementation."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)


class MoELanguageModel(LightningModule):
    """Causal language modelling with :class:`MoEDecoder`.

    Args:
        config: a preset name (see :func:`~lightning_moe.models.presets.list_presets`), a
            :class:`ModelConfig`, a dict of its fields, or a Hugging Face checkpoint directory:
            its config, and its weights read once the model is built (`from_hf` with
            ``materialize=False``; on the command line ``--model.config=DIR`` fine-tunes it).
        overrides: ``ModelConfig`` fields to change (``moe`` as a partial dict of MoE fields).
        learning_rate: peak AdamW learning rate.
        min_lr_ratio: final learning rate as a fraction of the peak (cosine floor).
        warmup_steps: optimizer steps of linear warmup.
        max_steps: optimizer steps of the schedule; None: ``trainer.estimated_stepping_batches``.
        weight_decay: AdamW decoupled weight decay of the ``decay`` group (see :func:`parameter_groups`).
        betas / eps: AdamW.

    Logged: ``train/loss`` (progress bar), ``train/ppl`` and ``train/lr`` on the steps whose
    metrics Lightning writes (every ``Trainer(log_every_n_steps)`` optimizer steps) and on the
    fit's last step, the loss as the mean over all ranks (one scalar all-reduce then); the
    routers' losses ``train/<name>`` (mean over MoE blocks of ``router.latest_losses``, without
    coefficients) on every step from this rank; ``val/loss`` and ``val/ppl`` once per validation
    run, token-weighted over the batches of all ranks.
    ``training_step`` returns only the language-model loss: the aux and z losses reach the
    routers' gradients by themselves.
    """

    def __init__(
        self,
        config: Union[str, ModelConfig, dict[str, Any]] = "tiny",
        overrides: Optional[dict[str, Any]] = None,
        learning_rate: float = 3e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        max_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {learning_rate}.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")
        if warmup_steps < 0 or (max_steps is not None and max_steps <= 0):
            raise ValueError(f"need warmup_steps >= 0 and max_steps > 0 (or None), got {warmup_steps}, {max_steps}.")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
        self.model_config = resolve_model_config(config, overrides)
        # Set for an HF checkpoint directory: the checkpoint the weights come from ({"path",
        # "model_type", "config": its config.json}; kept in this module's checkpoints without the
        # path, so that `save_hf` writes the same architecture and token ids back);
        # `_pending_hf_load` while the weights still have to be read into the built model.
        self.hf_source: Optional[dict[str, Any]] = None
        self._pending_hf_load = False
        if isinstance(config, str) and is_hf_checkpoint_dir(config):
            from lightning_moe.models.hf import architecture_of, read_hf_config

            hf_config = read_hf_config(config)
            self.hf_source = {"path": config, "model_type": architecture_of(hf_config), "config": hf_config}
            self._pending_hf_load = True
        # Plain Python values only, so that checkpoints load with weights_only=True and
        # `load_from_checkpoint` rebuilds the same model (overrides are already merged in).
        self.save_hyperparameters(
            {
                "config": self.model_config.to_dict(),
                "learning_rate": learning_rate,
                "min_lr_ratio": min_lr_ratio,
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "eps": eps,
            }
        )
        self.model: Optional[MoEDecoder] = None
        self._val_loss_sum: Optional[Tensor] = None
        self._val_tokens: Optional[Tensor] = None

    @classmethod
    def from_hf(
        cls,
        path: Union[str, Path],
        *,
        materialize: bool = True,
        module_kwargs: Optional[dict[str, Any]] = None,
        **overrides: Any,
    ) -> "MoELanguageModel":
        """A module with the config and weights of a Hugging Face checkpoint directory (as
        transformers' ``save_pretrained`` writes it: ``config.json`` and ``model.safetensors`` or
        shards with ``model.safetensors.index.json``) of a Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE or
        DeepSeek-V3 model, or of a dense Llama, Qwen3 or Qwen2 model (every block dense; `upcycle`
        turns it into an MoE model).

        Args:
            path: the checkpoint directory.
            materialize: True: build the decoder on the CPU now and read the weights into it,
                tensor by tensor (a ready module, e.g. for inference or a small model). False:
                build nothing now; the Trainer's strategy builds the decoder (on the meta device
                under `MegatronMoEStrategy`), parallelizes and materializes it, and then every
                rank reads only the slices it holds, before the first step. A checkpoint that
                the Trainer restores (``ckpt_path``) replaces these weights.
            module_kwargs: other arguments of this class (``learning_rate``, ...).
            overrides: ``ModelConfig`` fields changed after the HF config is mapped (``moe`` as a
                partial dict), e.g. ``max_seq_length=4096``; weight shapes must stay the same.
        """
        from lightning_moe.models.hf import read_hf_config

        read_hf_config(path)  # a missing config.json fails here, naming the file
        module = cls(str(path), overrides=overrides, **(module_kwargs or {}))
        if materialize:
            with torch.device("meta"):
                module.configure_model()
            module.model.to_empty(device="cpu")
            module._load_pending_hf_weights()
        return module

    def save_hf(
        self,
        path: Union[str, Path],
        architecture: Optional[str] = None,
        dtype: Optional[torch.dtype] = None,
        max_shard_size: Union[int, str] = "5GB",
    ) -> None:
        """Write the model as a Hugging Face checkpoint directory that transformers'
        ``AutoModelForCausalLM.from_pretrained`` loads, from any parallel layout: call it on every
        rank (each parameter is gathered in turn; rank 0 writes).

        Args:
            architecture: "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", or for a
                model with no MoE block "llama", "qwen3" or "qwen2"; None: the one the model was
                imported from if it expresses the config, else the first that does (`ValueError`
                naming what cannot be expressed otherwise; an upcycled Qwen3 writes Qwen3-MoE, a
                Llama Mixtral, with the imported token ids).
            dtype: of the saved tensors (None: each parameter's own, fp32 masters).
            max_shard_size: bytes per safetensors shard, or a size as transformers takes it ("5GB",
                "500MB"); more than one shard adds an index.
        """
        from lightning_moe.models.hf import choose_architecture, save_hf_weights
        from lightning_moe.models.hf.config_mapping import unexpressible

        if self.model is None or any(p.is_meta for p in self.model.parameters()):
            raise RuntimeError("save_hf needs the built model with its weights (configure_model, then a fit or load).")
        base = None
        if self.hf_source is not None:
            source, source_config = self.hf_source["model_type"], self.hf_source["config"]
            if architecture is None and not unexpressible(self.model_config, source):
                architecture = source
            # the imported config.json's other entries are kept; from another family's (a dense
            # checkpoint, upcycled) only the token ids
            base = source_config if architecture == source else {
                key: source_config[key] for key in _TOKEN_ID_KEYS if source_config.get(key) is not None
            }
        arch = choose_architecture(self.model_config, architecture)
        save_hf_weights(self.model, path, arch, base_config=base, dtype=dtype, max_shard_bytes=max_shard_size)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank returns once rank 0 has written the directory

    def _load_pending_hf_weights(self) -> None:
        """Read the weights `from_hf` promised into the built, materialized (and possibly
        parallelized) model: each rank reads only the blocks of its local shards."""
        if not self._pending_hf_load or self.model is None or any(p.is_meta for p in self.model.parameters()):
            return
        from lightning_moe.models.hf import load_hf_weights

        load_hf_weights(self.model, self.hf_source["path"], self.hf_source["model_type"])
        self._pending_hf_load = False

    def parallel_constraints(self) -> dict[str, Any]:
        """Sizes a parallel layout must divide; the strategy checks them before any collective."""
        cfg = self.model_config
        out: dict[str, Any] = {
            "num_attention_heads": cfg.num_attention_heads,
            "num_query_groups": cfg.num_query_groups or cfg.num_attention_heads,
            "num_moe_layers": cfg.num_moe_layers,  # 0: expert parallelism is refused
            "context_parallel_attention": cfg.attention_type == "gqa",  # MLA: context parallelism is refused
            "num_layers": cfg.num_layers,  # pipeline chunks: at most one per block
        }
        if cfg.moe is not None:
            out["num_experts"] = cfg.moe.num_experts
            out["expert_ffn_hidden_size"] = cfg.moe.ffn_hidden_size
        return out

    def configure_model(self) -> None:
        """Build the decoder (once: Lightning may call this hook again, e.g. when resuming)."""
        if self.model is not None:
            return
        self.model = MoEDecoder(self.model_config)
        self._load_pending_hf_weights()  # from_hf(materialize=False) outside a meta-device context

    def on_fit_start(self) -> None:
        self._load_pending_hf_weights()  # after the strategy parallelized and materialized the model

    def on_validation_start(self) -> None:
        self._load_pending_hf_weights()

    def on_test_start(self) -> None:
        self._load_pending_hf_weights()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The Trainer restores a checkpoint (ckpt_path) after on_fit_start: its weights win, and a
        # validate/test run with one must not read the HF weights over them afterwards.
        self._pending_hf_load = False
        if self.hf_source is None and checkpoint.get(HF_SOURCE_KEY) is not None:
            self.hf_source = {"path": None, **checkpoint[HF_SOURCE_KEY]}

    def forward(
        self, input_ids: Tensor, position_ids: Optional[Tensor] = None, document_ids: Optional[Tensor] = None
    ) -> Tensor:
        return self.model(input_ids, position_ids, document_ids)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint saved after max_steps stopped the fit mid-epoch records that epoch as
        # running, not finished, so a resumed run goes on in it (see lightning_moe.resume).
        record_mid_epoch_stop(self.trainer, checkpoint)
        if self.hf_source is not None:
            checkpoint[HF_SOURCE_KEY] = {k: self.hf_source[k] for k in ("model_type", "config")}

    def on_train_start(self) -> None:
        # Lightning divides the loss by accumulate_grad_batches; the routers' aux/z-loss gradients
        # are injected separately and must be scaled the same way (Megatron's auto-scaler).
        scale = 1.0 / self.trainer.accumulate_grad_batches
        for moe in self.model.moe_layers():
            moe.router.aux_loss_scale = scale

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # MegatronMoEStrategy updates expert biases itself (after reducing counts over the ranks
        # that routed distinct tokens); under any other strategy every rank holds the whole
        # model and routes its own batch, so the counts are summed over the world here.
        if getattr(self.trainer.strategy, "owns_router_updates", False):
            return
        for moe in self.model.moe_layers():
            router = moe.router
            if router.expert_bias is not None:
                counts = self.trainer.strategy.reduce(router.local_tokens_per_expert.clone(), reduce_op="sum")
                router.update_expert_bias(counts)
            router.reset_step_state()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._batch_loss(batch)
        if self._writes_metrics_this_step():
            # Only on the steps whose metrics Lightning writes (it flushes when the count of
            # optimizer steps taken, this one included, is a multiple of log_every_n_steps) and
            # on the last one. The loss is the mean over all ranks: one all-reduce of a scalar
            # (data-parallel replicas read distinct batches of equal size; their TP/EP peers hold
            # the same loss, so the mean over the world is the mean over the replicas). The
            # backward uses the local loss. The lr is this step's: `self.log` turns a Python
            # float into a device tensor, a synchronous host-to-device copy on GPU.
            mean_loss = self._mean_over_ranks(self._replica_loss(loss.detach(), batch["labels"]))
            self.log("train/loss", mean_loss, on_step=True, on_epoch=False, prog_bar=True)
            self.log("train/ppl", torch.exp(mean_loss), on_step=True, on_epoch=False)
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
        for name, value in self._router_losses().items():
            self.log(f"train/{name}", value, on_step=True, on_epoch=False)
        return loss

    def _batch_loss(self, batch: dict[str, Tensor]) -> Tensor:
        """The decoder's loss on a batch, packed (``position_ids``, ``document_ids``) or not."""
        positions, documents = batch.get("position_ids"), batch.get("document_ids")
        return self.model.loss(batch["input_ids"], batch["labels"], positions, documents)

    def _replica_loss(self, loss: Tensor, labels: Tensor) -> Tensor:
        """The token mean over this data-parallel replica's batch: under context parallelism each
        rank holds a shard of it (the mean over the CP group's labelled tokens, one all-reduce; under
        dynamic CP over the DP x CP ranks sharing the replicas' batches: the strategy's loss_group)."""
        group = getattr(self.trainer.strategy, "loss_group", None)
        if group is None:
            return loss
        from lightning_moe.parallel.context_parallel import token_mean_over_group

        return token_mean_over_group(loss, labels, group)

    def _mean_over_ranks(self, value: Tensor) -> Tensor:
        """The mean of a scalar over all ranks: one all-reduce of a copy (``strategy.reduce``
        reduces in place, after a barrier)."""
        world_size = self.trainer.world_size
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return value
        total = value.float().clone()
        dist.all_reduce(total)
        return total / world_size

    def _writes_metrics_this_step(self) -> bool:
        """The steps whose metrics Lightning writes, and the fit's last step (whose loss the
        progress bar and ``trainer.callback_metrics`` then show)."""
        trainer = self.trainer
        every, step = trainer.log_every_n_steps, self.global_step + 1
        return (every > 0 and step % every == 0) or (trainer.max_steps > 0 and step >= trainer.max_steps)

    def _router_losses(self) -> dict[str, Tensor]:
        """Mean over MoE blocks of each router loss of the last forward (device tensors, no sync)."""
        per_name: dict[str, list[Tensor]] = {}
        for moe in self.model.moe_layers():
            for name, value in moe.router.latest_losses.items():
                per_name.setdefault(name, []).append(value)
        return {name: torch.stack(values).mean() for name, values in per_name.items()}

    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = None
        self._val_tokens = None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        labels = batch["labels"]
        loss = self._batch_loss(batch)
        tokens = (labels != IGNORE_INDEX).sum()
        weighted = loss.detach() * tokens
        if self._val_loss_sum is None:
            self._val_loss_sum, self._val_tokens = weighted, tokens
        else:
            self._val_loss_sum = self._val_loss_sum + weighted
            self._val_tokens = self._val_tokens + tokens
        return loss

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def _log_eval(self, prefix: str) -> None:
        if self._val_loss_sum is None:
            return
        # One all-reduce per evaluation run: the token-weighted mean over every rank's batches.
        totals = torch.stack([self._val_loss_sum.float(), self._val_tokens.float()])
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        loss = totals[0] / totals[1].clamp(min=1.0)
        # Every rank holds the same value already; sync_dist says so to Lightning (which warns
        # about epoch-level metrics logged without it) at the cost of a scalar all-reduce.
        self.log(f"{prefix}/loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{prefix}/ppl", torch.exp(loss), sync_dist=True)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Held-out loss, token-weighted like validation (logged as ``test/loss``, ``test/ppl``)."""
        return self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = list(self.model.parameters())
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model, hp.weight_decay),
            lr=hp.learning_rate,
            betas=hp.betas,
            eps=hp.eps,
            fused=_can_fuse(params) or None,
        )
        max_steps = hp.max_steps if hp.max_steps is not None else self.trainer.estimated_stepping_batches
        if not math.isfinite(max_steps):
            raise ValueError(
                "the learning-rate schedule needs a finite length: pass max_steps to MoELanguageModel "
                "or set Trainer(max_steps=...) / Trainer(max_epochs=...)."
            )
        schedule = partial(
            warmup_cosine_lr_factor,
            warmup_steps=hp.warmup_steps,
            max_steps=int(max_steps),
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
