"""The C++ control-plane core (`_core.SchedulerCore`) must make exactly the decisions of the Python reference.

Random specs (tiny capacities force growth relocation, preemption and rejection), every policy, random CP bucket
tables and random interleavings of add_request / finish / step (random num_steps: multi-step windows) / lowering
(all instances or one, incremental or full snapshots) / queries / invalid calls drive both cores; after every
operation everything observable must agree: raised errors, last_* lists, batch, bindings, shard pages, loads,
request info, routing tables (byte for byte; lowering is stateful: both cores lower in lock step), and both cores'
invariants must hold.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanocp.control_plane import ClusterSpec, CPBucketTable, GlobalScheduler, SchedulerError
from nanocp.control_plane.lowering import RoutingTables, split_tables
from nanocp.control_plane.reference import ReferenceCore
from nanocp.control_plane.scheduler import make_core

_core = pytest.importorskip("nanocp.control_plane._core")

HANDLES = 12  # small handle pool: duplicates, reuse after finish and unknown handles all happen


# ---------------------------------------------------------------- helpers


def outcome(fn, *args):
    """(result, None) or (None, (exception type, args)) so errors can be compared across cores."""
    try:
        return fn(*args), None
    except (ValueError, KeyError, IndexError, AssertionError) as e:
        return None, (type(e), e.args)


def make_pair(spec: ClusterSpec, policy: str, table: CPBucketTable, max_batch: int):
    return ReferenceCore(spec, policy, table, max_batch), make_core(spec, policy, table, max_batch, "cpp")


def assert_same_tables(want: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        assert b.dtype == np.int32 and b.tobytes() == a.tobytes(), f"instance {i}"


def assert_same_state(ref: ReferenceCore, cpp, lower: bool = True) -> None:
    assert cpp.iteration == ref.iteration and cpp.num_steps == ref.num_steps
    assert list(cpp.last_admitted) == ref.last_admitted
    assert list(cpp.last_finished) == ref.last_finished
    assert list(cpp.last_preempted) == ref.last_preempted
    assert list(cpp.last_rejected) == ref.last_rejected
    batch = [int(h) for h in cpp.batch_handles()]
    assert batch == ref.batch_handles()
    assert cpp.num_waiting() == ref.num_waiting()
    assert tuple(list(x) for x in cpp.loads()) == ref.loads()
    for handle in range(-1, HANDLES + 1):
        for query in ("request_info", "binding", "shard_pages"):
            assert outcome(getattr(cpp, query), handle) == outcome(getattr(ref, query), handle), (query, handle)
    if lower:
        assert_same_tables(ref.lower_all(), cpp.lower_all())
    ref.check_invariants()
    cpp.check_invariants()


# ---------------------------------------------------------------- random workloads


@st.composite
def setups(draw):
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.sampled_from([1, 2, 3, 4]))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    frames = draw(st.integers(1, 10))
    capacity = frames * page + draw(st.integers(0, page - 1))  # rounded down to whole pages
    spec = ClusterSpec(nodes, per_node, capacity, page)
    divisors = [k for k in range(1, per_node + 1) if per_node % k == 0]
    room = frames * page - 1
    policy = draw(
        st.sampled_from(["nanocp", "nanocp", "least-batch", "least-cache", "round-robin", "csps"])
        | st.sampled_from(divisors).map(lambda k: f"uniform-cp:{k}")
        | st.integers(1, max(room, 1)).map(lambda n: f"medha:{n}" if room >= 1 else "nanocp")
        | st.integers(1, 3 * frames * page).map(lambda s: f"csps:{s}")
    )
    n_buckets = draw(st.integers(1, 4))
    max_lens = sorted(draw(st.sets(st.integers(1, 4 * frames * page), min_size=n_buckets, max_size=n_buckets)))
    cps = draw(st.lists(st.integers(1, per_node + 1), min_size=n_buckets, max_size=n_buckets))
    table = CPBucketTable(tuple(max_lens), tuple(cps))
    max_batch = draw(st.sampled_from([0, 0, 1, 2, 3]))
    return spec, policy, table, max_batch


@st.composite
def operations(draw, spec: ClusterSpec):
    cap = spec.frames_per_instance * spec.page_size
    ops = []
    for _ in range(draw(st.integers(1, 70))):
        kind = draw(st.sampled_from(["add", "add", "step", "step", "step", "finish", "bad", "lower"]))
        handle = draw(st.integers(0, HANDLES - 1))
        if kind == "add":
            prompt = draw(st.integers(1, cap) | st.integers(1, spec.instances_per_node * cap + 2))
            ops.append(("add", handle, prompt, draw(st.integers(1, 3 * cap))))
        elif kind == "finish":
            ops.append(("finish", draw(st.integers(-1, HANDLES))))
        elif kind == "bad":
            prompt = draw(st.sampled_from([0, -3, 1, spec.num_instances * cap + 1, 2**40]))
            ops.append(("add", handle, prompt, draw(st.sampled_from([0, -1, 1, 2**40]))))
        elif kind == "lower":  # one instance (or a bad index) or all, incremental or a full snapshot
            instance = draw(st.integers(-1, spec.num_instances))
            ops.append(("lower", instance if draw(st.booleans()) else None, draw(st.booleans())))
        else:
            ops.append(("step", draw(st.sampled_from([1, 1, 1, 2, 3, 4, 8]) | st.sampled_from([0, -2, 2**31]))))
        ops[-1] += (draw(st.booleans()),)  # lower every instance's tables after this operation?
    return ops


def run_ops(ref: ReferenceCore, cpp, ops) -> None:
    for op in ops:
        name, *args, lower_after = op
        if name == "lower":
            instance, full = args
            if instance is None:
                assert_same_tables(ref.lower_all(full), cpp.lower_all(full))
            else:
                got, want = outcome(cpp.lower, instance, full), outcome(ref.lower, instance, full)
                assert got[1] == want[1], op
                assert want[1] is not None or got[0].tobytes() == want[0].tobytes(), op
        else:
            method = {"add": "add_request", "finish": "finish", "step": "step"}[name]
            got, want = outcome(getattr(cpp, method), *args), outcome(getattr(ref, method), *args)
            assert got[1] == want[1], op
        assert_same_state(ref, cpp, lower_after)


@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_workloads_match_reference(data):
    spec, policy, table, max_batch = data.draw(setups())
    ref, cpp = make_pair(spec, policy, table, max_batch)
    assert cpp.max_context() == ref.max_context()
    run_ops(ref, cpp, data.draw(operations(spec)))


@pytest.mark.parametrize(
    "policy", ["nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp:2", "medha:40", "csps:30"]
)
def test_long_run_under_memory_pressure(policy):
    """Hundreds of iterations on a cluster kept nearly full: growth moves, preemption and re-admission recur."""
    rng = random.Random(zlib.crc32(policy.encode()))
    spec = ClusterSpec(2, 4, 24 * 4, 4)
    table = CPBucketTable((16, 48, 120), (1, 2, 4))
    ref, cpp = make_pair(spec, policy, table, 0)
    next_handle, preempted, grown = 0, 0, 0
    for _ in range(300):
        for _ in range(rng.randrange(0, 4)):
            prompt = rng.choice([rng.randint(1, 20), rng.randint(20, 90), rng.randint(90, 300)])
            run_ops(ref, cpp, [("add", next_handle, min(prompt, ref.max_context()), rng.randint(1, 60), True)])
            next_handle += 1
        if ref.requests and rng.random() < 0.2:
            run_ops(ref, cpp, [("finish", rng.choice(sorted(ref.requests)), rng.random() < 0.5)])
        widths = {h: len(cpp.binding(h)[1]) for h in cpp.batch_handles().tolist()}
        run_ops(ref, cpp, [("step", rng.choice([1, 1, 2, 4]), rng.random() < 0.7)])
        preempted += len(cpp.last_preempted)
        grown += sum(len(cpp.binding(h)[1]) > w for h, w in widths.items() if h in ref.running)
    assert ref.iteration == 299
    assert grown > 0, "the workload never grew a request onto another instance"
    assert preempted > 0, "the workload never preempted"


# ---------------------------------------------------------------- construction and errors


@pytest.mark.parametrize(
    "policy",
    [
        "bogus",
        "nanocp:3",
        "least-batch:x",
        "uniform-cp",
        "uniform-cp:",
        "uniform-cp:0",
        "uniform-cp:x",
        "uniform-cp:3",
        "uniform-cp:-2",
        "uniform-cp:2:2",
        "medha",
        "medha:",
        "medha:0",
        "medha:x",
        "medha:64",
        "medha:99999999999999999999999",
        "csps:0",
        "csps:-1",
        "csps:1:2",
        "Nanocp",
        "'quoted'",
    ],
)
def test_bad_policies_raise_the_reference_errors(policy):
    spec, table = ClusterSpec(1, 4, 64, 4), CPBucketTable((8,), (2,))
    with pytest.raises(SchedulerError) as want:
        ReferenceCore(spec, policy, table, 0)
    with pytest.raises(SchedulerError) as got:
        _core.SchedulerCore(1, 4, 64, 4, policy, [8], [2], 0)
    assert str(got.value) == str(want.value)


def test_accepted_policy_spellings_match():
    spec, table = ClusterSpec(1, 4, 64, 4), CPBucketTable((8,), (2,))
    for policy in [
        "nanocp:",
        "round-robin:",
        "uniform-cp:04",
        "uniform-cp:1",
        "csps",
        "csps:",
        "csps:7",
        "medha:63",
        "medha:1",
    ]:
        ref, cpp = ReferenceCore(spec, policy, table, 0), _core.SchedulerCore(1, 4, 64, 4, policy, [8], [2], 0)
        assert cpp.max_context() == ref.max_context()


def test_bad_construction_arguments():
    with pytest.raises(SchedulerError, match="max_batch_per_instance must be >= 0"):
        _core.SchedulerCore(1, 4, 64, 4, "nanocp", [8], [2], -1)
    for max_lens, cps in [([], []), ([8, 8], [1, 2]), ([8], [0]), ([8, 9], [1])]:
        with pytest.raises(SchedulerError) as want:
            CPBucketTable(tuple(max_lens), tuple(cps))
        with pytest.raises(SchedulerError) as got:
            _core.SchedulerCore(1, 4, 64, 4, "nanocp", max_lens, cps, 0)
        assert str(got.value) == str(want.value)
    for args in [(0, 4, 64, 4), (1, -1, 64, 4), (1, 4, 0, 4), (1, 4, 64, 0), (1, 4, 3, 4), (2048, 1024, 64, 4)]:
        with pytest.raises(SchedulerError) as want:
            ClusterSpec(*args)
        with pytest.raises(SchedulerError) as got:
            _core.SchedulerCore(*args, "nanocp", [8], [2], 0)
        assert str(got.value) == str(want.value)


def test_lower_and_step_reject_bad_arguments():
    cpp = _core.SchedulerCore(1, 2, 64, 4, "nanocp", [8], [1], 0)
    for bad in (-1, 2):
        with pytest.raises(IndexError):
            cpp.lower(bad)
    for bad in (0, -1, 2**31):
        with pytest.raises(SchedulerError, match="num_steps must be between 1 and 2147483647"):
            cpp.step(bad)
    assert cpp.iteration == -1


# ---------------------------------------------------------------- zero-copy tables stay valid


def test_tables_held_by_python_survive_later_steps():
    """Lowered arrays view pooled C++ buffers: a buffer is reused only after Python dropped every view of it."""
    spec, table = ClusterSpec(2, 2, 4096, 16), CPBucketTable((100, 1000), (1, 2))
    ref, cpp = make_pair(spec, "nanocp", table, 0)
    rng = random.Random(7)
    held = []  # (arrays, bytes at the time)
    for handle in range(200):
        prompt, new = rng.randint(1, 1500), rng.randint(2, 40)
        for core in (ref, cpp):
            core.add_request(handle, prompt, new)
        steps = rng.choice([1, 3])
        ref.step(steps)
        cpp.step(steps)
        full = handle % 7 == 0
        if handle % 2:  # packed: one array and the offsets of the tables in it
            packed, offsets = cpp.lower_packed(full)
            ref_packed, ref_offsets = ref.lower_packed(full)
            assert packed.dtype == np.int32 and offsets.dtype == np.int64 and len(offsets) == spec.num_instances + 1
            assert packed.tobytes() == ref_packed.tobytes() and offsets.tolist() == ref_offsets.tolist()
            tables = split_tables(packed, offsets)
            assert all(RoutingTables.parse(t).instance == i for i, t in enumerate(tables))
        else:
            tables = cpp.lower_all(full)
            assert [t.tobytes() for t in tables] == [t.tobytes() for t in ref.lower_all(full)]
        if handle % 3 == 0:
            held.append((tables, [t.tobytes() for t in tables]))
        if len(held) > 5:
            held.pop(0)
        for arrays, snapshot in held:
            assert [t.tobytes() for t in arrays] == snapshot


def test_facade_plans_match_across_backends():
    spec = ClusterSpec(2, 4, 50_000, 16)
    table = CPBucketTable((2_000, 20_000, 60_000), (1, 2, 8))
    scheds = [GlobalScheduler(spec, "nanocp", cp_buckets=table, backend=b) for b in ("python", "cpp")]
    rng = random.Random(3)
    for t in range(60):
        for k in range(rng.randrange(0, 5)):
            prompt, new = rng.randint(1, 60_000), rng.randint(1, 300)
            for s in scheds:
                s.add_request(f"r{t}.{k}", prompt, new)
        steps = rng.choice([1, 2, 5])
        plans = [s.step(steps) for s in scheds]
        assert plans[0].admitted == plans[1].admitted and plans[0].finished == plans[1].finished
        assert plans[0].preempted == plans[1].preempted and plans[0].rejected == plans[1].rejected
        assert plans[0].batch == plans[1].batch and plans[0].bindings == plans[1].bindings
        assert [a.tobytes() for a in plans[0].tables] == [a.tobytes() for a in plans[1].tables]
        if t % 5 == 0:
            assert [a.tobytes() for a in plans[0].full_tables()] == [a.tobytes() for a in plans[1].full_tables()]
        assert plans[0].cp_remote_shards == plans[1].cp_remote_shards
