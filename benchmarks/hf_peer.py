"""The HF transformers peer of `train_step.py`: ``Qwen3MoeForCausalLM`` of a preset's shape, trained as
the bare loop trains ours (fp32 master weights under bf16 autocast, AdamW, the same tokens per step,
each optimizer step timed from one step's end to the next).

Only shapes HF's Qwen3-MoE can express: every block MoE, no shared experts, softmax routing over
the top-k (``norm_topk_prob``), grouped-query attention with qk-norm (HF's Qwen3 always has it; a
preset without it is refused rather than timed as a different model). The experts run on HF's
``grouped_mm`` implementation where this transformers has it, attention on SDPA. The router's
auxiliary loss is on, as in ours (``output_router_logits`` with the preset's coefficient).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def hf_config(cfg: Any) -> Any:
    """``Qwen3MoeConfig`` of a `ModelConfig` (a Qwen3-MoE-shaped preset), or ValueError naming
    what HF's model cannot express."""
    from transformers import Qwen3MoeConfig

    moe = cfg.moe
    problems = []
    if moe is None:
        problems.append("a dense model")
    else:
        if moe.shared_expert_intermediate_size:
            problems.append("shared experts")
        if moe.router_score_function != "softmax":
            problems.append(f"{moe.router_score_function} router scores")
        if cfg.first_k_dense_layers or cfg.moe_layer_freq != 1:
            problems.append("dense blocks")
    if not cfg.qk_norm:
        problems.append("no qk-norm (HF's Qwen3 always normalizes q and k)")
    if cfg.tie_word_embeddings:
        problems.append("tied embeddings")
    if problems:
        raise ValueError(f"--peer hf times HF's Qwen3-MoE; this preset has {', '.join(problems)}")
    config = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
        intermediate_size=cfg.ffn_hidden_size or moe.ffn_hidden_size, moe_intermediate_size=moe.ffn_hidden_size,
        num_experts=moe.num_experts, num_experts_per_tok=moe.router_topk, norm_topk_prob=True,
        max_position_embeddings=cfg.max_seq_length, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        output_router_logits=moe.aux_loss_coeff > 0, router_aux_loss_coef=moe.aux_loss_coeff,
        initializer_range=cfg.init_method_std, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "grouped_mm"
    return config


def hf_model(cfg: Any, device: str) -> torch.nn.Module:
    """HF's model of ``cfg`` in fp32 (the master weights) on ``device``."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device(device):
        model = Qwen3MoeForCausalLM(hf_config(cfg))
    return model.train()


def hf_loop(args: Any, cfg: Any, batches: Any, device: str = "cuda") -> tuple[list[float], list[float]]:
    """Time ``args.steps`` optimizer steps (after ``args.warmup``) of HF's model: ``args.accumulate``
    micro-batches from ``batches`` each, then AdamW (lr 1e-4, the bare loop's peak rate). Returns
    (step times after the warm-up, the mean loss of every step)."""
    torch.manual_seed(0)
    model = hf_model(cfg, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                  fused=device == "cuda")
    data = batches(args, cfg.vocab_size, (args.warmup + args.steps) * args.accumulate, device)
    cuda = device == "cuda"
    times: list[float] = []
    losses: list[torch.Tensor] = []
    if cuda:
        torch.cuda.synchronize()  # host sync: the first step's start
    last_end = time.perf_counter()
    for _ in range(args.warmup + args.steps):
        window_loss = 0.0
        for _ in range(args.accumulate):
            batch = next(data)
            with torch.autocast(device, dtype=torch.bfloat16):
                # no labels: HF would shift them (ours are the next tokens already) and add its own loss pass
                out = model(input_ids=batch["input_ids"], use_cache=False)
                loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch["labels"].flatten())
            if getattr(out, "aux_loss", None) is not None:
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            (loss / args.accumulate).backward()
            window_loss = window_loss + loss.detach() / args.accumulate
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()  # host sync: the step's end
        now = time.perf_counter()
        times.append(now - last_end)
        last_end = now
        losses.append(window_loss)
    losses_list = torch.stack(losses).tolist()
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return times[args.warmup :], losses_list
