"""Where whole-layer recompute and the plain run part on a CUDA GPU (tests/gpu/test_memory_gpu.py).

Run from the repository root on one CUDA GPU (about half a minute on an H100)::

    python tests/gpu/_recompute_diff.py

The model, batch and steps are those of ``test_recompute_keeps_gradients_and_lowers_the_peak``
(bf16 autocast, fp32 weights) and of ``test_fp8_delayed_native_recompute_keeps_gradients``. For
each setting it prints whether the losses are equal and the largest absolute gradient difference
per parameter of

- plain vs plain: is the plain run itself deterministic from one run to the next?
- plain vs whole-layer recompute (``recompute_every_n_layers=1``),

under these settings:

- ``default``: as the tests run;
- ``deterministic``: ``torch.use_deterministic_algorithms(True)`` (SDPA's flash / efficient
  backward then take their deterministic dq accumulation instead of atomic adds; uninitialised
  memory is not NaN-filled, so that only the algorithms change);
- ``sdpa_math``: attention through SDPA's math backend (no atomics at all);
- ``no_fused_rotary``: the eager qk-norm + rotary instead of the Triton kernel.

The verdict at the end names the setting under which recompute is bit-equal to plain while the
default is not: the nondeterministic kernel that setting replaces is the cause.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

from _deterministic import deterministic_algorithms  # noqa: E402  (sets cuBLAS's workspace before CUDA starts)

from lightning_moe.models import MoEDecoder, causal_lm_loss, get_preset  # noqa: E402

SEQ, BATCH = 1024, 2


def _config(every):
    moe = {"num_experts": 16, "router_topk": 4, "ffn_hidden_size": 512, "expert_alignment": 16}
    return get_preset("small", num_layers=4, first_k_dense_layers=0, moe=moe, max_seq_length=SEQ,
                      recompute_every_n_layers=every)


def _bf16_run(every):
    """The test's `_step`: a warm-up step, then the measured one; (loss, grads)."""
    torch.manual_seed(0)
    cfg = _config(every)
    model = MoEDecoder(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        causal_lm_loss(model(ids), labels).backward()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = causal_lm_loss(model(ids), labels)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _fp8_run(every):
    """The FP8 delayed (native) test: two steps, the second casting with the first's scales."""
    from lightning_moe.precision import FP8Precision

    torch.manual_seed(0)
    model = MoEDecoder(_config(every)).cuda()
    plugin = FP8Precision(recipe="delayed", backend="torch")
    plugin.convert_module(model)
    ids = torch.randint(0, 1000, (BATCH, SEQ), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with plugin.forward_context():
            loss = causal_lm_loss(model(ids), torch.roll(ids, -1, dims=1))
        loss.backward()
        plugin.update_delayed_scaling()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _sdpa_math():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


@contextlib.contextmanager
def _no_fused_rotary():
    from lightning_moe.models import rotary

    kept, rotary.FUSED_KERNEL = rotary.FUSED_KERNEL, False
    try:
        yield
    finally:
        rotary.FUSED_KERNEL = kept


def _diffs(a, b):
    """Per parameter: max |a - b| (0.0: bit-equal; nan where the grads hold NaN)."""
    return {n: float((g.float() - b[1][n].float()).abs().max()) if not torch.equal(g, b[1][n]) else 0.0
            for n, g in a[1].items()}


def _summary(d):
    differing = [n for n, v in d.items() if v != 0.0]
    worst = max(d, key=lambda n: d[n]) if differing else None
    return (f"{len(differing):3d}/{len(d)} params differ"
            + (f", max {d[worst]:.3e} ({worst}); first differing: {differing[0]}" if differing else ""))


def _compare(kind, setting, run, context):
    start = time.perf_counter()
    try:
        with context():
            plain = run(None)
            again = run(None)
            recomputed = run(1)
    except Exception as error:  # noqa: BLE001 (a setting a kernel refuses: report it and go on)
        print(f"[{kind:4s} {setting:16s}] did not run: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
        return None
    pp, pr = _diffs(plain, again), _diffs(plain, recomputed)
    print(f"[{kind:4s} {setting:16s}] ({time.perf_counter() - start:4.1f} s) loss plain {plain[0].item():.6f}")
    print(f"    plain vs plain      : loss equal {torch.equal(plain[0], again[0])}; {_summary(pp)}")
    print(f"    plain vs recompute  : loss equal {torch.equal(plain[0], recomputed[0])}; {_summary(pr)}")
    return pp, pr


def _table(pp, pr):
    width = max(len(n) for n in pp)
    print(f"    {'parameter':{width}s}  {'plain/plain':>12s}  {'plain/recomp':>12s}")
    for name in pp:
        print(f"    {name:{width}s}  {pp[name]:12.3e}  {pr[name]:12.3e}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, SDPA flash "
          f"{torch.backends.cuda.flash_sdp_enabled()}, cuDNN SDPA {torch.backends.cuda.cudnn_sdp_enabled()}")
    start = time.perf_counter()
    settings = {"default": contextlib.nullcontext, "deterministic": deterministic_algorithms, "sdpa_math": _sdpa_math,
                "no_fused_rotary": _no_fused_rotary}
    kinds = {"bf16": _bf16_run}
    if torch.cuda.get_device_capability() >= (9, 0):
        kinds["fp8"] = _fp8_run
    results = {}
    for kind, run in kinds.items():
        for setting, context in settings.items():
            if kind == "fp8" and setting == "no_fused_rotary":
                continue
            results[kind, setting] = _compare(kind, setting, run, context)
            if setting == "default" and results[kind, setting] is not None:
                _table(*results[kind, setting])
    print("\nverdict:")
    for kind in kinds:
        default = results.get((kind, "default"))
        if default is None:
            continue
        plain_deterministic = all(v == 0.0 for v in default[0].values())
        recompute_equal = all(v == 0.0 for v in default[1].values())
        print(f"  {kind}: plain run deterministic: {plain_deterministic}; recompute bit-equal: {recompute_equal}")
        for setting in settings:
            got = results.get((kind, setting))
            if setting == "default" or got is None:
                continue
            equal = all(v == 0.0 for v in got[0].values()) and all(v == 0.0 for v in got[1].values())
            print(f"    under {setting:16s}: plain deterministic and recompute bit-equal: {equal}")
    print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
