"""Router replay: record the experts each router chose, then make later forwards use exactly those.

Megatron-Core's ``RouterReplay`` for reinforcement learning: the policy's rollout (or an inference
engine) routes the tokens once; the training forward over the same tokens must send them to the
same experts, or the log-probabilities it trains on are not those of the rollout. In a replayed
forward the router's top-k *selection* is replaced by the recorded expert ids, while the combine
weights are still computed from the current router logits at those experts (the score function,
pre-softmax, top-k renormalisation, scaling factor: as the config says), so the router keeps
receiving gradients.

::

    with RouterReplay.record(model) as replay:   # e.g. under torch.no_grad(), the rollout
        model(tokens)
    with replay.replay(model):                   # the training forward(s), same inputs, same order
        loss = model.loss(tokens, labels)
    loss.backward()

Per router (keyed by its module name in ``model``), every forward during ``record`` appends one
entry; every forward during ``replay`` consumes the next one, so micro-batches are replayed in the
order they were recorded (each ``replay`` context starts again at the first). What is replayed:

* the top-k experts ``[T, K]``: group-limited routing and the expert bias (which only steer the
  selection) are bypassed;
* the capacity keep-mask: the assignments the recorded forward dropped are dropped again (the
  "probs" drop policy would otherwise re-decide from the new probabilities).

Unchanged in a replayed forward: the aux and z losses (computed from the current logits, as in
Megatron), the expert-bias token counters (they count the replayed assignments). Nothing here
reads a device value back to the host except `from_experts`, which checks ids given from outside.
Plain PyTorch: module hooks on each `TopKRouter`, no Lightning.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from torch import Tensor, nn

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.router import RoutingResult, TopKRouter
from lightning_moe.nn.saved_tensors import recomputing

# Routers inside a `RouterReplay.replay` block: two replays of one router would both feed it.
_REPLAYING: "weakref.WeakSet[TopKRouter]" = weakref.WeakSet()


@dataclass(frozen=True)
class ReplayedRouting:
    """One recorded routing decision of one router, as `route` takes it back (``replayed=``).

    Attributes:
        experts_TK: int64 ``[T, K]`` expert ids (on the device they were recorded on).
        keep_TK: bool ``[T, K]`` capacity keep-mask, or None for a dropless forward.
        num_experts: ``E`` of the router that made it.
        name: the router's module name (for error messages).
    """

    experts_TK: Tensor
    keep_TK: Optional[Tensor]
    num_experts: int
    name: str = "router"

    def select(self, scores_TE: Tensor, cfg: MoEConfig) -> tuple[Tensor, Tensor]:
        """``(scores at the recorded experts [T, K], experts [T, K])``: the stand-in for top-k.

        ``scores_TE`` is whatever `route` would take the top-k of (logits, softmax or sigmoid
        scores, with the bias added when it selects): gathering the scores is what the score
        function's top-k values are, and the bias-free probabilities are gathered by `route`
        itself, as for a chosen top-k.
        """
        self._check(scores_TE.shape[0], cfg)
        experts_TK = self.experts_TK.to(scores_TE.device)
        return scores_TE.gather(1, experts_TK), experts_TK

    def _check(self, num_tokens: int, cfg: MoEConfig) -> None:
        recorded = tuple(self.experts_TK.shape)
        if recorded != (num_tokens, cfg.router_topk) or self.num_experts != cfg.num_experts:
            raise ValueError(
                f"RouterReplay: {self.name} recorded {recorded[0]} tokens x top-{recorded[1]} of {self.num_experts} "
                f"experts, but this forward routes {num_tokens} tokens x top-{cfg.router_topk} of {cfg.num_experts}: "
                "replay the inputs of the recorded forwards (same batch and sequence shapes, same order) on a model "
                "of the same MoE configuration."
            )
        dropless = cfg.expert_capacity(num_tokens) is None
        if dropless != (self.keep_TK is None):
            raise ValueError(
                f"RouterReplay: {self.name} was recorded {'with' if self.keep_TK is not None else 'without'} token "
                f"dropping, this forward routes {'without' if dropless else 'with'} it: keep expert_capacity_factor "
                "as it was when recording."
            )


class RouterReplay:
    """Recorded routing decisions of a model's routers (`TopKRouter` modules), replayable.

    Build one with `record` (a context manager over the forwards to record) or `from_experts`
    (expert ids from elsewhere, e.g. an inference engine); replay with `replay`.

    Attributes:
        routings: ``{router name: [ReplayedRouting per recorded forward]}``.
    """

    def __init__(self, routings: Optional[dict[str, list[ReplayedRouting]]] = None) -> None:
        self.routings: dict[str, list[ReplayedRouting]] = routings if routings is not None else {}

    @property
    def experts(self) -> dict[str, list[Tensor]]:
        """``{router name: [experts_TK per forward]}``, the recorded expert ids."""
        return {name: [r.experts_TK for r in entries] for name, entries in self.routings.items()}

    @classmethod
    @contextmanager
    def record(cls, model: nn.Module) -> Iterator["RouterReplay"]:
        """Record every forward of ``model``'s routers inside the ``with`` block; yields the recording."""
        routers = _routers(model)
        recording = cls({name: [] for name in routers})
        handles = []
        for name, router in routers.items():
            def save(module: TopKRouter, args, result: RoutingResult, name: str = name) -> None:
                keep = None if result.keep_TK is None else result.keep_TK.detach()
                recording.routings[name].append(ReplayedRouting(result.experts_TK.detach(), keep,
                                                                result.num_experts, name))
            handles.append(router.register_forward_hook(save))
        try:
            yield recording
        finally:
            for handle in handles:
                handle.remove()

    @classmethod
    def from_experts(cls, model: nn.Module, experts: dict[str, list[Tensor]]) -> "RouterReplay":
        """A replay of expert ids chosen elsewhere: ``{router name: [int [T, K] per forward]}``,
        for dropless routers of ``model``. Checks each tensor's values (ids in ``[0, E)``, no
        expert twice for one token): one device-to-host sync per tensor, here and not in the forwards."""
        routers = _routers(model)
        _check_names(routers, experts)
        routings: dict[str, list[ReplayedRouting]] = {}
        for name, tensors in experts.items():
            cfg = routers[name].cfg
            if cfg.expert_capacity_factor is not None:
                raise ValueError(f"RouterReplay.from_experts: {name} drops tokens (expert_capacity_factor); expert ids "
                                 "alone do not say which assignments to drop: record the forward instead.")
            routings[name] = []
            for experts_TK in tensors:
                if experts_TK.dim() != 2 or experts_TK.dtype.is_floating_point:
                    raise ValueError(f"RouterReplay.from_experts: {name} needs integer [T, K] expert ids, got "
                                     f"{experts_TK.dtype} {tuple(experts_TK.shape)}.")
                experts_TK = experts_TK.long()
                sorted_TK = experts_TK.sort(dim=1).values
                # device-to-host sync: validate ids from outside once, before any forward uses them
                bad = bool((experts_TK < 0).any() | (experts_TK >= cfg.num_experts).any()
                           | (sorted_TK[:, 1:] == sorted_TK[:, :-1]).any())
                if bad:
                    raise ValueError(f"RouterReplay.from_experts: {name} has ids outside [0, {cfg.num_experts}) or an "
                                     "expert twice for one token.")
                routings[name].append(ReplayedRouting(experts_TK, None, cfg.num_experts, name))
        return cls(routings)

    @contextmanager
    def replay(self, model: nn.Module) -> Iterator["RouterReplay"]:
        """Inside the ``with`` block, forward ``i`` of each router of ``model`` uses recorded entry ``i``."""
        routers = _routers(model)
        _check_names(routers, self.routings)
        busy = [name for name, router in routers.items() if router in _REPLAYING]
        if busy:
            raise RuntimeError(f"RouterReplay: {busy[0]} is already replaying; leave the other replay first.")
        handles = []
        for name, router in routers.items():
            entries, cursor = self.routings[name], [0]

            def take_next(module: TopKRouter, args, name: str = name, entries=entries, cursor=cursor) -> None:
                if recomputing():
                    raise RuntimeError(f"RouterReplay: {name} is being recomputed in backward, which would replay the "
                                       "next entry: replay without recomputing the MoE blocks (drop 'moe' from "
                                       "ModelConfig.recompute and set recompute_every_n_layers=None).")
                if cursor[0] >= len(entries):
                    raise RuntimeError(f"RouterReplay: {name} recorded {len(entries)} forward(s); this is forward "
                                       f"{cursor[0] + 1} of the replay. Replay the forwards that were recorded.")
                module.replayed_routing = entries[cursor[0]]
                cursor[0] += 1

            def clear(module: TopKRouter, args, output) -> None:
                module.replayed_routing = None

            handles += [router.register_forward_pre_hook(take_next), router.register_forward_hook(clear)]
            _REPLAYING.add(router)
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for router in routers.values():
                router.replayed_routing = None
                _REPLAYING.discard(router)


def _routers(model: nn.Module) -> dict[str, TopKRouter]:
    routers = {name: m for name, m in model.named_modules() if isinstance(m, TopKRouter)}
    if not routers:
        raise ValueError(f"RouterReplay: {type(model).__name__} holds no TopKRouter (no MoE layer).")
    return routers


def _check_names(routers: dict[str, TopKRouter], recorded: dict[str, object]) -> None:
    missing, extra = sorted(set(routers) - set(recorded)), sorted(set(recorded) - set(routers))
    if missing or extra:
        raise ValueError(
            "RouterReplay: the model's routers and the recorded ones differ "
            f"(not recorded: {missing or 'none'}; recorded but absent: {extra or 'none'}): replay on the model "
            "(or a copy of it) that was recorded."
        )
