"""Graph engine: bucket choice, the shared static pool and its per-bucket views, injection, the report."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.graphs import BucketFamily, BucketShape, FieldSpec, GraphEngine, PoolLayout, geometric_ladder

LADDERS = dict(moe_batch=(1, 2, 4, 8), remote=(0, 2, 8), max_blocks=(1, 4, 16))
FAMILY = BucketFamily.grid(**LADDERS)


def shapes(max_m=10, max_r=10, max_b=20):
    """Shapes as a lowered routing table produces them: shard rows = MoE rows + received queries."""
    return st.builds(
        lambda m, q, r, b: BucketShape(m, m + q, q, r, b),
        st.integers(0, max_m),
        st.integers(0, max_r),
        st.integers(0, max_r),
        st.integers(0, max_b),
    )


@settings(max_examples=200, deadline=None)
@given(shape=shapes())
def test_pick_bucket_is_the_smallest_covering_bucket(shape):
    picked = FAMILY.pick(shape)
    covering = [b for b in FAMILY if b.covers(shape)]
    if not covering:
        assert picked is None
        return
    assert picked is not None and picked.covers(shape)
    # component-wise least: every covering bucket is at least as large in every dimension
    for other in covering:
        assert other.covers(picked), f"{other} covers {shape} but not the picked {picked}"
    # and the picked bucket is what the three ladders give on their own
    want_m = min(m for m in LADDERS["moe_batch"] if m >= shape.moe_batch)
    want_r = min(r for r in LADDERS["remote"] if r >= max(shape.q_recv, shape.res_recv))
    want_b = min(b for b in LADDERS["max_blocks"] if b >= shape.max_blocks)
    assert picked == BucketShape(want_m, want_m + want_r, want_r, want_r, want_b)


def test_shapes_beyond_the_family_have_no_bucket_and_bad_families_are_rejected():
    assert FAMILY.pick(BucketShape(9, 9, 0, 0, 1)) is None  # MoE batch above the ladder
    assert FAMILY.pick(BucketShape(1, 1, 0, 0, 17)) is None  # block table wider than any bucket
    assert FAMILY.pick(BucketShape(1, 10, 9, 0, 1)) is None  # more received queries than any bucket
    assert len(FAMILY) == 4 * 3 * 3 and FAMILY.upper == BucketShape(8, 16, 8, 8, 16)
    with pytest.raises(ValueError, match="moe_batch ladder"):
        BucketFamily.grid(moe_batch=(0, 2), remote=(0,), max_blocks=(1,))
    with pytest.raises(ValueError, match=">= 0"):
        BucketShape(-1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="repeat"):
        BucketFamily((BucketShape(1, 1, 0, 0, 1), BucketShape(1, 1, 0, 0, 1)))
    assert geometric_ladder(10, 2) == (1, 2, 4, 8, 10) and geometric_ladder(8, 4, zero=True) == (0, 1, 4, 8)


FIELDS = [
    FieldSpec("index", ("moe_batch",), torch.int64, injected=True, pad=-1),
    FieldSpec("table", ("shard_rows", "max_blocks"), torch.int32, injected=True, pad=7),
    FieldSpec("flags", ("moe_batch",), torch.bool, injected=True, pad=False),
    FieldSpec("payload", ("q_recv", "heads", 3), torch.float32),
    FieldSpec("half", ("res_recv", 5), torch.bfloat16),
]


def make_engine(family=FAMILY) -> GraphEngine:
    return GraphEngine(family, FIELDS, constants={"heads": 2})


def test_one_pool_sized_by_the_upper_bounds_holds_every_bucket():
    engine = make_engine()
    upper = {**FAMILY.upper.sizes(), "heads": 2}
    assert engine.pool.nbytes == PoolLayout(FIELDS, upper).nbytes
    assert engine.pool.nbytes >= sum(f.nbytes(upper) for f in FIELDS)
    base = engine.pool.storage.data_ptr()
    end = base + engine.pool.nbytes
    slots = engine.layout.slots
    for bucket, ctx in engine.contexts.items():
        sizes = {**bucket.sizes(), "heads": 2}
        for f in FIELDS:
            view = ctx[f.name]
            assert view.shape == f.shape(sizes) and view.dtype == f.dtype and view.is_contiguous()
            # every bucket's view starts at the field's own range of the one pool
            assert view.untyped_storage().data_ptr() == engine.pool.storage.untyped_storage().data_ptr()
            if view.numel():
                assert view.data_ptr() == base + slots[f.name].offset
                assert view.data_ptr() + view.numel() * view.element_size() <= end
    # ranges of different fields do not overlap
    ranges = sorted((s.offset, s.offset + s.nbytes) for s in slots.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges))


@settings(max_examples=25, deadline=None)
@given(shape=shapes(8, 8, 16), seed=st.integers(0, 2**16))
def test_injection_writes_real_rows_and_padding_into_the_static_views(shape, seed):
    engine = make_engine()
    bucket = engine.pick_bucket(shape)
    ctx = engine.context(bucket)
    g = torch.Generator().manual_seed(seed)
    ctx["index"].copy_(torch.randint(0, 100, ctx["index"].shape, generator=g))  # stale values from an earlier use
    staging = engine.begin_injection(ctx)
    assert (staging["index"] == -1).all() and (staging["table"] == 7).all() and not staging["flags"].any()
    real_index = torch.randint(0, 50, (shape.moe_batch,), generator=g)
    real_table = torch.randint(0, 50, (shape.shard_rows, shape.max_blocks), generator=g, dtype=torch.int32)
    staging["index"][: shape.moe_batch] = real_index
    staging["table"][: shape.shard_rows, : shape.max_blocks] = real_table
    staging["flags"][: shape.moe_batch] = True
    ptrs = {name: t.data_ptr() for name, t in ctx.tensors.items()}
    engine.inject(ctx)
    assert {name: t.data_ptr() for name, t in ctx.tensors.items()} == ptrs
    assert torch.equal(ctx["index"][: shape.moe_batch], real_index)
    assert (ctx["index"][shape.moe_batch :] == -1).all()
    assert torch.equal(ctx["table"][: shape.shard_rows, : shape.max_blocks], real_table)
    assert (ctx["table"][shape.shard_rows :] == 7).all() and (ctx["table"][:, shape.max_blocks :] == 7).all()
    assert int(ctx["flags"].sum()) == shape.moe_batch


def test_run_calls_pieces_eagerly_on_cpu_and_the_report_counts_graphs_and_bytes():
    engine = make_engine()
    seen = []
    engine.register_pieces(["a", "b"])
    ctx = engine.context(FAMILY.buckets[5])
    engine.run(ctx, "a", lambda c: seen.append(("a", c.bucket)))
    engine.run(ctx, "b", lambda c: c["payload"].fill_(3.0))
    assert seen == [("a", ctx.bucket)] and (ctx["payload"] == 3.0).all()
    report = engine.report()
    assert report.mode == "eager-replay" and report.captured == 0
    assert report.buckets == len(FAMILY) and report.pieces == 2 and report.graphs == 2 * len(FAMILY)
    assert report.pool_bytes == engine.pool.nbytes and set(report.field_bytes) == {f.name for f in FIELDS}
    assert engine.capture_all({"a": lambda c: None}) == 0  # nothing to capture without CUDA
    with pytest.raises(ValueError, match="CUDA"):
        GraphEngine(FAMILY, FIELDS, constants={"heads": 2}, use_cuda_graphs=True)
    with pytest.raises(ValueError, match="unknown dimension"):
        GraphEngine(FAMILY, FIELDS)  # "heads" is not defined
    with pytest.raises(ValueError, match="not a bucket"):
        engine.context(BucketShape(3, 3, 0, 0, 1))
