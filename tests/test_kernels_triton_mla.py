"""The Triton paged MLA decode kernel against the exact attention, within the bound of its own arithmetic: each
split is an online softmax over its KV range (tolerances.attention with the kernel's chunk of BLOCK_N rows), the
splits merged by models.merge_attention_partials (tolerances.merge). Run on CPU by Triton's interpreter (CI), on
the GPU compiled (the GPU check sets TRITON_INTERPRET=0).

TRITON_INTERPRET=1 must be in the environment before the kernel module is imported (tests/test_kernels_routing.py
says why)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import tolerances as tol  # noqa: E402
import torch  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")
from nanocp.data_plane.backends import (
    Backends,  # noqa: E402
    triton_mla,  # noqa: E402
)
from nanocp.data_plane.backends.triton_mla import TritonMLAAttention, triton_mla_unavailable_reason  # noqa: E402
from nanocp.models import mla_paged_attention_with_lse  # noqa: E402

if not torch.cuda.is_available() and type(triton_mla._mla_decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the kernel was decorated without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
BF16_U = 2.0**-8  # bf16 unit roundoff (8 significand bits): torch's rounding to nearest
BF16_ULP = 2.0**-7  # one bf16 ulp, relative: the kernel's rounding of p (Triton's interpreter truncates)


def expected(q, kv_pages, block_table, lens, scale, v_dim, attention: TritonMLAAttention) -> tol.Attention:
    """The exact result and the bound of the kernel's evaluation: per split an online softmax (chunks of BLOCK_N
    rows), then the merge of the splits. bf16 inputs add the rounding of each probability before the value product
    (relative BF16_ULP on every term of acc) and of o to bf16 (BF16_U)."""
    (shards, blocks), page = block_table.shape, kv_pages.shape[1]
    heads = q.shape[1]
    splits, split_len = attention.split_plan(shards, heads, blocks * page, q.dtype, torch.device(DEVICE))
    kv = kv_pages.float().cpu()[block_table.long().cpu().clamp(min=0)].reshape(shards, blocks * page, q.shape[-1])
    qf, lens = q.float().cpu(), lens.cpu()
    parts = []
    for k in range(splits):
        lo = k * split_len
        seg_lens = (lens - lo).clamp(min=0, max=split_len)
        part = tol.attention(qf, kv[:, lo : lo + split_len], seg_lens, scale, v_dim, chunk=attention.block_n(q.dtype))
        if q.dtype != torch.float32:
            rows = torch.arange(kv[:, lo : lo + split_len].shape[1])[None, :] < seg_lens[:, None]  # [S, n]
            probs = torch.softmax(
                torch.einsum("shd,snd->shn", qf.double(), kv[:, lo : lo + split_len].double()) * scale
                + torch.where(rows, 0.0, float("-inf"))[:, None, :].double(),
                dim=-1,
            ).nan_to_num(0.0)
            pv = torch.einsum("shn,snc->shc", probs, kv[:, lo : lo + split_len, :v_dim].double().abs())
            part.o.err += BF16_ULP * pv
        parts.append(part)
    o = tol.Bounded(torch.stack([p.o.value for p in parts]), torch.stack([p.o.err for p in parts]))
    lse = tol.Bounded(torch.stack([p.lse.value for p in parts]), torch.stack([p.lse.err for p in parts]))
    merged = tol.merge(o, lse)
    if q.dtype != torch.float32:
        merged.o.err += BF16_U * merged.o.mag
    return merged


def check(q, kv_pages, block_table, lens, scale, v_dim, attention=None) -> None:
    attention = attention or TritonMLAAttention()
    o, lse = attention(q, kv_pages, block_table, lens, scale, v_dim)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    want = expected(q, kv_pages, block_table, lens, scale, v_dim, attention)
    tol.assert_within(lse.cpu(), want.lse.value, want.lse.err, "lse")
    tol.assert_within(o.float().cpu(), want.o.value, want.o.err, "o")
    empty = lens.cpu() == 0
    assert bool((lse.cpu()[empty] == float("-inf")).all()) and not o.cpu()[empty].any()


def randn(gen, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@settings(max_examples=15, deadline=None)
@given(
    shards=st.integers(0, 4),
    heads=st.sampled_from([1, 4, 17]),
    dims=st.sampled_from([(80, 64), (48, 32), (32, 32), (576, 512)]),
    page=st.sampled_from([1, 4, 16]),
    blocks=st.integers(1, 6),
    programs=st.sampled_from([1, 3, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
@example(shards=3, heads=17, dims=(80, 64), page=4, blocks=6, programs=64, dtype=torch.float32, seed=1)
def test_triton_mla_equals_the_exact_attention(shards, heads, dims, page, blocks, programs, dtype, seed):
    """Random pages and block tables (entries past a shard's length are junk: never read), lengths 0..B * page,
    one split or many (`programs`), more heads than one program's block."""
    dqk, v_dim = dims
    gen = torch.Generator().manual_seed(seed)
    pages = 2 * blocks + 3
    kv_pages = randn(gen, pages, page, dqk, dtype=dtype)
    block_table = torch.randint(0, pages, (shards, blocks), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, blocks * page + 1, (shards,), generator=gen)
    for s in range(shards):  # junk past the shard's pages: must never be read
        block_table[s, (int(lens[s]) + page - 1) // page :] = -(10**6)
    q = randn(gen, shards, heads, dqk, dtype=dtype)
    check(q, kv_pages, block_table.to(DEVICE), lens.to(DEVICE), 0.3, v_dim, TritonMLAAttention(programs))


def test_the_plan_splits_to_fill_the_machine_and_covers_every_token():
    att = TritonMLAAttention(programs=264)
    dev = torch.device("cpu")
    # 264 programs / 8 head blocks = 33 splits; 4096 tiles of 32 tokens over 33 splits: 125 tiles each
    assert att.split_plan(1, 128, 131072, torch.bfloat16, dev) == (33, 125 * 32)
    for shards, heads, max_len in [(1, 1, 1), (256, 128, 4096), (3, 16, 1000), (0, 4, 64)]:
        splits, split_len = att.split_plan(shards, heads, max_len, torch.float32, dev)
        assert splits >= 1 and split_len % att.block_n(torch.float32) == 0
        assert (splits - 1) * split_len < max(max_len, 1) <= splits * split_len


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 2, 8, device=DEVICE)
    kv = torch.zeros(3, 4, 8, device=DEVICE)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="v_dim"):
        TritonMLAAttention()(q, kv, table, lens, 0.1, 9)
    with pytest.raises(ValueError, match="KV cache"):
        TritonMLAAttention()(q, kv.double(), table, lens, 0.1, 4)
    with pytest.raises(ValueError, match="programs"):
        TritonMLAAttention(programs=0)


def test_it_agrees_with_the_reference_and_is_picked_on_cuda_without_flashmla():
    gen = torch.Generator().manual_seed(5)
    kv_pages, q = randn(gen, 9, 4, 80), randn(gen, 3, 4, 80)
    table = torch.randint(0, 9, (3, 3), generator=gen, dtype=torch.int32).to(DEVICE)
    lens = torch.tensor([12, 0, 5], device=DEVICE)
    o, lse = TritonMLAAttention(programs=4)(q, kv_pages, table, lens, 0.2, 64)
    ref_o, ref_lse = mla_paged_attention_with_lse(q, kv_pages, table, lens, 0.2, 64)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)  # both within their bounds (above) of the same value
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    assert "not CUDA" in triton_mla_unavailable_reason("cpu")
    if torch.cuda.is_available():
        assert Backends.detect("cuda", 16, torch.float32).describe()["attention"] == "triton-mla"


def test_decode_instances_running_it_give_the_reference_tokens(monkeypatch):
    """The instances' eager path with the kernel as their shard attention (what Backends.detect picks on a GPU
    without FlashMLA): the same greedy tokens as the CPU backends, CP shards included."""
    from nanocp import LLM, SamplingParams
    from nanocp.control_plane import CPBucketTable

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [2, 7, 1, 8]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=2, cp_buckets=CPBucketTable((24, 10**9), (1, 2)), page_size=8)
    with LLM("tiny", **kwargs) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    detect = Backends.detect.__func__

    def with_triton_mla(cls, device, page_size, dtype):
        backends = detect(cls, device, page_size, dtype)
        backends.attention = TritonMLAAttention(programs=4)
        return backends

    monkeypatch.setattr(Backends, "detect", classmethod(with_triton_mla))
    with LLM("tiny", device=DEVICE, **kwargs) as llm:
        assert llm.engine.cluster.instances[0].backends.describe()["attention"] == "triton-mla"
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
