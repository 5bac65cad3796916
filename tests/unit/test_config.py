"""Bad MoE configurations fail at construction with a message naming the fix."""

import pytest

from lightning_moe.nn import MoEConfig

BASE = dict(hidden_size=16, ffn_hidden_size=32, num_experts=8, router_topk=2)

BAD = [
    (dict(router_topk=9), "router_topk"),
    (dict(router_num_groups=3, router_group_topk=1), "divide"),
    (dict(router_num_groups=4, router_group_topk=5), "router_group_topk"),
    (dict(router_num_groups=4), "both"),
    (dict(router_enable_expert_bias=True), "sigmoid"),
    (dict(expert_capacity_factor=1.0, router_load_balancing_type="global_aux_loss", aux_loss_coeff=1e-2),
     "global_aux_loss"),
    (dict(hidden_size=0), "positive"),
    (dict(ffn_hidden_size=-4), "positive"),
    (dict(num_experts=0), "positive"),
    (dict(router_topk=1), "router_pre_softmax"),
    (dict(pad_expert_input_to_capacity=True), "expert_capacity_factor"),
    (dict(expert_capacity_factor=0.0), "dropless"),
    (dict(router_load_balancing_type=["aux_loss", "z"], aux_loss_coeff=[1.0, 1.0]), "router_load_balancing_type"),
    (dict(router_load_balancing_type=["aux_loss", "seq_aux_loss"], aux_loss_coeff=[1.0]), "one coefficient"),
    (dict(router_score_function="relu"), "router_score_function"),
    (dict(apply_probs_on_input=True), "router_topk=1"),
    (dict(expert_alignment=12), "expert_alignment"),
    (dict(shared_expert_gate=True), "shared_expert_intermediate_size"),
    (dict(expert_backend="cublas"), "expert_backend"),
    (dict(expert_capacity_factor="1.0"), "expert_capacity_factor must be float or None, got '1.0'"),
    (dict(router_pre_softmax=1), "router_pre_softmax must be bool"),
    (dict(num_experts=8.0), "num_experts must be int"),
]


@pytest.mark.parametrize("overrides,needle", BAD)
def test_bad_config_raises_naming_the_fix(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        MoEConfig(**{**BASE, **overrides})


def test_capacity_matches_megatron_formula():
    cfg = MoEConfig(**BASE, expert_capacity_factor=1.5)
    assert cfg.expert_capacity(100) == 38  # ceil(100 * 2 / 8 * 1.5)
    assert MoEConfig(**BASE).expert_capacity(100) is None
