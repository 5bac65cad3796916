"""`AdamWBF16Moments`: AdamW whose moment estimates are stored in bf16.

``exp_avg`` and ``exp_avg_sq`` take 2 bytes per parameter each instead of 4 (the optimizer
state halves); every update runs in fp32: the moments are widened, updated, applied to the
(fp32) parameter and written back. Writing back rounds stochastically by default: bf16 keeps
8 significant bits, and ``exp_avg_sq``'s per-step change ``(1 - beta2) = 1e-3`` is below
half an ulp, so round-to-nearest would freeze it; stochastic rounding keeps it unbiased.

Use it as any optimizer (``configure_optimizers``); it works with every precision plugin.
State keys match ``torch.optim.AdamW`` (``step``, ``exp_avg``, ``exp_avg_sq``), so
checkpoints load either way (moments are cast back to bf16 after loading).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view: in-place updates land in the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def round_to_bf16_(out: Tensor, x: Tensor, stochastic: bool) -> None:
    """Write fp32 ``x`` into bf16 ``out``: nearest-even, or stochastic rounding (round the
    magnitude up with probability equal to the dropped 16 bits' fraction)."""
    if not stochastic:
        out.copy_(x)
        return
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    out.copy_(((bits + noise) & -65536).view(torch.float32))  # low 16 bits zero: exact in bf16


class AdamWBF16Moments(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) with bf16 moments.

    Args:
        params / lr / betas / eps / weight_decay: as ``torch.optim.AdamW``.
        stochastic_rounding: round the moments to bf16 stochastically (default) or to nearest.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        stochastic_rounding: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}.")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "stochastic_rounding": stochastic_rounding}
        super().__init__(params, defaults)
        self.register_load_state_dict_post_hook(AdamWBF16Moments._moments_to_bf16)

    @staticmethod
    def _moments_to_bf16(optimizer: AdamWBF16Moments) -> None:
        # Optimizer.load_state_dict casts floating state to the parameter dtype (fp32).
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    def __setstate__(self, state: dict) -> None:
        # load_state_dict replaces the param groups with the saved ones: a torch.optim.AdamW
        # checkpoint has no "stochastic_rounding" entry.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("stochastic_rounding", True)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()  # host scalar on a CPU tensor: no device sync
                param, grad = _local(p), _local(p.grad).float()
                exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m = exp_avg.float().lerp_(grad, 1 - beta1)
                v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                update = m / denom
                param.add_(update.to(param.dtype), alpha=-group["lr"] / (1 - beta1**step))
                round_to_bf16_(exp_avg, m, group["stochastic_rounding"])
                round_to_bf16_(exp_avg_sq, v, group["stochastic_rounding"])
        return loss
