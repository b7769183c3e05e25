"""DeepSeek MoE: group-limited gate against the exact rule, weight scaling, expert-parallel partial sums; fp32 results
within the error bounds of tests/tolerances.py (choices closer than their bounds may go either way)."""

from __future__ import annotations

import dataclasses

import model_bounds as mb
import pytest
import tolerances as tol
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_reference import gate_config

from nanocp.models import (
    MoEWeights,
    expert_ffn,
    load_model,
    moe_forward_reference,
    moe_gate,
    moe_routed_partial,
    random_weights,
    shared_expert,
)

MODEL = load_model("tiny")
CONFIG = MODEL.config
MOE_LAYER = MODEL.layers[CONFIG.first_k_dense_replace]


def _gate_layer(n_experts, n_group, topk_group, k, norm, scaling, seed):
    """The tiny model's MoE layer with a different gate config and random gate weights / bias."""
    gen = torch.Generator().manual_seed(seed)
    config = gate_config(CONFIG, n_experts, n_group, topk_group, k, norm, scaling)
    moe = MoEWeights(
        gate=torch.randn(n_experts, CONFIG.hidden_size, generator=gen) / CONFIG.hidden_size**0.5,
        e_score_correction_bias=0.3 * torch.randn(n_experts, generator=gen),
        experts={},
        shared=None,
    )
    return dataclasses.replace(MOE_LAYER, config=config, moe=moe)


def _brute_force_gate(layer, x: torch.Tensor) -> list[dict[int, float]]:
    """Per token: {expert: weight}, by enumerating groups and experts in plain Python."""
    c = layer.config
    scores = torch.sigmoid(x.double() @ layer.moe.gate.double().T)
    per_group = c.n_routed_experts // c.n_group
    out = []
    for token_scores in scores.tolist():
        biased = [s + b for s, b in zip(token_scores, layer.moe.e_score_correction_bias.tolist())]
        group_score = {
            g: sum(sorted(biased[g * per_group : (g + 1) * per_group], reverse=True)[:2]) for g in range(c.n_group)
        }
        groups = sorted(group_score, key=group_score.get, reverse=True)[: c.topk_group]
        candidates = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[: c.num_experts_per_tok]
        total = sum(token_scores[e] for e in chosen) if c.norm_topk_prob else 1.0
        out.append({e: token_scores[e] / total * c.routed_scaling_factor for e in chosen})
    return out


@st.composite
def _gate_configs(draw):
    n_group = draw(st.sampled_from([1, 2, 4, 8]))
    per_group = draw(st.integers(2, 6))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * per_group))
    norm = draw(st.booleans())
    scaling = draw(st.sampled_from([1.0, 2.5, 0.7]))
    return n_group * per_group, n_group, topk_group, k, norm, scaling, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(_gate_configs())
def test_group_limited_topk_matches_brute_force(gate_config):
    layer = _gate_layer(*gate_config)
    x = torch.randn(9, CONFIG.hidden_size, generator=torch.Generator().manual_seed(gate_config[-1]))
    topk_idx, topk_weights = moe_gate(layer, x)
    assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    c = layer.config
    rule = (c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
    logits = mb.gate_logits(layer, x)
    tol.check_gate(logits, layer.moe.e_score_correction_bias, *rule, topk_idx, topk_weights)
    # brute force, in fp64: the same experts wherever no two choices are closer than their fp32 bounds
    margin = 2 * (tol.sigmoid(logits).err + tol.U * 2).max()
    for t, expected in enumerate(_brute_force_gate(layer, x)):
        if _nearest_choices(layer, x[t]) > margin:
            assert set(topk_idx[t].tolist()) == set(expected), f"token {t}"


def _nearest_choices(layer, x: torch.Tensor) -> float:
    """The smallest gap between two biased scores (and between two group scores) of one token, in fp64."""
    c = layer.config
    biased = torch.sigmoid(x.double() @ layer.moe.gate.double().T) + layer.moe.e_score_correction_bias.double()
    groups = biased.view(c.n_group, -1).topk(2, -1).values.sum(-1)
    gaps = [v.sort().values.diff().min() for v in (biased, groups) if v.numel() > 1]
    return float(min(gaps)) if gaps else float("inf")


def test_weights_normalised_then_scaled_and_bias_only_steers_choice():
    layer = _gate_layer(16, 4, 2, 4, True, 2.5, seed=1)
    x = torch.randn(50, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))
    _, weights = moe_gate(layer, x)
    # each weight: the k scores' sum (k - 1 adds), + 1e-20, the division, the scale: k + 3 roundings; their sum
    # k - 1 more (the scores' own errors cancel in the ratio; 1e-20 against sums of 4 scores is below 1e-19)
    tol.assert_within(weights.sum(-1), torch.full((50,), 2.5), 2.5 * (tol.gamma(2 * 4 + 2) + 1e-19))

    unnormalised = dataclasses.replace(layer, config=dataclasses.replace(layer.config, norm_topk_prob=False))
    idx, weights = moe_gate(unnormalised, x)
    scores = torch.sigmoid(x @ layer.moe.gate.T)
    # two fp32 evaluations of sigmoid(x @ W_gate) * 2.5, each within its bound
    score = tol.sigmoid(mb.gate_logits(layer, x))
    bound = 2 * 2.5 * (score.err + tol.gamma(2) * score.mag)
    tol.assert_within(weights, scores.gather(1, idx) * 2.5, bound.gather(1, idx))

    boosted = dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, e_score_correction_bias=torch.zeros(16)))
    boosted.moe.e_score_correction_bias[13] = 10.0  # always chosen, but its weight is its raw score
    idx, weights = moe_gate(dataclasses.replace(boosted, config=unnormalised.config), x)
    assert torch.all(idx[:, 0] == 13)
    tol.assert_within(weights[:, 0], scores[:, 13] * 2.5, bound[:, 13])


def test_topk_is_ordered_by_biased_score():
    x = torch.randn(20, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3))
    idx, _ = moe_gate(MOE_LAYER, x)
    biased = torch.sigmoid(x @ MOE_LAYER.moe.gate.T) + MOE_LAYER.moe.e_score_correction_bias
    chosen = biased.gather(1, idx)
    # in order up to two fp32 evaluations' bounds on the biased scores (the gate's and this one)
    score = tol.sigmoid(mb.gate_logits(MOE_LAYER, x))
    slack = (2 * (score.err + tol.U * (score.mag + MOE_LAYER.moe.e_score_correction_bias.abs()))).gather(1, idx)
    assert torch.all(chosen[:, :-1] >= chosen[:, 1:] - slack[:, :-1] - slack[:, 1:])


def _per_token_reference(layer, x):
    idx, weights = moe_gate(layer, x)
    rows = []
    for t in range(x.shape[0]):
        acc = shared_expert(layer, x[t : t + 1])[0]
        for e, w in zip(idx[t].tolist(), weights[t].tolist()):
            acc = acc + w * expert_ffn(layer.moe.experts[e], x[t : t + 1])[0]
        rows.append(acc)
    return torch.stack(rows)


def test_moe_forward_reference_equals_per_token_sum():
    x = torch.randn(12, CONFIG.hidden_size, generator=torch.Generator().manual_seed(4))
    ref = _per_token_reference(MOE_LAYER, x)
    idx, weights = moe_gate(MOE_LAYER, x)  # both sides take this choice: the comparison is of the sums
    bound = 2 * mb.moe_output(MOE_LAYER, x, idx, weights).err
    tol.assert_within(moe_forward_reference(MOE_LAYER, x), ref, bound)


@settings(max_examples=20, deadline=None)
@given(owner=st.lists(st.integers(0, 3), min_size=16, max_size=16), seed=st.integers(0, 2**16))
def test_partial_sums_over_an_expert_partition_give_the_full_moe(owner, seed):
    """Each of 4 instances runs only its experts; their partials plus the shared expert are the MoE output."""
    x = torch.randn(10, CONFIG.hidden_size, generator=torch.Generator().manual_seed(seed))
    idx, weights = moe_gate(MOE_LAYER, x)
    partials = [
        moe_routed_partial(MOE_LAYER, x, idx, weights, [e for e in range(16) if owner[e] == i]) for i in range(4)
    ]
    combined = torch.stack(partials).sum(0) + shared_expert(MOE_LAYER, x)
    # the same terms, the partition adding up to 4 partial sums (and zeros) on the way
    bound = mb.moe_output(MOE_LAYER, x, idx, weights, adds=4).err + mb.moe_output(MOE_LAYER, x, idx, weights).err
    tol.assert_within(combined, moe_forward_reference(MOE_LAYER, x), bound)


def test_instance_materialises_only_its_experts_with_identical_values():
    mine = {4, 5, 6, 7}
    part = random_weights(CONFIG, seed=0, expert_ids=mine)
    assert part.expert_ids == mine
    for layer, full_layer in zip(part.layers, MODEL.layers):
        if layer.moe is None:
            continue
        assert set(layer.moe.experts) == mine
        for e in mine:
            assert torch.equal(layer.moe.experts[e].up_proj, full_layer.moe.experts[e].up_proj)
        assert torch.equal(layer.moe.gate, full_layer.moe.gate)
    x = torch.randn(6, CONFIG.hidden_size)
    idx, weights = moe_gate(part.layers[1], x)
    assert torch.equal(
        moe_routed_partial(part.layers[1], x, idx, weights, mine),
        moe_routed_partial(MODEL.layers[1], x, idx, weights, mine),
    )
    with pytest.raises(ValueError, match=r"experts \[0, 1, 2, 3, 8"):
        moe_routed_partial(part.layers[1], x, idx, weights)
    with pytest.raises(ValueError, match=r"experts \[9\] are not materialised"):
        moe_routed_partial(part.layers[1], x, idx, weights, [4, 9])
