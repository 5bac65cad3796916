"""Routed experts as grouped GEMMs, and the always-on shared experts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_moe.kernels import use_triton
from lightning_moe.nn.compute_weights import CachedCastLinear, autocast_dtype, compute_weight
from lightning_moe.nn.grouped_gemm import (
    BACKENDS,
    gathered_grouped_mm_covered,
    gathers_in_backward,
    resolve_backend,
    te_grouped_mm,
)
from lightning_moe.nn.permutation import DeferredCombine, DeferredPermutation, PermutationPlan
from lightning_moe.nn.saved_tensors import OutputRecompute, memory_region


def activate(h: Tensor, activation: str) -> Tensor:
    """Expert activation on the first projection's output.

    "swiglu" takes ``h = [gate | up]`` (the two halves of the fused projection, Megatron's
    gated-linear-unit layout) and returns ``silu(gate) * up``.
    """
    if activation == "swiglu":
        if use_triton(h):
            from lightning_moe.kernels.swiglu_triton import swiglu

            return swiglu(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    if activation == "squared_relu":
        return F.relu(h).square()
    raise ValueError(f"unknown activation {activation!r}")


# The unquantized grouped path on CUDA weights the SwiGLU by the routing probabilities and sums
# each token's rows after fc2 (`GroupedExperts.weighted_swiglu_combine`); False: the dispatcher's
# weighted combine after the experts (a benchmark toggle).
WEIGHTED_SWIGLU_COMBINE = True

# The unquantized grouped path on CUDA takes the permutation into fc1's autograd node and keeps the
# tokens, not the permuted rows, for the weight gradient (`GroupedExperts.gathers_first_projection`);
# False: the dispatcher permutes and fc1 keeps the rows (a benchmark toggle).
GATHERED_FIRST_PROJECTION = True


def _combined(y_RD: Tensor, combine: DeferredCombine | None) -> Tensor:
    """``y_RD``, or its combine where the dispatcher deferred it to the experts."""
    return y_RD if combine is None else combine.apply(y_RD)


class GroupedGemmQuantization(ABC):
    """The hook a precision plugin sets as ``GroupedExperts.quantization`` to run the experts'
    GEMMs quantized (e.g. the precision package's ``FP8GroupedGemm``): every member the experts
    call, with its default. Only `grouped_mm` is required; the defaults decline every fused path
    and start nothing, so the experts then run the plain activation and `grouped_mm` per
    projection. ``projection`` ("fc1" / "fc2") names the weight (e.g. for a weight cache or
    per-projection scaling state). A plain mixin without state: a subclass may also be an
    ``nn.Module``. A subclass that overrides `grouped_mm_swiglu` or `prefetch_weights` says so in
    the flag beside it.
    """

    # Whether `grouped_mm_swiglu` takes ``combine=`` (else the experts apply the combine after it).
    swiglu_takes_combine: bool = True
    # Whether `prefetch_weights` does anything (else the experts do not gather their weights for it).
    prefetches_weights: bool = False

    @abstractmethod
    def grouped_mm(self, x_RK: Tensor, w_EKN: Tensor, offsets_E: Tensor, projection: str = "") -> Tensor:
        """``[R, K] @ w[E, K, N] -> [R, N]`` per row group (``offsets_E``: the groups' end rows)."""

    def grouped_mm_swiglu(self, h_RF2: Tensor, w_EFN: Tensor, offsets_E: Tensor, projection: str = "",
                          combine: DeferredCombine | None = None) -> Tensor | None:
        """The second projection with the SwiGLU fused in, ``swiglu(h) @ w``; with ``combine``
        (only where `swiglu_takes_combine`) ending in that `DeferredCombine` (``[T, N]``). None
        where it does not apply: then the experts apply the SwiGLU and call `grouped_mm`.
        Default: None."""
        return None

    def takes_deferred_permutation(self, tokens_TK: Tensor) -> bool:
        """Whether `grouped_mm_gathered` runs on these tokens (then the experts hand it the tokens
        and the plan instead of the permuted rows). Default: False."""
        return False

    def grouped_mm_gathered(self, tokens_TK: Tensor, plan: PermutationPlan, w_EKN: Tensor, offsets_E: Tensor,
                            projection: str = "") -> Tensor | None:
        """The first projection of ``permute(tokens, plan)`` with the permutation read inside the
        quantized input cast; must run wherever `takes_deferred_permutation` said so. Default: None."""
        return None

    def takes_deferred_combine(self, tokens_TK: Tensor) -> bool:
        """Whether ``grouped_mm_swiglu(..., combine=...)`` would end in the combine for these
        tokens (where it then declines after all, the experts combine). Default: False."""
        return False

    def prefetch_weights(self, weights: dict[str, Tensor]) -> None:
        """(`prefetches_weights`) Start the quantized copies of the weights (``{"fc1": w1, "fc2":
        w2}``) before the tokens arrive, for the next GEMMs of those projections to take.
        Default: nothing."""

    def release_prefetched(self) -> None:
        """Drop what `prefetch_weights` started that no GEMM took. Default: nothing."""

    def check_sharded_weights(self) -> None:
        """(`prefetches_weights`) Called instead of `prefetch_weights` when FSDP shards the experts
        (their weights are gathered only inside their forward): raise if this quantization cannot
        run that way. Default: nothing."""

class RoutedExperts(Protocol):
    """What ``MoELayer`` calls on its ``experts`` (`GroupedExperts` implements every member; a
    replacement experts module must too, most simply by deriving from `GroupedExperts`).

    ``forward(x_RD, group_sizes_E, tail_unwritten=False, combine=None)``: rows grouped by local
    expert (or a `DeferredPermutation` where `takes_deferred_permutation`) -> ``[R, D]``, or the
    combined ``[T, D]`` with ``combine``; ``tail_unwritten`` is passed only where
    `reads_only_grouped_rows`, possibly with a `DeferredPermutation` (whose plan's ``rows_end``
    then marks the rows left unwritten). `prefetch` / `release_prefetched` bracket every layer forward.
    """

    def __call__(self, x_RD: Tensor | DeferredPermutation, group_sizes_E: Tensor, tail_unwritten: bool = False,
                 combine: DeferredCombine | None = None) -> Tensor: ...

    def prefetch(self) -> None: ...

    def release_prefetched(self) -> None: ...

    def reads_only_grouped_rows(self, dtype: torch.dtype) -> bool: ...

    def takes_deferred_permutation(self, tokens_TD: Tensor) -> bool: ...

    def takes_deferred_combine(self, tokens_TD: Tensor) -> bool: ...


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor parameter (experts sharded over EP), or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def fc1_matrix(fc1: Tensor) -> Tensor:
    """The first projection as ``[E, D, F1]``: SwiGLU's ``[E, D, 2, F]`` viewed as ``[gate | up]``."""
    return fc1.flatten(-2) if fc1.dim() == 4 else fc1


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs applied to contiguous row groups with one GEMM per projection.

    Parameters (fp32 masters; cast to the activation dtype by the GEMM):
        fc1_weight: SwiGLU: [E, D, 2, F] (gate, up), used as the fused [E, D, 2F] matrix
            ``[gate | up]`` (a free view); other activations: [E, D, F].
        fc2_weight: [E, F, D].

    SwiGLU keeps the gate/up axis separate in storage so that splitting F over expert-tensor-
    parallel ranks is a plain ``Shard(3)`` (each rank holds matching gate and up columns), which
    checkpoints and reshards like any other DTensor.

    ``forward(x_RD, group_sizes_E)`` takes rows grouped by expert (``group_sizes_E`` int64 [E]
    on the device; rows past their sum are zero padding) and returns [R, D]. With
    ``tail_unwritten=True`` (only where `reads_only_grouped_rows`) the rows past the sum may
    hold anything and come out unspecified, in the output and in the input gradient.
    A precision plugin may set ``quantization`` to a `GroupedGemmQuantization` to run quantized
    GEMMs instead. Where
    `takes_deferred_permutation`, ``x_RD`` may be a `DeferredPermutation` (the tokens and the plan, not
    yet permuted): the quantization then reads the permutation inside its first cast, or the
    unquantized path inside fc1's autograd node (`gathers_first_projection`). With
    ``combine=`` (a dispatcher's `DeferredCombine`) it returns the combined tokens [T, D]
    instead: fused into the second projection where `takes_deferred_combine`, else carried out
    after it.

    Memory: the first GEMM runs in the `memory_region` "expert_fc1" and the activation in
    "moe_act" (activation offload attaches there). ``recompute_activation``: the activation's
    output, which fc2 saves, is recomputed in backward instead of kept (Megatron's ``moe_act``
    recompute; unquantized experts only).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        backend: str = "auto",
        init_std: float = 0.02,
        output_init_std: float | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.requested_backend = backend
        self.backend = resolve_backend(backend)
        self.init_std = init_std
        self.output_init_std = init_std if output_init_std is None else output_init_std
        factory = {"device": device, "dtype": dtype}
        fc1_shape = (num_experts, hidden_size) + ((2, ffn_hidden_size) if activation == "swiglu" else (ffn_hidden_size,))
        self.fc1_weight = nn.Parameter(torch.empty(fc1_shape, **factory))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size, **factory))
        self.quantization: GroupedGemmQuantization | None = None
        # (dtype,): what FSDP2 casts this module's forward inputs to (None: nothing), as declared by
        # whoever sharded it (`declare_fsdp_input_cast`); None: undeclared
        self._fsdp_input_cast: tuple[torch.dtype | None] | None = None
        self.recompute_activation = False
        self.reset_parameters()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "quantization" and value is not None and not isinstance(value, GroupedGemmQuantization):
            raise TypeError(f"GroupedExperts.quantization takes a GroupedGemmQuantization (lightning_moe.nn.experts); "
                            f"{type(value).__name__} does not derive from it: derive from it (only grouped_mm is "
                            "required).")
        super().__setattr__(name, value)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc1_weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.fc2_weight, mean=0.0, std=self.output_init_std)

    def _mm(self, x_RK: Tensor, w_EKN: Tensor, group_sizes_E: Tensor, projection: str,
            offsets_E: Tensor | None = None) -> Tensor:
        if self.quantization is not None:
            return self.quantization.grouped_mm(x_RK, w_EKN, offsets_E, projection)
        if self.backend == "te":
            # Each projection keeps its own te.GroupedLinear (per-module FP8 state), held in a
            # plain dict attribute: not a submodule, so state dicts never depend on the backend.
            cache = self.__dict__.setdefault("_te_modules", {})
            return te_grouped_mm(x_RK, w_EKN, group_sizes_E, cache=cache, key=projection)
        return BACKENDS[self.backend](x_RK, w_EKN, group_sizes_E)

    def prefetch(self) -> None:
        """Start what does not depend on the tokens; `MoELayer` calls it before routing (and
        `release_prefetched` after its forward). A quantization that can
        (``FP8GroupedGemm.prefetch_weights``) starts casting the expert weights on a side
        stream, to be taken by this module's next `forward`. Not when FSDP shards this module:
        its weights are gathered only when its own forward starts (the quantization's
        ``check_sharded_weights`` says whether it can run so)."""
        quantization = self.quantization
        if quantization is None or not quantization.prefetches_weights:
            return
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self, FSDPModule):
            quantization.prefetch_weights({"fc1": fc1_matrix(local_tensor(self.fc1_weight)),
                                           "fc2": local_tensor(self.fc2_weight)})
        else:
            quantization.check_sharded_weights()

    def release_prefetched(self) -> None:
        """Drop whatever `prefetch` started that `forward` did not take (a forward that stopped
        early), once the current stream has waited for it."""
        if self.quantization is not None:
            self.quantization.release_prefetched()

    def reads_only_grouped_rows(self, dtype: torch.dtype) -> bool:
        """Whether `forward` on ``dtype`` rows reads only the rows its groups cover, in the
        input and in the output's gradient (the "grouped_mm" backend without quantization), so
        that a caller that never reads the rest back may leave it unwritten (``tail_unwritten``)."""
        return self.quantization is None and self.backend == "grouped_mm" and dtype != torch.float64

    def takes_deferred_permutation(self, tokens_TD: Tensor) -> bool:
        """Whether `forward` can take these tokens as a `DeferredPermutation` and read the
        permutation inside the first projection's quantized input cast (FP8 delayed scaling on
        the native backend), so the permuted rows are never written in the tokens' dtype; or,
        unquantized, inside fc1's autograd node (`gathers_first_projection`), so they are never
        kept for the backward."""
        quantization = self.quantization
        if self._fsdp_casts_inputs(tokens_TD.dtype):
            return False
        if quantization is None:
            return self.gathers_first_projection(tokens_TD)
        return quantization.takes_deferred_permutation(tokens_TD)

    def gathers_first_projection(self, tokens_TD: Tensor) -> bool:
        """Whether the unquantized path reads the permutation inside its first projection's
        autograd node (`GATHERED_FIRST_PROJECTION`, the grouped SwiGLU path on CUDA with Triton,
        16-byte rows, a training pass): fc1 then keeps the ``[T, D]`` tokens for its weight
        gradient and gathers the ``[R, D]`` rows again in the backward, instead of keeping them
        (`grouped_gemm.gathered_grouped_mm_covered`; K times fewer bytes, the same bits)."""
        if not (GATHERED_FIRST_PROJECTION and self.activation == "swiglu" and torch.is_grad_enabled()):
            return False
        dtype = autocast_dtype(tokens_TD)
        if not (self.reads_only_grouped_rows(dtype) and use_triton(tokens_TD)):
            return False
        fc1 = fc1_matrix(local_tensor(self.fc1_weight))
        return gathers_in_backward(dtype, fc1.shape[-2], fc1.shape[-1])

    def takes_deferred_combine(self, tokens_TD: Tensor) -> bool:
        """Whether `forward` can end in a `DeferredCombine` with the combine fused into its own
        passes (FP8 delayed scaling on the native backend, SwiGLU, a training pass): the
        probabilities weight the SwiGLU's rows, and the second projection's gradient cast
        gathers the tokens' gradient, so the combine's backward pass disappears. `forward`
        accepts ``combine`` either way and otherwise carries the combine out after itself."""
        quantization = self.quantization
        # FSDP2 casting this module's inputs would cast the deferred probabilities (fp32, the
        # router's) too, and with them the router's gradient: then the dispatcher combines.
        if self.activation != "swiglu" or self._fsdp_casts_inputs(tokens_TD.dtype) or self._fsdp_casts_inputs(
                torch.float32):
            return False
        if quantization is None:
            return self.weighted_swiglu_combine(tokens_TD)
        return quantization.takes_deferred_combine(tokens_TD)

    def weighted_swiglu_combine(self, tokens_TD: Tensor) -> bool:
        """Whether the unquantized path takes the combine (`WEIGHTED_SWIGLU_COMBINE`, the grouped
        GEMMs on CUDA with Triton, SwiGLU, a training pass): the probabilities weight the SwiGLU's
        rows (`kernels.swiglu_triton.weighted_swiglu`) and each token's rows are summed after the
        second projection, as Megatron-Core's experts do; the combine then keeps no expert outputs
        for its backward (the probabilities' gradient comes from the SwiGLU's)."""
        return (WEIGHTED_SWIGLU_COMBINE and self.activation == "swiglu" and torch.is_grad_enabled()
                and self.reads_only_grouped_rows(autocast_dtype(tokens_TD)) and use_triton(tokens_TD))

    def declare_fsdp_input_cast(self, dtype: torch.dtype | None) -> None:
        """Declare the dtype FSDP2's mixed-precision policy casts this module's forward inputs to
        (None: no cast): whoever calls ``fully_shard`` on it says so (`parallel.fsdp.shard_experts`)."""
        self._fsdp_input_cast = (dtype,)

    def _fsdp_casts_inputs(self, dtype: torch.dtype) -> bool:
        """Whether FSDP2 (sharding this module) casts its forward inputs away from ``dtype``. It
        would cast the deferred tokens, not the permuted rows, and the token gradient would then
        be summed over the assignments in the cast dtype instead of in ``dtype``. Sharded without
        a declaration (`declare_fsdp_input_cast`) counts as casting."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self, FSDPModule):
            return False
        if self._fsdp_input_cast is None:
            return True
        (cast,) = self._fsdp_input_cast
        return cast is not None and cast != dtype

    def forward(self, x_RD: Tensor | DeferredPermutation, group_sizes_E: Tensor,
                tail_unwritten: bool = False, combine: DeferredCombine | None = None) -> Tensor:
        """[R, D] -> [R, D], or with ``combine`` (a dispatcher's `DeferredCombine`) [T, D], the
        combined output (see `takes_deferred_combine`). ``tail_unwritten``: the caller left the
        rows after the groups unwritten and never reads them in the output or the input gradient,
        so they are not zeroed either (the all-gather dispatcher's buffer is about half such rows).
        ``x_RD`` may be a `DeferredPermutation` (see `takes_deferred_permutation`); where the
        first projection cannot read it, it is permuted here."""
        if combine is not None and tail_unwritten:
            raise ValueError("GroupedExperts: combine= reads every row it combines; pass tail_unwritten=False with it")
        permuted = x_RD if isinstance(x_RD, DeferredPermutation) else None
        # the quantized casts write every row they read; the unquantized gathered path leaves the tail
        if permuted is not None and (not self.takes_deferred_permutation(permuted.tokens_TD)
                                     or (tail_unwritten and self.quantization is not None)):
            x_RD, permuted = permuted.materialize(), None
        # the unquantized path taking the permutation (`gathers_first_projection`); quantized
        # experts read it inside their first cast instead (`_gathered_first_projection`)
        gathered = permuted is not None and self.quantization is None
        if gathered:
            # the tokens in the GEMMs' dtype (autocast's cast); `_swiglu_covered_rows` permutes
            # them inside fc1's node
            tokens_TD = permuted.tokens_TD
            if torch.is_autocast_enabled(tokens_TD.device.type):
                tokens_TD = tokens_TD.to(torch.get_autocast_dtype(tokens_TD.device.type))
            x_RD = permuted = DeferredPermutation(tokens_TD, permuted.plan)
        elif permuted is None:
            if tail_unwritten and not self.reads_only_grouped_rows(x_RD.dtype):
                raise ValueError(
                    "tail_unwritten=True needs experts that read only the grouped rows (backend 'grouped_mm', no "
                    f"FP8 quantization, not float64); these run backend {self.backend!r}"
                    f"{' with quantization' if self.quantization is not None else ''} on {x_RD.dtype}. Leave it False."
                )
            device_type = x_RD.device.type
            if torch.is_autocast_enabled(device_type):
                # torch._grouped_mm is not on autocast's cast list: cast the operands ourselves, or an
                # fp32 residual stream would run the experts as fp32 GEMMs.
                x_RD = x_RD.to(torch.get_autocast_dtype(device_type))
        fc1 = fc1_matrix(local_tensor(self.fc1_weight))
        fc2 = local_tensor(self.fc2_weight)
        if self.quantization is None:
            # The GEMMs' operands in the tokens' dtype (the quantization casts fp32 weights itself);
            # made once per optimizer step where a ComputeWeightCache is active.
            dtype = x_RD.tokens_TD.dtype if gathered else x_RD.dtype
            fc1 = compute_weight(fc1, dtype, source=self.fc1_weight)
            fc2 = compute_weight(fc2, dtype, source=self.fc2_weight)
        if group_sizes_E.shape[0] != fc1.shape[0]:
            raise ValueError(f"got {group_sizes_E.shape[0]} token groups for {fc1.shape[0]} local experts")
        offsets_E = None
        if self.quantization is not None:
            from lightning_moe.nn.grouped_gemm import group_offsets

            # One offsets tensor for both projections: a quantized GEMM that needs the group
            # sizes on the host (per-expert FP8 GEMMs) then syncs once per forward, not twice.
            offsets_E = group_offsets(group_sizes_E, x_RD.shape[0] if permuted is None else permuted.num_rows)
        if gathered:
            return self._swiglu_covered_rows(x_RD, fc1, fc2, group_sizes_E, zero_tails=not tail_unwritten,
                                             combine=combine)
        if permuted is not None:
            with memory_region(self, "expert_fc1"):
                h_RF = self._gathered_first_projection(permuted, fc1, offsets_E)
        elif self.activation == "swiglu" and self.reads_only_grouped_rows(x_RD.dtype) and use_triton(x_RD):
            return self._swiglu_covered_rows(x_RD, fc1, fc2, group_sizes_E, zero_tails=not tail_unwritten,
                                             combine=combine)
        else:
            with memory_region(self, "expert_fc1"):
                h_RF = self._mm(x_RD, fc1, group_sizes_E, "fc1", offsets_E)
        return self._second_projection(h_RF, fc2, group_sizes_E, offsets_E, combine)

    def _second_projection(self, h_RF: Tensor, fc2: Tensor, group_sizes_E: Tensor,
                           offsets_E: Tensor | None, combine: DeferredCombine | None = None) -> Tensor:
        """The activation and fc2 of the first projection's output ``h_RF``, then ``combine``."""
        quantization = self.quantization
        recompute = self.recompute_activation and torch.is_grad_enabled()
        if recompute and quantization is not None:
            raise ValueError(
                "GroupedExperts.recompute_activation (recompute 'moe_act') runs on unquantized experts; FP8 experts "
                "keep FP8 copies of the activation instead: recompute 'moe' (the whole MoE block) or drop 'moe_act'."
            )
        if quantization is not None and self.activation == "swiglu":
            # the SwiGLU computed inside the FP8 cast of fc2's input, where that runs (and the
            # combine after it, where the quantization offers that)
            fuses_combine = combine is not None and quantization.swiglu_takes_combine
            with memory_region(self, "moe_act"):
                y = quantization.grouped_mm_swiglu(h_RF, fc2, offsets_E, "fc2",
                                                   **({"combine": combine} if fuses_combine else {}))
            if y is not None:
                return y if fuses_combine else _combined(y, combine)
        with OutputRecompute(recompute) as outputs:
            with memory_region(self, "moe_act"):
                a_RF = outputs.run(activate, h_RF, self.activation)
            return _combined(self._mm(a_RF, fc2, group_sizes_E, "fc2", offsets_E), combine)

    def _gathered_first_projection(self, permuted: DeferredPermutation, fc1: Tensor, offsets_E: Tensor) -> Tensor:
        """fc1 of tokens not yet permuted, reading the permutation inside its quantized input cast
        (only where `takes_deferred_permutation`)."""
        h_RF = self.quantization.grouped_mm_gathered(permuted.tokens_TD, permuted.plan, fc1, offsets_E, "fc1")
        if h_RF is None:  # the two predicates drifted apart: a bug, not a configuration to fall back from
            raise RuntimeError(
                f"{type(self.quantization).__name__}.takes_deferred_permutation accepted these tokens but its "
                "grouped_mm_gathered declined them; the two must agree."
            )
        return h_RF

    def _swiglu_covered_rows(self, x_RD: Tensor, fc1: Tensor, fc2: Tensor, group_sizes_E: Tensor,
                             zero_tails: bool, combine: DeferredCombine | None = None) -> Tensor:
        """The bf16/fp32 grouped path on CUDA: the fused SwiGLU neither reads nor writes the
        padding rows after the last group, so the tensors on either side of it keep unwritten
        tails; the block's own output and input gradient get zeroed tails when ``zero_tails``.
        With ``combine`` where `weighted_swiglu_combine` holds, the SwiGLU weights each row by its
        probability and the rows are summed per token after fc2; else the combine runs after."""
        from lightning_moe.kernels.swiglu_triton import swiglu, weighted_swiglu
        from lightning_moe.nn.grouped_gemm import covered_offsets, grouped_mm_covered

        gathered = isinstance(x_RD, DeferredPermutation)
        tokens = x_RD.tokens_TD if gathered else x_RD
        weighted = combine is not None and self.weighted_swiglu_combine(tokens)
        offsets_E = covered_offsets(group_sizes_E, x_RD.num_rows if gathered else x_RD.shape[0])  # both GEMMs'
        with memory_region(self, "expert_fc1"):
            if gathered:  # the permutation inside fc1's node: the tokens kept, not the rows
                h_RF2 = gathered_grouped_mm_covered(x_RD.tokens_TD, x_RD.plan, fc1, offsets_E)
            else:
                h_RF2 = grouped_mm_covered(x_RD, fc1, offsets_E, zero_output=False, zero_grad_input=zero_tails)
        with OutputRecompute(self.recompute_activation and torch.is_grad_enabled()) as outputs:
            with memory_region(self, "moe_act"):
                if weighted:
                    a_RF = outputs.run(weighted_swiglu, h_RF2, combine.row_probs(), offsets_E[-1])
                else:
                    a_RF = outputs.run(swiglu, h_RF2, offsets_E[-1])
            y_RD = grouped_mm_covered(a_RF, fc2, offsets_E, zero_output=zero_tails and not weighted,
                                      zero_grad_input=False)
        return combine.apply_unweighted(y_RD) if weighted else _combined(y_RD, combine)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
            f"activation={self.activation}, backend={self.backend}"
        )


class _NormalInitLinear(CachedCastLinear):
    """Bias-free linear whose ``reset_parameters`` draws N(0, std) (Megatron's init), so that
    materializing a meta-device model (which calls every module's ``reset_parameters``) keeps
    the MoE initialisation instead of nn.Linear's Kaiming default."""

    def __init__(self, in_features: int, out_features: int, std: float) -> None:
        self.init_std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class SharedExperts(nn.Module):
    """A dense MLP every token passes through (DeepSeek / Qwen2-MoE shared experts).

    ``linear_fc1``: D -> 2F (SwiGLU) or F; ``linear_fc2``: F -> D; with ``gate=True`` the output
    is scaled by ``sigmoid(x @ gate_weight.T)`` per token (Megatron's ``moe_shared_expert_gate``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        gate: bool = False,
        init_std: float = 0.02,
        output_init_std: float | None = None,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.init_std = init_std
        self.output_init_std = init_std if output_init_std is None else output_init_std
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        self.linear_fc1 = _NormalInitLinear(hidden_size, fc1_out, self.init_std)
        self.linear_fc2 = _NormalInitLinear(ffn_hidden_size, hidden_size, self.output_init_std)
        self.gate_weight = nn.Parameter(torch.empty(1, hidden_size)) if gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.linear_fc1.reset_parameters()
        self.linear_fc2.reset_parameters()
        if self.gate_weight is not None:
            nn.init.normal_(self.gate_weight, std=self.init_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        y_TD = self.linear_fc2(activate(self.linear_fc1(x_TD), self.activation))
        if self.gate_weight is not None:
            y_TD = y_TD * torch.sigmoid(F.linear(x_TD, self.gate_weight.to(x_TD.dtype)))
        return y_TD

