"""MLA: absorbed decode equals the non-absorbed math; partial attentions over any split of the KV merge exactly."""

from __future__ import annotations

import math

import pytest
import tolerances as tol
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nanocp.models import (
    ContiguousKVCache,
    decode_step,
    ffn_forward,
    load_model,
    logits,
    merge_attention_partials,
    mla_attention_with_lse,
    mla_decode_output,
    mla_decode_qkv,
    mla_expand_kv,
    mla_paged_attention_with_lse,
    mla_prefill_attention_with_lse,
    mla_prefill_output,
    mla_prefill_qkv,
    post_attention_norm,
    prefill_forward,
)

MODEL = load_model("tiny")
CONFIG = MODEL.config
DQK, DV = CONFIG.kv_cache_dim, CONFIG.kv_lora_rank
HEADS = CONFIG.num_attention_heads


def _random_kv_rows(layer, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic latent KV rows: the layer's own projection of random hidden states at random positions."""
    h = torch.randn(n, CONFIG.hidden_size, generator=gen)
    positions = torch.randperm(4 * n + 8, generator=gen)[:n]
    _, kv = mla_decode_qkv(layer, h, positions)
    return kv, positions


@pytest.mark.parametrize("layer_idx", range(CONFIG.num_hidden_layers))
def test_absorbed_decode_equals_non_absorbed_attention(layer_idx):
    gen = torch.Generator().manual_seed(layer_idx)
    layer = MODEL.layers[layer_idx]
    kv, kv_positions = _random_kv_rows(layer, 37, gen)
    h = torch.randn(5, CONFIG.hidden_size, generator=gen)
    q_positions = kv_positions.max() + 1 + torch.randint(0, 50, (5,), generator=gen)  # sees every key
    scale = MODEL.softmax_scale

    q_latent, kv_new = mla_decode_qkv(layer, h, q_positions)
    o_latent, lse_absorbed = mla_attention_with_lse(q_latent, kv.expand(5, -1, -1), torch.full((5,), 37), scale, DV)
    absorbed = mla_decode_output(layer, o_latent)

    q, kv_new_prefill = mla_prefill_qkv(layer, h, q_positions)
    k, v = mla_expand_kv(layer, kv)
    o, lse_plain = mla_prefill_attention_with_lse(q, k, v, q_positions, kv_positions, scale)
    plain = mla_prefill_output(layer, o)

    assert torch.equal(kv_new, kv_new_prefill)
    # both from the same fp32 q (nope | roped pe) and latent rows: the two orders' fp32 bounds (tests/tolerances.py)
    nope = CONFIG.qk_nope_head_dim
    lse_a, out_a, lse_p, out_p = absorbed_and_plain_bounds(layer, q[..., :nope], q[..., nope:], kv, scale)
    tol.assert_within(lse_absorbed, lse_plain, lse_a + lse_p, "lse")
    tol.assert_within(absorbed, plain, out_a + out_p, "output")


def per_head(x: tol.Bounded | torch.Tensor) -> tol.Bounded:
    """[T, H, ...] <-> [H, T, ...]."""
    x = tol.as_bounded(x)
    return tol.Bounded(x.value.transpose(0, 1), x.err.transpose(0, 1))


def absorbed_and_plain_bounds(layer, q_nope, q_pe, kv, scale):
    """The fp32 bounds of the lse and the attention output [T, D] by the absorbed decode form (W_UK into the query,
    attention over the latent rows, W_UV after) and by the plain one (k, v expanded per head from the latent rows):
    per head q_nope W_UK_h and o W_UV_h, the expansion and the projections as tolerances.linear, the attention as
    tolerances.attention, each step carrying the errors of its inputs."""
    lora, t = CONFIG.kv_lora_rank, q_nope.shape[0]
    o_proj = layer.attn.o_proj.T  # [H * v, D]
    # absorbed: q_latent = [q_nope W_UK | q_pe] over the latent rows, o = o_latent W_UV per head, then o_proj
    q_latent = per_head(tol.linear(per_head(q_nope), layer.w_uk))  # [T, H, kv_lora]
    q_latent = tol.Bounded(
        torch.cat([q_latent.value, q_pe.double()], -1), torch.cat([q_latent.err, torch.zeros_like(q_pe.double())], -1)
    )
    rows = kv.expand(t, -1, -1)
    absorbed = tol.attention(q_latent, rows, torch.full((t,), kv.shape[0]), scale, lora)
    o = per_head(tol.linear(per_head(absorbed.o), layer.w_uv.transpose(1, 2)))  # [T, H, v]
    out_a = tol.linear(tol.Bounded(o.value.flatten(1), o.err.flatten(1)), o_proj)
    # plain: k_nope, v = c_kv W_kv_b per head, attention per head, then o_proj
    heads = tol.linear(kv[:, :lora], layer.attn.kv_b_proj.T)  # [N, H * (nope + v)]
    heads = tol.Bounded(heads.value.view(kv.shape[0], HEADS, -1), heads.err.view(kv.shape[0], HEADS, -1))
    nope = q_nope.shape[-1]
    k_pe = kv[:, None, lora:].double().expand(-1, HEADS, -1)
    k = tol.Bounded(torch.cat([heads.value[..., :nope], k_pe], -1), torch.cat([heads.err[..., :nope], 0 * k_pe], -1))
    v = tol.Bounded(heads.value[..., nope:], heads.err[..., nope:])
    q = tol.exact(torch.cat([q_nope, q_pe], -1))
    all_rows = torch.ones(1, 1, kv.shape[0], dtype=torch.bool)
    plain = tol.attention(per_head(q), per_head(k), all_rows, scale, v=per_head(v))  # [H, T, ...]
    o = per_head(plain.o)
    out_p = tol.linear(tol.Bounded(o.value.flatten(1), o.err.flatten(1)), o_proj)
    assert torch.allclose(out_a.value, out_p.value, rtol=1e-9, atol=1e-9)  # the same exact value
    return absorbed.lse.err, out_a.err, plain.lse.err.transpose(0, 1), out_p.err


def _full_and_sharded(lens: list[int], shard_of_token: list[list[int]], num_shards: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    b, n = len(lens), max(max(lens), 1)
    q = torch.randn(b, HEADS, DQK, generator=gen)
    kv = torch.randn(b, n, DQK, generator=gen)
    scale = 0.3
    full = mla_attention_with_lse(q, kv, torch.tensor(lens), scale, DV)
    full_bound = tol.attention(q, kv, torch.tensor(lens), scale, DV)
    os, lses, parts = [], [], []
    for s in range(num_shards):
        shard_lens = [sum(1 for t in range(lens[r]) if shard_of_token[r][t] == s) for r in range(b)]
        shard_kv = torch.zeros(b, n, DQK)
        for r in range(b):
            rows = [t for t in range(lens[r]) if shard_of_token[r][t] == s]
            shard_kv[r, : len(rows)] = kv[r, rows]
        o, lse = mla_attention_with_lse(q, shard_kv, torch.tensor(shard_lens), scale, DV)
        os.append(o)
        lses.append(lse)
        parts.append(tol.attention(q, shard_kv, torch.tensor(shard_lens), scale, DV))
    merged_bound = merge_bounds(parts)
    return full, merge_attention_partials(torch.stack(os), torch.stack(lses)), full_bound, merged_bound


def merge_bounds(parts: list[tol.Attention]) -> tol.Attention:
    """The bound of the LSE merge of partial attentions, each partial with its own fp32 bound (tests/tolerances.py)."""
    o = tol.Bounded(torch.stack([p.o.value for p in parts]), torch.stack([p.o.err for p in parts]))
    lse = tol.Bounded(torch.stack([p.lse.value for p in parts]), torch.stack([p.lse.err for p in parts]))
    return tol.merge(o, lse)


def causal_bound(q, k, v, q_positions, kv_positions, scale) -> tol.Attention:
    """tolerances.attention of mla_prefill_attention_with_lse's causal attention: per head, every query over the
    keys at positions <= its own; o [T, H, Dv], lse [T, H]."""
    visible = kv_positions[None, :] <= q_positions[:, None]  # [T, N]
    a = tol.attention(q.transpose(0, 1), k.transpose(0, 1), visible[None], scale, v=v.transpose(0, 1))
    return tol.Attention(
        tol.Bounded(a.o.value.transpose(0, 1), a.o.err.transpose(0, 1)),
        tol.Bounded(a.lse.value.transpose(0, 1), a.lse.err.transpose(0, 1)),
    )


def assert_attention_close(o, lse, bound: tol.Attention, o_want, lse_want, want_bound: tol.Attention) -> None:
    """Two fp32 evaluations of the same attention: within the sum of their bounds."""
    tol.assert_within(lse, lse_want, bound.lse.err + want_bound.lse.err, "lse")
    tol.assert_within(o, o_want, bound.o.err + want_bound.o.err, "o")


@st.composite
def _splits(draw):
    num_shards = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, 24), min_size=1, max_size=4))
    shard_of_token = [draw(st.lists(st.integers(0, num_shards - 1), min_size=n, max_size=n)) for n in lens]
    return lens, shard_of_token, num_shards, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(_splits())
def test_lse_merge_of_any_kv_split_equals_whole_attention(split):
    """Tokens go to shards arbitrarily (keys carry their own positions), shards may be empty."""
    lens, shard_of_token, num_shards, seed = split
    (o_full, lse_full), (o_merged, lse_merged), full, merged = _full_and_sharded(lens, shard_of_token, num_shards, seed)
    assert not torch.isnan(o_merged).any() and not torch.isnan(lse_merged).any()
    assert_attention_close(o_merged, lse_merged, merged, o_full, lse_full, full)
    for r, n in enumerate(lens):
        if n == 0:  # no KV at all: o = 0, lse = -inf
            assert torch.all(o_merged[r] == 0) and torch.all(lse_merged[r] == -math.inf)


def test_empty_kv_gives_zero_output_and_minus_inf_lse():
    q = torch.randn(2, HEADS, DQK)
    o, lse = mla_attention_with_lse(q, torch.randn(2, 0, DQK), torch.zeros(2, dtype=torch.int64), 0.1, DV)
    assert o.shape == (2, HEADS, DV) and torch.all(o == 0) and torch.all(lse == -math.inf)
    o2, lse2 = mla_attention_with_lse(q, torch.randn(2, 9, DQK), torch.tensor([0, 3]), 0.1, DV)
    assert torch.all(o2[0] == 0) and torch.all(lse2[0] == -math.inf) and torch.isfinite(lse2[1]).all()


def test_merge_with_one_part_is_identity_and_all_empty_stays_empty():
    o = torch.randn(1, 3, HEADS, DV)
    lse = torch.randn(1, 3, HEADS)
    merged_o, merged_lse = merge_attention_partials(o, lse)
    assert torch.equal(merged_lse, lse[0])
    tol.assert_within(merged_o, o[0], tol.merge(o, lse).o.err)
    empty_o, empty_lse = merge_attention_partials(torch.zeros(3, 2, HEADS, DV), torch.full((3, 2, HEADS), -math.inf))
    assert torch.all(empty_o == 0) and torch.all(empty_lse == -math.inf)


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_contiguous(lens, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_blocks = max(1, max(-(-n // page_size) for n in lens))
    kv = torch.randn(b, max_blocks * page_size, DQK, generator=gen)
    pages = torch.randn(b * max_blocks + 3, page_size, DQK, generator=gen)  # extra pages hold garbage
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    frames = torch.randperm(pages.shape[0], generator=gen)
    for r, n in enumerate(lens):
        for j in range(-(-n // page_size)):
            frame = int(frames[r * max_blocks + j])
            pages[frame] = kv[r, j * page_size : (j + 1) * page_size]
            table[r, j] = frame
    q = torch.randn(b, HEADS, DQK, generator=gen)
    o_ref, lse_ref = mla_attention_with_lse(q, kv, torch.tensor(lens), 0.2, DV)
    o, lse = mla_paged_attention_with_lse(q, pages, table, torch.tensor(lens), 0.2, DV)
    assert torch.equal(lse, lse_ref) and torch.equal(o, o_ref)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 30), min_size=0, max_size=4), seed=st.integers(0, 2**16))
@example(cuts=[0], seed=0)  # an empty chunk of keys
def test_prefill_attention_chunks_of_keys_merge_to_causal_attention(cuts, seed):
    """Ring attention: keys split into chunks, each chunk's causal partial merged by LSE."""
    gen = torch.Generator().manual_seed(seed)
    t = 30
    q = torch.randn(t, HEADS, CONFIG.qk_head_dim, generator=gen)
    k = torch.randn(t, HEADS, CONFIG.qk_head_dim, generator=gen)
    v = torch.randn(t, HEADS, CONFIG.v_head_dim, generator=gen)
    positions = torch.arange(t)
    o_full, lse_full = mla_prefill_attention_with_lse(q, k, v, positions, positions, 0.25)
    bounds = [0, *sorted(cuts), t]
    chunks = list(zip(bounds, bounds[1:]))
    partials = [mla_prefill_attention_with_lse(q, k[a:b], v[a:b], positions, positions[a:b], 0.25) for a, b in chunks]
    o, lse = merge_attention_partials(torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))
    merged = merge_bounds([causal_bound(q, k[a:b], v[a:b], positions, positions[a:b], 0.25) for a, b in chunks])
    assert_attention_close(o, lse, merged, o_full, lse_full, causal_bound(q, k, v, positions, positions, 0.25))


def test_chunked_prefill_with_past_kv_equals_whole_prompt():
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(3))
    whole = prefill_forward(MODEL, tokens)
    first = prefill_forward(MODEL, tokens[:9])
    second = prefill_forward(MODEL, tokens[9:], past_kv=first.kv)
    torch.testing.assert_close(torch.cat([first.kv, second.kv], dim=1), whole.kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second.logits, whole.logits[9:], rtol=1e-5, atol=1e-5 * whole.logits.abs().max())


def test_batched_decode_equals_one_request_at_a_time():
    """Requests of different lengths share a batch; padding rows of shorter requests never leak in."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (3, 17, 9)]
    nexts = torch.randint(0, 256, (3, 4), generator=gen)
    batch = ContiguousKVCache.from_prefill([prefill_forward(MODEL, p).kv for p in prompts], capacity=24)
    batched = [decode_step(MODEL, batch, nexts[:, s]) for s in range(4)]
    for r, prompt in enumerate(prompts):
        alone = ContiguousKVCache.from_prefill([prefill_forward(MODEL, prompt).kv], capacity=24)
        for s in range(4):
            single = decode_step(MODEL, alone, nexts[r, s : s + 1])[0]
            torch.testing.assert_close(batched[s][r], single, rtol=1e-5, atol=1e-5 * single.abs().max())
    assert batch.lens.tolist() == [7, 21, 13]


def test_decode_step_rejects_bad_tokens_and_full_cache():
    cache = ContiguousKVCache.from_prefill([prefill_forward(MODEL, torch.tensor([1, 2])).kv], capacity=2)
    with pytest.raises(ValueError, match="capacity"):
        decode_step(MODEL, cache, torch.tensor([5]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prefill_forward(MODEL, torch.tensor([1, CONFIG.vocab_size]))
    with pytest.raises(ValueError, match="past_kv"):
        prefill_forward(MODEL, torch.tensor([1]), past_kv=torch.zeros(1, 2, DQK))


def test_every_phase_accepts_an_empty_batch():
    """Instances run every layer in lock-step, also when they have no request of their own."""
    none = torch.zeros(0, dtype=torch.int64)
    h = MODEL.embed_tokens[none]
    for layer in MODEL.layers:
        q_latent, kv_new = mla_decode_qkv(layer, h, none)
        assert q_latent.shape == (0, HEADS, DQK) and kv_new.shape == (0, DQK)
        pages = torch.randn(3, 4, DQK)
        o, lse = mla_paged_attention_with_lse(q_latent, pages, torch.zeros(0, 2, dtype=torch.int32), none, 0.1, DV)
        o, lse = merge_attention_partials(o[None], lse[None])
        h = h + mla_decode_output(layer, o)
        h = h + ffn_forward(layer, post_attention_norm(layer, h))
    assert h.shape == (0, CONFIG.hidden_size) and logits(MODEL, h).shape == (0, CONFIG.vocab_size)


def test_packed_prefill_equals_one_prompt_at_a_time():
    from nanocp.models import load_model, prefill_forward, prefill_forward_packed

    model = load_model("tiny")
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 17, 1, 33)]
    for prompt, packed in zip(prompts, prefill_forward_packed(model, prompts)):
        alone = prefill_forward(model, prompt)
        torch.testing.assert_close(packed.kv, alone.kv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[-1], alone.logits[-1], rtol=1e-5, atol=1e-5)
