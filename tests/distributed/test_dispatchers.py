"""Expert-parallel dispatchers on gloo: every rank's outputs and gradients equal one process's.

Every rank builds the same MoELayer (same seed) and keeps an unsharded copy as the reference.
Rank ``r`` feeds its own tokens ``x_r``; routing is per token, so its output and input gradient
must equal the reference layer applied to ``x_r`` alone, its router and shared-expert gradients
the reference's on ``x_r``, and its expert-weight shard gradient the matching slice of the sum
over ranks of the reference gradients (each rank's tokens reach every expert's gradient through
the dispatcher's backward).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from _launch import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_moe.nn.config import MoEConfig
from lightning_moe.nn.moe_layer import MoELayer
from lightning_moe.nn.permutation import round_up
from lightning_moe.parallel.expert_parallel import expert_parallel_layer, shard_experts_for_etp

BASE = dict(hidden_size=16, ffn_hidden_size=8, num_experts=8, router_topk=2)

# name -> (config overrides, starve): ``starve`` makes every expert of EP rank 1 and expert 0
# unreachable, so EP rank 1 receives no rows at all and other ranks see empty experts.
ROUTING_CASES = {
    "k2_aux": (dict(aux_loss_coeff=1e-2), False),
    "k1_pre_softmax": (dict(router_topk=1, router_pre_softmax=True), False),
    "k1_probs_on_input": (dict(router_topk=1, router_pre_softmax=True, apply_probs_on_input=True), False),
    "k4_sigmoid": (dict(router_topk=4, router_score_function="sigmoid"), False),
    "capacity_drop": (dict(expert_capacity_factor=0.5), False),
    "capacity_drop_position": (dict(expert_capacity_factor=0.7, token_drop_policy="position"), False),
    "capacity_pad": (dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True), False),
    # capacity 3 padded to 8-row groups (FP8 kernels need aligned groups even at static capacity)
    "capacity_pad_align8": (dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True, expert_alignment=8), False),
    "align8_shared": (dict(expert_alignment=8, shared_expert_intermediate_size=12, shared_expert_gate=True), False),
    "gelu": (dict(activation="gelu"), False),
    "starved_align8": (dict(expert_alignment=8), True),
    "starved_capacity": (dict(expert_capacity_factor=1.5), True),
    # Pipelined all-to-all (token chunks; streams only on CUDA): same results as unchunked.
    "chunks3_aux": (dict(aux_loss_coeff=1e-2, dispatch_chunks=3), False),
    "chunks2_capacity_align8": (dict(expert_capacity_factor=0.7, expert_alignment=8, dispatch_chunks=2), False),
    "chunks4_starved_probs_on_input": (
        dict(router_topk=1, router_pre_softmax=True, apply_probs_on_input=True, dispatch_chunks=4), True
    ),
}
LAYOUTS = {"ep2": (2, 1), "ep4": (4, 1), "ep2_etp2": (2, 2), "ep1_etp2": (1, 2)}
# Every routing case on EP2; a representative subset on the 4-rank layouts. The cases of one
# layout run in one launch (a process's first step pays most of the warm-up).
CASES_BY_LAYOUT = {
    "ep2": list(ROUTING_CASES),
    "ep4": ["k2_aux", "k4_sigmoid", "capacity_drop", "capacity_pad", "align8_shared", "gelu", "starved_align8",
            "chunks3_aux"],
    "ep2_etp2": ["k2_aux", "k4_sigmoid", "capacity_drop", "capacity_pad_align8", "align8_shared", "gelu", "starved_align8",
                 "chunks2_capacity_align8"],
    "ep1_etp2": ["k2_aux", "capacity_pad", "align8_shared"],
}


def _needs_equal_tokens(dispatcher: str, overrides: dict) -> bool:
    return dispatcher == "allgather" or overrides.get("pad_expert_input_to_capacity", False)


def _make_mesh(ep: int, etp: int, device: str = "cpu"):
    if etp == 1:
        return init_device_mesh(device, (ep,), mesh_dim_names=("ep",))
    return init_device_mesh(device, (ep, etp), mesh_dim_names=("ep", "etp"))


def _build_layer(overrides: dict, starve: bool, ep: int) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**{**BASE, **overrides}))
    if starve:
        per_rank = BASE["num_experts"] // ep
        with torch.no_grad():
            for expert in [0, *range(per_rank, 2 * per_rank)]:
                layer.router.weight[expert, 0] = -20.0
    return layer


def _tokens(rank: int, num_tokens: int, starve: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(num_tokens, BASE["hidden_size"], generator=gen)
    if starve:
        x[:, 0] = 2.0 + x[:, 0].abs()  # with the router weights above, starved experts never win
    return x


def _expected_shard(full_grad_fc1, full_grad_fc2, ep_rank, ep, etp_rank, etp, gated):
    per_rank = full_grad_fc1.shape[0] // ep
    experts = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    return shard_experts_for_etp(full_grad_fc1[experts], full_grad_fc2[experts], etp_rank, etp, gated)


def _run_parity(rank, world_size, layout, case, dispatcher, device="cpu"):
    ep, etp = LAYOUTS[layout]
    overrides, starve = ROUTING_CASES[case]
    if device == "cuda":
        overrides = {**overrides, "expert_backend": "loop"}  # fp32 grouped GEMMs on CUDA: per-expert loop
    mesh = _make_mesh(ep, etp, device)
    ep_rank = mesh.get_local_rank(0)
    etp_rank = mesh.get_local_rank(1) if etp > 1 else 0

    layer = _build_layer(overrides, starve, ep).to(device)
    reference = copy.deepcopy(layer)
    expert_parallel_layer(layer, mesh, dispatcher)
    cfg = layer.config
    kind = {"alltoall": "all-to-all", "allgather": "all-gather"}[dispatcher]
    assert layer.dispatcher.describe() == (f"{kind} (EP={ep})" if etp == 1 else f"{kind} (EP={ep}, ETP={etp})")
    # Each rank holds its experts' FFN slices (global weights: see the checkpoint test).
    ref_weights = (reference.experts.fc1_weight.detach(), reference.experts.fc2_weight.detach())
    for param, want in zip(
        (layer.experts.fc1_weight, layer.experts.fc2_weight),
        _expected_shard(*ref_weights, ep_rank, ep, etp_rank, etp, cfg.is_gated),
    ):
        assert torch.equal(param.to_local(), want)

    seen_group_sizes = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen_group_sizes.append(args[1].clone()))

    num_tokens = 12 if _needs_equal_tokens(dispatcher, overrides) else 9 + 3 * rank
    x = _tokens(rank, num_tokens, starve).to(device).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = layer(x)
    y_ref = reference(x_ref)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    (y * upstream).sum().backward()
    (y_ref * upstream).sum().backward()

    close = dict(atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(y, y_ref, **close)
    torch.testing.assert_close(x.grad, x_ref.grad, **close)
    torch.testing.assert_close(layer.router.weight.grad, reference.router.weight.grad, **close)
    if layer.shared_experts is not None:
        for p, p_ref in zip(layer.shared_experts.parameters(), reference.shared_experts.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, **close)

    ref_grads = [reference.experts.fc1_weight.grad.clone(), reference.experts.fc2_weight.grad.clone()]
    for grad in ref_grads:
        dist.all_reduce(grad)  # EDP = 1 here: the EP x ETP block is the whole world
    expected = _expected_shard(*ref_grads, ep_rank, ep, etp_rank, etp, cfg.is_gated)
    for param, want in zip((layer.experts.fc1_weight, layer.experts.fc2_weight), expected):
        assert isinstance(param.grad, DTensor)
        torch.testing.assert_close(param.grad.to_local(), want, **close)

    chunks = cfg.dispatch_chunks if dispatcher == "alltoall" and not overrides.get("pad_expert_input_to_capacity") else 1
    assert len(seen_group_sizes) == chunks  # one expert call per token chunk
    align = cfg.expert_alignment
    for sizes in seen_group_sizes:
        assert bool((sizes % align == 0).all())
    group_sizes = torch.stack(seen_group_sizes).sum(0)
    assert group_sizes.shape == (cfg.num_experts // ep,)
    if starve and ep_rank == 1:
        assert int(group_sizes.sum()) == 0, "the starved EP rank must receive no rows"
    if overrides.get("pad_expert_input_to_capacity"):
        capacity = cfg.expert_capacity(num_tokens)
        # all-to-all: one aligned block per source; all-gather: one aligned block of all sources
        rows = (round_up(capacity, align) * ep * etp if dispatcher == "alltoall"
                else round_up(capacity * ep * etp, align))
        assert group_sizes.tolist() == [rows] * (cfg.num_experts // ep)
    return int((group_sizes == 0).sum())


def _run_cases(rank, world_size, layout, dispatcher):
    empty_experts = {}
    for case in CASES_BY_LAYOUT[layout]:
        try:
            empty_experts[case] = _run_parity(rank, world_size, layout, case, dispatcher)
        except Exception as err:
            raise AssertionError(f"case {case!r} ({layout}, {dispatcher}) failed on rank {rank}") from err
    return empty_experts


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("layout", list(CASES_BY_LAYOUT))
def test_dispatcher_parity(layout, dispatcher):
    ep, etp = LAYOUTS[layout]
    results = run_distributed(_run_cases, ep * etp, layout, dispatcher)
    for case in CASES_BY_LAYOUT[layout]:
        if ROUTING_CASES[case][1]:
            assert sum(r[case] for r in results) > 0, f"{case}: no rank saw an empty expert"


def _host_reads(fn) -> dict:
    """Python-level device-to-host reads (``tolist``, ``item``, ``cpu``, conversions) while ``fn`` runs."""
    counts = {}
    names = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in names:
        setattr(torch.Tensor, name, counting(name, originals[name]))
    try:
        fn()
    finally:
        for name in names:
            setattr(torch.Tensor, name, originals[name])
    return counts


def _forward_backward(layer, x):
    y = layer(x)
    (y * 1.5).sum().backward()
    return y


def _count_host_syncs(rank, world_size, overrides, dispatcher):
    """Python-level device-to-host reads during one forward + backward of the layer."""
    mesh = _make_mesh(world_size, 1)
    layer = expert_parallel_layer(_build_layer(overrides, False, world_size), mesh, dispatcher)
    x = _tokens(rank, 12, False).requires_grad_()
    return _host_reads(lambda: _forward_backward(layer, x))


@pytest.mark.parametrize(
    ("dispatcher", "overrides", "expected"),
    [
        ("alltoall", {}, {"tolist": 1}),
        ("alltoall", dict(expert_capacity_factor=0.5), {"tolist": 1}),
        ("alltoall", dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True), {}),
        ("alltoall", dict(dispatch_chunks=3, expert_alignment=8), {"tolist": 1}),
        ("allgather", {}, {}),
        ("allgather", dict(expert_capacity_factor=0.5, expert_alignment=8), {}),
    ],
    ids=["a2a-dropless", "a2a-capacity", "a2a-pad-capacity", "a2a-chunked", "ag-dropless", "ag-capacity-align"],
)
def test_host_syncs(dispatcher, overrides, expected):
    """The all-to-all reads its split sizes once per forward, chunked or not (none when padded to capacity); the
    all-gather never reads the device. Counts Python-level reads (``tolist``, ``item``, ``cpu``,
    conversions); syncs inside C++ kernels are checked on CUDA by the GPU test below."""
    for counts in run_distributed(_count_host_syncs, 2, overrides, dispatcher):
        assert counts == expected


def _checkpoint_roundtrip(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    reference = _build_layer({}, False, 2)
    saved = expert_parallel_layer(copy.deepcopy(reference), _make_mesh(2, 2))
    # The SwiGLU fc1 DTensor's global tensor is the canonical [E, D, 2, F] weight.
    assert torch.equal(saved.experts.fc1_weight.full_tensor(), reference.experts.fc1_weight.detach())
    assert torch.equal(saved.experts.fc2_weight.full_tensor(), reference.experts.fc2_weight.detach())
    state = {"fc1": saved.experts.fc1_weight, "fc2": saved.experts.fc2_weight}
    dcp.save(state, checkpoint_id=path)
    torch.manual_seed(123)
    loaded = expert_parallel_layer(MoELayer(MoEConfig(**BASE)), _make_mesh(4, 1))
    target = {"fc1": loaded.experts.fc1_weight, "fc2": loaded.experts.fc2_weight}
    dcp.load(target, checkpoint_id=path)
    for name in ("fc1_weight", "fc2_weight"):
        assert torch.equal(getattr(loaded.experts, name).full_tensor(), getattr(saved.experts, name).full_tensor())
    with torch.device("meta"):
        meta = MoELayer(MoEConfig(**BASE))
    expert_parallel_layer(meta, _make_mesh(2, 2))
    assert meta.experts.fc1_weight.shape == (8, 16, 2, 8) and meta.experts.fc1_weight.to_local().shape == (4, 16, 2, 4)
    assert meta.experts.fc1_weight.to_local().is_meta


def test_etp_layout_checkpoint_reshards(tmp_path):
    """SwiGLU experts saved under EP2 x ETP2 load into an EP4 layer with the same weights."""
    run_distributed(_checkpoint_roundtrip, 4, str(tmp_path / "ckpt"))


def test_shard_experts_for_etp_pairs_gate_and_up():
    fc1 = torch.arange(2 * 3 * 8.0).view(2, 3, 2, 4)  # F = 4: [:, :, 0] gate, [:, :, 1] up
    fc2 = torch.arange(2 * 4 * 3.0).view(2, 4, 3)
    local1, local2 = shard_experts_for_etp(fc1, fc2, etp_rank=1, etp_size=2, gated=True)
    assert torch.equal(local1.flatten(-2), fc1.flatten(-2)[..., [2, 3, 6, 7]])  # [gate_1 | up_1]
    assert torch.equal(local2, fc2[:, 2:4])
    local1, _ = shard_experts_for_etp(fc1[:, :, 0], fc2, etp_rank=1, etp_size=2, gated=False)
    assert torch.equal(local1, fc1[:, :, 0, 2:4])
    with pytest.raises(ValueError, match="divisible"):
        shard_experts_for_etp(fc1, fc2, etp_rank=0, etp_size=3, gated=True)


def _cuda_syncs(step) -> list[str]:
    """Where ``step()`` syncs the host, as CUDA's sync debug mode reports it (C++ kernels included)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


PARALLEL_FILES = ("dispatchers.py", "dispatch_ops.py", "expert_parallel.py")
GPU_SYNC_CASES = [
    ("alltoall", {}),
    ("alltoall", dict(dispatch_chunks=2)),
    ("alltoall", dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True)),
    ("allgather", {}),
]


def _train_step(layer, x):
    layer(x).float().square().sum().backward()


def _gpu_checks(rank, world_size):
    torch.cuda.set_device(rank)
    for layout in ("ep2", "ep1_etp2"):
        for dispatcher in ("alltoall", "allgather"):
            for case in ("k2_aux", "capacity_drop", "capacity_pad", "align8_shared"):
                _run_parity(rank, world_size, layout, case, dispatcher, device="cuda")
    _run_parity(rank, world_size, "ep2", "starved_align8", "alltoall", device="cuda")
    # Chunked all-to-all: every chunk on its own CUDA stream.
    for case in ("chunks3_aux", "chunks4_starved_probs_on_input", "chunks2_capacity_align8"):
        _run_parity(rank, world_size, "ep2", case, "alltoall", device="cuda")
    _run_parity(rank, world_size, "ep1_etp2", "chunks2_capacity_align8", "alltoall", device="cuda")
    # bf16 activations through torch._grouped_mm, as in training; syncs of the whole layer
    # (router, permutation, experts, dispatcher, backward), expert-parallel vs local.
    syncs = []
    for dispatcher, overrides in GPU_SYNC_CASES:
        cfg = dict(BASE, hidden_size=64, ffn_hidden_size=32, **overrides)
        torch.manual_seed(0)
        local = MoELayer(MoEConfig(**cfg)).cuda()
        parallel = expert_parallel_layer(copy.deepcopy(local), _make_mesh(2, 1, "cuda"), dispatcher)
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        counts = []
        for layer in (local, parallel):
            step = functools.partial(_train_step, layer, x)
            step()  # warm-up (kernel compilation, lazy initialisation)
            step()
            counts.append(_cuda_syncs(step))
        syncs.append(tuple(counts))
    return syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_parity_and_host_syncs():
    """On NCCL: parity (fp32, per-expert loop GEMMs), and the host syncs the dispatchers add to the
    local layer: one for the all-to-all (split sizes), none padded to capacity or all-gathered."""
    results = run_distributed(_gpu_checks, 2, backend="nccl", timeout=300)
    own_syncs = []
    for (dispatcher, overrides), (local, parallel) in zip(GPU_SYNC_CASES, results[0]):
        print(f"{dispatcher} {overrides}: local syncs {local}, expert-parallel syncs {parallel}")
        own = [site for site in parallel if site.startswith(PARALLEL_FILES)]
        # Whatever the expert-parallel layer syncs beyond the local layer comes from the dispatcher.
        assert set((Counter(parallel) - Counter(local)).elements()) <= set(own)
        own_syncs.append(len(own))
    assert own_syncs == [1, 1, 0, 0]


def _transport_errors(rank, world_size):
    from lightning_moe.parallel.dispatchers import AllGatherDispatcher, AllToAllDispatcher

    cfg = MoEConfig(**BASE, dispatch_transport="copy_engine")
    group = _make_mesh(world_size, 1).get_group(0)
    messages = []
    for kind in (AllGatherDispatcher, AllToAllDispatcher):
        with pytest.raises(ValueError) as err:
            kind(cfg, group)
        messages.append(str(err.value))
    return messages


def test_copy_engine_transport_errors_name_the_fix():
    """The copy-engine transport needs CUDA GPUs on NCCL (gloo here), and only the all-gather
    dispatcher has it: each refusal says what to set instead."""
    for gather_msg, a2a_msg in run_distributed(_transport_errors, 2):
        assert "dispatch_transport='nccl'" in gather_msg and "'gloo'" in gather_msg
        assert "token_dispatcher_type='allgather'" in a2a_msg
    with pytest.raises(ValueError, match="dispatch_transport"):
        MoEConfig(**BASE, dispatch_transport="nvlink")



def _spread_bf16(rows, seed):
    """bf16 rows over many binades, so that a sum rounded at two steps would show."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-20, 20, (rows, 1), generator=g)
    return (torch.randn(rows, 48, generator=g) * scale).to(torch.bfloat16)


def _fp32_sum_cast(x, group, world_size, rank, rows):
    exact = x.float()
    dist.all_reduce(exact, group=group)  # the fp32 sum of the bf16 inputs
    return exact.view(world_size, rows, -1)[rank].to(torch.bfloat16)


def _bf16_reduce_scatters(rank, world_size):
    from lightning_moe.parallel.dispatch_ops import all_gather_rows, reduce_scatter_rows

    group = _make_mesh(world_size, 1).get_group(0)
    rows = 64
    x = _spread_bf16(world_size * rows, rank)
    forward_ok = torch.equal(reduce_scatter_rows(x, group), _fp32_sum_cast(x, group, world_size, rank, rows))
    leaf = _spread_bf16(rows, 100 + rank).requires_grad_(True)
    upstream = _spread_bf16(world_size * rows, 200 + rank)
    all_gather_rows(leaf, group).backward(upstream)  # backward: the reduce-scatter of the upstream
    backward_ok = torch.equal(leaf.grad, _fp32_sum_cast(upstream, group, world_size, rank, rows))
    return forward_ok, backward_ok


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_reduce_scatters_equal_the_fp32_sum_cast_back(world_size):
    """Expert outputs (forward) and token gradients (the all-gather's backward) are summed in
    bf16 only where that equals the fp32 sum rounded once: over two ranks; over three they
    travel as fp32."""
    assert run_distributed(_bf16_reduce_scatters, world_size) == [(True, True)] * world_size


def _deferred_permutation_parity(rank, world_size, dispatcher):
    """Outputs and every gradient of a layer whose experts read the deferred permutation equal
    those with the permutation carried out by the dispatcher; the deferred path ran."""
    from _deferred_gemm import GatheringGemm

    from lightning_moe.nn.experts import GroupedExperts

    results = []
    for defer in (True, False):
        torch.manual_seed(0)
        layer = MoELayer(MoEConfig(**BASE, expert_alignment=8, aux_loss_coeff=1e-2))
        if dispatcher != "local":
            expert_parallel_layer(layer, _make_mesh(world_size, 1), dispatcher)
        gemm = GatheringGemm()
        layer.experts.quantization = gemm
        original = GroupedExperts.takes_deferred_permutation
        GroupedExperts.takes_deferred_permutation = original if defer else (lambda self, tokens: False)
        try:
            x = _tokens(rank, 24, starve=False).requires_grad_(True)
            for _ in range(2):
                out = layer(x)
                out.square().sum().backward()
        finally:
            GroupedExperts.takes_deferred_permutation = original
        results.append((gemm.gathered, [out.detach(), x.grad] + [p.grad for p in layer.parameters()]))
    (deferred_calls, deferred), (plain_calls, plain) = results
    # the all-to-all dispatcher permutes after its exchange and never defers
    assert deferred_calls == (0 if dispatcher == "alltoall" else 2) and plain_calls == 0, (deferred_calls, plain_calls)
    for i, (a, b) in enumerate(zip(deferred, plain)):
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        assert torch.equal(a, b), i
    return True


@pytest.mark.parametrize("dispatcher,world_size", [("local", 1), ("allgather", 2), ("alltoall", 2)])
def test_deferred_permutation_trains_identically(dispatcher, world_size):
    """The local dispatcher and the all-gather dispatcher (EP=2) hand experts that take it the
    tokens and the plan instead of the permuted rows (`DeferredPermutation`): two training
    steps give the same outputs and gradients, bit for bit, as with the rows permuted first.
    The all-to-all dispatcher does not offer it, and the layer does not ask it to."""
    assert run_distributed(_deferred_permutation_parity, world_size, dispatcher) == [True] * world_size


def _fsdp_input_casts(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lightning_moe.nn.experts import GroupedExperts, GroupedGemmQuantization

    mesh = init_device_mesh("cpu", (world_size,))
    casting, plain, unwrapped, undeclared = (GroupedExperts(4, 16, 8) for _ in range(4))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(casting, mesh=mesh, mp_policy=policy)
    casting.declare_fsdp_input_cast(torch.bfloat16)  # what parallel.fsdp.shard_experts declares
    fully_shard(plain, mesh=mesh)
    plain.declare_fsdp_input_cast(None)
    fully_shard(undeclared, mesh=mesh, mp_policy=policy)  # sharded by someone else: counts as casting
    casts = [casting._fsdp_casts_inputs(torch.float32), casting._fsdp_casts_inputs(torch.bfloat16),
             plain._fsdp_casts_inputs(torch.float32), unwrapped._fsdp_casts_inputs(torch.float32),
             undeclared._fsdp_casts_inputs(torch.bfloat16)]

    class TakesCombine(GroupedGemmQuantization):  # a quantization that would fuse the combine
        def grouped_mm(self, *args):
            raise AssertionError("not called")

        def takes_deferred_combine(self, tokens):
            return True

    for experts in (casting, plain):
        experts.quantization = TakesCombine()
    tokens = torch.randn(8, 16, dtype=torch.bfloat16)
    return casts + [casting.takes_deferred_combine(tokens), plain.takes_deferred_combine(tokens)]


def test_fsdp_input_casts_turn_the_deferred_permutation_off():
    """FSDP2 casting the experts' inputs to bf16 would cast the deferred tokens, so the token
    gradient would be summed over assignments in bf16: such experts do not take the deferred
    permutation of fp32 tokens (bf16 tokens are not cast, so they still do). Nor the deferred
    combine, even of bf16 tokens: its probabilities (fp32) would be cast."""
    assert run_distributed(_fsdp_input_casts, 1) == [[True, False, False, False, True, False, True]]


# The static (capturable) dropless all-to-all: the same layer with host-synced sizes is the reference.
STATIC_CASES = ["k2_aux", "k4_sigmoid", "capacity_drop", "align8_shared", "starved_align8", "chunks3_aux",
                "k1_probs_on_input"]


def _static_parity(rank, world_size, layout, budget):
    ep, etp = LAYOUTS[layout]
    mesh = _make_mesh(ep, etp)
    results = {}
    for case in STATIC_CASES:
        overrides, starve = ROUTING_CASES[case]
        synced, static = (expert_parallel_layer(_build_layer(overrides, starve, ep), mesh, "alltoall")
                          for _ in range(2))
        static.dispatcher.static_budget = budget
        assert not synced.dispatcher.syncs_host or synced.dispatcher.takes_static_budget
        x = _tokens(rank, 12, starve)
        upstream = torch.randn(12, BASE["hidden_size"], generator=torch.Generator().manual_seed(7 + rank))
        outputs = []
        for layer in (synced, static):
            x_in = x.clone().requires_grad_()
            y = layer(x_in)
            (y * upstream).sum().backward()
            outputs.append([y, x_in.grad] + [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                              for p in layer.parameters() if p.grad is not None])
        for ours, reference in zip(*outputs):  # the same rows reach the same GEMMs: the same bits
            if overrides.get("dispatch_chunks", 1) > 1:  # the static path exchanges the micro-batch at once
                torch.testing.assert_close(ours, reference, atol=1e-7, rtol=1e-5)
            else:
                assert torch.equal(ours, reference), case
        assert synced.dispatcher.overflow is None and int(static.dispatcher.overflow) == 0, case
        results[case] = static.dispatcher.static_sizes(12, budget)
    return results


@pytest.mark.parametrize("layout", ["ep2", "ep4", "ep2_etp2"])
def test_static_all_to_all_equals_the_synced_one(layout):
    """Sizes fixed by the token count (no host read) give the host-synced dispatch's outputs and
    gradients bit for bit where nothing overflows (a budget of twice the balanced rows)."""
    run_distributed(_static_parity, 4 if layout != "ep2" else 2, layout, 2.0)


def _static_overflow(rank, world_size):
    mesh = _make_mesh(world_size, 1)
    # every token to EP rank 0's experts: rank 0's buffer overflows at budget 1 (2x the balanced rows needed)
    layer = expert_parallel_layer(_build_layer({}, False, world_size), mesh, "alltoall")
    with torch.no_grad():
        layer.router.weight[BASE["num_experts"] // world_size:] = -30.0
    dispatcher = layer.dispatcher
    dispatcher.static_budget = 1.0
    x = _tokens(rank, 12, False).requires_grad_()
    outputs = []
    counts = _host_reads(lambda: outputs.append(_forward_backward(layer, x)))
    (y,) = outputs
    overflowed = int(dispatcher.overflow)
    dispatcher.overflow.zero_()
    dispatcher.static_budget = 4.0  # room for every row: no overflow, and the flag stays clear
    layer(x)
    return counts, overflowed, int(dispatcher.overflow), bool(torch.isfinite(y).all()), bool(torch.isfinite(x.grad).all())


def test_static_all_to_all_overflow_sets_the_flag_without_a_host_read():
    results = run_distributed(_static_overflow, 2)
    counts = [r[0] for r in results]
    assert counts == [{}, {}]  # nothing read on the host, forward or backward
    assert [r[1] for r in results] == [1, 0]  # rank 0's experts got every row: its buffer overflowed
    assert [r[2] for r in results] == [0, 0]
    assert all(r[3] and r[4] for r in results)


def test_static_sizes_follow_the_budget():
    from lightning_moe.parallel.dispatchers import AllToAllDispatcher

    dispatcher = AllToAllDispatcher.__new__(AllToAllDispatcher)
    dispatcher.cfg = MoEConfig(**{**BASE, "router_topk": 8, "num_experts": 64, "expert_alignment": 16})
    dispatcher.ep_size, dispatcher.etp_size, dispatcher.num_local_experts = 8, 1, 8
    slot, rows = dispatcher.static_sizes(4096, 1.25)
    assert slot == 4096  # f K >= EP: a slot holds every token (no slot overflows)
    assert rows == round_up(5 * 4096 * 8 // 4 + 8 * 15, 16)  # 1.25 x the balanced 32768 rows, plus alignment
    dispatcher.cfg = MoEConfig(**{**BASE, "router_topk": 2, "num_experts": 64})
    slot, rows = dispatcher.static_sizes(4096, 1.25)
    assert slot == 1280 and rows == 10240
    with pytest.raises(ValueError, match="must be > 0"):
        dispatcher.static_sizes(4096, 0.0)


def _static_fp8_parity(rank, world_size):
    """Emulated FP8 delayed experts behind the static all-to-all: the budget's spare rows (zeros past
    the last group) change no amax, scale or bit against the synced path, over two steps."""
    from lightning_moe.precision import FP8Precision

    mesh = _make_mesh(world_size, 1)
    results = []
    for budget in (None, 2.0):
        layer = expert_parallel_layer(_build_layer(dict(expert_alignment=16), False, world_size), mesh, "alltoall")
        plugin = FP8Precision(recipe="delayed", backend="emulated", device="cpu")
        plugin.convert_module(layer)
        assert layer.experts.quantization is not None  # the experts' GEMMs quantized (emulated on CPU)
        layer.dispatcher.static_budget = budget
        seen = []
        for step in range(2):
            x = _tokens(rank + 10 * step, 12, False).requires_grad_()
            with plugin.forward_context():
                y = layer(x)
            (y * 1.5).sum().backward()
            plugin.update_delayed_scaling()
            seen += [y.detach(), x.grad] + [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                            for p in layer.parameters() if p.grad is not None]
        histories = [b.clone() for n, b in layer.named_buffers() if b is not None and "amax_history" in n]
        assert histories and all(bool(h.abs().sum() > 0) for h in histories)  # amaxes were recorded
        seen += [b.clone() for b in layer.buffers() if b is not None]
        results.append(seen)
    assert len(results[0]) == len(results[1])
    for ours, reference in zip(results[1], results[0]):
        assert torch.equal(ours, reference)
    return True


def test_static_all_to_all_under_fp8_delayed_equals_the_synced_one():
    assert run_distributed(_static_fp8_parity, 2) == [True, True]
