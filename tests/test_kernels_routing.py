"""Triton routing kernels against the torch reference, run on CPU by Triton's interpreter.

TRITON_INTERPRET=1 must be in the environment before our kernel module is imported: `triton.jit` reads it when it
decorates a kernel, to choose between a compiled kernel (needs a GPU) and the interpreter (runs the kernel body
with numpy on CPU tensors); a kernel decorated without it stays compiled. So it is set at the very top of this
module, before anything imports triton or the kernels, and the test skips if the kernels were decorated earlier
(in this process) without it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import tolerances as tol  # noqa: E402
import torch  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanocp.data_plane.kernels import TorchRoutingKernels, select_routing_kernels  # noqa: E402
from nanocp.models import merge_attention_partials  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed")
from nanocp.data_plane.kernels import triton_routing  # noqa: E402
from nanocp.data_plane.kernels.triton_routing import TritonRoutingKernels  # noqa: E402

if not torch.cuda.is_available() and type(triton_routing._merge_routed_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the kernels were decorated without TRITON_INTERPRET=1 and there is no GPU", allow_module_level=True)

# the interpreter evaluates log(0) = -inf (a row without parts) with numpy, which warns about it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
REF, TRI = TorchRoutingKernels(), TritonRoutingKernels()
DTYPES = [torch.float32, torch.bfloat16]
CASES = settings(max_examples=12, deadline=None)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype, g) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def ints(high: int, n: int, g) -> torch.Tensor:
    return torch.randint(0, max(high, 1), (n,), generator=g).to(DEVICE)


@CASES
@given(rows=st.integers(1, 9), n=st.integers(0, 12), heads=st.integers(1, 3), dim=st.integers(1, 300),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_gather_rows_is_index_select(rows, n, heads, dim, dtype, seed):
    g = gen(seed)
    src, index = rand((rows, heads, dim), dtype, g), ints(rows, n, g)
    out = torch.full((n, heads, dim), 7.0, dtype=dtype, device=DEVICE)
    assert torch.equal(TRI.gather_rows(src, index, out=out), src.index_select(0, index))
    assert torch.equal(out, src.index_select(0, index))


@CASES
@given(rows=st.integers(1, 12), heads=st.integers(1, 3), dim=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_scatter_rows_is_index_copy(rows, heads, dim, dtype, seed):
    g = gen(seed)
    n = int(torch.randint(0, rows + 1, (1,), generator=g))
    index = torch.randperm(rows, generator=g)[:n].to(DEVICE)  # distinct rows: the result is defined
    dst, src = rand((rows, heads, dim), dtype, g), rand((n, heads, dim), dtype, g)
    expected = dst.clone().index_copy_(0, index, src)
    assert torch.equal(TRI.scatter_rows(dst, index, src), expected)
    assert torch.equal(dst, expected)


@CASES
@given(rows_a=st.integers(1, 6), rows_b=st.integers(0, 6), n=st.integers(0, 12), dim=st.integers(1, 300),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_gather_two_reads_both_sources(rows_a, rows_b, n, dim, dtype, seed):
    g = gen(seed)
    a, b = rand((rows_a, 2, dim), dtype, g), rand((rows_b, 2, dim), dtype, g)
    index = ints(rows_a + rows_b, n, g)
    expected = REF.gather_two(a, b, index)
    assert torch.equal(TRI.gather_two(a, b, index), expected)
    assert torch.equal(expected, torch.cat([a, b]).index_select(0, index))


@CASES
@given(rows=st.integers(1, 8), n=st.integers(0, 10), heads=st.integers(1, 4), dv=st.integers(1, 300),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_pack_partials_appends_lse(rows, n, heads, dv, dtype, seed):
    g = gen(seed)
    o, lse = rand((rows, heads, dv), dtype, g), rand((rows, heads), torch.float32, g)
    lse[0, 0] = float("-inf")  # an empty shard's partial
    index = ints(rows, n, g)
    packed = TRI.pack_partials(o, lse, index)
    assert packed.dtype == torch.float32 and packed.shape == (n, heads, dv + 1)
    assert torch.equal(packed, REF.pack_partials(o, lse, index))
    assert torch.equal(packed[..., :dv], o.float().index_select(0, index))
    assert torch.equal(packed[..., dv], lse.index_select(0, index))


def random_merge_case(g, s, r, n, k, heads, dv, dtype):
    """Local partials (some shards empty), received rows, and an index [n, k] naming distinct parts (-1 = none)."""
    o, lse = rand((s, heads, dv), dtype, g), rand((s, heads), torch.float32, g) * 4
    res = torch.cat([rand((r, heads, dv), torch.float32, g), rand((r, heads, 1), torch.float32, g) * 4], dim=-1)
    if s:
        empty = torch.rand(s, generator=g) < 0.2
        lse[empty.to(DEVICE)] = float("-inf")
        o[empty.to(DEVICE)] = 0
    index = torch.full((n, k), -1, dtype=torch.int64)
    for row in range(n):
        parts = torch.randperm(s + r, generator=g)[: int(torch.randint(0, k + 1, (1,), generator=g))]
        index[row, : len(parts)] = parts
    return o, lse, res, index.to(DEVICE)


@CASES
@given(s=st.integers(0, 6), r=st.integers(0, 6), n=st.integers(0, 6), k=st.integers(1, 4), heads=st.integers(1, 3),
       dv=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
@example(s=0, r=2, n=1, k=2, heads=1, dv=4, dtype=torch.bfloat16, seed=0)  # bf16 outputs 2 ulps apart (interpreter)
@example(s=0, r=0, n=0, k=1, heads=1, dv=1, dtype=torch.float32, seed=0)  # nothing to merge
def test_merge_routed_matches_merge_attention_partials(s, r, n, k, heads, dv, dtype, seed):
    o, lse, res, index = random_merge_case(gen(seed), s, r, n, k, heads, dv, dtype)
    ref_o, ref_lse = REF.merge_routed(o, lse, res, index)
    tri_o, tri_lse = TRI.merge_routed(o, lse, res, index)
    assert tri_o.dtype == o.dtype and tri_lse.dtype == torch.float32
    assert torch.equal(torch.isinf(tri_lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    # two fp32 evaluations of the same merge, each within its bound (tests/tolerances.py; the parts' o as both read
    # them: received rows in o's dtype). bf16: torch converts to it rounding to nearest (2^-8 relatively), Triton's
    # interpreter by truncating (up to 1 ulp, 2^-7): the received rows' conversion moves o by up to 2^-7 sum w_k |o_k|,
    # the outputs' by 2^-7 + 2^-8 of |o|
    dv_ = o.shape[-1]
    parts_o = torch.cat([o.float(), res[..., :dv_].to(dtype).float(), o.new_zeros(1, heads, dv_).float()]).cpu()
    parts_lse = torch.cat([lse.float(), res[..., dv_], lse.new_full((1, heads), float("-inf"))]).cpu()
    parts = torch.where(index < 0, parts_o.shape[0] - 1, index).T.cpu()  # [K, N]
    want = tol.merge(parts_o[parts], parts_lse[parts])
    tol.assert_within(tri_lse.cpu(), ref_lse.cpu(), 2 * want.lse.err, "lse")
    bound = 2 * want.o.err
    if dtype != torch.float32:
        weighted = tol.merge(parts_o[parts].abs(), parts_lse[parts]).o.value  # sum_k w_k |o_k|
        bound = bound + 2.0**-7 * weighted + (2.0**-7 + 2.0**-8) * (want.o.value.abs() + want.o.err)
    tol.assert_within(tri_o.float().cpu(), ref_o.float().cpu(), bound, "o")
    assert not tri_o[~finite].any(), "a row without parts must merge to zeros"


def test_merge_routed_reference_is_the_plain_merge():
    """The reference itself: a row with parts (local a, received b) equals merge_attention_partials of the two."""
    g = gen(3)
    o, lse, res, _ = random_merge_case(g, 3, 2, 0, 1, 2, 8, torch.float32)
    index = torch.tensor([[1, 3 + 0], [2, -1], [-1, -1]], device=DEVICE)
    merged, merged_lse = REF.merge_routed(o, lse, res, index)
    parts_o = torch.stack([o[1], res[0, :, :8]])
    parts_lse = torch.stack([lse[1], res[0, :, 8]])
    want_o, want_lse = merge_attention_partials(parts_o, parts_lse)
    assert torch.equal(merged[0], want_o) and torch.equal(merged_lse[0], want_lse)
    assert torch.equal(merged[1], o[2]) and torch.equal(merged_lse[1], lse[2])
    assert not merged[2].any() and bool((merged_lse[2] == float("-inf")).all())


def test_kernels_reject_int32_indices_and_selector_falls_back_on_cpu():
    src = torch.randn(4, 3)
    with pytest.raises(TypeError, match="int64"):
        TRI.gather_rows(src, torch.tensor([0, 1], dtype=torch.int32))
    assert select_routing_kernels("cpu").name == "torch"
