"""The eager decode path's prepared-weight math (data_plane/decode_layers.py) against the reference phase functions
(models/deepseek_v3.py), on random inputs, for configs that take every branch (q_lora or plain q_proj, rope with
and without interleave, absorbed or per-head W_UK / W_UV, grouped gates, shared experts); and the CPU shard
attention backend against the reference paged attention. Both sides are fp32 evaluations of the same steps: they
must agree within the sum of their error bounds (tests/model_bounds.py, tests/tolerances.py); steps that run the
same arithmetic are compared bit for bit."""

from __future__ import annotations

import dataclasses

import model_bounds as mb
import numpy as np
import pytest
import tolerances as tol
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.data_plane import cpu_kernels
from nanocp.data_plane import decode_layers as dl
from nanocp.data_plane.backends.cpu_attention import CpuPagedAttention, fused_attention_unavailable_reason
from nanocp.models import (
    ModelConfig,
    apply_rotary,
    dense_mlp,
    expert_ffn,
    logits,
    mla_decode_output,
    mla_decode_qkv,
    mla_paged_attention_with_lse,
    moe_gate,
    post_attention_norm,
    random_weights,
    shared_expert,
)

TINY = ModelConfig.tiny()
CONFIGS = {
    "tiny": TINY,
    "plain": dataclasses.replace(
        TINY, q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1, n_shared_experts=2, rope_interleave=False
    ),
}


pytestmark = pytest.mark.usefixtures("cpu_kernel_path")  # every test on both paths (tests/conftest.py)


@pytest.fixture(scope="module", params=[(name, absorb) for name in sorted(CONFIGS) for absorb in (True, False)])
def prepared(request):
    """(reference weights, prepared weights); absorb=False forces the per-head W_UK / W_UV products."""
    name, absorb = request.param
    model = random_weights(CONFIGS[name], seed=5)
    ratio = dl.ABSORB_MAX_FLOP_RATIO
    dl.ABSORB_MAX_FLOP_RATIO = ratio if absorb else 0.0
    try:
        weights = dl.DecodeWeights.build(model, local_experts=[3, 0, 7])
    finally:
        dl.ABSORB_MAX_FLOP_RATIO = ratio
    assert all((layer.attn.w_uk is None) == absorb for layer in weights.layers)
    return model, weights


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_projection_and_output_equal_the_reference(prepared, rows):
    model, weights = prepared
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    for layer, w in zip(model.layers, weights.layers):
        h = torch.randn(rows, c.hidden_size, generator=gen)
        positions = torch.randint(0, 5000, (rows,), generator=gen)
        q_ref, kv_ref = mla_decode_qkv(layer, h, positions)
        q, kv = dl.project(w, c, h, dl.RopeTable.at(weights.rope, positions))
        assert q.shape == q_ref.shape and kv.shape == kv_ref.shape
        q_bound, kv_bound = mb.decode_qkv(layer, h, positions)
        q_ours, kv_ours = mb.decode_qkv(layer, h, positions, absorbed=w.attn.w_uk is None)
        tol.assert_within(q, q_ref, q_bound.err + q_ours.err, "q_latent")
        tol.assert_within(kv, kv_ref, kv_bound.err + kv_ours.err, "kv")
        o = torch.randn(rows, c.num_attention_heads, c.kv_lora_rank, generator=gen)
        out = mb.decode_output(layer, o, h).err + mb.decode_output(layer, o, h, absorbed=w.attn.w_uv is None).err
        tol.assert_within(dl.add_attention_output(w, h, o), h + mla_decode_output(layer, o), out, "output")
        norm = tol.rms_norm(h, layer.post_attention_norm, c.rms_norm_eps)
        tol.assert_within(dl.ffn_input(w, c, h), post_attention_norm(layer, h), 2 * norm.err, "ffn input")


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_moe_input_equals_output_projection_norm_and_gate_step_by_step(prepared, rows):
    """moe_input (one kernel call on the fp32 CPU path) gives bit for bit what add_attention_output, ffn_input and
    moe_gate give one after the other."""
    model, weights = prepared
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    for w in (w for w in weights.layers if w.mlp is None):
        h = torch.randn(rows, c.hidden_size, generator=gen)
        o = torch.randn(rows, c.num_attention_heads, c.kv_lora_rank, generator=gen)
        h_want = dl.add_attention_output(w, h, o)
        x_want = dl.ffn_input(w, c, h_want)
        idx_want, weights_want = dl.moe_gate(w, c, x_want)
        h_got, x_got, idx_got, weights_got = dl.moe_input(w, c, h, o)
        assert torch.equal(h_got, h_want) and torch.equal(x_got, x_want)
        assert torch.equal(idx_got, idx_want) and torch.equal(weights_got, weights_want)


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_dense_output_equals_output_projection_and_mlp_step_by_step(prepared, rows):
    """dense_output (one kernel call on the fp32 CPU path) gives bit for bit what add_attention_output, then add_mlp
    of ffn_input give."""
    model, weights = prepared
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    for w in (w for w in weights.layers if w.mlp is not None):
        h = torch.randn(rows, c.hidden_size, generator=gen)
        o = torch.randn(rows, c.num_attention_heads, c.kv_lora_rank, generator=gen)
        h1 = dl.add_attention_output(w, h, o)
        assert torch.equal(dl.dense_output(w, c, h, o), dl.add_mlp(w.mlp, dl.ffn_input(w, c, h1), h1))


@pytest.mark.parametrize("rows", [1, 7])
def test_projection_stores_each_rows_kv_in_its_slot(prepared, rows):
    """project(..., store): the same q and kv, each row's kv also in its slot of the pages (-1: none stored),
    every other row of the pages untouched."""
    model, weights = prepared
    c = model.config
    gen, rng = torch.Generator().manual_seed(rows), np.random.default_rng(rows)
    w, h = weights.layers[1], torch.randn(rows, c.hidden_size, generator=gen)
    rope = dl.RopeTable.at(weights.rope, torch.randint(0, 5000, (rows,), generator=gen))
    pages = torch.randn(3 * rows + 2, c.kv_lora_rank + c.qk_rope_head_dim, generator=gen)
    slots = rng.permutation(len(pages))[:rows].astype(np.int64)
    slots[rng.random(rows) < 0.4] = -1
    stored = np.nonzero(slots >= 0)[0]
    store = dl.KVWrite(pages, slots, torch.from_numpy(stored), torch.from_numpy(slots[stored]))
    want_pages = pages.clone()
    q_want, kv_want = dl.project(w, c, h, rope)
    q, kv = dl.project(w, c, h, rope, store)
    want_pages[torch.from_numpy(slots[stored])] = kv_want[torch.from_numpy(stored)]
    assert torch.equal(q, q_want) and torch.equal(kv, kv_want) and torch.equal(pages, want_pages)


def test_ffn_gate_and_logits_equal_the_reference(prepared):
    model, weights = prepared
    c = model.config
    gen = torch.Generator().manual_seed(1)
    x, h = torch.randn(9, c.hidden_size, generator=gen), torch.randn(9, c.hidden_size, generator=gen)
    for layer, w in zip(model.layers, weights.layers):
        if layer.moe is None:
            bound = 2 * mb.mlp(layer.mlp, x, h).err
            tol.assert_within(dl.add_mlp(w.mlp, x, h), h + dense_mlp(layer, x), bound, "dense MLP")
            continue
        rule = (c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        bias = layer.moe.e_score_correction_bias
        for name, (idx, weight) in {"ours": dl.moe_gate(w, c, x), "reference": moe_gate(layer, x)}.items():
            tol.check_gate(mb.gate_logits(layer, x), bias, *rule, idx, weight, f"{name} gate")
        bound = 2 * mb.mlp(layer.moe.shared, x, h).err
        tol.assert_within(dl.add_mlp(w.shared, x, h), h + shared_expert(layer, x), bound, "shared expert")
    tol.assert_within(dl.final_logits(weights, h), logits(model, h), 2 * mb.final_logits(model, h).err, "logits")


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 12), sources=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_grouped_experts_apply_each_token_its_expert(tokens, sources, seed):
    model = random_weights(TINY, seed=2)
    local_experts = [5, 1, 12, 8]
    layer = model.layers[-1]
    grouped = dl.GroupedExperts.of([layer.moe.experts[e] for e in local_experts])
    rng = np.random.default_rng(seed)
    source = torch.from_numpy(rng.standard_normal((sources, TINY.hidden_size)).astype(np.float32))
    rows = rng.integers(0, sources, tokens).astype(np.int64)
    local = rng.integers(0, len(local_experts), tokens).astype(np.int64)
    y = dl.grouped_experts(grouped, source, rows, local)
    assert y.shape == (tokens, TINY.hidden_size)
    for i in range(tokens):
        expert, x = layer.moe.experts[local_experts[local[i]]], source[rows[i] : rows[i] + 1]
        tol.assert_within(y[i], expert_ffn(expert, x)[0], 2 * mb.mlp(expert, x).err[0], f"token {i}")


@pytest.mark.parametrize("interleave", [True, False])
def test_pair_rotation_equals_the_reference_rope(interleave):
    config = dataclasses.replace(TINY, rope_interleave=interleave)
    rope = random_weights(config, seed=0).rope
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, config.qk_rope_head_dim, generator=gen)
    positions = torch.randint(0, 9000, (6,), generator=gen)
    table = dl.RopeTable.at(rope, positions)
    want = rope.apply(x, positions)
    pairs = x[..., dl.rope_pair_order(config)]
    cos, sin = rope.cos_sin(positions)
    tol.assert_within(dl.rotate_pairs(pairs, table), want, 2 * mb.rope(tol.exact(x), cos, sin, interleave).err)
    half = x.to(torch.bfloat16)  # the real-valued fallback (no complex bf16 on CPU)
    got = dl.rotate_pairs(half[..., dl.rope_pair_order(config)], table)
    assert got.dtype == torch.bfloat16
    # both in bf16 from the same bf16 values and bf16 cos / sin: a product each and the add, rounded to bf16
    # (u = 2^-8): gamma_bf16(2) (|x1 c| + |x2 s|) each
    cos16, sin16 = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    terms = mb.rope(tol.exact(half.float()), cos16.float(), sin16.float(), interleave)
    bound = 2 * terms.err / tol.gamma(2) * tol.gamma(2, unit=2.0**-8)
    tol.assert_within(got.float(), apply_rotary(half, *rope.cos_sin(positions), interleave).float(), bound)


@pytest.mark.skipif(fused_attention_unavailable_reason() is not None, reason="no fused CPU attention kernel")
@settings(max_examples=25, deadline=None)
@given(shards=st.integers(0, 6), page=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_cpu_attention_backend_equals_the_reference(shards, page, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, dqk, dv, frames = 4, 80, 64, 12
    kv_pages = torch.randn(frames, page, dqk, generator=gen)
    blocks = int(torch.randint(1, 4, (1,), generator=gen))
    block_table = torch.randint(0, frames, (shards, blocks), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, blocks * page + 1, (shards,), generator=gen)
    if shards:
        lens[0] = 0  # an empty shard: o = 0, lse = -inf
    q = torch.randn(shards, heads, dqk, generator=gen)
    o, lse = CpuPagedAttention()(q, kv_pages, block_table, lens, 0.3, dv)
    o_ref, lse_ref = mla_paged_attention_with_lse(q, kv_pages, block_table, lens, 0.3, dv)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape and lse.dtype == torch.float32
    # the backend's fp32 form (the kernel's online softmax in chunks of whole pages, or the reference's) and the
    # reference's, each within its bound (tests/tolerances.py)
    kv = kv_pages[block_table.long()].reshape(shards, blocks * page, dqk)
    chunk = max(page, 64 // page * page) if cpu_kernels.usable(q) else None
    ours, ref = (tol.attention(q, kv, lens, 0.3, dv, chunk=size) for size in (chunk, None))
    tol.assert_within(lse, lse_ref, ours.lse.err + ref.lse.err, "lse")
    tol.assert_within(o, o_ref, ours.o.err + ref.o.err, "o")
    assert bool((lse[lens == 0] == float("-inf")).all())


def test_cpu_attention_backend_rejects_lengths_past_its_pages():
    with pytest.raises(ValueError, match="shard lengths"):
        CpuPagedAttention().plan(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([3, 9]), 4, torch.float32)


@pytest.mark.parametrize("rows", [1, dl.PANEL_MAX_ROWS, dl.PANEL_MAX_ROWS + 1])
def test_linear_takes_the_panel_kernel_for_decode_batches_and_equals_the_matrix_product(rows, cpu_kernel_path):
    """x @ W (+ base) through the panel kernel up to PANEL_MAX_ROWS rows on the kernel path, through torch's GEMM
    above it and on the torch path: the same product either way (fp32 rounding)."""
    gen = torch.Generator().manual_seed(rows)
    linear = dl.Linear.of(torch.randn(48, 37, generator=gen).T)  # [in 37, out 48], made contiguous
    x, base = torch.randn(rows, 37, generator=gen), torch.randn(rows, 48, generator=gen)
    assert linear.takes(x) == (cpu_kernel_path == "cpu-kernels" and rows <= dl.PANEL_MAX_ROWS)
    want, with_base = tol.linear(x, linear.weight), tol.linear(x, linear.weight, base)
    tol.assert_within(linear(x), want.value, want.err)
    tol.assert_within(linear(x, base=base), with_base.value, with_base.err)
