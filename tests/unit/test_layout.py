"""ParallelLayout: validation, rank groups (against Megatron-Core's RankGenerator), coordinates."""

import io
import itertools
import random
import warnings

import pytest

from lightning_moe.layout import DENSE_AXES, EXPERT_AXES, ParallelLayout

# Every combination of one grid's axes, e.g. "tp", "tp-cp", ..., "tp-cp-dp-pp".
DENSE_TOKENS = ["-".join(c) for r in range(1, 5) for c in itertools.combinations(DENSE_AXES, r)]
EXPERT_TOKENS = ["-".join(c) for r in range(1, 5) for c in itertools.combinations(EXPERT_AXES, r)]
# Our expert axes under the names Megatron's expert RankGenerator uses.
TO_MEGATRON = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _random_layouts(count, seed=0, max_world=1024, min_world=1):
    """Random valid layouts: any dense split of W, then any expert split of one stage."""
    rng = random.Random(seed)
    # Powers of two and a few other composites (factors 3, 5, 7), so sizes need not be 2^k.
    worlds = sorted({b * 2**k for b in (1, 3, 5, 7, 9, 15) for k in range(11) if min_world <= b * 2**k <= max_world})
    layouts = []
    while len(layouts) < count:
        W = rng.choice(worlds)
        pp = rng.choice(_divisors(W))
        stage = W // pp
        tp = rng.choice(_divisors(stage))
        cp = rng.choice(_divisors(stage // tp))
        etp = rng.choice(_divisors(stage))
        ep = rng.choice(_divisors(stage // etp))
        layouts.append(
            ParallelLayout(
                world_size=W,
                tensor_parallel_size=tp,
                context_parallel_size=cp,
                pipeline_parallel_size=pp,
                expert_parallel_size=ep,
                expert_tensor_parallel_size=etp,
            )
        )
    return layouts


@pytest.fixture(scope="module")
def rank_generator():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformer Engine / Apex missing: harmless here
        parallel_state = pytest.importorskip("megatron.core.parallel_state")
    return parallel_state.RankGenerator


def test_groups_equal_megatron_rank_generator(rank_generator):
    # Mostly small worlds, plus a few large ones: the reference is pure Python and O(W) per group list.
    layouts = _random_layouts(200, seed=0, max_world=128) + _random_layouts(12, seed=1, min_world=256)
    assert max(layout.world_size for layout in layouts) >= 768
    assert any(
        layout.context_parallel_size > 1 and layout.expert_parallel_size > layout.data_parallel_size
        for layout in layouts
    )
    for layout in layouts:
        dense = rank_generator(
            tp=layout.tensor_parallel_size,
            ep=1,
            dp=layout.data_parallel_size,
            pp=layout.pipeline_parallel_size,
            cp=layout.context_parallel_size,
            order="tp-cp-ep-dp-pp",
        )
        expert = rank_generator(
            tp=layout.expert_tensor_parallel_size,
            ep=layout.expert_parallel_size,
            dp=layout.expert_data_parallel_size,
            pp=layout.pipeline_parallel_size,
            cp=1,
            order="tp-cp-ep-dp-pp",
        )
        for token in DENSE_TOKENS:
            assert layout.groups(token) == dense.get_ranks(token), (layout, token)
        for token in EXPERT_TOKENS:
            megatron_token = "-".join(TO_MEGATRON[t] for t in token.split("-"))
            assert layout.groups(token) == expert.get_ranks(megatron_token), (layout, token)


def test_hand_checked_folding_example():
    # W=8, TP=2, EP=4: attention splits pairs, experts span blocks of four ranks.
    layout = ParallelLayout(world_size=8, tensor_parallel_size=2, expert_parallel_size=4)
    assert (layout.data_parallel_size, layout.expert_data_parallel_size) == (4, 2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("etp") == [[r] for r in range(8)]
    assert layout.groups("pp") == [[r] for r in range(8)]  # PP=1: one stage


def test_hand_checked_pipeline_and_context():
    # W=16, TP=2, CP=2, PP=2 (DP=2); experts ETP=1, EP=4 (EDP=2).
    layout = ParallelLayout(
        world_size=16,
        tensor_parallel_size=2,
        context_parallel_size=2,
        pipeline_parallel_size=2,
        expert_parallel_size=4,
    )
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.groups("pp") == [[r, r + 8] for r in range(8)]
    assert layout.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert layout.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert layout.groups("ep-edp") == layout.groups("tp-cp-dp") == [list(range(8)), list(range(8, 16))]
    # The order of the names and the separator do not matter.
    assert layout.groups("cp-dp") == layout.groups("dp_cp") == layout.groups("dp-cp")
    assert layout.size("dp-cp") == 4 and layout.size("ep") == 4 and layout.size("edp-pp") == 4


@pytest.mark.parametrize("layout", _random_layouts(40, seed=1, max_world=256), ids=repr)
def test_coordinates_round_trip(layout):
    sizes = {
        "tp": layout.tensor_parallel_size,
        "cp": layout.context_parallel_size,
        "dp": layout.data_parallel_size,
        "pp": layout.pipeline_parallel_size,
        "etp": layout.expert_tensor_parallel_size,
        "ep": layout.expert_parallel_size,
        "edp": layout.expert_data_parallel_size,
    }
    axes = ("tp", "dp", "dp-cp", "tp-cp", "ep", "edp", "etp-ep", "pp")
    groups = {axis: layout.groups(axis) for axis in axes}
    for rank in range(layout.world_size):
        c = layout.coordinates(rank)
        for grid in (DENSE_AXES, EXPERT_AXES):
            rebuilt, stride = 0, 1
            for axis in grid:
                assert 0 <= c[axis] < sizes[axis]
                rebuilt += c[axis] * stride
                stride *= sizes[axis]
            assert rebuilt == rank
        for axis in axes:
            group = groups[axis][layout.group_index(axis, rank)]
            assert group[layout.rank_in_group(axis, rank)] == rank
        assert layout.rank_in_group("dp", rank) == c["dp"]
        assert layout.group("ep", rank) == groups["ep"][layout.group_index("ep", rank)]
        assert layout.rank_in_group("ep", rank) == c["ep"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 8, "tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"world_size": 8, "context_parallel_size": -2}, "context_parallel_size"),
        ({"world_size": 8, "expert_parallel_size": 2.0}, "expert_parallel_size"),
        ({"world_size": 8, "pipeline_parallel_size": True}, "pipeline_parallel_size"),
        ({"world_size": 8, "data_parallel_size": 0}, "data_parallel_size"),
        ({"world_size": 8, "tensor_parallel_size": 3}, "does not divide world_size=8"),
        ({"world_size": 12, "tensor_parallel_size": 2, "context_parallel_size": 4}, "2 x 4 x 1 = 8"),
        ({"world_size": 8, "pipeline_parallel_size": 2, "expert_parallel_size": 8}, "expert_parallel_size"),
        ({"world_size": 8, "expert_tensor_parallel_size": 2, "expert_parallel_size": 3}, "does not divide"),
        ({"world_size": 8, "tensor_parallel_size": 2, "data_parallel_size": 2}, "data_parallel_size='auto' or 4"),
        ({"world_size": 8, "expert_parallel_size": 4, "num_experts": 6}, "num_experts=6"),
        ({"world_size": 8, "expert_tensor_parallel_size": 2, "expert_ffn_hidden_size": 7}, "expert_ffn_hidden_size"),
        ({"world_size": 8, "tensor_parallel_size": 4, "num_attention_heads": 6}, "num_attention_heads=6"),
        ({"world_size": 8, "tensor_parallel_size": 4, "num_query_groups": 2}, "num_query_groups=2"),
    ],
)
def test_invalid_layouts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_valid_model_sizes_and_explicit_dp():
    layout = ParallelLayout(
        world_size=16,
        tensor_parallel_size=2,
        expert_parallel_size=8,
        data_parallel_size=8,
        num_experts=64,
        num_attention_heads=16,
        num_query_groups=4,
        expert_ffn_hidden_size=768,
        expert_tensor_parallel_size=2,
    )
    assert layout.expert_data_parallel_size == 1
    assert layout == ParallelLayout(
        world_size=16,
        tensor_parallel_size=2,
        expert_parallel_size=8,
        num_experts=64,
        num_attention_heads=16,
        num_query_groups=4,
        expert_ffn_hidden_size=768,
        expert_tensor_parallel_size=2,
    )


@pytest.mark.parametrize("axis", ["", "xp", "tp-tp", "tp-ep", "dp-edp", "cp--dp"])
def test_bad_axis_names_raise(axis):
    with pytest.raises(ValueError, match="grid"):
        ParallelLayout(world_size=8, expert_parallel_size=2).groups(axis)


def test_bad_rank_raises():
    layout = ParallelLayout(world_size=4)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        layout.coordinates(4)


def test_meshes_before_build_raise_naming_the_fix():
    layout = ParallelLayout(world_size=4, expert_parallel_size=4)
    assert not layout.meshes_built
    for get in (lambda: layout.dense_mesh, lambda: layout.expert_mesh, lambda: layout.mesh("dp_cp")):
        with pytest.raises(RuntimeError, match="build_meshes"):
            get()


def test_build_meshes_without_process_group_raises():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelLayout(world_size=2).build_meshes("cpu")


def test_frozen_and_repr():
    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=8)
    with pytest.raises(AttributeError):
        layout.tensor_parallel_size = 4
    assert repr(layout) == ("ParallelLayout(world_size=16; dense tp=2 cp=1 dp=4 pp=2; expert etp=1 ep=8 edp=1 pp=2)")


def test_summary_table_lists_sizes_orders_and_backends():
    from rich.console import Console

    layout = ParallelLayout(world_size=16, tensor_parallel_size=2, context_parallel_size=2, expert_parallel_size=8)
    console = Console(file=io.StringIO(), width=120, record=True)
    layout.print_summary({"expert GEMM": "torch._grouped_mm", "EP dispatch": "all_to_all_single (gloo)"}, console)
    text = console.export_text()
    for expected in (
        "world size",
        "TP (tensor)",
        "EDP (expert data)",
        "tp-cp-dp-pp",
        "etp-ep-edp-pp",
        "2 x 2 x 4 x 1",
        "1 x 8 x 2 x 1",
        "torch._grouped_mm",
        "all_to_all_single (gloo)",
    ):
        assert expected in text, expected
    assert "expert GEMM" not in _render(layout.summary_table())


def _render(table):
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, record=True)
    console.print(table)
    return console.export_text()
