"""Control-plane behaviour: page table, WaterFill, scheduler invariants, NanoCP's own examples, multi-step windows,
block-table slots and incremental tables, bad input."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.control_plane import (
    ClusterSpec,
    CPBucketTable,
    GlobalPageTable,
    GlobalScheduler,
    RoutingTables,
    SchedulerError,
    StalePlanError,
    waterfill,
)
from nanocp.control_plane.reference import parse_policy

BACKENDS = ["python"]
try:  # the C++ core is tested whenever it is built (it always is by `make test`)
    from nanocp.control_plane import _core

    if hasattr(_core, "SchedulerCore"):
        BACKENDS.append("cpp")
except ImportError:
    pass

CPP_POLICIES = {"nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp", "medha", "csps"}
POLICIES = ["nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp:2", "medha:24", "csps:40"]


def imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean - 1 if mean else 0.0


# ------------------------------------------------------------------ page table


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=60), st.randoms())
def test_page_table_never_double_allocates(ops, rnd):
    spec = ClusterSpec(2, 2, kv_capacity_tokens=40, page_size=4)  # 10 frames per instance
    table = GlobalPageTable(spec)
    owned: list[list[int]] = []
    for instance, n in ops:
        if owned and rnd.random() < 0.3:
            table.free(owned.pop(rnd.randrange(len(owned))))
            continue
        if n > table.free_frames(instance):
            with pytest.raises(SchedulerError):
                table.alloc(instance, n)
            continue
        owned.append(table.alloc(instance, n))
    frames = [table.lookup(p) for pages in owned for p in pages]
    assert len(frames) == len(set(frames)), "a physical frame is mapped twice"
    for i in range(4):
        used = sum(1 for inst, _ in frames if inst == i)
        assert used + table.free_frames(i) == spec.frames_per_instance
    for pages in owned:
        table.free(pages)
    assert table.used_pages() == 0
    with pytest.raises(SchedulerError):
        table.free(owned[0] if owned and owned[0] else [0])


# ------------------------------------------------------------------ WaterFill


def brute_force_peak(loads: list[int], total: int) -> int:
    best = None
    for split in itertools.product(range(total + 1), repeat=len(loads)):
        if sum(split) == total:
            peak = max(load + x for load, x in zip(loads, split))
            best = peak if best is None else min(best, peak)
    return best


@given(st.lists(st.integers(0, 12), min_size=1, max_size=4), st.integers(0, 14))
def test_waterfill_is_optimal(loads, total):
    x = waterfill(loads, total)
    assert sum(x) == total and all(v >= 0 for v in x)
    assert max(load + v for load, v in zip(loads, x)) == brute_force_peak(loads, total)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=8), st.integers(0, 10**6))
def test_waterfill_large_values_level(loads, total):
    x = waterfill(loads, total)
    after = [load + v for load, v in zip(loads, x)]
    assert sum(x) == total
    # Receivers end within one token of each other, and nobody left out sits more than one token below them.
    filled = [a for v, a in zip(x, after) if v > 0]
    if filled:
        assert max(filled) - min(filled) <= 1
        assert all(v > 0 or a >= max(filled) - 1 for v, a in zip(x, after))


def test_waterfill_rejects_bad_input():
    with pytest.raises(ValueError):
        waterfill([], 3)
    with pytest.raises(ValueError):
        waterfill([1], -1)


# ------------------------------------------------------------------ scheduler invariants under random workloads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_workload_keeps_invariants(backend, policy, seed):
    rnd = random.Random(seed)
    spec = ClusterSpec(2, 2, kv_capacity_tokens=rnd.choice([64, 128, 512]), page_size=rnd.choice([4, 8, 16]))
    if backend == "cpp" and policy.split(":")[0] not in CPP_POLICIES:
        pytest.skip(f"the C++ core does not implement {policy} yet")
    buckets = CPBucketTable((rnd.randint(1, 100), 10**9), (1, rnd.randint(1, 3)))
    sched = GlobalScheduler(spec, policy, cp_buckets=buckets, backend=backend)
    submitted, ended = set(), set()
    for step in range(60):
        for _ in range(rnd.randint(0, 3)):
            rid = f"r{len(submitted)}"
            try:
                sched.add_request(rid, rnd.randint(1, 150), rnd.randint(1, 30))
                submitted.add(rid)
            except SchedulerError:
                pass
        if submitted - ended and rnd.random() < 0.2:
            victim = rnd.choice(sorted(r for r in submitted - ended if r in sched))
            sched.finish(victim)
        plan = sched.step()
        ended |= set(plan.finished) | set(plan.rejected)
        sched.check_invariants()
        loads = sched.loads()
        assert all(ld.free_pages >= 0 for ld in loads)
        assert all(ld.kv_tokens <= spec.frames_per_instance * spec.page_size for ld in loads)
        for moe, split in plan.bindings.values():
            assert moe in split and all(t > 0 for t in split.values())
        assert plan.iteration == step
    for _ in range(5000):  # drain: every request ends, every page comes back
        if not (sched.num_running or sched.num_waiting):
            break
        plan = sched.step()
        ended |= set(plan.finished) | set(plan.rejected)
    plan = sched.step()
    ended |= set(plan.finished) | set(plan.rejected)
    assert ended == submitted, "a request was lost"
    assert all(ld.free_pages == spec.frames_per_instance and ld.kv_tokens == 0 for ld in sched.loads())


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_request_completes_with_exact_decode_count(backend):
    spec = ClusterSpec(1, 4, kv_capacity_tokens=4096, page_size=16)
    sched = GlobalScheduler(spec, "nanocp", backend=backend)
    rnd = random.Random(7)
    want = {f"r{i}": rnd.randint(1, 12) for i in range(30)}
    for rid, n in want.items():
        sched.add_request(rid, rnd.randint(10, 300), n)
    decoded = dict.fromkeys(want, 0)
    finished = set()
    while len(finished) < len(want):
        plan = sched.step()
        finished |= set(plan.finished)
        for rid in plan.batch:
            decoded[rid] += 1
    assert decoded == {rid: n - 1 for rid, n in want.items()}


# ------------------------------------------------------------------ growth, relocation, preemption


@pytest.mark.parametrize("backend", BACKENDS)
def test_growth_moves_to_another_instance_when_moe_instance_is_full(backend):
    spec = ClusterSpec(1, 2, kv_capacity_tokens=32, page_size=4)
    sched = GlobalScheduler(spec, "least-batch", backend=backend)
    sched.add_request("a", prompt_len=31, max_new_tokens=10)  # 31 + 1 fills instance 0 exactly
    plan = sched.step()
    assert plan.bindings["a"] == (0, {0: 32})
    plan = sched.step()  # instance 0 is full: the KV binding grows onto instance 1 and the MoE binding follows
    assert plan.bindings["a"] == (1, {0: 32, 1: 1})
    sched.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_cluster_preempts_most_recent_and_it_still_completes(backend):
    spec = ClusterSpec(1, 2, kv_capacity_tokens=32, page_size=4)
    sched = GlobalScheduler(spec, "least-batch", backend=backend)
    sched.add_request("old", prompt_len=20, max_new_tokens=40)
    sched.step()
    sched.add_request("new", prompt_len=20, max_new_tokens=40)
    preempted, finished, readmitted = [], set(), []
    for _ in range(200):
        plan = sched.step()
        preempted += plan.preempted
        finished |= set(plan.finished)
        readmitted += [a for a in plan.admitted if a.recompute]
        sched.check_invariants()
        if finished == {"old", "new"}:
            break
    assert preempted and preempted[0] == "new"
    assert readmitted and readmitted[0].rid == "new" and readmitted[0].context_len > 20
    assert finished == {"old", "new"}


# ------------------------------------------------------------------ NanoCP's behaviour on its own examples


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_requests_stay_local_long_request_is_split(backend):
    sched = GlobalScheduler(ClusterSpec(4, 8, kv_capacity_tokens=1_000_000, page_size=64), backend=backend)
    sched.add_request("long", prompt_len=512_000, max_new_tokens=800)
    for i in range(64):
        sched.add_request(f"s{i}", prompt_len=2048, max_new_tokens=100)
    plan = sched.step()
    moe, split = plan.bindings["long"]
    assert len(split) > 1 and sum(split.values()) == 512_001 and moe in split
    assert max(split.values()) - min(split.values()) <= 1
    assert all(len(plan.bindings[f"s{i}"][1]) == 1 for i in range(64))
    assert plan.cp_remote_shards == len(split) - 1


def figure4_loads(policy: str, backend: str) -> tuple[list[int], list[int]]:
    """Two instances; three long and many short requests arriving interleaved (cf. NanoCP Fig. 4)."""
    buckets = CPBucketTable((1000, 10**9), (1, 2))
    sched = GlobalScheduler(ClusterSpec(1, 2, 100_000, 16), policy, cp_buckets=buckets, backend=backend)
    arrivals = ["L", "S", "L", "L"] + ["S"] * 18
    for i, kind in enumerate(arrivals):
        sched.add_request(f"{kind}{i}", prompt_len=10_000 if kind == "L" else 100, max_new_tokens=50)
    sched.step()
    loads = sched.loads()
    return [ld.kv_tokens for ld in loads], [ld.moe_batch for ld in loads]


@pytest.mark.parametrize("backend", BACKENDS)
def test_figure4_dual_balance(backend):
    kv, batch = figure4_loads("nanocp", backend)
    assert imbalance(kv) < 0.02 and imbalance(batch) < 0.1, (kv, batch)
    kv, batch = figure4_loads("least-batch", backend)
    assert imbalance(kv) > 0.25 and imbalance(batch) < 0.1, (kv, batch)
    kv, batch = figure4_loads("least-cache", backend)
    assert imbalance(batch) > 0.5, (kv, batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rebalance_moves_moe_binding_inside_kv_binding(backend):
    buckets = CPBucketTable((100, 10**9), (1, 2))
    sched = GlobalScheduler(ClusterSpec(1, 2, 100_000, 16), "nanocp", cp_buckets=buckets, backend=backend)
    sched.add_request("long", prompt_len=5000, max_new_tokens=50)
    for i in range(4):
        sched.add_request(f"s{i}", prompt_len=50, max_new_tokens=50 if i % 2 else 3)
    sched.step()
    before = sched.loads()
    for _ in range(4):  # the two short requests on one instance finish: the long one's MoE binding moves
        plan = sched.step()
    after = [ld.moe_batch for ld in sched.loads()]
    assert max(after) - min(after) <= 1, (before, after)
    assert set(plan.bindings["long"][1]) == {0, 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_cp_splits_evenly_over_fixed_groups(backend):
    sched = GlobalScheduler(ClusterSpec(2, 4, 1_000_000, 64), "uniform-cp:4", backend=backend)
    sched.add_request("a", prompt_len=1001, max_new_tokens=5)
    sched.add_request("b", prompt_len=7, max_new_tokens=5)
    plan = sched.step()
    moe, split = plan.bindings["a"]
    assert set(split) == {0, 1, 2, 3} and sum(split.values()) == 1002
    assert set(plan.bindings["b"][1]) <= {4, 5, 6, 7}


# ------------------------------------------------------------------ lowering


@pytest.mark.parametrize("backend", BACKENDS)
def test_lowering_tables_are_consistent_with_bindings(backend):
    buckets = CPBucketTable((300, 10**9), (1, 4))
    spec = ClusterSpec(2, 4, 20_000, 16)
    sched = GlobalScheduler(spec, "nanocp", cp_buckets=buckets, backend=backend)
    rnd = np.random.default_rng(3)
    for i in range(40):
        sched.add_request(f"r{i}", int(rnd.integers(1, 3000)), int(rnd.integers(2, 20)))
    for _ in range(5):
        plan = sched.step()
        tables = [plan.routing(i) for i in range(spec.num_instances)]
        sent = {(i, int(m), int(d), int(r)) for i, t in enumerate(tables) for m, d, r in t.q_send}
        for j, t in enumerate(tables):
            for row, (src, shard) in enumerate(t.q_recv):
                assert t.shards[shard][1] == row
                batch_index = t.shards[shard][0]
                moe, _ = plan.bindings[plan.batch[batch_index]]
                assert src == moe
                moe_row = next(k for k, e in enumerate(tables[src].moe) if e[0] == batch_index)
                assert (src, moe_row, j, row) in sent
        for rid_index, rid in enumerate(plan.batch):
            moe, split = plan.bindings[rid]
            rows = [(i, s) for i, t in enumerate(tables) for s in t.shards if s[0] == rid_index]
            assert {i for i, _ in rows} == set(split)
            assert all(s[2] == split[i] for i, s in rows)
            assert sum(1 for e in tables[moe].moe if e[0] == rid_index) == 1
        for t in tables:
            assert t.shape.moe_batch == sched.loads()[t.instance].moe_batch


def test_stale_plan_is_an_error():
    sched = GlobalScheduler(ClusterSpec(1, 2, 1000, 8), backend="python")
    sched.add_request("a", 10, 5)
    plan = sched.step()
    sched.step()
    with pytest.raises(StalePlanError):
        _ = plan.bindings


def test_routing_table_rejects_corruption():
    sched = GlobalScheduler(ClusterSpec(1, 2, 1000, 8), backend="python")
    sched.add_request("a", 10, 5)
    table = sched.step().tables[0].copy()
    RoutingTables.parse(table)
    with pytest.raises(ValueError):
        RoutingTables.parse(table[:-1])
    table[0] ^= 1
    with pytest.raises(ValueError):
        RoutingTables.parse(table)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_rejected_and_nothing_is_half_applied(backend):
    with pytest.raises(SchedulerError):
        ClusterSpec(0, 8, 1000, 64)
    with pytest.raises(SchedulerError):
        ClusterSpec(1, 8, 10, 64)
    with pytest.raises(SchedulerError):
        GlobalScheduler(ClusterSpec(1, 8, 1000, 64), "fastest", backend=backend)
    with pytest.raises(SchedulerError):
        GlobalScheduler(ClusterSpec(1, 6, 1000, 64), "uniform-cp:4", backend=backend)
    with pytest.raises(SchedulerError):
        GlobalScheduler(ClusterSpec(1, 6, 1000, 64), "nanocp", backend="gpu")
    sched = GlobalScheduler(ClusterSpec(1, 2, 1024, 64), backend=backend)
    sched.add_request("a", 10, 5)
    for bad in [("a", 10, 5), ("b", 0, 5), ("c", 10, 0), ("d", 5000, 5), ("", 1, 1), ("e", 1.5, 2)]:
        with pytest.raises(SchedulerError):
            sched.add_request(*bad)
    with pytest.raises(SchedulerError):
        sched.finish("nobody")
    assert sched.num_waiting == 1
    plan = sched.step()
    assert [a.rid for a in plan.admitted] == ["a"]
    sched.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_medha_gains_a_kv_instance_every_n_tokens(backend):
    if backend == "cpp" and "medha" not in CPP_POLICIES:
        pytest.skip("the C++ core does not implement medha yet")
    sched = GlobalScheduler(ClusterSpec(1, 4, 1000, 4), "medha:16", backend=backend)
    sched.add_request("a", prompt_len=40, max_new_tokens=30)  # groups of 16, 16, 8 (+1 new token)
    plan = sched.step()
    moe, split = plan.bindings["a"]
    assert sorted(split.values()) == [9, 16, 16] and split[moe] == 9
    sizes = []
    for _ in range(12):
        moe, split = sched.step().bindings["a"]
        sizes.append(len(split))
        assert split[moe] <= 16 and all(t == 16 for i, t in split.items() if i != moe)
    assert sizes[-1] == 4 and sizes[0] == 3  # the tail group filled up and a fourth instance joined


@pytest.mark.parametrize("backend", BACKENDS)
def test_csps_splits_long_requests_in_one_node_next_to_short_ones(backend):
    if backend == "cpp" and "csps" not in CPP_POLICIES:
        pytest.skip("the C++ core does not implement csps yet")
    sched = GlobalScheduler(ClusterSpec(2, 4, 10_000, 8), "csps:100", backend=backend)
    for i in range(6):
        sched.add_request(f"s{i}", prompt_len=50, max_new_tokens=5)
    sched.add_request("long", prompt_len=350, max_new_tokens=5)
    plan = sched.step()
    moe, split = plan.bindings["long"]
    assert len(split) == 4 and len({i // 4 for i in split}) == 1 and max(split.values()) - min(split.values()) <= 2
    assert all(len(plan.bindings[f"s{i}"][1]) == 1 for i in range(6))


def test_policy_parsing():
    assert parse_policy("uniform-cp:8") == ("uniform-cp", 8)
    assert parse_policy("medha:4096") == ("medha", 4096)
    assert parse_policy("csps") == ("csps", 65536) and parse_policy("csps:100") == ("csps", 100)
    for bad in ["uniform-cp", "uniform-cp:x", "nanocp:2", "rr", "medha", "medha:0", "csps:-1"]:
        with pytest.raises(SchedulerError):
            parse_policy(bad)


def test_cp_bucket_table_roundtrip(tmp_path):
    table = CPBucketTable.load()
    assert table.lookup(1) == 1 and table.lookup(10**7) == table.cps[-1]
    path = tmp_path / "b.json"
    table.save(path)
    assert CPBucketTable.load(path) == table
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SchedulerError, match="bad.json"):
        CPBucketTable.load(tmp_path / "bad.json")
    with pytest.raises(SchedulerError):
        CPBucketTable((10, 5), (1, 2))


# ------------------------------------------------------------------ multi-step windows


def moe_row(plan, rid: str) -> tuple[int, np.ndarray]:
    """(MoE instance, its moe row [batch index, first position, tail shard, window]) of a request in the batch."""
    g = plan.batch.index(rid)
    moe = plan.bindings[rid][0]
    rows = plan.routing(moe).moe
    return moe, rows[rows[:, 0] == g][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_windows_reserve_kv_and_count_decode_steps(backend):
    sched = GlobalScheduler(ClusterSpec(1, 4, 4096, 16), "least-batch", backend=backend)
    sched.add_request("a", prompt_len=30, max_new_tokens=11)  # 10 decode steps: windows 4, 4, 2
    windows, done = [], 0
    while True:
        plan = sched.step(4)
        if "a" in plan.finished:
            break
        moe, row = moe_row(plan, "a")
        context = sum(plan.bindings["a"][1].values())  # the window's slots included
        assert plan.routing(moe).num_steps == 4 and row[1] == context - row[3] == 30 + done
        tail = plan.routing(moe).shards[row[2]]
        assert tail[2] == context  # one shard: the window's tokens are reserved at its tail
        windows.append(int(row[3]))
        done += int(row[3])
        assert sched.request_state("a").decode_steps == done
    assert windows == [4, 4, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_num_steps_decode_exactly_the_budget(backend):
    spec = ClusterSpec(1, 4, 4096, 16)
    sched = GlobalScheduler(spec, "nanocp", backend=backend)
    rnd = random.Random(5)
    want = {f"r{i}": rnd.randint(1, 15) for i in range(30)}
    for rid, n in want.items():
        sched.add_request(rid, rnd.randint(10, 300), n)
    decoded = dict.fromkeys(want, 0)
    finished = set()
    while len(finished) < len(want):
        k = rnd.choice([1, 2, 3, 4, 8])
        plan = sched.step(k)
        finished |= set(plan.finished)
        for rid in plan.batch:
            window = int(moe_row(plan, rid)[1][3])
            assert 1 <= window <= k
            decoded[rid] += window
        sched.check_invariants()
    assert decoded == {rid: n - 1 for rid, n in want.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_admission_falls_back_to_a_window_of_one(backend):
    """The full window does not fit next to a running request; a window of one does: admitted, nothing stalls."""
    sched = GlobalScheduler(ClusterSpec(1, 1, 64, 4), "least-batch", backend=backend)  # 16 frames
    sched.add_request("a", prompt_len=40, max_new_tokens=20)
    sched.step(1)  # a: 41 tokens, 11 pages
    sched.add_request("b", prompt_len=14, max_new_tokens=10)
    plan = sched.step(4)  # a grows to 45 tokens (12 pages); b needs 18 tokens (5 pages) for 4 steps, 4 are free
    assert [(x.rid, x.context_len) for x in plan.admitted] == [("b", 14)]
    assert int(moe_row(plan, "a")[1][3]) == 4 and int(moe_row(plan, "b")[1][3]) == 1
    assert plan.bindings["b"] == (0, {0: 15}) and sched.loads()[0].free_pages == 0
    assert sched.request_state("b").decode_steps == 1
    sched.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_growth_needs_room_for_the_whole_window(backend):
    sched = GlobalScheduler(ClusterSpec(1, 2, 32, 4), "least-batch", backend=backend)
    sched.add_request("a", prompt_len=28, max_new_tokens=20)
    assert sched.step(1).bindings["a"] == (0, {0: 29})  # 8 pages: 3 free slots at the tail, no free page
    plan = sched.step(4)  # 4 tokens do not fit instance 0: they go to instance 1, and the MoE binding follows
    assert plan.bindings["a"] == (1, {0: 29, 1: 4})
    moe, row = moe_row(plan, "a")
    assert moe == 1 and row[1] == 29 and row[3] == 4


def test_bad_num_steps_is_rejected():
    sched = GlobalScheduler(ClusterSpec(1, 2, 1000, 8), backend="python")
    sched.add_request("a", 10, 5)
    for bad in (0, -1, 2**31, 1.5, True, "2"):
        with pytest.raises(SchedulerError, match="num_steps"):
            sched.step(bad)
    assert sched.step(2).iteration == 0 and "a" in sched


# ------------------------------------------------------------------ block-table slots and incremental tables


def apply_updates(store: dict[tuple[int, int], int], table: RoutingTables) -> None:
    for slot, block, frame in table.updates.tolist():
        store[slot, block] = frame


def assert_store_holds_shards(store: dict, table: RoutingTables, plan, sched, page: int) -> None:
    """Every shard row's slot holds exactly that shard's frames (what a full block table would list)."""
    for g, _, n_tokens, slot in table.shards.tolist():
        frames = next(f for i, _, f in sched.shard_pages(plan.batch[g]) if i == table.instance)
        assert len(frames) == -(-n_tokens // page)
        assert [store.get((slot, b)) for b in range(len(frames))] == frames


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["nanocp", "least-cache", "medha:24", "csps:40"])
def test_incremental_tables_rebuild_the_full_block_tables(backend, policy):
    """A consumer applying every lowered table's updates holds what a full snapshot lists; tables chain by
    base_seq (skipped iterations included); slots stay below the most shards an instance held at a step's end."""
    rnd = random.Random(hash((backend, policy)) & 0xFFFF)
    spec = ClusterSpec(2, 2, 256, 4)
    sched = GlobalScheduler(spec, policy, cp_buckets=CPBucketTable((30, 10**9), (1, 3)), backend=backend)
    n = spec.num_instances
    stores: list[dict] = [{} for _ in range(n)]
    held = [-1] * n  # the sequence of the last table each consumer applied
    most_rows, updates, reused = [0] * n, 0, 0
    owner: dict[tuple[int, int], str] = {}  # (instance, slot) -> request that last held it
    submitted: list[str] = []
    for step in range(80):
        for k in range(rnd.randint(0, 3)):
            submitted.append(f"r{step}.{k}")
            sched.add_request(submitted[-1], rnd.randint(1, min(120, sched.core.max_context())), rnd.randint(1, 25))
        live = [rid for rid in submitted if rid in sched]
        if live and rnd.random() < 0.15:
            sched.finish(rnd.choice(live))
        plan = sched.step(rnd.choice([1, 1, 2, 4]))
        most_rows = [max(m, load.shards) for m, load in zip(most_rows, sched.loads())]  # shard rows at step end
        if rnd.random() < 0.2:
            continue  # this iteration is not lowered: the next tables build on the last lowered ones
        for i in range(n):
            table = RoutingTables.parse(plan.tables[i])
            assert table.base_seq == held[i] and not table.full
            apply_updates(stores[i], table)
            held[i] = table.iteration
            updates += len(table.updates)
            assert all(slot < most_rows[i] for slot in table.shards[:, 3].tolist())
            assert_store_holds_shards(stores[i], table, plan, sched, spec.page_size)
            for g, slot in table.shards[:, [0, 3]].tolist():
                reused += owner.get((i, slot), plan.batch[g]) != plan.batch[g]
                owner[i, slot] = plan.batch[g]
        if rnd.random() < 0.2:  # a fresh consumer rebuilt from full snapshots holds the same block tables
            for i in range(n):
                full = RoutingTables.parse(plan.full_tables()[i])
                assert full.full and full.base_seq == -1 and full.iteration == plan.iteration
                fresh: dict = {}
                apply_updates(fresh, full)
                assert_store_holds_shards(fresh, full, plan, sched, spec.page_size)
                assert np.array_equal(full.shards, RoutingTables.parse(plan.tables[i]).shards)
    assert updates > 0 and reused > 0, "no table listed a block, or no slot was ever reused"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tables_list_only_new_frames(backend):
    sched = GlobalScheduler(ClusterSpec(1, 1, 4096, 4), "least-batch", backend=backend)
    sched.add_request("a", prompt_len=400, max_new_tokens=30)
    first = RoutingTables.parse(sched.step().tables[0])
    assert len(first.updates) == 101 and first.base_seq == -1  # 401 tokens in pages of 4: all new
    seen = []
    for _ in range(8):  # one token per iteration: a new page every fourth
        table = RoutingTables.parse(sched.step().tables[0])
        seen.append(table.updates.tolist())
        assert table.base_seq == table.iteration - 1
    frames = sched.shard_pages("a")[0][2]
    assert [u for u in seen if u] == [[[0, 101, frames[101]]], [[0, 102, frames[102]]]]
    again = sched.core.lower_all()[0]  # lowering the same iteration again: nothing new, built on itself
    table = RoutingTables.parse(again)
    assert len(table.updates) == 0 and table.base_seq == table.iteration
