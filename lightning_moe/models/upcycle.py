"""Upcycling: turn the dense SwiGLU MLPs of a model into `MoELayer`s whose output equals theirs.

Megatron-Core's ``upcycling_utils`` and "Upcycling Large Language Models into Mixture of
Experts" (arXiv 2410.07524): every expert starts as a copy of the dense MLP (granularity 1), or
the dense MLP's ``F`` intermediate columns are cut into ``G`` shards of ``F / G`` and each expert
is one shard (granular upcycling, ``G = granularity``).

Why the output is unchanged. A SwiGLU MLP is a sum over its intermediate columns::

    mlp(x) = sum_f down[:, f] * silu(gate[f] . x) * (up[f] . x)

so cutting the columns into shards ``S_0 .. S_{G-1}`` gives ``mlp(x) = sum_i shard_i(x)``
exactly. Expert ``e`` holds shard ``e mod G``; the experts ``b*G .. b*G + G-1`` form block ``b``
(one whole copy of the MLP), and their router rows are all set to router row ``b`` (Megatron's
router processing: the first ``E / G`` rows, each repeated ``G`` times). The ``G`` experts of a
block then have bit-identical logits, so a top-k with ``k = m*G`` takes ``m`` whole blocks (a
tie across blocks has probability zero). With the combine weights ``p_e`` of the chosen
experts summing to ``c`` (the ``router_topk_scaling_factor``, 1 when unset) and equal inside a
block, the layer computes::

    y = sum_blocks w_b * (c / G) * sum_i shard_i(x) * s      (sum_b w_b = 1)
      = mlp(x)   for   s = G / c,

where ``s`` scales each expert's down projection. Only the down projection is scaled: it is
linear, whereas Megatron's ``moe_activation_scale ** (1/3)`` on both projections passes through
``silu`` and is exact only for homogeneous activations.

The combine weights sum to ``c`` for softmax over the top-k logits (``router_pre_softmax=False``),
for softmax before top-k only when every expert is chosen (``router_topk == num_experts``), for
sigmoid scores with ``router_topk > 1`` (normalised), and whenever ``router_topk_renormalize=True``.
Token dropping (``expert_capacity_factor``) drops parts of the sum, and ``apply_probs_on_input``
puts ``p`` inside the activation: :func:`upcycle` refuses these (and ``router_topk`` not a multiple
of ``G``, and group-limited routing whose groups would split a block) unless ``exact=False``. A
shared expert starts with a zero down projection, so it adds nothing at step 0 and trains from there.

Targets the reference decoder's `DenseMLP` (``gate_proj``, ``up_proj``, ``down_proj``), which is
also what a dense Llama/Qwen3 checkpoint imported into `MoEDecoder` holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.decoder import DecoderLayer, DenseMLP, MoEDecoder
from lightning_moe.nn.config import MoEConfig, check_field_names
from lightning_moe.nn.moe_layer import MoELayer


def exactness_problems(cfg: MoEConfig, granularity: int) -> list[str]:
    """Why an upcycled layer with ``cfg`` would not reproduce the dense MLP at step 0 (empty: it does)."""
    problems = []
    k, e, g = cfg.router_topk, cfg.num_experts, granularity
    if k % g:
        problems.append(f"router_topk={k} is not a multiple of granularity={g} (top-k would take part of a block)")
    if cfg.router_score_function == "softmax" and cfg.router_pre_softmax and k != e and not cfg.renormalizes_topk:
        problems.append("router_pre_softmax=True: the top-k softmax weights sum to less than 1, differently per token "
                        "(set router_pre_softmax=False or router_topk_renormalize=True)")
    if cfg.router_score_function == "sigmoid" and not cfg.renormalizes_topk:
        problems.append("sigmoid scores are not renormalised here (router_topk=1 or router_topk_renormalize=False): "
                        "set router_topk_renormalize=True")
    if cfg.expert_capacity_factor is not None:
        problems.append("expert_capacity_factor drops assignments (set it to None for dropless routing)")
    if cfg.apply_probs_on_input:
        problems.append("apply_probs_on_input scales the expert input inside the activation (set it to False)")
    if cfg.router_num_groups is not None and (e // cfg.router_num_groups) % g:
        problems.append(f"router_num_groups={cfg.router_num_groups} gives groups of {e // cfg.router_num_groups} "
                        f"experts, which split the blocks of {g} (use groups whose size is a multiple of {g})")
    return problems


def upcycle(
    module: nn.Module,
    num_experts: int,
    router_topk: int,
    granularity: int = 1,
    layers: Optional[Iterable[int]] = None,
    exact: bool = True,
    **moe_fields: Any,
) -> nn.Module:
    """Replace dense SwiGLU MLPs of ``module`` by upcycled `MoELayer`s, in place; returns ``module``.

    Args:
        module: a `MoEDecoder`, a LightningModule holding one as ``.model`` with a ``model_config``
            (`MoELanguageModel` after ``configure_model``), or any module holding `DecoderLayer`s.
        num_experts: experts ``E`` per layer; a multiple of ``granularity``.
        router_topk: experts per token ``K``.
        granularity: ``G``: each expert holds ``1/G`` of the dense MLP's intermediate columns
            (``ffn_hidden_size / G``); 1 copies the whole MLP into every expert.
        layers: indices of the decoder layers to upcycle (default: every dense one of a `MoEDecoder`).
        exact: refuse a configuration whose step-0 output would differ from the dense model's
            (see :func:`exactness_problems`); False builds it anyway (weights as in the exact case).
        **moe_fields: other `MoEConfig` fields (``aux_loss_coeff``, ``router_score_function``, ...).

    The `MoEDecoder`'s ``config`` (and a LightningModule's ``model_config`` and saved
    hyperparameters) are updated to the new layer pattern, so checkpoints rebuild the MoE model.
    """
    decoder = _find_decoder(module)
    _check_weights_loaded(module, decoder)
    layer_modules = _decoder_layers(module, decoder)
    if layers is None:
        chosen = [i for i, layer in layer_modules.items() if isinstance(layer.mlp, DenseMLP)]
    else:
        chosen = sorted(set(int(i) for i in layers))
        missing = [i for i in chosen if i not in layer_modules]
        if missing:
            raise ValueError(f"upcycle: layers {missing} do not exist (the model has layers {sorted(layer_modules)}).")
    if not chosen:
        raise ValueError("upcycle: the model has no dense SwiGLU MLP (DenseMLP) to upcycle.")
    for i in chosen:
        if not isinstance(layer_modules[i].mlp, DenseMLP):
            raise ValueError(f"upcycle: layer {i}'s mlp is a {type(layer_modules[i].mlp).__name__}, not a DenseMLP; "
                             "leave it out of `layers`.")
    dense = layer_modules[chosen[0]].mlp
    cfg = upcycled_config(dense, num_experts, router_topk, granularity, exact, **moe_fields)
    if decoder is not None and decoder.config.moe is not None and decoder.config.moe != cfg:
        raise ValueError(
            "upcycle: the model already has MoE layers of another configuration, and ModelConfig holds one; "
            "pass the same MoEConfig fields as its `moe` (or upcycle a dense model)."
        )
    for i in chosen:
        layer = layer_modules[i]
        layer.mlp = upcycle_mlp(layer.mlp, cfg, granularity, output_init_std=_output_init_std(decoder, layer.mlp))
    if decoder is not None:
        _update_model_config(module, decoder, cfg)
    return module


def upcycled_config(dense: DenseMLP, num_experts: int, router_topk: int, granularity: int = 1, exact: bool = True,
                    **moe_fields: Any) -> MoEConfig:
    """The `MoEConfig` of the layer upcycled from ``dense`` (checked as :func:`upcycle` describes)."""
    check_field_names("MoEConfig", moe_fields, (f.name for f in dataclasses.fields(MoEConfig)))
    fixed = {"hidden_size", "ffn_hidden_size", "num_experts", "router_topk", "activation"} & set(moe_fields)
    if fixed:
        raise ValueError(f"upcycle: {sorted(fixed)} follow from the dense MLP and the arguments; drop them.")
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"upcycle: granularity must be an int >= 1, got {granularity!r}.")
    ffn, hidden = dense.gate_proj.weight.shape
    if ffn % granularity:
        raise ValueError(f"upcycle: granularity={granularity} must divide the dense ffn_hidden_size={ffn}.")
    if num_experts % granularity:
        raise ValueError(f"upcycle: num_experts={num_experts} must be a multiple of granularity={granularity} "
                         "(each block of `granularity` experts is one copy of the dense MLP).")
    moe_fields.setdefault("init_method_std", dense.gate_proj.init_std)
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn // granularity, num_experts=num_experts,
                    router_topk=router_topk, activation="swiglu", **moe_fields)
    problems = exactness_problems(cfg, granularity)
    if exact and problems:
        raise ValueError("upcycle: the upcycled model would not reproduce the dense one at step 0: "
                         + "; ".join(problems) + ". Or pass exact=False to accept that.")
    return cfg


@torch.no_grad()
def upcycle_mlp(dense: DenseMLP, cfg: MoEConfig, granularity: int = 1,
                output_init_std: Optional[float] = None) -> MoELayer:
    """A `MoELayer` of ``cfg`` upcycled from ``dense`` (see the module doc for the construction).

    The router's weight is drawn as ``MoELayer`` draws it (Normal(0, ``init_method_std``), from the
    global RNG), then its first ``E / G`` rows are repeated ``G`` times each. The layer is built on
    the dense weights' device; the experts take their dtype, the router stays fp32.
    """
    weight = dense.gate_proj.weight
    num_blocks = cfg.num_experts // granularity
    shard = cfg.ffn_hidden_size
    with torch.device(weight.device):
        layer = MoELayer(cfg, output_init_std=output_init_std)
    layer.experts.to(weight.dtype)
    if layer.shared_experts is not None:
        layer.shared_experts.to(weight.dtype)
        layer.shared_experts.linear_fc2.weight.zero_()  # adds nothing at step 0
    # [F, D] -> [G, D, F/G] per projection: shard i holds intermediate columns i*F/G .. (i+1)*F/G - 1
    gate_GDS = dense.gate_proj.weight.view(granularity, shard, -1).transpose(1, 2)
    up_GDS = dense.up_proj.weight.view(granularity, shard, -1).transpose(1, 2)
    down_GSD = dense.down_proj.weight.view(-1, granularity, shard).permute(1, 2, 0)
    scale = granularity / (cfg.router_topk_scaling_factor or 1.0)
    # expert e = block e // G, shard e % G: the shard tensors repeat once per block
    fc1 = layer.experts.fc1_weight  # [E, D, 2, F/G] (gate, up)
    fc1[:, :, 0, :] = gate_GDS.repeat(num_blocks, 1, 1)
    fc1[:, :, 1, :] = up_GDS.repeat(num_blocks, 1, 1)
    layer.experts.fc2_weight.copy_((down_GSD * scale).repeat(num_blocks, 1, 1))
    router_EW = layer.router.weight
    router_EW.copy_(router_EW[:num_blocks].repeat_interleave(granularity, dim=0))
    return layer


def _find_decoder(module: nn.Module) -> Optional[MoEDecoder]:
    if isinstance(module, MoEDecoder):
        return module
    inner = getattr(module, "model", None)
    if isinstance(inner, MoEDecoder):
        return inner
    if hasattr(module, "model_config") and inner is None:
        raise ValueError("upcycle: the LightningModule has no model yet; call module.configure_model() first.")
    return None


def _check_weights_loaded(module: nn.Module, decoder: Optional[MoEDecoder]) -> None:
    """Upcycle real weights only: not meta tensors, nor a model whose HF weights are still to come."""
    if getattr(module, "_pending_hf_load", False):
        raise ValueError("upcycle: the module's Hugging Face weights are not loaded yet; use "
                         "MoELanguageModel.from_hf(path, materialize=True) before upcycling.")
    if any(p.is_meta for p in (decoder or module).parameters()):
        raise ValueError("upcycle: the model is on the meta device; materialize and load its weights first.")


def _decoder_layers(module: nn.Module, decoder: Optional[MoEDecoder]) -> dict[int, DecoderLayer]:
    if decoder is not None:
        return {int(name): layer for name, layer in decoder.layers.items()}
    found = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    if not found:
        raise ValueError(f"upcycle: {type(module).__name__} holds no DecoderLayer (the reference decoder's block).")
    return dict(enumerate(found))


def _output_init_std(decoder: Optional[MoEDecoder], dense: DenseMLP) -> float:
    return decoder.config.output_init_std if decoder is not None else dense.down_proj.init_std


def _update_model_config(module: nn.Module, decoder: MoEDecoder, cfg: MoEConfig) -> None:
    """The decoder's (and a LightningModule's) `ModelConfig` with the new MoE layer pattern."""
    pattern = [int(layer.is_moe) for layer in decoder.layers.values()]
    fields = decoder.config.to_dict()
    fields.update(moe=cfg, moe_layer_freq=pattern, first_k_dense_layers=0)
    new_config = ModelConfig(**fields)
    decoder.config = new_config
    if hasattr(module, "model_config"):
        module.model_config = new_config
        # An HF import keeps its hf_source: save_hf writes the imported family if it still expresses
        # the config, else the first (MoE) family that does, with the imported token ids.
        # what checkpoints save (hparams) and what loggers write (Lightning keeps a copy of the
        # initial hyperparameters for them)
        for hparams in (getattr(module, "hparams", None), getattr(module, "_hparams_initial", None)):
            if hparams is not None and "config" in hparams:
                hparams["config"] = new_config.to_dict()
