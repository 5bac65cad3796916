"""Runs Transformer Engine's delayed scaling (frozen weights, 3 steps) under EP=2 and EP=1 on two
GPUs in a fresh process and prints every TE module's amax histories as JSON, the experts'
gathered over EP into global expert order (see test_fp8_amax_groups_gpu.py)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (package not installed)

from _launch import run_distributed  # noqa: E402
from _parity import tiny_config, train  # noqa: E402


def _plugins():
    from lightning_moe.precision import FP8Precision

    return [FP8Precision(recipe="delayed", backend="te")]


def _te_histories(strategy, model):
    """{name: {"fwd": [H, cols], "bwd": [H, cols]}}; a grouped linear's columns are per local
    GEMM (3 forward, 2 backward each), concatenated over EP ranks by global expert."""
    import torch
    import torch.distributed as dist

    local = {}
    for layer_name, layer in ((n, m) for n, m in model.named_modules() if hasattr(m, "_te_modules")):
        for key, (_, te_module) in layer._te_modules.items():
            local[f"{layer_name}.{key}"] = (True, te_module)
    for name, module in model.named_modules():
        if hasattr(module, "fp8_meta") and getattr(module, "is_fp8_linear", False):
            local[name] = (False, module)
    states = {
        name: (grouped, {d: module.fp8_meta[f"scaling_{d}"].amax_history.float().cpu() for d in ("fwd", "bwd")})
        for name, (grouped, module) in local.items()
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (strategy.layout.coordinates(dist.get_rank()), states))
    out = {}
    for name, (grouped, _) in states.items():
        by_ep = {}
        for coords, theirs in gathered:
            by_ep.setdefault(coords["ep"] if grouped else 0, theirs[name][1])
        out[name] = {}
        for d, per_gemm in (("fwd", 3), ("bwd", 2)):
            parts = [by_ep[ep][d] for ep in sorted(by_ep)]
            if grouped:  # [H, gemms * per_gemm], laid out gemm-major
                parts = [p.reshape(p.shape[0], -1, per_gemm) for p in parts]
                out[name][d] = torch.cat(parts, 1).reshape(parts[0].shape[0], -1).tolist()
            else:
                out[name][d] = parts[0].tolist()
    return out


def main() -> None:
    config = tiny_config(expert_backend="te", expert_alignment=16)
    common = dict(backend="nccl", timeout=300)
    out = {}
    for label, ep in (("ep2", 2), ("ep1", 1)):
        kwargs = dict(expert_parallel_size=ep, sharding="ddp", expert_sharding="ddp")
        result = run_distributed(train, 2, kwargs, 2, 3, 1, config, None, 0.0, "bf16-mixed", "cuda", _plugins,
                                 _te_histories, **common)[0]  # fmt: skip
        out[label] = {"losses": result["rank_losses"].tolist(), "histories": result["collected"]}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
