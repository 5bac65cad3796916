"""`CUDAGraphs` on CPU: scope selection, module discovery, refusals and their messages, the CPU
no-op notice, and the callback's bookkeeping in a real fit (warm-up, capture order, replay,
eager evaluation, eager calls of another shape, capture again after a resume) with the capture
itself replaced by an eager stand-in (the graphs are GPU tests: tests/gpu/test_cuda_graphs_callback_gpu.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_moe.callbacks.cuda_graphs as callback_module
from lightning_moe.callbacks import CUDAGraphs
from lightning_moe.callbacks._graph_calls import bind_tensors, call_signature, sample_tensors
from lightning_moe.callbacks._graph_targets import check_targets, describe_targets, find_targets, normalize_scope
from lightning_moe.cuda_graphs import _assigned, _attributes, _holds_tensor
from lightning_moe.models import MoELanguageModel
from lightning_moe.nn import MoEConfig, MoELayer

SEQ = 16


def tiny_model(**moe) -> MoELanguageModel:
    overrides = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
                 "num_query_groups": 1, "moe": {"ffn_hidden_size": 32, **moe}}
    return MoELanguageModel("tiny", overrides=overrides, learning_rate=1e-2, warmup_steps=1)


def built(module: MoELanguageModel) -> MoELanguageModel:
    torch.manual_seed(0)
    module.configure_model()
    return module


class Tokens(Dataset):
    def __init__(self, count: int, seed: int = 0) -> None:
        self.tokens = torch.randint(0, 256, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


# ---------------------------------------------------------------------------- scopes


def test_scope_names_and_combinations():
    assert normalize_scope("full") == ("full",)
    assert normalize_scope(["attn", "moe"]) == ("attn", "moe")
    with pytest.raises(ValueError, match="choose one of"):
        normalize_scope("layers")
    with pytest.raises(ValueError, match="only 'attn' and 'moe' combine"):
        normalize_scope(("full", "moe"))
    with pytest.raises(ValueError, match="twice"):
        normalize_scope(("moe", "moe"))
    with pytest.raises(ValueError, match="warmup_steps"):
        CUDAGraphs(warmup_steps=0)
    with pytest.raises(ValueError, match="num_warmup_iters"):
        CUDAGraphs(num_warmup_iters=0)


@pytest.mark.parametrize("scope, expected", [
    ("full", ["model.layers.0", "model.layers.1"]),
    ("attn", ["model.layers.0.attention", "model.layers.1.attention"]),
    ("moe", ["model.layers.0.mlp", "model.layers.1.mlp"]),
    (("attn", "moe"), ["model.layers.0.attention", "model.layers.0.mlp", "model.layers.1.attention",
                       "model.layers.1.mlp"]),
    ("full_iteration", ["model"]),
])
def test_reference_modules_found_by_type(scope, expected):
    module = built(tiny_model())
    assert [name for name, _ in find_targets(module, normalize_scope(scope))] == expected


def test_mla_attention_found():
    module = built(MoELanguageModel("tiny", overrides={
        "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "attention_type": "mla", "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "moe": {"ffn_hidden_size": 32}}))
    (name, attention), = find_targets(module, ("attn",))
    assert name == "model.layers.0.attention" and type(attention).__name__ == "MultiHeadLatentAttention"


def test_user_modules_by_class_and_name():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 4)

    root = nn.Module()
    root.net = Net()
    assert [n for n, _ in find_targets(root, ("full",), [Block])] == ["net.blocks.0", "net.blocks.1"]
    assert [n for n, _ in find_targets(root, ("full",), ["net.blocks.*"])] == ["net.blocks.0", "net.blocks.1"]
    # nested matches: the outermost is captured, the inner ones are inside its graph
    assert [n for n, _ in find_targets(root, ("full",), ["net", Block])] == ["net"]
    with pytest.raises(ValueError, match=r"'net\.missing' matched no module"):
        find_targets(root, ("full",), ["net.missing"])
    with pytest.raises(ValueError, match=r"found no DecoderLayer in Module: pass your own modules"):
        find_targets(root, ("full",))
    with pytest.raises(ValueError, match=r"modules=\['model'\]"):
        find_targets(root, ("full",), [""])
    with pytest.raises(ValueError, match="module classes or qualified-name patterns"):
        find_targets(root, ("full",), [3])


def test_describe_targets():
    module = built(tiny_model())
    text = describe_targets(find_targets(module, ("moe",)))
    assert text == "2 x MoELayer (model.layers.0.mlp .. model.layers.1.mlp)"


# ---------------------------------------------------------------------------- refusals


def _moe_targets():
    module = built(tiny_model())
    return module, find_targets(module, ("full",))


def test_reference_model_passes_the_checks():
    module, targets = _moe_targets()
    check_targets(targets)


def test_dropless_all_to_all_is_refused_naming_allgather():
    module, targets = _moe_targets()
    module.model.layers["0"].mlp.dispatcher = SimpleNamespace(syncs_host=True, describe=lambda: "all-to-all (EP=2)")
    with pytest.raises(ValueError, match=r"all-to-all \(EP=2\).*token_dispatcher='allgather'"):
        check_targets(targets)


def test_host_syncing_expert_backend_is_refused():
    module, targets = _moe_targets()
    module.model.layers["1"].mlp.experts.backend = "loop"
    with pytest.raises(ValueError, match="expert_backend='grouped_mm'"):
        check_targets(targets)


def test_module_hooks_are_refused():
    module, targets = _moe_targets()
    module.model.layers["0"].mlp.router.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.router \(TopKRouter\).*forward hooks"):
        check_targets(targets)


def test_global_module_hooks_are_refused():
    module, targets = _moe_targets()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        with pytest.raises(ValueError, match="global module forward hooks"):
            check_targets(targets)
    finally:
        handle.remove()


def test_fsdp_units_are_refused_naming_ddp():
    from torch.distributed import fsdp

    module, targets = _moe_targets()
    experts = module.model.layers["0"].mlp.experts
    # What fully_shard does to a module's class, without a process group.
    experts.__class__ = type("FSDPGroupedExperts", (fsdp.FSDPModule, type(experts)), {})
    with pytest.raises(ValueError, match=r"FSDP-sharded.*expert_sharding='ddp'"):
        check_targets(targets)


@pytest.mark.parametrize("dims, match", [(("dp",), "FSDP-sharded"), (("tp",), "tensor_parallel_size=1")])
def test_sharded_parameters_are_refused(dims, match):
    module, targets = _moe_targets()
    weight = module.model.layers["0"].attention.q_proj.weight
    weight.device_mesh = SimpleNamespace(mesh_dim_names=dims)  # what a DTensor parameter reports
    with pytest.raises(ValueError, match=match):
        check_targets(targets)


def test_expert_parallel_shards_pass():
    module, targets = _moe_targets()
    module.model.layers["0"].mlp.experts.fc1_weight.device_mesh = SimpleNamespace(mesh_dim_names=("ep",))
    check_targets(targets)


def test_context_parallel_attention_is_refused():
    module, targets = _moe_targets()
    module.model.layers["0"].attention.cp_group = object()
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        check_targets(targets)


def test_uncapturable_arguments_are_refused():
    with pytest.raises(ValueError, match=r"documents=DocumentMask.*scope='moe'"):
        call_signature((torch.zeros(2),), {"documents": type("DocumentMask", (), {})()}, "model.layers.0.attention")


def test_te_fp8_and_packed_batches_are_refused_at_setup():
    callback = CUDAGraphs()
    te = SimpleNamespace(precision_plugin=SimpleNamespace(backend="te"), datamodule=None)
    with pytest.raises(ValueError, match="FP8Precision\\(backend='torch'\\)"):
        callback._refuse_setup(te)
    packed = SimpleNamespace(precision_plugin=SimpleNamespace(), datamodule=SimpleNamespace(pack_sequences=True))
    with pytest.raises(ValueError, match="pack_sequences=False"):
        callback._refuse_setup(packed)
    CUDAGraphs(scope="moe")._refuse_setup(packed)  # MoE layers take only their tokens


@pytest.mark.parametrize("scope, overrides, refused", [
    ("full", {"recompute": ["layernorm"]}, "model.layers.0.attention_norm is recomputed in backward \\('layernorm'\\)"),
    ("attn", {"recompute": ["layernorm"]}, None),  # the norms are outside every captured module
    ("moe", {"recompute": ["layernorm", "core_attn"]}, None),
    ("attn", {"recompute": ["core_attn"]}, "core_attention is recomputed.*drop 'core_attn'"),
    ("moe", {"recompute": ["moe"]}, "model.layers.0.mlp is recomputed in backward \\('moe'\\)"),
    ("moe", {"recompute": ["moe_act"]}, "experts is recomputed.*'moe_act'"),
    ("attn", {"recompute": ["moe", "moe_act"]}, None),
    ("moe", {"recompute_every_n_layers": 2}, "model.layers.0 is recomputed.*recompute_every_n_layers=None"),
    ("full_iteration", {"recompute": ["moe_act"]}, "overlaps the captured model"),
])
def test_recompute_inside_a_captured_module_is_refused(scope, overrides, refused):
    """A graph's pool keeps what a recomputation would free, and torch.utils.checkpoint saves the RNG
    state, which a capture cannot read: recomputed parts inside a target, or around one, are refused
    at fit start; parts outside every target pass."""
    module = built(MoELanguageModel("tiny", overrides={
        "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2, "num_query_groups": 1,
        "moe": {"ffn_hidden_size": 32}, **overrides}))
    callback = CUDAGraphs(scope=scope)
    if refused is None:
        assert callback.plan(module)
        return
    with pytest.raises(ValueError, match=refused) as error:
        callback.plan(module)
    assert "RNG state" in str(error.value)


def test_recompute_inside_the_targets_is_refused_without_the_root():
    module = built(MoELanguageModel("tiny", overrides={"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                                                       "recompute": ["core_attn"], "moe": {"ffn_hidden_size": 32}}))
    with pytest.raises(ValueError, match="model.layers.0.attention.core_attention is recomputed"):
        check_targets(find_targets(module, ("full",)))


def test_pipeline_parallelism_is_refused_at_setup():
    def trainer(pp):
        return SimpleNamespace(strategy=SimpleNamespace(layout=SimpleNamespace(pipeline_parallel_size=pp)))

    with pytest.raises(ValueError, match="pipeline_parallel_size=1.*drop the callback"):
        CUDAGraphs().setup(trainer(2), None, "fit")
    CUDAGraphs().setup(trainer(1), None, "fit")
    CUDAGraphs().setup(SimpleNamespace(strategy=object()), None, "fit")  # a strategy without a layout


def test_dropped_graphs_leave_no_reference_cycle():
    """make_graphed_callables sets ``module.forward`` to a function whose closure holds the module:
    dropping the graphs removes it, so the graphed callable (and the graphs' pool) goes at once and
    the module's forward is its class's again; uninstalling puts the targets' forwards back too."""
    import weakref

    from lightning_moe.cuda_graphs import CapturedModules

    class Proxy(nn.Module):
        def forward(self, x):
            return x

    proxy, layer = Proxy(), nn.Linear(2, 2)

    def graphed(func):  # what torch.cuda.graphs.make_graphed_callables does for a module
        def new_fwd(*args):
            return func.__class__.forward(func, *args)
        return new_fwd

    proxy.forward = graphed(proxy)
    callable_ref = weakref.ref(proxy.forward)
    callback = CUDAGraphs(modules=[nn.Linear])
    callback._install([("layer", layer)])
    callback._graphs = CapturedModules([layer], [proxy], [[]], SimpleNamespace(remove=lambda: None))
    callback._uninstall()
    assert callback._graphs is None and callback._targets == []
    assert "forward" not in proxy.__dict__ and proxy.forward.__func__ is Proxy.forward
    assert "forward" not in layer.__dict__ and layer.forward.__func__ is nn.Linear.forward
    assert callable_ref() is None  # the proxy is still alive here: only its graphed forward is gone


# ---------------------------------------------------------------------------- calls and attributes


def test_call_signature_binding_and_samples():
    x = torch.randn(2, 3, 4, requires_grad=True)
    ids = torch.arange(6).view(2, 3)
    signature, tensors = call_signature((x, None, 3), {"ids": ids, "mask": None}, "m")
    assert tensors == (x, ids)
    other, _ = call_signature((x[:1], None, 3), {"ids": ids}, "m")
    assert other != signature  # another shape: another signature (that call runs eagerly)
    seen = []
    bind_tensors(lambda *a, **k: seen.append((a, k)), signature)(*tensors)
    assert seen[0][0][1:] == (None, 3) and set(seen[0][1]) == {"ids"}
    samples = sample_tensors(signature, torch.Generator().manual_seed(0))
    assert [s.shape for s in samples] == [x.shape, ids.shape] and samples[0].requires_grad
    assert not samples[1].requires_grad and samples[1].dtype == ids.dtype and not samples[1].any()


def test_attributes_a_forward_assigns_are_found():
    """What the capture re-assigns after each replay: the router's losses and the layer's stats."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, router_topk=2,
                               aux_loss_coeff=1e-2))
    before = _attributes([layer])
    layer(torch.randn(2, 8, 16))
    names = sorted(name for _, name, _ in _assigned(before, _attributes([layer])))
    assert names == ["last_stats", "latest_losses"]
    assert _holds_tensor({"a": torch.zeros(1)}) and not _holds_tensor(3) and not _holds_tensor({})


# ---------------------------------------------------------------------------- the callback in a fit


def _trainer(callbacks, max_steps, accumulate=1, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, callbacks=callbacks,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   accumulate_grad_batches=accumulate, num_sanity_val_steps=0, **kwargs)


def test_cpu_fit_is_a_no_op_with_one_notice(caplog):
    module = tiny_model()
    callback = CUDAGraphs(scope="moe", warmup_steps=1)
    with caplog.at_level(logging.INFO):
        _trainer([callback], max_steps=2).fit(module, DataLoader(Tokens(8), batch_size=2))
    notices = [r.getMessage() for r in caplog.records if "CUDAGraphs" in r.getMessage()]
    assert notices == ["CUDAGraphs: no CUDA device (training on cpu); nothing is captured, every step runs eagerly."]
    assert callback.captured == [] and all("forward" not in m.__dict__ for m in module.modules())
    assert callback.layout_rows(module) == {"CUDA graphs": "scope 'moe': off (no CUDA device)"}


@dataclass
class _EagerCapture:
    """Stands in for `capture_modules` on CPU: "replays" run the captured forwards eagerly."""

    modules: list
    forwards: list
    accumulate_grads: bool
    replays: int = 0
    released: bool = False
    stale_clears: int = 0
    events: list = field(default_factory=list)  # "replay" and "clear", in the order they came

    def replay(self, slot, *tensors):
        self.replays += 1
        self.events.append("replay")
        return self.forwards[slot](*tensors)

    def clear_stale_grads(self):
        self.stale_clears += 1
        self.events.append("clear")

    def release(self):
        self.released = True


class _OnCPU(CUDAGraphs):
    """The callback's bookkeeping on CPU (the capture itself is `_EagerCapture`)."""

    def _uses_cuda(self, trainer):
        return True


@pytest.fixture
def captures(monkeypatch):
    made = []

    def fake(modules, samples, num_warmup_iters, accumulate_grads, forwards):
        made.append(_EagerCapture(list(modules), list(forwards), accumulate_grads))
        return made[-1]

    monkeypatch.setattr(callback_module, "capture_modules", fake)
    return made


def _losses(module, callbacks, steps, accumulate=1, data=None, ckpt_path=None, val=None, **kwargs):
    seen = []

    class Keep(callback_module.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(outputs["loss"].item())

    torch.manual_seed(0)
    trainer = _trainer([*callbacks, Keep()], max_steps=steps, accumulate=accumulate, **kwargs)
    trainer.fit(module, data or DataLoader(Tokens(64), batch_size=2), val, ckpt_path=ckpt_path)
    return seen, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_capture_after_warm_up_then_replay(captures, accumulate):
    reference, _ = _losses(tiny_model(), [], steps=5, accumulate=accumulate)
    callback = _OnCPU(scope=("attn", "moe"), warmup_steps=2)
    module = tiny_model()
    losses, _ = _losses(module, [callback], steps=5, accumulate=accumulate)
    assert losses == reference
    (capture,) = captures
    assert callback.captured == ["model.layers.0.attention", "model.layers.0.mlp",
                                 "model.layers.1.attention", "model.layers.1.mlp"]  # the order of the step
    assert capture.accumulate_grads == (accumulate > 1)
    assert capture.replays == 3 * accumulate * 4  # steps 2..4, every micro-batch, four modules
    # one micro-batch per step: at the start of steps 3 and 4 and before the zero_grad of steps 2..4
    assert capture.stale_clears == (0 if accumulate > 1 else 2 + 3)
    assert capture.released and all("forward" not in m.__dict__ for m in module.modules())


def test_validation_runs_eagerly(captures):
    callback = _OnCPU(scope="full", warmup_steps=1)
    module = tiny_model()
    data = DataLoader(Tokens(64), batch_size=2)
    torch.manual_seed(0)
    _trainer([callback], max_steps=4, val_check_interval=2, limit_val_batches=2).fit(module, data, data)
    (capture,) = captures
    assert capture.replays == 3 * 2  # training calls only: validation's forwards ran eagerly


def test_other_shapes_run_eagerly_with_one_notice(captures, caplog):
    callback = _OnCPU(scope="moe", warmup_steps=1)
    with caplog.at_level(logging.INFO):
        # 7 samples in batches of 2: every epoch ends with a batch of one
        _losses(tiny_model(), [callback], steps=8, data=DataLoader(Tokens(7), batch_size=2))
    (capture,) = captures
    assert callback.eager_calls == 2 * 2  # two epochs' last batches, two MoE layers
    notices = [r.getMessage() for r in caplog.records if "other than at its capture" in r.getMessage()]
    assert len(notices) == 2 and "[1, 16, 32]" in notices[0] and "[2, 16, 32]" in notices[0]


def test_resume_warms_up_and_captures_again(captures, tmp_path):
    callback = _OnCPU(scope="moe", warmup_steps=2)
    module = tiny_model()
    _, trainer = _losses(module, [callback], steps=3)
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    resumed = _OnCPU(scope="moe", warmup_steps=2)
    _losses(tiny_model(), [resumed], steps=6, ckpt_path=str(path))
    first, second = captures
    assert first.replays == 1 * 2 and second.replays == 1 * 2  # step 2 of the first fit; step 5 after the resume


def test_module_called_twice_is_refused_at_capture(captures):
    class Twice(MoELanguageModel):
        def training_step(self, batch, batch_idx):
            layer = self.model.layers["0"].mlp
            h = self.model.embed_tokens(batch["input_ids"]).float()
            return layer(layer(h)).square().mean()

    callback = _OnCPU(scope="moe", warmup_steps=1)
    overrides = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "moe": {"ffn_hidden_size": 32}}
    with pytest.raises(RuntimeError, match="ran more than once in one training micro-batch"):
        _trainer([callback], max_steps=3).fit(Twice("tiny", overrides=overrides), DataLoader(Tokens(8), batch_size=2))


def test_recomputed_module_is_refused_at_capture(captures):
    """Activation checkpointing around a captured module runs its forward again inside the backward."""
    from torch.utils.checkpoint import checkpoint

    class Recomputed(MoELanguageModel):
        def training_step(self, batch, batch_idx):
            layer = self.model.layers["0"].mlp
            h = self.model.embed_tokens(batch["input_ids"]).float()
            return checkpoint(layer, h, use_reentrant=False).square().mean()

    callback = _OnCPU(scope="moe", warmup_steps=1)
    overrides = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "moe": {"ffn_hidden_size": 32}}
    with pytest.raises(RuntimeError, match="ran again inside the backward"):
        _trainer([callback], max_steps=3).fit(Recomputed("tiny", overrides=overrides),
                                               DataLoader(Tokens(8), batch_size=2))


def test_layout_table_names_the_capture():
    """`MegatronMoEStrategy`'s layout table has the callback's row (on CPU: off)."""
    from lightning_moe import MegatronMoEStrategy

    strategy = MegatronMoEStrategy(print_layout=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                      callbacks=[CUDAGraphs(scope="moe")], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    try:
        trainer.fit(tiny_model(), DataLoader(Tokens(4), batch_size=2))
    finally:  # the strategy initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert strategy.backend_summary()["CUDA graphs"] == "scope 'moe': off (no CUDA device)"


def test_capture_modules_argument_checks():
    from lightning_moe.cuda_graphs import capture_modules

    layer = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="one tuple of sample args"):
        capture_modules([layer], [])
    with pytest.raises(ValueError, match="listed twice"):
        capture_modules([layer, layer], [(torch.zeros(1, 4),), (torch.zeros(1, 4),)])
    with pytest.raises(ValueError, match="CUDA device"):
        capture_modules([layer], [(torch.zeros(1, 4),)])


class _FixedBuffer(torch.autograd.Function):
    """A backward that hands out views of one buffer, as a replayed backward graph does."""

    @staticmethod
    def forward(ctx, w, buffer):
        ctx.buffer = buffer
        return w.sum()

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.fill_(float(grad))
        return ctx.buffer.detach(), None


def test_gradient_guard_steals_clears_or_copies():
    """`.grad` takes the graph's buffer (steal mode), which a second backward would overwrite: it
    raises unless the stale `.grad` is cleared first (what the callback does for an in-place
    zero_grad); in accumulation mode the first backward copies, later ones add."""
    from lightning_moe.cuda_graphs import _GradientGuard

    w = nn.Parameter(torch.zeros(3))
    buffer = torch.zeros(3)
    guard = _GradientGuard([w], accumulate_grads=False)
    _FixedBuffer.apply(w, buffer).backward()
    if w.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():  # autograd took it as is
        with pytest.raises(RuntimeError, match="accumulate_grads=True"):
            _FixedBuffer.apply(w, buffer).backward()
    w.grad.zero_()  # zero_grad(set_to_none=False)
    guard.clear_stale_grads()
    _FixedBuffer.apply(w, buffer).backward(torch.tensor(2.0))
    assert w.grad.tolist() == [2.0, 2.0, 2.0]
    guard.remove()

    v = nn.Parameter(torch.zeros(3))
    guard = _GradientGuard([v], accumulate_grads=True)
    for scale in (1.0, 2.0, 3.0):
        _FixedBuffer.apply(v, buffer).backward(torch.tensor(scale))
    assert v.grad.tolist() == [6.0, 6.0, 6.0]
    assert v.grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    guard.remove()


def test_handed_gradient_buffer_is_not_zeroed_in_place_once_cleared():
    """The buffer a backward graph hands to ``.grad`` is pool memory that the next forwards
    reuse (another captured module's saved activations, until the backwards read them): cleared
    before the in-place ``zero_grad``, the zeroing leaves it alone; the next backward hands it out
    again with the new gradient."""
    from lightning_moe.cuda_graphs import _GradientGuard

    w = nn.Parameter(torch.zeros(3))
    buffer = torch.zeros(3)
    guard = _GradientGuard([w], accumulate_grads=False)
    optimizer = torch.optim.SGD([w], lr=0.0)
    _FixedBuffer.apply(w, buffer).backward()
    assert w.grad.tolist() == [1.0, 1.0, 1.0]
    if w.grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        pytest.skip("autograd copied the buffer into .grad: nothing aliases the pool here")
    optimizer.step()
    buffer.copy_(torch.tensor([7.0, 8.0, 9.0]))  # the next forward replay keeps an activation there
    guard.clear_stale_grads()
    optimizer.zero_grad(set_to_none=False)
    assert w.grad is None and buffer.tolist() == [7.0, 8.0, 9.0]
    _FixedBuffer.apply(w, buffer).backward(torch.tensor(2.0))
    assert w.grad.tolist() == [2.0, 2.0, 2.0]
    guard.remove()


def test_zero_grad_in_place_never_meets_a_graph_gradient(captures):
    """One micro-batch per step with ``zero_grad(set_to_none=False)`` and validation in between
    (Lightning's module ``zero_grad`` before it sets ``.grad`` to None, so the next backward hands
    the graph's buffer to ``.grad``): the callback clears the graphs' gradients at every batch
    start, before that step's forwards replay, and again before Lightning's ``zero_grad``, so the
    in-place zeroing never writes into the graphs' pool. The losses are the eager ones."""
    order = []

    class InPlace(MoELanguageModel):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            order.append("zero_grad")
            optimizer.zero_grad(set_to_none=False)

    def model():
        overrides = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
                     "num_query_groups": 1, "moe": {"ffn_hidden_size": 32}}
        return InPlace("tiny", overrides=overrides, learning_rate=1e-2, warmup_steps=1)

    data = DataLoader(Tokens(64), batch_size=2)
    kwargs = {"val_check_interval": 3, "limit_val_batches": 1}
    reference, _ = _losses(model(), [], steps=7, data=data, val=data, **kwargs)
    callback = _OnCPU(scope="full", warmup_steps=2)
    order.clear()
    losses, _ = _losses(model(), [callback], steps=7, data=data, val=data, **kwargs)
    assert losses == reference
    (capture,) = captures
    events = capture.events
    assert events.count("replay") == 5 * 2  # steps 2..6, two layers
    # per step after the capture: clear, replay x 2 (the forwards), clear (just before zero_grad)
    steps = "".join("c" if e == "clear" else "r" for e in events)
    assert steps == "rrc" + "crrc" * 4, steps
    assert order.count("zero_grad") == 7


def test_capture_leaves_buffers_and_grads_as_they_were(monkeypatch):
    """torch's warm-up passes (forward, then backward on uninitialized output gradients) count
    tokens and move router state: `capture_modules` puts every buffer back in place, leaves `.grad`
    alone, and finds per module the attributes its forward assigned (stood in for on CPU: the
    capture is the warm-up alone)."""
    import lightning_moe.cuda_graphs as cg

    def warm_up_only(proxies, sample_args, num_warmup_iters):
        for proxy, args in zip(proxies, sample_args):
            for _ in range(num_warmup_iters):
                out = proxy(*args)
                params = [p for p in proxy.parameters() if p.requires_grad]
                torch.autograd.grad(out, [a for a in args if a.requires_grad] + params, torch.empty_like(out))

    monkeypatch.setattr(cg, "_check_capturable", lambda module, args: None)
    monkeypatch.setattr(cg, "_capture", warm_up_only)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: None)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=32, num_experts=4, router_topk=2, aux_loss_coeff=1e-2,
                    router_score_function="sigmoid", router_enable_expert_bias=True)
    layers = [MoELayer(cfg), MoELayer(cfg)]
    for layer in layers:
        layer.router.local_tokens_per_expert.fill_(3.0)
    before = [[b.clone() for b in layer.buffers()] for layer in layers]
    x = torch.randn(2, 8, 16, requires_grad=True)
    captured = cg.capture_modules(layers, [(x,), (x.detach().clone().requires_grad_(),)], num_warmup_iters=2)
    for layer, values in zip(layers, before):
        assert all(torch.equal(b, v) for b, v in zip(layer.buffers(), values))
        assert all(p.grad is None for p in layer.parameters())
    assert [sorted(n for _, n, _ in assigned) for assigned in captured._assigned] == [
        ["last_stats", "latest_losses"], ["last_stats", "latest_losses"]]
    assert captured._assigned[1][0][0] in set(layers[1].modules())
    captured.release()


def test_full_iteration_captures_the_reference_loss(captures):
    """``"full_iteration"`` routes the reference network's ``loss`` (its training step's whole
    forward, cross-entropy included): one graph per step, the same losses."""
    from lightning_moe.callbacks._graph_targets import routed_method

    module = built(tiny_model())
    assert routed_method(module.model, ("full_iteration",)) == "loss"
    assert routed_method(module.model, ("full",)) == "forward"
    assert describe_targets([("model", module.model)], ("full_iteration",)) == "1 x MoEDecoder (model), the loss included"
    reference, _ = _losses(tiny_model(), [], steps=4)
    callback = _OnCPU(scope="full_iteration", warmup_steps=2)
    module = tiny_model()
    losses, _ = _losses(module, [callback], steps=4)
    assert losses == reference and callback.captured == ["model"]
    (capture,) = captures
    assert capture.replays == 2
    assert "loss" not in module.model.__dict__ and "forward" not in module.model.__dict__


def test_checkpoint_loaded_mid_fit_drops_the_graphs(captures):
    """A checkpoint loaded into a running fit: the graphs go, and come back after the warm-up."""

    class LoadAtStep(callback_module.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                graphs.on_load_checkpoint(trainer, pl_module, {})

    graphs = _OnCPU(scope="moe", warmup_steps=2)
    _losses(tiny_model(), [LoadAtStep(), graphs], steps=8)
    first, second = captures
    assert first.released and first.replays == 2 * 2  # steps 2, 3
    assert second.replays == 2 * 2  # steps 6, 7: warmed up again over steps 4, 5


def test_train_step_cuda_graph_flag(tmp_path, monkeypatch):
    """`benchmarks/train_step.py --cuda-graph SCOPE`: the Lightning run again with the callback, its
    speedup and both peaks in the JSON (on CPU the callback does nothing: a plumbing check)."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.delenv("OUT", raising=False)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.train_step import main

    try:
        main(["--preset", "tiny", "--layers", "1", "--seq", "32", "--micro-batch", "1", "--steps", "1", "--warmup",
              "2", "--accelerator", "cpu", "--skip-bare", "--cuda-graph", "attn+moe", "--results-dir", str(tmp_path),
              "--tag", "graphs"])
    finally:  # the Lightning runs initialised a 1-rank process group; later tests expect none
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    out = json.loads((tmp_path / "train_step_graphs.json").read_text())
    assert set(out["results"]) == {"lightning", "lightning_cuda_graph"}
    assert out["cuda_graph"]["scope"] == "attn+moe" and out["cuda_graph"]["speedup"] > 0
    with pytest.raises(SystemExit, match="--warmup >= 2"):
        main(["--accelerator", "cpu", "--skip-bare", "--cuda-graph", "moe", "--warmup", "1"])


def test_capture_takes_the_usual_shapes_not_the_last_batch(captures):
    """Capture right after an epoch's last, smaller batch: the graphs take the shapes most
    micro-batches had, and only the smaller batches run eagerly."""
    callback = _OnCPU(scope="moe", warmup_steps=3)
    # 5 samples in batches of 2: (2, 2, 1) per epoch; the capture comes at the first step of epoch 2
    _losses(tiny_model(), [callback], steps=6, data=DataLoader(Tokens(5), batch_size=2))
    (capture,) = captures
    assert capture.replays == 2 * 2 and callback.eager_calls == 2


def test_own_warm_up_runs_the_passes_and_keeps_nothing():
    """`cuda_graphs.warm_up` (`OWN_WARMUP`, the default): the forward and the input and parameter
    gradients, ``num_warmup_iters`` times per module, ``.grad`` untouched, no output kept alive."""
    import weakref

    from lightning_moe.cuda_graphs import warm_up

    calls, outputs = [], []

    class Recording(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            calls.append(x.shape)
            outputs.append(weakref.ref(y))
            return y

    modules = [Recording(4, 3), Recording(3, 2)]
    args = [(torch.randn(5, 4, requires_grad=True),), (torch.randn(5, 3),)]
    warm_up(modules, args, num_warmup_iters=2)
    assert calls == [(5, 4), (5, 4), (5, 3), (5, 3)]
    assert all(p.grad is None for m in modules for p in m.parameters()) and args[0][0].grad is None
    assert all(ref() is None for ref in outputs)
