"""`MoEConfig`: one validated description of a Mixture-of-Experts layer.

Field names are Megatron-Core's ``moe_*`` flags without the prefix where one exists, so a
Megatron user can translate a launch script line by line (README.md carries the table).
"""

from __future__ import annotations

import difflib
import functools
import math
import typing
from dataclasses import dataclass, fields
from typing import Literal, Optional, Union

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_LOGITS_GEMMS = ("fp32", "bf16x3")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("swiglu", "gelu", "relu", "squared_relu")
EXPERT_BACKENDS = ("auto", "grouped_mm", "te", "loop")
DISPATCHER_TYPES = ("alltoall", "allgather", "deepep")
DISPATCH_TRANSPORTS = ("nccl", "copy_engine")


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of one MoE layer.

    Frozen: a field is never changed in place (assigning one raises
    ``dataclasses.FrozenInstanceError``). A setting derived later, such as the expert alignment an
    FP8 recipe needs, makes a new config with ``dataclasses.replace``, which `MoELayer.set_config`
    hands to the layer, its router and its dispatcher at once (``MoELayer.set_expert_alignment``
    for the alignment), so that they always hold the same object. One config may be shared by
    several layers (a model's ``ModelConfig.moe``): what one layer derives leaves the others, and
    the model's configuration, as they were.

    Args:
        hidden_size: model width ``D`` (Megatron ``hidden_size``).
        ffn_hidden_size: width ``F`` of each routed expert (``moe_ffn_hidden_size``).
        num_experts: number of routed experts ``E`` (``num_moe_experts``).
        router_topk: experts per token ``K`` (``moe_router_topk``).
        router_score_function: "softmax" or "sigmoid".
        router_pre_softmax: softmax over all experts before top-k (default: softmax over the
            selected k logits). Required when ``router_topk == 1`` with softmax, as in Megatron.
        router_num_groups / router_group_topk: group-limited routing (DeepSeek-V3): experts are
            split into ``router_num_groups`` groups, tokens pick experts only from the
            ``router_group_topk`` best groups.
        router_group_score_topk: a group's score is the sum of its best ``router_group_score_topk``
            expert scores (biased ones under ``router_enable_expert_bias``); None:
            ``router_topk // router_group_topk`` as Megatron-Core. DeepSeek-V3's own and HF's code
            always sum the best 2 (the same number for its top-8 of 4 groups, not for other shapes).
        router_topk_scaling_factor: multiplies the routing probabilities after top-k.
        router_topk_renormalize: whether the ``K`` chosen weights are divided by their sum (before
            the scaling factor). None (default): Megatron-Core's rule (``topk_routing_with_score_function``):
            sigmoid scores are renormalised when ``K > 1`` only, softmax over the top-k logits sums to 1
            by construction, ``router_pre_softmax`` weights are the full softmax's, not renormalised.
            True: renormalise always, also one sigmoid weight (it becomes 1, as HF's DeepSeek-V3 with
            ``norm_topk_prob`` and one expert per token) and pre-softmax weights (HF's
            ``norm_topk_prob=True``). False: never (sigmoid scores used as they are, HF's DeepSeek-V3
            ``norm_topk_prob=False``); refused with softmax over the top-k logits, which is normalised
            by construction (set ``router_pre_softmax=True``). No Megatron flag.
        router_enable_expert_bias: aux-loss-free balancing with an fp32 ``expert_bias`` used for
            selection only (sigmoid routing only, as in Megatron).
        router_bias_update_rate: step of the bias update ``bias += rate * sign(mean - count)``.
        router_logits_gemm: how the fp32 logits are computed from the tokens. "fp32" (default):
            fp32 products on the CUDA cores, as ``F.linear(x.float(), W)`` (Megatron-Core's
            ``moe_router_dtype="fp32"``). "bf16x3": for bf16 tokens on CUDA, the fp32 weight split
            exactly into three bf16 parts, multiplied on the tensor cores with fp32 outputs (about
            3x faster at qwen3's shape; logits to ~2^-17 relative where the CUDA cores give ~2^-20,
            against 2^-8 for bf16 logits; see ``nn.router_logits``); other tokens (fp32 ones, as under
            bf16-mixed autocast, or CPU ones) take "fp32" with a one-time warning.
        router_load_balancing_type: one of "aux_loss", "seq_aux_loss", "global_aux_loss",
            "none", or a list of them (one coefficient each in ``aux_loss_coeff``).
        aux_loss_coeff: coefficient(s) of the load-balancing loss(es).
        z_loss_coeff: coefficient of the router z-loss (None: off).
        input_jitter_eps: multiplicative uniform jitter on router input in training (None: off).
        expert_capacity_factor: capacity per expert as a multiple of ``T*K/E`` (None: dropless).
        token_drop_policy: "probs" keeps the highest-probability tokens of a full expert,
            "position" keeps the earliest ones.
        pad_expert_input_to_capacity: pad every expert's input to exactly its capacity.
        shared_expert_intermediate_size: width of the shared expert(s) MLP (None: none).
        shared_expert_gate: gate the shared expert output by ``sigmoid(x @ w)``.
        token_dispatcher_type: "alltoall", "allgather" or "deepep" (used under expert
            parallelism; a single rank always dispatches locally).
        dispatch_chunks: all-to-all dispatcher only: split each micro-batch's tokens into this
            many chunks whose all-to-alls overlap the other chunks' expert GEMMs (one CUDA
            stream per chunk, forward and backward); 1 = no pipelining. Measured slower than 1
            on 2 x H200 with ``torch._grouped_mm`` experts, whose kernels hold every SM, hence
            off by default.
        dispatch_transport: how the all-gather dispatcher moves rows: "nccl" (the process
            group's all-gather / reduce-scatter) or "copy_engine" (peer copies through
            symmetric memory, ``torch.ops.symm_mem``'s low-contention collectives: no NCCL
            kernel, no SMs for the transfer; CUDA GPUs of one host with peer access).
        apply_probs_on_input: multiply routing probabilities into the expert input instead of
            the expert output (``moe_apply_probs_on_input``; needs ``router_topk == 1``).
        activation: expert activation; "swiglu" fuses gate and up projections.
        expert_backend: "auto", "grouped_mm" (``torch._grouped_mm``), "te" (Transformer
            Engine ``GroupedLinear``) or "loop" (per-expert reference).
        expert_alignment: pad each expert's token group to a multiple of this (1, 8, 16, 32,
            64, 128) for quantized GEMMs (``moe_router_padding_for_quantization``); under
            ``pad_expert_input_to_capacity`` the capacity block is rounded up to it. The FP8
            precision plugin raises a layer's to its recipe's need on kernel backends
            (``MoELayer.set_expert_alignment``: the layer's config is replaced, not changed).
        init_method_std: std of the normal initialisation of expert and router weights.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    router_topk: int = 2
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_pre_softmax: bool = False
    router_num_groups: Optional[int] = None
    router_group_topk: Optional[int] = None
    router_group_score_topk: Optional[int] = None
    router_topk_scaling_factor: Optional[float] = None
    router_topk_renormalize: Optional[bool] = None
    router_enable_expert_bias: bool = False
    router_bias_update_rate: float = 1e-3
    router_logits_gemm: Literal["fp32", "bf16x3"] = "fp32"
    router_load_balancing_type: Union[str, list[str]] = "aux_loss"
    aux_loss_coeff: Union[float, list[float]] = 0.0
    z_loss_coeff: Optional[float] = None
    input_jitter_eps: Optional[float] = None
    expert_capacity_factor: Optional[float] = None
    token_drop_policy: Literal["probs", "position"] = "probs"
    pad_expert_input_to_capacity: bool = False
    shared_expert_intermediate_size: Optional[int] = None
    shared_expert_gate: bool = False
    token_dispatcher_type: Literal["alltoall", "allgather", "deepep"] = "alltoall"
    dispatch_chunks: int = 1
    dispatch_transport: Literal["nccl", "copy_engine"] = "nccl"
    apply_probs_on_input: bool = False
    activation: Literal["swiglu", "gelu", "relu", "squared_relu"] = "swiglu"
    expert_backend: Literal["auto", "grouped_mm", "te", "loop"] = "auto"
    expert_alignment: int = 1
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        _check_scalar_types(self)  # from here on, int fields hold ints (not bools)
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "router_topk"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}.")
        if self.dispatch_chunks < 1:
            raise ValueError(
                f"MoEConfig.dispatch_chunks must be an int >= 1 (1 = no pipelining), got {self.dispatch_chunks!r}."
            )
        if self.router_topk > self.num_experts:
            raise ValueError(
                f"router_topk={self.router_topk} exceeds num_experts={self.num_experts}: "
                "lower router_topk or add experts."
            )
        _check_choice("router_score_function", self.router_score_function, SCORE_FUNCTIONS)
        _check_choice("router_logits_gemm", self.router_logits_gemm, ROUTER_LOGITS_GEMMS)
        _check_choice("token_drop_policy", self.token_drop_policy, DROP_POLICIES)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("expert_backend", self.expert_backend, EXPERT_BACKENDS)
        _check_choice("token_dispatcher_type", self.token_dispatcher_type, DISPATCHER_TYPES)
        _check_choice("dispatch_transport", self.dispatch_transport, DISPATCH_TRANSPORTS)
        self._validate_groups()
        self._validate_balancing()
        self._validate_capacity()
        if self.router_topk == 1 and self.router_score_function == "softmax" and not self.router_pre_softmax:
            raise ValueError(
                "router_topk=1 with softmax gives zero router gradients (softmax over one logit): "
                "set router_pre_softmax=True."
            )
        if self.router_topk_renormalize is False and self.router_score_function == "softmax":
            if not self.router_pre_softmax:
                raise ValueError(
                    "router_topk_renormalize=False with softmax over the top-k logits (which always sum to 1): "
                    "set router_pre_softmax=True for the full softmax's weights, or leave router_topk_renormalize None."
                )
        if self.router_enable_expert_bias and self.router_score_function != "sigmoid":
            raise ValueError(
                "router_enable_expert_bias (aux-loss-free balancing) needs "
                "router_score_function='sigmoid', as in Megatron-Core."
            )
        if self.router_bias_update_rate < 0:
            raise ValueError("router_bias_update_rate must be >= 0.")
        if self.router_topk_scaling_factor is not None and self.router_topk_scaling_factor <= 0:
            raise ValueError("router_topk_scaling_factor must be positive (or None).")
        if self.z_loss_coeff is not None and self.z_loss_coeff < 0:
            raise ValueError("z_loss_coeff must be >= 0 (or None to disable).")
        if self.input_jitter_eps is not None and not 0 < self.input_jitter_eps < 1:
            raise ValueError("input_jitter_eps must be in (0, 1) (or None to disable).")
        if self.shared_expert_intermediate_size is not None and self.shared_expert_intermediate_size <= 0:
            raise ValueError("shared_expert_intermediate_size must be positive (or None for no shared expert).")
        if self.shared_expert_gate and self.shared_expert_intermediate_size is None:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate_size.")
        if self.apply_probs_on_input and self.router_topk != 1:
            raise ValueError(
                "apply_probs_on_input needs router_topk=1 (with k>1 a token's expert outputs "
                "would be summed unweighted); set router_topk=1 or apply_probs_on_input=False."
            )
        if self.expert_alignment not in (1, 8, 16, 32, 64, 128):
            raise ValueError(f"expert_alignment must be one of 1, 8, 16, 32, 64, 128, got {self.expert_alignment}.")
        if self.init_method_std <= 0:
            raise ValueError("init_method_std must be positive.")

    @property
    def renormalizes_topk(self) -> bool:
        """Whether `route` divides the chosen weights by their sum (``router_topk_renormalize``
        resolved; softmax over the top-k logits needs no division and reports False)."""
        if self.router_score_function == "softmax" and not self.router_pre_softmax:
            return False
        if self.router_topk_renormalize is not None:
            return self.router_topk_renormalize
        return self.router_score_function == "sigmoid" and self.router_topk > 1

    def _validate_groups(self) -> None:
        if self.router_group_topk is None and self.router_num_groups is None:
            if self.router_group_score_topk is not None:
                raise ValueError(
                    "router_group_score_topk needs group-limited routing: set router_num_groups and "
                    "router_group_topk, or leave router_group_score_topk None."
                )
            return
        if self.router_group_topk is None or self.router_num_groups is None:
            raise ValueError(
                "group-limited routing needs both router_num_groups and router_group_topk "
                f"(got {self.router_num_groups} and {self.router_group_topk})."
            )
        if self.router_num_groups <= 0 or self.num_experts % self.router_num_groups:
            raise ValueError(
                f"router_num_groups={self.router_num_groups} must divide num_experts={self.num_experts}."
            )
        if not 0 < self.router_group_topk <= self.router_num_groups:
            raise ValueError(
                f"router_group_topk={self.router_group_topk} must be in [1, router_num_groups="
                f"{self.router_num_groups}]."
            )
        experts_per_group = self.num_experts // self.router_num_groups
        if self.router_topk > self.router_group_topk * experts_per_group:
            raise ValueError(
                f"router_topk={self.router_topk} exceeds the {self.router_group_topk * experts_per_group} "
                "experts in the selected groups: raise router_group_topk or lower router_topk."
            )
        if self.router_group_score_topk is not None and not 0 < self.router_group_score_topk <= experts_per_group:
            raise ValueError(
                f"router_group_score_topk={self.router_group_score_topk} must be in [1, {experts_per_group}] "
                "(the experts of one group)."
            )

    def _validate_balancing(self) -> None:
        types = self.load_balancing_types
        coeffs = self.aux_loss_coeffs
        for t in types:
            _check_choice("router_load_balancing_type", t, LOAD_BALANCING_TYPES)
        if len(coeffs) != len(types):
            raise ValueError(
                f"aux_loss_coeff has {len(coeffs)} value(s) for {len(types)} load-balancing type(s): "
                "give one coefficient per type."
            )
        if len(set(types)) != len(types):
            raise ValueError(f"router_load_balancing_type lists a type twice: {types}.")
        if any(c < 0 for c in coeffs):
            raise ValueError("aux_loss_coeff values must be >= 0.")

    def _validate_capacity(self) -> None:
        if self.expert_capacity_factor is None:
            if self.pad_expert_input_to_capacity:
                raise ValueError("pad_expert_input_to_capacity needs expert_capacity_factor to be set.")
            return
        if self.expert_capacity_factor <= 0:
            raise ValueError(
                f"expert_capacity_factor must be positive, got {self.expert_capacity_factor}; "
                "use None for dropless routing."
            )
        if "global_aux_loss" in self.load_balancing_types:
            raise ValueError(
                "global_aux_loss counts tokens across micro-batches and cannot be combined with token "
                "dropping: use aux_loss/seq_aux_loss or set expert_capacity_factor=None."
            )
        if self.token_dispatcher_type == "deepep":
            raise ValueError("the deepep dispatcher is dropless: set expert_capacity_factor=None.")

    @property
    def load_balancing_types(self) -> list[str]:
        t = self.router_load_balancing_type
        return list(t) if isinstance(t, (list, tuple)) else [t]

    @property
    def aux_loss_coeffs(self) -> list[float]:
        c = self.aux_loss_coeff
        if isinstance(c, (list, tuple)):
            return [float(v) for v in c]
        return [float(c)] * (1 if not isinstance(self.router_load_balancing_type, (list, tuple)) else len(self.router_load_balancing_type))

    @property
    def active_aux_losses(self) -> dict[str, float]:
        """Load-balancing losses that contribute: ``{type: coeff}`` with coeff > 0, no "none"."""
        return {t: c for t, c in zip(self.load_balancing_types, self.aux_loss_coeffs) if t != "none" and c > 0}

    @property
    def is_gated(self) -> bool:
        return self.activation == "swiglu"

    def expert_capacity(self, num_tokens: int) -> Optional[int]:
        """Capacity of one expert for ``num_tokens`` local tokens, as Megatron's ``get_capacity``."""
        if self.expert_capacity_factor is None:
            return None
        return math.ceil(num_tokens * self.router_topk / self.num_experts * self.expert_capacity_factor)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Python types a scalar field accepts, by annotation ("float" takes ints too; bools are never
# numbers here, although Python's bool is an int).
_SCALAR_TYPES = {int: (int,), float: (int, float), bool: (bool,)}


@functools.cache
def _scalar_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """(name, annotation, optional) of ``cls``'s int / float / bool fields (annotations are
    strings under ``from __future__ import annotations``: resolved once per class)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        annotation, optional = hints[f.name], False
        if typing.get_origin(annotation) is Union and type(None) in typing.get_args(annotation):
            rest = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation, optional = (rest[0] if len(rest) == 1 else None), True
        if annotation in _SCALAR_TYPES:
            out.append((f.name, annotation, optional))
    return tuple(out)


def _check_scalar_types(config: MoEConfig) -> None:
    """Fields annotated int / float / bool (optionally Optional) hold a value of that type, so a
    string from a hand-written config fails here, naming the field, not deep in a comparison."""
    for name, annotation, optional in _scalar_fields(type(config)):
        accepted, value = _SCALAR_TYPES[annotation], getattr(config, name)
        if optional and value is None:
            continue
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            kind = annotation.__name__ + (" or None" if optional else "")
            raise ValueError(f"MoEConfig.{name} must be {kind}, got {value!r} ({type(value).__name__}).")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"MoEConfig.{name}={value!r} is not one of {choices}.")


def check_field_names(owner: str, names: typing.Iterable[str], valid: typing.Iterable[str]) -> None:
    """Raise ``ValueError`` naming every unknown field among ``names``, each with the closest
    valid one ("router_top_k: did you mean 'router_topk'?"), before a dataclass refuses them with
    a bare ``TypeError``."""
    valid = sorted(valid)
    unknown = sorted(set(names) - set(valid))
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"unknown {owner} field(s): {', '.join(parts)}. Valid fields: {', '.join(valid)}.")
