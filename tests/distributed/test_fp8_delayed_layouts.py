"""Delayed FP8 scaling (emulated on CPU) under expert parallelism: the same amax histories,
scales and losses as without it.

Each expert's amaxes are reduced over the ranks that hold that expert (ETP x EDP), dense
layers' over their replicas (the stage's TP x CP x DP ranks). Reducing the experts' per-local-
expert histories over all ranks, as a single world group would, maxes expert e of EP rank 0
with expert E/2 + e of EP rank 1: the histories gathered by global expert then differ from
the EP=1 run's. The comparison is against EP=1 on the same number of data-parallel ranks: the
gradients' amaxes depend on the per-rank loss scale (one micro-batch per rank here).
"""

import functools

import numpy as np
import pytest
import torch

from _launch import DistributedTestError, run_distributed
from _parity import as_tensors, dp_representatives, step_losses, train

STEPS = 3


def _plugins():
    from lightning_moe.precision import FP8Precision

    return [FP8Precision(recipe="delayed", backend="emulated", device="cpu")]


def _delayed_state(strategy, model):
    """Every FP8 module's amax history ``[H, 3, G]`` and scales ``[3, G]``; grouped experts'
    gathered over EP into global expert order (fc1's E experts, then fc2's). Checks that the
    ranks which must agree (all ranks for dense layers, one EP index's ranks for experts) do."""
    import torch.distributed as dist

    from lightning_moe.precision.modules import FP8GroupedGemm

    local = {
        name: (isinstance(m, FP8GroupedGemm), m.fp8_amax_history.cpu().numpy(), m.fp8_scale.cpu().numpy())
        for name, m in model.named_modules()
        if getattr(m, "fp8_amax_history", None) is not None
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (strategy.layout.coordinates(dist.get_rank()), local))
    out = {}
    for name, (is_experts, _, _) in local.items():
        by_ep: dict[int, tuple] = {}
        for coords, state in gathered:
            key = coords["ep"] if is_experts else 0
            first = by_ep.setdefault(key, state[name][1:])
            for mine, theirs, what in zip(state[name][1:], first, ("history", "scale")):
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{name} {what}: ranks holding it disagree")
        parts = [by_ep[ep] for ep in sorted(by_ep)]
        if not is_experts:
            out[name] = parts[0]
            continue
        halves = [[np.split(a, 2, axis=-1) for a in part] for part in parts]  # per EP rank: (fc1, fc2) per array
        out[name] = tuple(
            np.concatenate([h[i][0] for h in halves] + [h[i][1] for h in halves], axis=-1) for i in range(2)
        )
    return out


def _plugins_reducing_experts_over_all_ranks():
    """The plugin as it was before expert groups existed: every amax over the whole stage."""
    (plugin,) = _plugins()
    install = plugin.install_amax_reduction_groups
    plugin.install_amax_reduction_groups = lambda dense, experts: install(dense, dense)
    return [plugin]


@functools.lru_cache(maxsize=None)
def _run(world: int, ep: int, plugins=_plugins) -> dict:
    # DDP for both meshes: FSDP2 would gather bf16 weights where experts are sharded over EDP
    # (EP=1 on 2 ranks) and the FP8 casts would read those instead of the fp32 ones.
    kwargs = dict(expert_parallel_size=ep, sharding="ddp", expert_sharding="ddp")
    # Learning rate 0: every step sees new data with the same weights. Trained weights differ
    # between layouts in the last bits (gradients summed in another order), and FP8 rounding
    # turns such differences into different quantized values, so only frozen weights compare
    # bit for bit over several steps; the fp32 parity tests cover the updates.
    result = run_distributed(train, world, kwargs, world, STEPS, 1, None, None, 0.0, "32-true", "cpu", plugins,
                             _delayed_state, timeout=240)[0]  # fmt: skip
    out = as_tensors(result)
    out["losses"] = step_losses(out, dp_representatives(kwargs, world))
    out["fp8"] = result["collected"]
    return out


@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2)], ids=["ep2", "ep2_edp2"])
def test_expert_parallel_delayed_scaling_matches_ep1(world, ep):
    result, ref = _run(world, ep), _run(world, 1)
    assert result["fp8"].keys() == ref["fp8"].keys()
    experts = [n for n in ref["fp8"] if n.endswith("quantization")]
    assert experts and len(experts) < len(ref["fp8"]), sorted(ref["fp8"])  # both kinds are checked
    for name, (history, scale) in ref["fp8"].items():
        got_history, got_scale = result["fp8"][name]
        assert got_history.shape == history.shape, name
        assert np.count_nonzero(history[1]) > 0, name  # amaxes were recorded and rolled
        np.testing.assert_array_equal(got_history, history, err_msg=f"{name} amax history")
        np.testing.assert_array_equal(got_scale, scale, err_msg=f"{name} scale")
    # (losses in fp32: the aux losses are summed in another order; 3e-6 relative measured)
    torch.testing.assert_close(result["losses"], ref["losses"], rtol=1e-5, atol=0)


def test_the_comparison_sees_experts_reduced_over_all_ranks():
    """The same EP=2 run with the experts' amaxes reduced over both ranks (each holding other
    experts) gives other expert histories: the test above can fail."""
    result, ref = _run(2, 2, _plugins_reducing_experts_over_all_ranks), _run(2, 1)
    name = "model.layers.1.mlp.experts.quantization"
    mixed = ~np.isclose(result["fp8"][name][0], ref["fp8"][name][0], rtol=1e-3)
    assert mixed[1:STEPS + 1].mean() > 0.2, mixed[1:STEPS + 1].mean()  # rows 1..STEPS hold the steps' amaxes


def _misfit_group(rank, world_size, option):
    import torch.distributed as dist

    from lightning_moe.precision import FP8Precision

    plugin = FP8Precision(recipe="delayed", backend="emulated", device="cpu", **{option: dist.group.WORLD})
    train(rank, world_size, dict(expert_parallel_size=2), world_size, 1, 1, plugins=lambda: [plugin])


def test_a_group_that_does_not_fit_the_layout_is_refused():
    # EP=2 on 2 ranks: the dense layers' replicas are both ranks, but each rank holds other experts.
    run_distributed(_misfit_group, 2, "amax_reduction_group", timeout=120)
    with pytest.raises(DistributedTestError, match=r"expert_amax_reduction_group=\.\.\.\) holds ranks \[0, 1\], "
                       r"but on rank \d the same experts .* are ranks \[\d\].* Leave expert_amax_reduction_group=None"):
        run_distributed(_misfit_group, 2, "expert_amax_reduction_group", timeout=120)
