"""Where a training forward's activation memory goes: the tensors saved for backward, by module.

    python benchmarks/activation_breakdown.py                      # qwen3_30b_a3b shape, 4 layers, seq 4096
    python benchmarks/activation_breakdown.py --lm-head-chunk-tokens 2048 --recompute moe_act layernorm

Runs one forward of `train_step.py`'s model (same preset, overrides, bf16 autocast over fp32
master weights, weight casts shared as the strategy shares them) under saved-tensor hooks, and
charges each saved tensor's storage to the innermost module running when it was saved (a storage
saved twice counts once, for its first saver; parameters and their compute-dtype casts are left
out; the LM head's and the per-head q / k norms' parts count under the module around them: hooked,
they would leave their fused paths). Layer indices are folded,
so a row is one part of a layer summed over the layers. Next to the saved bytes: the bytes the
forward left allocated (saved tensors + the weight-cast caches + what the loss keeps outside
autograd, such as a chunked LM head's weight-gradient accumulator) and the forward's peak, both
over what was allocated before it. A tool for finding what to offload or recompute; the step
figures are `train_step.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import weakref
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.train_step import add_shape_arguments, batch_loss, batches, build_module  # noqa: E402
from lightning_moe.models.recompute import RECOMPUTE_MODULES  # noqa: E402
from lightning_moe.nn.saved_tensors import parameter_derived  # noqa: E402

WEIGHT_CASTS = "(weight casts, not activations)"
# Modules the library runs on a faster path only while they carry no hooks: a hooked LM head is
# never chunked, hooked per-head q / k norms leave the fused norm + rotary kernel for the eager
# norm (fp32 copies of q and k). Left unhooked, so the forward measured is the one that trains.
UNHOOKED = frozenset({"lm_head", "q_norm", "k_norm"})
_LAYER_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def folded(name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.*.mlp.experts``."""
    return _LAYER_INDEX.sub(".*", name) or "(top)"


class SavedTensorLedger:
    """Saved-for-backward storages by the innermost module running when they were saved."""

    def __init__(self, model: torch.nn.Module, device: str = "cuda") -> None:
        self.device = device
        self.stack: list[str] = []
        self.by_module: dict[str, int] = defaultdict(int)
        self.shapes: dict[str, set] = defaultdict(set)
        self.seen: set[int] = set()
        self.entries: list[tuple[weakref.ref, str]] = []
        self.parameter_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.handles = []
        for name, module in model.named_modules():
            if name.split(".")[-1] in UNHOOKED:
                continue  # see UNHOOKED: their tensors count under the module around them
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave(name), always_call=True))

    def _enter(self, name: str):
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1] == name:
                self.stack.pop()

        return hook

    def pack(self, t: torch.Tensor):
        if t.device.type == self.device:
            # a weight's compute-dtype cast lives with the weights (the cast cache), not the activations
            owner = WEIGHT_CASTS if parameter_derived(t) else folded(self.stack[-1]) if self.stack else "(top)"
            self.entries.append((weakref.ref(t), owner))
        return t

    def tally(self) -> None:
        """Charge the storages still saved (a graph made and dropped inside the forward, such as an
        eager loss's inner backward, leaves none): each once, for its first saver."""
        for ref, owner in self.entries:
            t = ref()
            if t is None:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.seen or ptr in self.parameter_ptrs:
                continue
            self.seen.add(ptr)
            self.by_module[owner] += storage.nbytes()
            self.shapes[owner].add(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser)
    parser.add_argument("--lm-head-chunk-tokens", type=int, default=0, help="0: the unchunked head")
    parser.add_argument("--recompute", nargs="+", default=None, choices=RECOMPUTE_MODULES)
    parser.add_argument("--recompute-layers", type=int, default=None)
    parser.add_argument("--expert-backend", default="auto")
    parser.add_argument("--out", default=None, help="a JSON file for the table")
    args = parser.parse_args(argv)
    args.precision, args.data, args.packed = "bf16", "random", False
    if not torch.cuda.is_available():
        raise SystemExit("activation_breakdown.py measures CUDA memory: run it on a GPU")

    from lightning_moe.nn.compute_weights import ComputeWeightCache

    torch.manual_seed(0)
    module = build_module(args)
    with torch.device("meta"):
        module.configure_model()
    model = module.model.to_empty(device="cuda")
    model.init_weights()
    batch = next(batches(args, module.model_config.vocab_size, 1, "cuda"))
    ledger = SavedTensorLedger(model)
    casts = ComputeWeightCache(accumulate_grads_in_place=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with casts.active(), torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
            loss = batch_loss(model, batch)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - before
    forward_peak = torch.cuda.max_memory_allocated() - before
    cast_bytes = sum(entry[2].untyped_storage().nbytes() for entry in casts._casts.values())
    ledger.close()
    ledger.tally()
    loss.backward()
    del loss
    torch.cuda.synchronize()

    weight_casts = ledger.by_module.pop(WEIGHT_CASTS, 0)
    saved = sum(ledger.by_module.values())
    gib = 2**30
    rows = sorted(ledger.by_module.items(), key=lambda kv: -kv[1])
    tokens = args.micro_batch * args.seq
    print(f"{args.preset}, {args.layers} layers, {tokens} tokens a micro-batch; "
          f"lm_head_chunk_tokens={args.lm_head_chunk_tokens or None}, recompute={args.recompute}")
    print(f"{'module (layers folded)':58s} {'GiB':>7s} {'share':>6s}  saved tensors")
    for name, nbytes in rows:
        shapes = ", ".join(sorted(ledger.shapes[name])[:4])
        print(f"{name[:58]:58s} {nbytes / gib:7.3f} {nbytes / saved:6.1%}  {shapes}")
    print(f"{'saved for backward (activations)':58s} {saved / gib:7.3f}")
    print(f"{'saved weight casts (in the caches below)':58s} {weight_casts / gib:7.3f}")
    print(f"{'weight-cast caches':58s} {cast_bytes / gib:7.3f}")
    print(f"{'allocated after the forward (over before it)':58s} {after_forward / gib:7.3f}")
    print(f"{'peak of the forward (over before it)':58s} {forward_peak / gib:7.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "saved_gib_by_module": {k: v / gib for k, v in rows},
                       "saved_gib": saved / gib, "weight_cast_gib": cast_bytes / gib,
                       "after_forward_gib": after_forward / gib, "forward_peak_gib": forward_peak / gib,
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
