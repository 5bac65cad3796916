"""Selective and whole-layer recomputation of the reference decoder (`ModelConfig.recompute`,
`ModelConfig.recompute_every_n_layers`).

Module names are Megatron-Core's ``--recompute-modules``:

========================  ==================================================================
``core_attn``             the attention product ``softmax(q k^T) v`` (`AttentionCore`)
``layernorm``             the outputs of ``attention_norm`` and ``mlp_norm``, which the following
                          projections save; each is recomputed from the residual when needed
``mla_up_proj``           MLA's up-projections, rotary embedding and q/k/v assembly from the latents
``mlp``                   the dense MLP of dense blocks
``moe``                   the whole MoE block of MoE blocks (router, dispatch, experts, combine)
``moe_act``               the experts' activation output, which fc2 saves (bf16/fp32 experts)
``shared_experts``        the shared experts
========================  ==================================================================

``recompute_every_n_layers=N`` recomputes whole blocks ``0, N, 2N, ...`` (N = 1: every block);
the selective names then apply to the other blocks. Recomputation runs the same code on the
same inputs under the forward's autocast and RNG states, so gradients are the same bits; router
counters and FP8 amax histories are left as the forward left them
(`lightning_moe.nn.saved_tensors.recomputing`).

`ActivationOffload` refuses a part that a name here already covers (``layernorm`` with the norms
and ``qkv_linear``, ``moe_act`` with ``moe_act``, ...; keep one of the two) and leaves alone the
parts of blocks recomputed whole; `CUDAGraphs` refuses recomputation inside its captured modules.
"""

from __future__ import annotations

from typing import Any, Callable

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def check_recompute_supported() -> None:
    """Refuse recomputation under Transformer Engine's FP8 autocast: the backward re-runs the
    forward outside it, so TE modules would recompute different tensors than they saved."""
    from lightning_moe.precision import _te

    if _te.available() and _te.fp8_autocast_active():
        raise ValueError(
            "ModelConfig.recompute / recompute_every_n_layers cannot run under FP8Precision(backend='te'): the "
            "recomputation during backward runs outside TE's FP8 autocast. Use FP8Precision(backend='torch') or "
            "'emulated', or turn recomputation off (recompute=None, recompute_every_n_layers=None)."
        )


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` recomputed in backward (`lightning_moe.nn.saved_tensors.checkpoint`)."""
    from lightning_moe.nn.saved_tensors import checkpoint

    check_recompute_supported()
    return checkpoint(fn, *args)
