"""SP prefill execution: any CDSP chunk plan (chunk counts, group sizes, ring / Ulysses per chunk) gives the KV cache
and first-token logits of a single-instance prefill; zigzag and cache balancing keep the work even."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.models import load_model, prefill_forward
from nanocp.prefill.instance import PrefillExecError, Wait
from nanocp.prefill.sp_exec import ChunkSpec, SpPrefillExecutor, balance_plan, drive, zigzag_segments

MODEL = load_model("tiny")
NUM_INSTANCES = 6
CAPACITY = 192
ATOL = 2e-5


@pytest.fixture(scope="module")
def executor():
    return SpPrefillExecutor(MODEL, NUM_INSTANCES, CAPACITY)


@st.composite
def chunk_plans(draw, nested: bool = True):
    """A prompt and a chunk plan: nested, strictly growing groups (what the CDSP planner makes) or any groups."""
    length = draw(st.integers(1, CAPACITY))
    n_chunks = draw(st.integers(1, min(4, length)))
    cuts = (
        sorted(draw(st.sets(st.integers(1, length - 1), min_size=n_chunks - 1, max_size=n_chunks - 1)))
        if n_chunks > 1
        else []
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, length])]
    order = draw(st.permutations(range(NUM_INSTANCES)))
    chunks, group_size = [], 0
    for tokens in sizes:
        if nested:
            group_size = draw(st.integers(min(group_size + 1, NUM_INSTANCES), NUM_INSTANCES))
            group = tuple(order[:group_size])
        else:
            group = tuple(draw(st.lists(st.integers(0, NUM_INSTANCES - 1), min_size=1, max_size=5, unique=True)))
        chunks.append(ChunkSpec(tokens, group, draw(st.sampled_from(["ring", "ulysses"]))))
    seed = draw(st.integers(0, 2**31 - 1))
    tokens = torch.randint(0, MODEL.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    return tokens, chunks


def check_against_reference(executor: SpPrefillExecutor, tokens: torch.Tensor, chunks: list[ChunkSpec]) -> None:
    reference = prefill_forward(MODEL, tokens)
    results = executor.run_plan("r", tokens, chunks)
    try:
        torch.testing.assert_close(executor.gather_kv("r"), reference.kv, atol=ATOL, rtol=1e-5)
        assert all(r.logits is None for r in results[:-1])
        torch.testing.assert_close(results[-1].logits, reference.logits[-1], atol=ATOL, rtol=1e-5)
        # The chunks' new rows (what the hand-off streams to decode) cover every position once, with its KV.
        covered = torch.zeros(tokens.numel(), dtype=torch.int64)
        for result in results:
            for run in result.runs:
                covered[run.start : run.start + run.tokens] += 1
                torch.testing.assert_close(
                    run.kv, reference.kv[:, run.start : run.start + run.tokens], atol=ATOL, rtol=0
                )
        assert bool((covered == 1).all())
        # After the last chunk the rows sit on its group only, spread within 2 rows (history +-1, zigzag +-1).
        held = executor.holdings("r")
        assert set(held) == set(chunks[-1].instances) and sum(held.values()) == tokens.numel()
        assert max(held.values()) - min(held.values()) <= 2
    finally:
        executor.finish("r")


@settings(max_examples=30, deadline=None)
@given(chunk_plans(nested=True))
def test_cdsp_plans_match_single_instance_prefill(executor, plan):
    check_against_reference(executor, *plan)


@settings(max_examples=15, deadline=None)
@given(chunk_plans(nested=False))
def test_any_group_sequence_matches_single_instance_prefill(executor, plan):
    """Groups that shrink or move (holders outside the group hand over everything) still give the same KV."""
    check_against_reference(executor, *plan)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_sp_size_above_chunk_tokens_and_heads(executor, attention):
    """Six members for 5 tokens (empty zigzag shares) and for 4 heads (members without heads in Ulysses)."""
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    check_against_reference(
        executor, tokens, [ChunkSpec(5, tuple(range(6)), attention), ChunkSpec(35, tuple(range(6)), attention)]
    )


@given(st.integers(0, 500), st.integers(1, 16))
def test_zigzag_split_is_even(tokens, size):
    segments = zigzag_segments(tokens, size)
    positions = sorted(p for member in segments for a, b in member for p in range(a, b))
    assert positions == list(range(tokens))
    counts = [sum(b - a for a, b in member) for member in segments]
    assert max(counts) - min(counts) <= 1
    for member in segments:
        assert member == sorted(member)
    if tokens % (2 * size) == 0:  # whole segments: every member has exactly the same causal work
        work = [sum(p + 1 for a, b in member for p in range(a, b)) for member in segments]
        assert len(set(work)) == 1


@given(
    st.dictionaries(st.integers(0, 15), st.integers(0, 300), max_size=8),
    st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True),
)
def test_balance_plan_spreads_history_evenly_with_fewest_moves(holdings, group):
    plan = balance_plan(holdings, group)
    total = sum(holdings.values())
    assert set(plan.targets) == set(group) and sum(plan.targets.values()) == total
    assert max(plan.targets.values()) - min(plan.targets.values()) <= 1
    after = dict(holdings)
    for src, dst, count in plan.moves:
        assert count > 0 and dst in group
        after[src] = after.get(src, 0) - count
        after[dst] = after.get(dst, 0) + count
    assert all(after.get(i, 0) == plan.targets.get(i, 0) for i in set(after) | set(plan.targets))
    moved = sum(count for _, _, count in plan.moves)
    assert moved == sum(max(0, n - plan.targets.get(i, 0)) for i, n in holdings.items())


def test_timing_reports_a_critical_path_latency():
    timed = SpPrefillExecutor(MODEL, 4, 128, timing=True)
    tokens = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(5))
    results = timed.run_plan("t", tokens, [ChunkSpec(64, (0, 1)), ChunkSpec(64, (0, 1, 2, 3), "ulysses")])
    assert all(r.latency_s is not None and r.latency_s > 0 for r in results)


def test_bad_chunks_are_rejected(executor):
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    executor.start("bad", tokens)
    try:
        with pytest.raises(ValueError, match="distinct"):
            executor.run_chunk("bad", ChunkSpec(5, (1, 1)))
        with pytest.raises(ValueError, match="outside"):
            executor.run_chunk("bad", ChunkSpec(5, (0, NUM_INSTANCES)))
        with pytest.raises(ValueError, match="attention mode"):
            executor.run_chunk("bad", ChunkSpec(5, (0,), "tree"))
        with pytest.raises(ValueError, match="left to prefill"):
            executor.run_chunk("bad", ChunkSpec(21, (0,)))
        with pytest.raises(ValueError, match="already in prefill"):
            executor.start("bad", tokens)
    finally:
        executor.finish("bad")
    with pytest.raises(ValueError, match="capacity"):
        executor.start("long", torch.zeros(CAPACITY + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="vocabulary"):
        executor.start("oov", torch.tensor([MODEL.config.vocab_size]))
    with pytest.raises(ValueError, match="cover"):
        executor.run_plan("short", tokens, [ChunkSpec(10, (0,))])
    with pytest.raises(KeyError):
        executor.run_chunk("missing", ChunkSpec(1, (0,)))


def test_the_driver_raises_on_a_deadlock_instead_of_hanging(executor):
    def stuck():
        yield Wait([(0, 10**9)])  # a flag nobody will ever set

    with pytest.raises(PrefillExecError, match="deadlocked"):
        drive({0: stuck(), 1: stuck()}, executor.instances, None)
