"""The fused fp32 CPU kernels (data_plane/cpu_kernels.py over data_plane/csrc/cpu_kernels.cpp) against their torch
references on random shapes and inputs, strided rows included: RMSNorm (models.rms_norm), MLA's latent norms and
rope (decode_layers.rotate_pairs), the query heads' in-place rope, SwiGLU, the MoE gate's group-limited top-k (the
torch branch of decode_layers.moe_gate), the weighted combine, the grouped expert MLP, the panel GEMMs and the paged
MLA attention (models.mla_paged_attention_with_lse); and the errors on bad input.

Every test runs at every vector width built and runnable here (the `width` fixture: 16 fp32 lanes with AVX-512, 8
with AVX2, 4 portable). Results are compared with the exact value (fp64, from the same fp32 inputs) within the
fp32 error bound derived from the arithmetic (tests/tolerances.py), and the torch reference within its own bound:
bounds hold for any summation order, so for every width, with or without FMA. Fused calls that run the same
arithmetic as their steps are compared bit for bit."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import tolerances as tol
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moe_reference import gate_config

from nanocp.data_plane import cpu_kernels
from nanocp.data_plane import decode_layers as dl
from nanocp.models import ModelConfig, RotaryEmbedding, mla_paged_attention_with_lse, rms_norm

pytestmark = pytest.mark.skipif(
    cpu_kernels._k is None, reason="the extension nanocp.data_plane._cpu_kernels is not built"
)

TINY = ModelConfig.tiny()
ROPE_HALVES = [1, 3, 8, 32, 64, 128]  # the kernels' table holds rope <= 256 dims


@pytest.fixture(scope="module", autouse=True, params=list(cpu_kernels.WIDTHS))
def width(request):
    """Every test of this module once per build of the kernels (data_plane/cpu_kernels.py WIDTHS) this machine can
    run: an AVX-512 machine runs its 16-lane native build, the AVX2 build and the portable one side by side."""
    reason = cpu_kernels.width_unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"CPU kernels at width {request.param!r}: {reason}")
    previous = cpu_kernels.use_width(request.param)
    yield request.param
    cpu_kernels.use_width(previous)


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU flags from /proc/cpuinfo")
def test_kernels_are_built_for_this_cpus_vector_width(width):
    """The register tiles are sized by the vector width of the build: with -march=native (the default) 16 fp32 lanes
    where the CPU has AVX-512, 8 where it has AVX (AVX-512-sized tiles on an AVX2 CPU spill every accumulator:
    several times slower); a portable build (-DNANOCP_NATIVE=OFF, and the "portable" width) takes x86-64's baseline,
    SSE: 4; the "avx2" width 8, with FMA."""
    assert cpu_kernels.current_width() == width and cpu_kernels._k.width == width
    if width == "avx2":
        assert cpu_kernels.vector_lanes() == 8 and cpu_kernels._k.fma
        return
    if width == "portable" or not cpu_kernels._k.native_build:
        assert cpu_kernels.vector_lanes() == 4
        return
    flags = cpu_flags()
    assert cpu_kernels.vector_lanes() == (16 if "avx512f" in flags else 8 if "avx" in flags else 4)


def test_fast_exp_is_within_the_bound_the_tolerances_assume():
    """tests/tolerances.py bounds every exp of the kernels by FUNC u relatively: checked on a dense sweep of the
    range (whole vectors and a tail), at random points, and below it (clamped: e^-87 or less, never above)."""
    x = np.concatenate(
        [np.linspace(-87, 88, 2**21 + 3, dtype=np.float32), np.random.default_rng(0).uniform(-87, 88, 4099)]
    ).astype(np.float32)
    y = x.copy()
    cpu_kernels._k.exp_(y)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(y - want) / want
    assert rel.max() <= tol.FUNC * tol.U, f"fast_exp: {rel.max() / tol.U:.2f} u at x = {x[rel.argmax()]!r}"
    below = np.array([-87.5, -100, -1e4, -np.inf], dtype=np.float32)
    cpu_kernels._k.exp_(below)
    assert (below >= 0).all() and (below <= np.exp(-87.0) * (1 + tol.FUNC * tol.U)).all()


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def wide_slice(gen: torch.Generator, rows: int, cols: int, extra: int) -> torch.Tensor:
    """A fresh random [rows, cols] view starting inside a wider tensor (row stride cols + extra) when extra > 0."""
    start = extra // 2
    return randn(gen, rows, cols + extra)[:, start : start + cols]


def rope_table(half: int, positions: torch.Tensor) -> dl.RopeTable:
    """The RopeTable (YaRN rope of the tiny model, rope dims 2 * half) of `positions` [T]."""
    rope = RotaryEmbedding.from_config(dataclasses.replace(TINY, qk_rope_head_dim=2 * half))
    return dl.RopeTable.at(rope, positions)


def cos_sin(table: dl.RopeTable, heads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's fp32 (cos, sin) [T, half] (the values the kernels read), [T, 1, half] with `heads`."""
    cs = torch.from_numpy(table.cos_sin)
    cos, sin = cs[..., 0], cs[..., 1]
    return (cos[:, None], sin[:, None]) if heads else (cos, sin)


# ---- attention side ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 9),
    dim=st.integers(1, 300),
    extra=st.sampled_from([0, 0, 5, 64]),
    log_scale=st.floats(-3, 3),
    eps=st.sampled_from([1e-6, 1e-5, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_equals_the_reference(tokens, dim, extra, log_scale, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = wide_slice(gen, tokens, dim, extra) * 10**log_scale  # [T, D], strided rows when extra > 0
    weight = randn(gen, dim)
    want = tol.rms_norm(x, weight, eps)
    tol.assert_within(cpu_kernels.rms_norm(x, weight, eps), want.value, want.err, "kernel")
    tol.assert_within(rms_norm(x, weight, eps), want.value, want.err, "reference")


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 8),
    q_lora=st.sampled_from([0, 1, 24, 96]),
    lora=st.sampled_from([1, 17, 64, 512]),
    half=st.sampled_from(ROPE_HALVES),
    extra=st.sampled_from([0, 7]),
    eps=st.sampled_from([1e-6, 1e-4]),
    seed=st.integers(0, 2**16),
)
def test_mla_qkv_post_equals_norms_and_rotate_pairs(tokens, q_lora, lora, half, extra, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = wide_slice(gen, tokens, q_lora + lora + 2 * half, extra)  # [T, q_lora + kv_lora + rope], rope in pairs
    q_norm = randn(gen, q_lora) if q_lora else None
    kv_norm = randn(gen, lora)
    table = rope_table(half, torch.randint(0, 20000, (tokens,), generator=gen))
    q_in, kv_new = cpu_kernels.mla_qkv_post(qkv, q_norm, kv_norm, eps, table.cos_sin)
    if q_lora:
        want = tol.rms_norm(qkv[:, :q_lora], q_norm, eps)
        tol.assert_within(q_in, want.value, want.err, "q_in")
        tol.assert_within(rms_norm(qkv[:, :q_lora], q_norm, eps), want.value, want.err, "q_in reference")
    else:
        assert q_in is None
    want = tol.rms_norm(qkv[:, q_lora : q_lora + lora], kv_norm, eps)
    tol.assert_within(kv_new[:, :lora], want.value, want.err, "latent")
    tol.assert_within(rms_norm(qkv[:, q_lora : q_lora + lora], kv_norm, eps), want.value, want.err, "reference")
    pairs = qkv[:, q_lora + lora :]
    want = tol.rotate(pairs[:, 0::2], pairs[:, 1::2], *cos_sin(table))
    tol.assert_within(kv_new[:, lora:], want.value, want.err, "rope")
    # a copy: rotate_pairs's complex view refuses a one-row slice at an odd offset (see _rotated)
    tol.assert_within(dl.rotate_pairs(pairs.clone(), table), want.value, want.err, "rope reference")


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 8),
    heads=st.integers(1, 5),
    half=st.sampled_from(ROPE_HALVES),
    offset=st.integers(0, 70),
    tail=st.integers(0, 5),
    extra=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_rope_heads_rotates_only_the_rope_dims_in_place(tokens, heads, half, offset, tail, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    width, rope = offset + 2 * half + tail, 2 * half
    storage = randn(gen, tokens, heads, width + extra)
    q = storage[:, :, extra : extra + width]  # [T, H, width]: head stride width + extra when extra > 0
    before = storage.clone()
    table = rope_table(half, torch.randint(0, 20000, (tokens,), generator=gen))
    pairs = q[..., offset : offset + rope].clone()  # [T, H, rope]
    want = tol.rotate(pairs[..., 0::2], pairs[..., 1::2], *cos_sin(table, heads=True))
    tol.assert_within(dl.rotate_pairs(pairs, table), want.value, want.err, "reference")
    got = cpu_kernels.rope_heads_(q, offset, table.cos_sin)
    assert got is q
    tol.assert_within(q[..., offset : offset + rope], want.value, want.err, "kernel")
    untouched = torch.ones(width + extra, dtype=torch.bool)
    untouched[extra + offset : extra + offset + rope] = False
    assert torch.equal(storage[..., untouched], before[..., untouched])


# ---- FFN / MoE side ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 9),
    inter=st.integers(1, 200),
    extra=st.sampled_from([0, 0, 9]),
    log_scale=st.floats(-2, 1.5),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_equals_the_reference(tokens, inter, extra, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = wide_slice(gen, tokens, 2 * inter, extra) * 10**log_scale  # [T, 2I]: gate | up
    want = tol.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    tol.assert_within(cpu_kernels.silu_mul(gate_up), want.value, want.err, "kernel")
    tol.assert_within(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], want.value, want.err, "reference")


@st.composite
def gate_shapes(draw) -> tuple[int, int, int, int]:
    """(n_group, experts per group, topk_group, top-k) that DeepSeek-V3's gate accepts."""
    n_group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    per_group = draw(st.integers(1 if n_group == 1 else 2, 64 // n_group))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(8, topk_group * per_group)))
    return n_group, per_group, topk_group, top_k


@settings(max_examples=120, deadline=None)
@given(
    shape=gate_shapes(),
    tokens=st.integers(1, 8),
    normalize=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    extra=st.sampled_from([0, 6]),
    seed=st.integers(0, 2**16),
)
def test_moe_gate_topk_equals_the_torch_gate(shape, tokens, normalize, scale, extra, seed):
    n_group, per_group, topk_group, top_k = shape
    experts = n_group * per_group
    gen = torch.Generator().manual_seed(seed)
    logits = wide_slice(gen, tokens, experts, extra) * 2.0  # [T, E] before the sigmoid
    bias = randn(gen, experts, scale=0.05)
    config = gate_config(TINY, experts, n_group, topk_group, top_k, normalize, scale)
    idx, weights = cpu_kernels.moe_gate_topk(
        logits, bias, cpu_kernels.GateRule(n_group, topk_group, top_k, normalize, scale)
    )
    # the torch branch on x = logits and an identity gate: its GEMM reproduces the logits exactly
    layer = SimpleNamespace(gate=dl.Linear.of(torch.eye(experts)), gate_bias=bias)
    previous = cpu_kernels.set_enabled(False)
    try:
        idx_ref, weights_ref = dl.moe_gate(layer, config, logits.contiguous())
    finally:
        cpu_kernels.set_enabled(previous)
    assert idx.dtype == torch.int64
    # the picks where no two choices are closer than their fp32 bounds are the exact ones (both sides equal);
    # where some are, either order is valid
    rule = (n_group, topk_group, normalize, scale)
    tol.check_gate(logits, bias, *rule, idx, weights, "kernel")
    tol.check_gate(logits, bias, *rule, idx_ref, weights_ref, "reference")


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.integers(1, 8),
    top_k=st.integers(0, 6),
    sources=st.integers(1, 20),
    dim=st.integers(1, 130),
    extra=st.sampled_from([0, 5]),
    in_place=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_weighted_combine_equals_the_weighted_sum(tokens, top_k, sources, dim, extra, in_place, seed):
    gen = torch.Generator().manual_seed(seed)
    y = wide_slice(gen, sources, dim, extra)  # [N, D] expert outputs
    rows = torch.randint(-1, sources, (tokens, 2 * top_k), generator=gen)[:, ::2]  # [T, k] strided, -1 = none
    weights = randn(gen, tokens, top_k)
    base = randn(gen, tokens, dim)
    base_before = base.clone()
    got = cpu_kernels.weighted_combine(y, rows, weights, base, out=base if in_place else None)
    assert got is base if in_place else torch.equal(base, base_before)
    terms = weights.double()[..., None] * y.double()[rows.clamp(min=0)] * (rows >= 0)[..., None]  # [T, k, D]
    want = base_before.double() + terms.sum(dim=1)
    # k products and k adds per value, in any order: gamma(k + 1) times the terms' sizes
    bound = tol.gamma(top_k + 1) * (base_before.double().abs() + terms.abs().sum(dim=1))
    tol.assert_within(got, want, bound)


def expert_mlp_reference(source, rows, local, gate_up, down) -> tol.Bounded:
    """Token by token, exact (fp64) with its fp32 bound: y[i] = SwiGLU MLP of expert local[i] on source[rows[i]]."""
    rows, local = torch.from_numpy(rows), torch.from_numpy(local)
    out = tol.swiglu_mlp(source[rows][:, None, :], gate_up[local], down[local])  # [N, 1, D]
    return tol.Bounded(out.value[:, 0], out.err[:, 0])


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 40),
    sources=st.integers(1, 12),
    experts=st.integers(1, 6),
    dim=st.sampled_from([1, 5, 16, 48, 64, 80, 256]),
    inter=st.sampled_from([1, 3, 16, 32, 96, 128]),
    extra=st.sampled_from([0, 0, 7]),
    seed=st.integers(0, 2**16),
)
def test_grouped_expert_mlp_equals_each_tokens_expert(tokens, sources, experts, dim, inter, extra, seed):
    """Every token through its own expert, any routing (idle experts, one expert taking all, repeated rows), rows
    of the source strided; widths that leave a partial last panel, expert token counts that leave row tails."""
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    source = wide_slice(gen, sources, dim, extra)
    gate_up, down = randn(gen, experts, dim, 2 * inter, scale=0.1), randn(gen, experts, inter, dim, scale=0.1)
    rows = rng.integers(0, sources, tokens).astype(np.int64)
    local = rng.integers(0, experts, tokens).astype(np.int64)
    got = cpu_kernels.grouped_expert_mlp(
        source, rows, local, cpu_kernels.pack_panels(gate_up), cpu_kernels.pack_panels(down)
    )
    want = expert_mlp_reference(source, rows, local, gate_up, down)
    tol.assert_within(got, want.value, want.err)


def packed_receive_buffer(rng: np.random.Generator, counts: list[int], cap: int, dim: int, experts: int):
    """A packed dispatch's receive buffer [ranks * (cap + 1), dim + 1] (moe_exchange.py): per source a header row
    tagged with its count, then `count` random rows tagged with random local experts; unused rows random too."""
    recv = rng.standard_normal((len(counts) * (cap + 1), dim + 1)).astype(np.float32)
    tags = recv[:, dim:].view(np.int32)[:, 0]
    rows, local = [], []
    for s, n in enumerate(counts):
        tags[s * (cap + 1)] = n
        block = np.arange(s * (cap + 1) + 1, s * (cap + 1) + 1 + n)
        tags[block] = rng.integers(0, experts, n)
        rows += block.tolist()
        local += tags[block].tolist()
    return recv, np.array(rows, dtype=np.int64), np.array(local, dtype=np.int64)


@settings(max_examples=30, deadline=None)
@given(
    ranks=st.integers(1, 4),
    cap=st.integers(0, 12),
    experts=st.integers(1, 4),
    dim=st.sampled_from([8, 16, 48, 256]),
    inter=st.sampled_from([1, 16, 40, 128]),
    seed=st.integers(0, 2**16),
)
def test_received_expert_mlp_equals_the_grouped_kernel_on_the_parsed_buffer(ranks, cap, experts, dim, inter, seed):
    """The experts read straight from a packed receive buffer, each source's outputs written to its own array in
    its order: bit-equal to grouped_expert_mlp on the rows and experts read out of the buffer; rows of `outs` past a
    source's count are left as they were."""
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    counts = rng.integers(0, cap + 1, ranks).tolist()
    recv, rows, local = packed_receive_buffer(rng, counts, cap, dim, experts)
    gate_up = cpu_kernels.pack_panels(randn(gen, experts, dim, 2 * inter, scale=0.1))
    down = cpu_kernels.pack_panels(randn(gen, experts, inter, dim, scale=0.1))
    outs = [rng.standard_normal((cap, dim)).astype(np.float32) for _ in range(ranks)]
    before = [o.copy() for o in outs]
    assert cpu_kernels.received_expert_mlp(recv, cap, gate_up, down, outs) == counts
    want = cpu_kernels.grouped_expert_mlp(torch.from_numpy(recv[:, :dim]), rows, local, gate_up, down).numpy()
    got = np.concatenate([o[:n] for o, n in zip(outs, counts)])
    assert np.array_equal(got, want.reshape(-1, dim))
    for o, b, n in zip(outs, before, counts):
        assert np.array_equal(o[n:], b[n:])


def test_received_expert_mlp_rejects_corrupt_dispatches_and_shapes():
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    cap, dim, inter = 4, 16, 8
    gate_up = cpu_kernels.pack_panels(randn(gen, 2, dim, 2 * inter))
    down = cpu_kernels.pack_panels(randn(gen, 2, inter, dim))
    recv, _, _ = packed_receive_buffer(rng, [2, 3], cap, dim, 2)
    outs = [np.zeros((cap, dim), dtype=np.float32) for _ in range(2)]
    tags = recv[:, dim:].view(np.int32)[:, 0]
    bad = recv.copy()
    bad[:, dim:].view(np.int32)[cap + 1, 0] = cap + 1
    with pytest.raises(ValueError, match=r"corrupt dispatch: source 1 sent 5 pairs, outside \[0, 4\]"):
        cpu_kernels.received_expert_mlp(bad, cap, gate_up, down, outs)
    bad = recv.copy()
    bad[:, dim:].view(np.int32)[2, 0] = 2
    with pytest.raises(ValueError, match=r"corrupt dispatch: local expert 2 outside \[0, 2\)"):
        cpu_kernels.received_expert_mlp(bad, cap, gate_up, down, outs)
    with pytest.raises(ValueError, match=r"recv must have ranks \* \(cap \+ 1\) = 15 rows"):
        cpu_kernels.received_expert_mlp(recv, cap, gate_up, down, outs + [outs[0]])
    with pytest.raises(ValueError, match=r"outs\[1\] must hold \[3, 16\]"):
        cpu_kernels.received_expert_mlp(recv, cap, gate_up, down, [outs[0], outs[1][:2]])
    with pytest.raises(TypeError):  # a copy made to convert would lose the outputs
        cpu_kernels.received_expert_mlp(recv, cap, gate_up, down, [outs[0], outs[1].astype(np.float64)])
    assert tags[0] == 2 and tags[cap + 1] == 3


def kernel_chunk(page: int) -> int:
    """Rows per online-softmax step of the attention kernel: whole pages, 64 rows where pages divide it."""
    return max(page, 64 // page * page)


def check_attention(q, kv_pages, block_table, lens, scale, v_dim) -> None:
    """The kernel and models.mla_paged_attention_with_lse against the exact attention, each within the bound of its
    own fp32 form (tolerances.attention: the kernel's online softmax, the reference's exp(s - lse))."""
    o, lse = cpu_kernels.mla_paged_attention(q, kv_pages, block_table, lens.numpy(), scale, v_dim)
    o_ref, lse_ref = mla_paged_attention_with_lse(q, kv_pages, block_table, lens, scale, v_dim)
    (shards, blocks), page = block_table.shape, kv_pages.shape[1]
    kv = kv_pages[block_table.long()].reshape(shards, blocks * page, kv_pages.shape[-1])  # [S, B * page, Dqk]
    kernel = tol.attention(q, kv, lens, scale, v_dim, chunk=kernel_chunk(page))
    reference = tol.attention(q, kv, lens, scale, v_dim)
    tol.assert_within(lse, kernel.lse.value, kernel.lse.err, "kernel lse")
    tol.assert_within(o, kernel.o.value, kernel.o.err, "kernel o")
    tol.assert_within(lse_ref, reference.lse.value, reference.lse.err, "reference lse")
    tol.assert_within(o_ref, reference.o.value, reference.o.err, "reference o")
    empty = lens == 0
    assert bool((lse[empty] == float("-inf")).all()) and bool((o[empty] == 0).all())


@settings(max_examples=25, deadline=None)
@given(
    shards=st.integers(0, 6),
    heads=st.integers(1, 5),
    dqk=st.sampled_from([8, 17, 80, 96]),
    page=st.sampled_from([1, 4, 16]),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
@example(shards=6, heads=4, dqk=96, page=1, blocks=1, seed=691)  # issue 19: lse 1.2e-6 off, over a fixed 1e-6
@example(shards=0, heads=1, dqk=8, page=1, blocks=1, seed=0)  # no shards at all
def test_mla_paged_attention_equals_the_reference(shards, heads, dqk, page, blocks, seed):
    """Random pages, random block tables (pages shared between shards too), lengths 0..B * page."""
    gen = torch.Generator().manual_seed(seed)
    pages = 2 * blocks + 3
    kv_pages = randn(gen, pages, page, dqk)
    block_table = torch.randint(0, pages, (shards, blocks), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, blocks * page + 1, (shards,), generator=gen)
    q = randn(gen, shards, heads, dqk)
    check_attention(q, kv_pages, block_table, lens, 0.3, max(1, dqk - 5))


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 9), n=st.integers(0, 20), hidden=st.sampled_from([1, 16, 33]), seed=st.integers(0, 2**31 - 1)
)
def test_pack_dispatch_rows_equals_the_torch_packing(tokens, n, hidden, seed):
    """Each payload row: the values of its source token, then its tag's int32 bits in the last slot."""
    gen = torch.Generator().manual_seed(seed)
    x = wide_slice(gen, tokens, hidden, 3)
    source = torch.randint(0, tokens, (n,), generator=gen).numpy()
    tags = torch.randint(-5, 2**31 - 1, (n,), generator=gen).numpy()
    out = randn(gen, n, hidden + 1)
    cpu_kernels.pack_dispatch_rows(x, source, tags, out)
    assert torch.equal(out[:, :hidden], x[torch.from_numpy(source)])
    assert torch.equal(out[:, hidden:].view(torch.int32)[:, 0], torch.from_numpy(tags).to(torch.int32))


def test_pack_dispatch_rows_rejects_bad_rows_and_shapes():
    x, out = torch.randn(3, 4), torch.empty(2, 5)
    with pytest.raises(ValueError, match="source row 3 outside x's 3 rows"):
        cpu_kernels.pack_dispatch_rows(x, np.array([0, 3]), np.array([1, 2]), out)
    with pytest.raises(ValueError, match="disagree"):
        cpu_kernels.pack_dispatch_rows(x, np.array([0, 1]), np.array([1, 2]), torch.empty(2, 4))


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [1, 4, 16, 48])
def test_mla_paged_attention_over_many_chunks_equals_the_reference(page):
    """Shards longer than the kernel's 64-row chunk (several softmax steps, the running max rising and not), and
    lengths on and off chunk and page boundaries."""
    gen = torch.Generator().manual_seed(page)
    lens = torch.tensor([1, 63, 64, 65, 128, 130, 200, 257])
    blocks = -(-int(lens.max()) // page)
    pages = len(lens) * blocks + 5
    kv_pages = randn(gen, pages, page, 80)
    kv_pages[3] *= 4.0  # a page of large scores somewhere: the running max jumps in a later chunk
    block_table = torch.randperm(pages, generator=gen)[: len(lens) * blocks].view(len(lens), blocks).to(torch.int32)
    q = randn(gen, len(lens), 4, 80)
    check_attention(q, kv_pages, block_table, lens, 0.2, 64)


def test_mla_paged_attention_rejects_bad_tables():
    gen = torch.Generator().manual_seed(12)
    kv_pages, q = randn(gen, 3, 4, 8), randn(gen, 2, 2, 8)
    table, lens = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), np.array([5, 8])
    with pytest.raises(ValueError, match="page 3 outside the pool's 3"):
        cpu_kernels.mla_paged_attention(q, kv_pages, torch.tensor([[0, 3], [2, 0]], dtype=torch.int32), lens, 1.0, 8)
    with pytest.raises(ValueError, match=r"shard length 9 outside \[0, 8\]"):
        cpu_kernels.mla_paged_attention(q, kv_pages, table, np.array([5, 9]), 1.0, 8)
    with pytest.raises(ValueError, match="as wide as the queries"):
        cpu_kernels.mla_paged_attention(q, randn(gen, 3, 4, 9), table, lens, 1.0, 8)
    with pytest.raises(TypeError):
        cpu_kernels.mla_paged_attention(q, kv_pages, table.long(), lens, 1.0, 8)


def test_rms_norm_rejects_bad_shapes_and_strides():
    gen = torch.Generator().manual_seed(1)
    x = randn(gen, 3, 8)
    with pytest.raises(ValueError, match=r"rms_norm: x \[3, 8\], weight \[9\]"):
        cpu_kernels.rms_norm(x, randn(gen, 9), 1e-6)
    with pytest.raises(ValueError, match="x: the last dimension must be contiguous"):
        cpu_kernels.rms_norm(randn(gen, 3, 16)[:, ::2], randn(gen, 8), 1e-6)


def test_mla_kernels_reject_bad_shapes():
    gen = torch.Generator().manual_seed(2)
    table = rope_table(4, torch.arange(3))
    q_norm, kv_norm = randn(gen, 5), randn(gen, 6)
    with pytest.raises(ValueError, match="qkv has 20 columns, expected q_lora \\+ kv_lora \\+ rope = 19"):
        cpu_kernels.mla_qkv_post(randn(gen, 3, 20), q_norm, kv_norm, 1e-6, table.cos_sin)
    with pytest.raises(ValueError, match=r"mla_qkv_post: rope_cs must be \[T, rope / 2, 2\]"):
        cpu_kernels.mla_qkv_post(randn(gen, 2, 19), q_norm, kv_norm, 1e-6, table.cos_sin)
    with pytest.raises(ValueError, match="mla_qkv_post: rope_cs must be .* rope <= 256"):
        big = rope_table(129, torch.arange(3))
        cpu_kernels.mla_qkv_post(randn(gen, 3, 11 + 258), q_norm, kv_norm, 1e-6, big.cos_sin)
    with pytest.raises(ValueError, match="rope_heads_: the rope dims do not fit the rows of q"):
        cpu_kernels.rope_heads_(randn(gen, 3, 2, 10), 3, table.cos_sin)
    with pytest.raises(ValueError, match="rope_heads_: rope_cs must be contiguous"):
        cpu_kernels.rope_heads_(randn(gen, 3, 2, 10), 0, table.cos_sin[:, ::2])
    with pytest.raises(ValueError, match="q: the last dimension must be contiguous"):
        cpu_kernels.rope_heads_(randn(gen, 3, 2, 20)[..., ::2], 0, table.cos_sin)


def test_silu_mul_rejects_an_odd_width():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match=r"silu_mul: gate_up \[4, 9\] and out \[4, 4\] disagree"):
        cpu_kernels.silu_mul(randn(gen, 4, 9))


def test_moe_gate_topk_rejects_bad_grouping_and_top_k():
    gen = torch.Generator().manual_seed(4)
    logits, bias = randn(gen, 2, 12), randn(gen, 12)
    with pytest.raises(ValueError, match="bias must have one value per expert"):
        cpu_kernels.moe_gate_topk(logits, randn(gen, 11), cpu_kernels.GateRule(1, 1, 2, True, 1.0))
    with pytest.raises(ValueError, match=r"bad grouping \(n_group 5, topk_group 1, 12 experts\)"):
        cpu_kernels.moe_gate_topk(logits, bias, cpu_kernels.GateRule(5, 1, 2, True, 1.0))
    with pytest.raises(ValueError, match=r"bad grouping \(n_group 4, topk_group 5"):
        cpu_kernels.moe_gate_topk(logits, bias, cpu_kernels.GateRule(4, 5, 2, True, 1.0))
    with pytest.raises(ValueError, match="top-k 7 does not fit the allowed groups"):
        cpu_kernels.moe_gate_topk(logits, bias, cpu_kernels.GateRule(4, 2, 7, True, 1.0))  # 2 groups of 3 experts
    with pytest.raises(ValueError, match="top-k 1 does not fit"):
        cpu_kernels.moe_gate_topk(
            logits, bias, cpu_kernels.GateRule(12, 1, 1, True, 1.0)
        )  # one expert per group: no top-2 group score


def test_weighted_combine_rejects_bad_shapes_and_rows():
    gen = torch.Generator().manual_seed(5)
    y, rows, weights, base = randn(gen, 4, 6), torch.tensor([[0, 3], [-1, 2]]), randn(gen, 2, 2), randn(gen, 2, 6)
    with pytest.raises(ValueError, match="row 4 outside y's 4"):
        cpu_kernels.weighted_combine(y, torch.tensor([[0, 4], [1, 2]]), weights, base)
    with pytest.raises(ValueError, match=r"weights must be shaped like rows \[2, 2\]"):
        cpu_kernels.weighted_combine(y, rows, randn(gen, 2, 3), base)
    with pytest.raises(ValueError, match=r"base and out must be \[2, 6\]"):
        cpu_kernels.weighted_combine(y, rows, weights, randn(gen, 2, 5))


def test_grouped_expert_mlp_rejects_bad_routing_and_shapes():
    gen = torch.Generator().manual_seed(11)
    source = randn(gen, 5, 32)
    gate_up, down = cpu_kernels.pack_panels(randn(gen, 3, 32, 32)), cpu_kernels.pack_panels(randn(gen, 3, 16, 32))
    rows, local = np.array([0, 4, 2]), np.array([2, 0, 1])
    with pytest.raises(ValueError, match=r"local expert 3 outside \[0, 3\)"):
        cpu_kernels.grouped_expert_mlp(source, rows, np.array([2, 3, 0]), gate_up, down)
    with pytest.raises(ValueError, match="row 5 outside the source's 5 rows"):
        cpu_kernels.grouped_expert_mlp(source, np.array([0, 5, 1]), local, gate_up, down)
    with pytest.raises(ValueError, match="rows, local and y must have the same length"):
        cpu_kernels.grouped_expert_mlp(source, rows, local[:2], gate_up, down)
    with pytest.raises(ValueError, match=r"gate_up \[E, D, 2I\] and down \[E, I, D\] disagree"):
        cpu_kernels.grouped_expert_mlp(source, rows, local, gate_up, down[:2])
    with pytest.raises(ValueError, match=r"gate_up: panels must be \[\d+, 24, \d+\] for a \[24, 32\] weight"):
        cpu_kernels.grouped_expert_mlp(randn(gen, 5, 24), rows, local, gate_up, down)  # D = 24, panels of D = 32
    with pytest.raises(ValueError, match="down: panels must be contiguous"):
        cpu_kernels.grouped_expert_mlp(
            source, rows, local, gate_up, np.ascontiguousarray(down.swapaxes(-1, -2)).swapaxes(-1, -2)
        )


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 20),
    k=st.integers(1, 300),
    n=st.integers(1, 200),
    with_base=st.sampled_from(["none", "apart", "in place"]),
    extra=st.sampled_from([0, 0, 5]),
    seed=st.integers(0, 2**16),
)
def test_linear_on_panels_equals_the_matrix_product(tokens, k, n, with_base, extra, seed):
    """x @ W (+ base) for any widths (a partial last panel, rows that leave a short last row tile), x rows strided."""
    gen = torch.Generator().manual_seed(seed)
    x, w = wide_slice(gen, tokens, k, extra), randn(gen, k, n, scale=k**-0.5)
    base = None if with_base == "none" else randn(gen, tokens, n)
    want = tol.linear(x, w, base)
    if with_base == "in place":
        out = base.clone()
        cpu_kernels._k.linear_panels(x.numpy(), cpu_kernels.pack_panels(w), n, out.numpy(), out.numpy())
        got = out
    else:
        got = cpu_kernels.linear(x, cpu_kernels.pack_panels(w), n, base)
    assert got.shape == (tokens, n)
    tol.assert_within(got, want.value, want.err)


@given(k=st.integers(1, 40), n=st.integers(1, 150), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_pack_panels_lays_out_column_blocks(k, n, seed):
    """Panel p holds columns [p W, (p + 1) W) of the weight, row by row; columns past n are zero."""
    w = randn(torch.Generator().manual_seed(seed), 2, k, n)
    width = cpu_kernels.panel_width()
    panels = cpu_kernels.pack_panels(w)
    assert panels.shape == (2, -(-n // width), k, width) and panels.flags.c_contiguous
    for p in range(panels.shape[1]):
        cols = min(width, n - p * width)
        assert np.array_equal(panels[:, p, :, :cols], w[:, :, p * width : p * width + cols].numpy())
        assert not panels[:, p, :, cols:].any()


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 20),
    dim=st.integers(1, 100),
    inter=st.integers(1, 90),
    with_base=st.booleans(),
    extra=st.sampled_from([0, 0, 5]),
    seed=st.integers(0, 2**16),
)
def test_gated_mlp_equals_swiglu_reference(tokens, dim, inter, with_base, extra, seed):
    """The fused SwiGLU MLP (both GEMMs on panels, the activation between them) against the exact value."""
    gen = torch.Generator().manual_seed(seed)
    x = wide_slice(gen, tokens, dim, extra)
    gate_up, down = randn(gen, dim, 2 * inter, scale=dim**-0.5), randn(gen, inter, dim, scale=inter**-0.5)
    base = randn(gen, tokens, dim) if with_base else None
    got = cpu_kernels.gated_mlp(x, cpu_kernels.pack_panels(gate_up), cpu_kernels.pack_panels(down), inter, base)
    want = tol.swiglu_mlp(x, gate_up, down, base)
    tol.assert_within(got, want.value, want.err)
    with pytest.raises(ValueError, match=r"gated_mlp: (gate_up|down): panels must be"):
        cpu_kernels.gated_mlp(x, cpu_kernels.pack_panels(gate_up), cpu_kernels.pack_panels(down), inter + 1, base)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(0, 13),
    dim=st.integers(1, 70),
    q_lora=st.sampled_from([0, 1, 24]),
    lora=st.integers(1, 40),
    half=st.sampled_from(ROPE_HALVES[:4]),
    heads=st.integers(1, 5),
    extra=st.sampled_from([0, 0, 3]),
    seed=st.integers(0, 2**16),
)
def test_mla_project_equals_its_steps_one_by_one(tokens, dim, q_lora, lora, half, heads, extra, seed):
    """The fused projection computes exactly what its steps' kernels compute one call at a time (bit for bit):
    norm, the qkv_a GEMM, the latent norms and rope, the q_b GEMM, the heads' rope."""
    gen = torch.Generator().manual_seed(seed)
    width, qkv_width = lora + 2 * half, q_lora + lora + 2 * half
    h, input_norm = wide_slice(gen, tokens, dim, extra), randn(gen, dim)
    qkv_a, q_b = randn(gen, dim, qkv_width, scale=0.2), randn(gen, q_lora or dim, heads * width, scale=0.2)
    q_norm, kv_norm = (randn(gen, q_lora) if q_lora else None), randn(gen, lora)
    cs = rope_table(half, torch.arange(tokens) + 3).cos_sin
    qkv_p, q_b_p = cpu_kernels.pack_panels(qkv_a), cpu_kernels.pack_panels(q_b)
    q, kv = cpu_kernels.mla_project(h, input_norm, 1e-5, qkv_p, q_norm, kv_norm, 1e-6, cs, q_b_p, heads)
    x = cpu_kernels.rms_norm(h, input_norm, 1e-5)
    q_in, kv_want = cpu_kernels.mla_qkv_post(cpu_kernels.linear(x, qkv_p, qkv_width), q_norm, kv_norm, 1e-6, cs)
    q_want = cpu_kernels.linear(x if q_in is None else q_in, q_b_p, heads * width).view(tokens, heads, width)
    cpu_kernels.rope_heads_(q_want, lora, cs)
    assert torch.equal(q, q_want) and torch.equal(kv, kv_want)
    with pytest.raises(ValueError, match="mla_project: q_b: panels must be"):
        cpu_kernels.mla_project(h, input_norm, 1e-5, qkv_p, q_norm, kv_norm, 1e-6, cs, q_b_p, heads + 64)
    # the KV store: each row into its own slot of a cache (-1: none), every other cache row untouched
    rng = np.random.default_rng(seed)
    cache = randn(gen, tokens + 5, width)
    slots = rng.permutation(tokens + 5)[:tokens].astype(np.int64)
    slots[rng.random(tokens) < 0.3] = -1
    want = cache.clone()
    want[torch.from_numpy(slots[slots >= 0])] = kv_want[torch.from_numpy(slots >= 0)]
    args = (h, input_norm, 1e-5, qkv_p, q_norm, kv_norm, 1e-6, cs, q_b_p, heads)
    q, kv = cpu_kernels.mla_project(*args, cache, slots)
    assert torch.equal(q, q_want) and torch.equal(kv, kv_want) and torch.equal(cache, want)
    if tokens:
        slots[0] = tokens + 5
        with pytest.raises(ValueError, match=f"kv slot {tokens + 5} outside the cache's {tokens + 5} rows"):
            cpu_kernels.mla_project(*args, cache, slots)
        with pytest.raises(ValueError, match=r"kv_cache must be \[N, \d+\] and kv_slots"):
            cpu_kernels.mla_project(*args, cache[:, 1:], slots)


def test_linear_on_panels_rejects_mismatched_shapes():
    gen = torch.Generator().manual_seed(12)
    x, panels = randn(gen, 3, 20), cpu_kernels.pack_panels(randn(gen, 20, 40))
    with pytest.raises(ValueError, match=r"panels must be \[\d+, 21, \d+\] for a \[21, 40\] weight"):
        cpu_kernels.linear(randn(gen, 3, 21), panels, 40)
    with pytest.raises(ValueError, match=r"for a \[20, 400\] weight"):
        cpu_kernels.linear(x, panels, 400)
    with pytest.raises(ValueError, match=r"base must be \[3, 40\]"):
        cpu_kernels.linear(x, panels, 40, base=randn(gen, 2, 40))


def test_float64_inputs_are_refused():
    """The kernels take fp32 arrays only (no implicit conversion): another dtype is a TypeError."""
    gen = torch.Generator().manual_seed(6)
    x, weight = randn(gen, 3, 10).double(), randn(gen, 10)
    with pytest.raises(TypeError):
        cpu_kernels.rms_norm(x, weight, 1e-6)


def _rope_heads_fp64() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    table = rope_table(4, torch.arange(2) + 100)
    q = randn(gen, 2, 3, 8).double()
    want = dl.rotate_pairs(q.clone(), table)
    return cpu_kernels.rope_heads_(q, 0, table.cos_sin), want


def _raw_rms_norm_fp64_out() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    x, weight = randn(gen, 3, 10), randn(gen, 10)
    out = np.zeros((3, 10))
    cpu_kernels._k.rms_norm(x.numpy(), weight.numpy(), 1e-6, out)
    return torch.from_numpy(out), rms_norm(x, weight, 1e-6).double()


@pytest.mark.parametrize("case", [_rope_heads_fp64, _raw_rms_norm_fp64_out], ids=["rope_heads_", "rms_norm-out"])
def test_float64_outputs_are_refused(case):
    """An array a kernel writes must be fp32 itself: never a temporary converted copy whose result is lost."""
    with pytest.raises(TypeError):
        case()


def _strided_rms_norm_weight(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight = randn(gen, 3, 8), randn(gen, 16)[::2]
    return cpu_kernels.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6)


def _strided_kv_norm(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    qkv, kv_norm, table = randn(gen, 3, 8 + 4), randn(gen, 16)[::2], rope_table(2, torch.arange(3))
    _, kv_new = cpu_kernels.mla_qkv_post(qkv, None, kv_norm, 1e-6, table.cos_sin)
    return kv_new[:, :8], rms_norm(qkv[:, :8], kv_norm, 1e-6)


def _strided_gate_bias(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias = randn(gen, 4, 16) * 0.01, randn(gen, 32)[::2]  # the bias decides the choice
    idx, _ = cpu_kernels.moe_gate_topk(logits, bias, cpu_kernels.GateRule(1, 1, 4, True, 1.0))
    return idx, (logits.sigmoid() + bias).topk(4, dim=-1).indices


def _strided_combine_base(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    y, rows, weights, base = randn(gen, 4, 6), torch.tensor([[0, 3], [-1, 2]]), randn(gen, 2, 2), randn(gen, 2, 12)
    base = base[:, ::2]
    want = base + (weights[..., None] * y[rows.clamp(min=0)] * (rows >= 0)[..., None]).sum(dim=1)
    return cpu_kernels.weighted_combine(y, rows, weights, base), want


@pytest.mark.parametrize(
    "case",
    [_strided_rms_norm_weight, _strided_kv_norm, _strided_gate_bias, _strided_combine_base],
    ids=["rms_norm-weight", "mla-kv_norm", "gate-bias", "combine-base"],
)
def test_strided_vectors_are_refused(case):
    """Weights, the gate bias and the combine's base are read as contiguous: a strided view is a clear error."""
    with pytest.raises(ValueError, match="contiguous"):
        case(torch.Generator().manual_seed(9))


def _empty_batch(name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """An empty batch (T = 0) through kernel `name`: (its result, the expected shape)."""
    gen = torch.Generator().manual_seed(10)
    table = rope_table(4, torch.zeros(0, dtype=torch.int64))
    weight = randn(gen, 8)
    if name == "rms_norm":
        return cpu_kernels.rms_norm(randn(gen, 0, 8), weight, 1e-6), (0, 8)
    if name == "mla_qkv_post":
        return cpu_kernels.mla_qkv_post(randn(gen, 0, 16), None, weight, 1e-6, table.cos_sin)[1], (0, 16)
    if name == "rope_heads_":
        return cpu_kernels.rope_heads_(randn(gen, 0, 2, 8), 0, table.cos_sin), (0, 2, 8)
    if name == "silu_mul":
        return cpu_kernels.silu_mul(randn(gen, 0, 8)), (0, 4)
    if name == "moe_gate_topk":
        return cpu_kernels.moe_gate_topk(randn(gen, 0, 16), randn(gen, 16), cpu_kernels.GateRule(4, 2, 4, True, 1.0))[
            0
        ], (0, 4)
    y, rows, weights = randn(gen, 3, 8), torch.zeros(0, 2, dtype=torch.int64), randn(gen, 0, 2)
    return cpu_kernels.weighted_combine(y, rows, weights, randn(gen, 0, 8)), (0, 8)


@pytest.mark.parametrize(
    "name", ["rms_norm", "mla_qkv_post", "rope_heads_", "silu_mul", "moe_gate_topk", "weighted_combine"]
)
def test_an_empty_batch_gives_an_empty_result(name):
    got, shape = _empty_batch(name)
    assert tuple(got.shape) == shape


def test_moe_gate_input_rejects_mismatched_shapes():
    gen = torch.Generator().manual_seed(13)
    o, h, norm = randn(gen, 3, 32), randn(gen, 3, 16), randn(gen, 16)
    w_o, gate, bias = (
        cpu_kernels.pack_panels(randn(gen, 32, 16)),
        cpu_kernels.pack_panels(randn(gen, 16, 8)),
        randn(gen, 8),
    )
    args = (cpu_kernels.GateRule(2, 2, 4, True, 2.5),)
    cpu_kernels.moe_gate_input(o, w_o, h, norm, 1e-6, gate, 8, bias, *args)
    with pytest.raises(
        ValueError, match=r"o \[T, H \* kv_lora\], h, h_out, x_out \[T, D\] and post_norm \[D\] disagree"
    ):
        cpu_kernels.moe_gate_input(o, w_o, h, randn(gen, 15), 1e-6, gate, 8, bias, *args)
    with pytest.raises(ValueError, match=r"moe_gate_input: w_o: panels must be"):
        cpu_kernels.moe_gate_input(randn(gen, 3, 24), w_o, h, norm, 1e-6, gate, 8, bias, *args)
    with pytest.raises(ValueError, match="moe_gate_input: bias must have one value per expert"):
        cpu_kernels.moe_gate_input(o, w_o, h, norm, 1e-6, gate, 8, randn(gen, 9), *args)


def test_dense_layer_output_rejects_mismatched_shapes():
    gen = torch.Generator().manual_seed(14)
    o, h, norm = randn(gen, 3, 32), randn(gen, 3, 16), randn(gen, 16)
    w_o = cpu_kernels.pack_panels(randn(gen, 32, 16))
    gate_up, down = cpu_kernels.pack_panels(randn(gen, 16, 24)), cpu_kernels.pack_panels(randn(gen, 12, 16))
    assert cpu_kernels.dense_layer_output(o, w_o, h, norm, 1e-6, gate_up, down, 12).shape == (3, 16)
    with pytest.raises(ValueError, match=r"dense_layer_output: o \[T, H \* kv_lora\], h, .* disagree"):
        cpu_kernels.dense_layer_output(o, w_o, randn(gen, 2, 16), norm, 1e-6, gate_up, down, 12)
    with pytest.raises(ValueError, match="dense_layer_output: down: panels must be"):
        cpu_kernels.dense_layer_output(o, w_o, h, norm, 1e-6, gate_up, down, 10)
