"""A naive per-token MoE: the readable definition the fast layer is tested against.

Loops over tokens and their top-k experts with plain matmuls, using the layer's own router and
weights. Slow by design; for tests and for correctness checks in benchmarks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_moe.nn.experts import activate, fc1_matrix, local_tensor
from lightning_moe.nn.moe_layer import MoELayer


def naive_moe_forward(layer: MoELayer, x: Tensor) -> Tensor:
    """``sum_k p[t,k] * expert_{e[t,k]}(x[t])`` (+ shared experts) for every token ``t``."""
    cfg = layer.config
    x_TD = x.reshape(-1, cfg.hidden_size)
    routing = layer.router(x if x.dim() == 3 else x_TD)
    fc1 = fc1_matrix(local_tensor(layer.experts.fc1_weight))
    fc2 = local_tensor(layer.experts.fc2_weight)
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for k in range(cfg.router_topk):
            if routing.keep_TK is not None and not bool(routing.keep_TK[t, k]):
                continue
            e = int(routing.experts_TK[t, k])
            p = routing.probs_TK[t, k].to(x_TD.dtype)
            token = x_TD[t] * p if cfg.apply_probs_on_input else x_TD[t]
            out = activate(token @ fc1[e].to(x_TD.dtype), cfg.activation) @ fc2[e].to(x_TD.dtype)
            acc = acc + (out if cfg.apply_probs_on_input else p * out)
        rows.append(acc)
    y_TD = torch.stack(rows)
    if layer.shared_experts is not None:
        y_TD = y_TD + layer.shared_experts(x_TD)
    return y_TD.view(x.shape)
