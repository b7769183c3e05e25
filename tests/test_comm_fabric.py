"""Fabric backends: put/signal/wait semantics, timeouts, bad input, cleanup (threads and processes)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import tolerances as tol
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.comm import (
    FabricError,
    FabricTimeout,
    InProcessFabric,
    LowLatencyDispatcher,
    RoutingBackend,
    ShmFabric,
    TorchDistFabric,
)
from nanocp.comm.fabric import POLL_SPIN_S, SHARED_CORE_SPIN_S, poll_until
from nanocp.comm.launch import run_processes, run_threads

ROW = (2, 3)  # row shape of the test buffers


def make_fabrics(backend: str, world: int, num_flags: int = 16):
    if backend == "inprocess":
        return InProcessFabric.create(world, num_flags=num_flags)
    info = ShmFabric.new_session(world, num_flags=num_flags, spin_s=0.0)  # ranks are threads: no spin under the GIL
    return run_threads(lambda r: ShmFabric(info, r), world, timeout_s=30)


def rows_from(src: int, n: int) -> torch.Tensor:
    """The rows rank `src` sends in the ring test (fresh random values, reproducible per source)."""
    return torch.randn(n, *ROW, generator=torch.Generator().manual_seed(1000 + src))


def ring_exchange(fabric, rounds: int = 3) -> None:
    """Each rank puts 2 rows into the next rank at rows [2*rank, 2*rank+2) and signals; checks what it got."""
    world, rank = fabric.world_size, fabric.rank
    buf = fabric.register("ring", (2 * world, *ROW), torch.float32)
    flag = fabric.reserve_flags(1)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for seq in range(1, rounds + 1):
        fabric.put(nxt, "ring", 2 * rank, rows_from(rank, 2) * seq)
        fabric.signal(nxt, flag, seq)
        assert fabric.wait(flag, seq, timeout_s=10) >= seq
        got = buf[2 * prv : 2 * prv + 2].clone()
        fabric.barrier(10)  # nobody starts the next round before everyone has read
        assert torch.equal(got, rows_from(prv, 2) * seq)
        untouched = torch.cat([buf[: 2 * prv], buf[2 * prv + 2 :]]) if world > 1 else buf[:0]
        assert torch.count_nonzero(untouched) == 0


@pytest.mark.parametrize("backend", ["inprocess", "shm"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ring_put_signal_wait(backend, world):
    fabrics = make_fabrics(backend, world)
    run_threads(lambda r: ring_exchange(fabrics[r]), world, timeout_s=30)
    for f in fabrics:
        f.close()


@pytest.mark.parametrize("backend", ["inprocess", "shm"])
def test_wait_timeout_names_flag_rank_value(backend):
    fabric = make_fabrics(backend, 1)[0]
    fabric.signal(0, 5, 3)
    start = time.monotonic()
    with pytest.raises(FabricTimeout) as info:
        fabric.wait(5, 7, timeout_s=0.05)
    assert time.monotonic() - start < 2.0
    assert (info.value.flag, info.value.rank, info.value.value, info.value.observed) == (5, 0, 7, 3)
    assert "flag 5" in str(info.value) and "rank 0" in str(info.value) and "7" in str(info.value)
    assert fabric.wait(5, 3, timeout_s=0.05) == 3
    fabric.close()


@pytest.mark.parametrize("backend", ["inprocess", "shm"])
def test_barrier_without_peer_times_out(backend):
    fabrics = make_fabrics(backend, 2)
    with pytest.raises(FabricTimeout, match="barrier"):
        fabrics[0].barrier(timeout_s=0.1)
    for f in fabrics:
        f.close()


def test_register_without_peer_times_out():
    fabrics = InProcessFabric.create(2)
    with pytest.raises(FabricTimeout):
        fabrics[0].register("x", (4,), torch.float32, timeout_s=0.1)


@pytest.mark.parametrize("backend", ["inprocess", "shm"])
def test_bad_input_is_rejected(backend):
    fabric = make_fabrics(backend, 1)[0]
    fabric.register("b", (4, 3), torch.float32)
    good = torch.randn(2, 3)
    with pytest.raises(TypeError, match="dtype"):
        fabric.put(0, "b", 0, good.double())
    with pytest.raises(ValueError, match="do not fit"):
        fabric.put(0, "b", 0, torch.randn(2, 4))
    with pytest.raises(ValueError, match="outside"):
        fabric.put(0, "b", 3, good)
    with pytest.raises(ValueError, match="outside"):
        fabric.put(0, "b", -1, good)
    with pytest.raises(ValueError, match="dst rank"):
        fabric.put(1, "b", 0, good)
    with pytest.raises(KeyError, match="not registered"):
        fabric.put(0, "nope", 0, good)
    with pytest.raises(ValueError, match="already registered"):
        fabric.register("b", (4, 3), torch.float32)
    with pytest.raises(ValueError, match="positive"):
        fabric.register("c", (0, 3), torch.float32)
    with pytest.raises(ValueError, match="flag"):
        fabric.signal(0, fabric.num_flags, 1)
    with pytest.raises(ValueError, match="flag value"):
        fabric.signal(0, 0, -1)
    with pytest.raises(TypeError, match="integer"):
        fabric.wait(0.5, 1, timeout_s=0.01)
    fabric.close()
    with pytest.raises(FabricError, match="closed"):
        fabric.put(0, "b", 0, good)


def test_reserve_flags_is_deterministic_and_bounded():
    a, b = InProcessFabric.create(2, num_flags=8)
    assert [a.reserve_flags(2), a.reserve_flags(3)] == [b.reserve_flags(2), b.reserve_flags(3)] == [0, 2]
    with pytest.raises(ValueError, match="cannot reserve"):
        a.reserve_flags(4)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12),
    puts=st.lists(st.tuples(st.integers(0, 11), st.integers(1, 5)), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_random_puts_match_plain_slicing(rows, puts, seed):
    """Any sequence of in-range puts from rank 0 leaves rank 1's buffer equal to plain slice assignment."""
    src, dst = InProcessFabric.create(2)
    run_threads(lambda r: (src, dst)[r].register("b", (rows, 3), torch.int64), 2)
    reference = torch.zeros(rows, 3, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    for step, (offset, n) in enumerate(puts, start=1):
        offset, n = offset % rows, min(n, rows - offset % rows)
        payload = torch.randint(-1000, 1000, (n, 3), generator=gen)
        src.put(1, "b", offset, payload)
        src.signal(1, 0, step)
        reference[offset : offset + n] = payload
    dst.wait(0, len(puts), timeout_s=5)
    assert torch.equal(dst.buffer("b"), reference)


def test_shm_close_unlinks_every_segment_and_cleanup_sweeps_crashes():
    fabrics = make_fabrics("shm", 2)
    run_threads(lambda r: fabrics[r].register("x", (3, 2), torch.float16), 2)
    info = fabrics[0].info
    assert len(ShmFabric.segments(info)) == 4  # flags + one buffer per rank
    view = fabrics[1].buffer("x")
    for f in fabrics:
        f.close()
    assert ShmFabric.segments(info) == []
    view.fill_(1.0)  # a view held past close() stays a valid mapping
    crashed = ShmFabric(ShmFabric.new_session(1), 0)
    crashed.register("y", (2,), torch.int32)
    assert ShmFabric.cleanup(crashed.info) == 2
    assert ShmFabric.segments(crashed.info) == []
    crashed.close()


# ---- multi-process backends -----------------------------------------------------------------------------
def peer_ring(fabric, rounds: int = 3) -> None:
    """The ring exchange written in place into the next rank's mapped buffer (peer_buffer), published by signal."""
    world, rank = fabric.world_size, fabric.rank
    buf = fabric.register("peer", (2 * world, *ROW), torch.float32)
    flag = fabric.reserve_flags(1)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    target = fabric.peer_buffer(nxt, "peer")
    assert (target is buf) == (nxt == rank)  # its own buffer is the one it registered
    for seq in range(1, rounds + 1):
        target[2 * rank : 2 * rank + 2] = rows_from(rank, 2) * seq
        fabric.signal(nxt, flag, seq)
        fabric.wait(flag, seq, timeout_s=10)
        got = buf[2 * prv : 2 * prv + 2].clone()
        fabric.barrier(10)
        assert torch.equal(got, rows_from(prv, 2) * seq)


@pytest.mark.parametrize("backend", ["inprocess", "shm"])
@pytest.mark.parametrize("world", [1, 3])
def test_writes_into_a_mapped_peer_buffer_arrive_with_the_signal(backend, world):
    fabrics = make_fabrics(backend, world)
    run_threads(lambda r: peer_ring(fabrics[r]), world, timeout_s=30)
    with pytest.raises(KeyError, match="not registered"):
        fabrics[0].peer_buffer(0, "nope")
    with pytest.raises(ValueError, match="out of range"):
        fabrics[0].peer_buffer(world, "peer")
    for f in fabrics:
        f.close()


def _process_scenario(fabric) -> dict:
    """Runs in each process: ring exchange, ordering stress, timeouts, routing, dispatch/combine."""
    world, rank = fabric.world_size, fabric.rank
    ring_exchange(fabric, rounds=2)
    # put-then-signal ordering: the row a signal announces is always there when the flag is seen
    stress = fabric.register("stress", (world, 64), torch.int64)
    stress_flag = fabric.reserve_flags(2)
    idle_flag = stress_flag + 1
    ok = True
    for seq in range(1, 31):
        fabric.put((rank + 1) % world, "stress", rank, torch.full((1, 64), seq, dtype=torch.int64))
        fabric.signal((rank + 1) % world, stress_flag, seq)
        fabric.wait(stress_flag, seq, timeout_s=20)
        ok &= bool((stress[(rank - 1) % world] >= seq).all())
    start = time.monotonic()
    try:
        fabric.wait(idle_flag, 99, timeout_s=0.2)
        timed_out = False
    except FabricTimeout:
        timed_out = time.monotonic() - start < 5.0
    # routing: rank r sends its rows 0..2 to every rank, into rows [3r, 3r+3)
    route = RoutingBackend(fabric, "q", 3 * world, (4,), torch.float32)
    src = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    sends = [(d, i, 3 * rank + i) for d in range(world) for i in range(3)]
    recv = route.route(sends, src, range(world), seq=1, timeout_s=20).clone()
    expect = torch.cat([torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(world)])
    # dispatch + combine with an elementwise expert so the result is exact
    disp = LowLatencyDispatcher(fabric, 2 * world, 8, 4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(4, 8, generator=gen)
    idx = torch.stack([torch.randperm(2 * world, generator=gen)[: min(2, 2 * world)] for _ in range(4)])
    w = torch.rand(idx.shape, generator=gen)
    recv_x, count, handle = disp.dispatch(x, idx)
    local0 = rank * disp.local_experts
    scale = torch.arange(local0, local0 + disp.local_experts, dtype=torch.float32)[:, None, None] + 1
    out = disp.combine(recv_x * scale, idx, w, handle)
    ref, terms = torch.zeros(4, 8), torch.zeros(4, 8)
    for k in range(idx.shape[1]):
        ref += w[:, k, None] * (x * (idx[:, k, None].float() + 1))
        terms += (w[:, k, None] * (x * (idx[:, k, None].float() + 1))).abs()
    fabric.barrier(20)
    peer = fabric.peer_buffer((rank + 1) % world, "stress")  # mapped across processes only by shared memory
    return {
        "peer_mapped": peer is not None and peer.shape == stress.shape,
        "ordered": ok,
        "timed_out": timed_out,
        "routed": torch.equal(recv, expect),
        # two fp32 sums of k products (the same products: an elementwise expert), in any order: each within
        # gamma(k) sum |terms| (tests/tolerances.py)
        "combine": bool(((out - ref).abs() <= 2 * tol.gamma(idx.shape[1]) * terms + tol.TINY).all()),
    }


def shm_worker(rank: int, world: int, info) -> dict:
    fabric = ShmFabric(info, rank)
    result = _process_scenario(fabric)
    fabric.close()
    return result


def dist_worker(rank: int, world: int) -> dict:
    fabric = TorchDistFabric(num_flags=16)
    result = _process_scenario(fabric)
    # registrations that disagree: rank 1's rows are wider; rank 0's put must not block and rank 1 must know
    try:
        fabric.register("skewed", (2, 4 if rank == 1 else 2), torch.float32, timeout_s=20)
        flag = fabric.reserve_flags(1)
        if rank == 0:
            fabric.put(1, "skewed", 0, torch.ones(1, 2))
            fabric.signal(1, flag, 1)
        elif rank == 1:
            fabric.wait(flag, 1, timeout_s=20)
        reported = False
    except FabricError as exc:  # at the first wait after the bad put (which may be the register barrier)
        reported = "does not match" in str(exc)
    if rank == 1:
        result["mismatch_reported"] = reported
    fabric.close()
    return result


def test_shm_fabric_across_processes_leaves_no_segment():
    info = ShmFabric.new_session(3, num_flags=16)
    try:
        results = run_processes(shm_worker, 3, args=(info,), timeout_s=120)
    finally:
        leftovers = ShmFabric.segments(info)
        ShmFabric.cleanup(info)
    assert leftovers == []
    expected = {"peer_mapped": True, "ordered": True, "timed_out": True, "routed": True, "combine": True}
    assert results == [expected] * len(results)


def test_torch_distributed_fabric_across_processes():
    results = run_processes(dist_worker, 3, timeout_s=180, torch_distributed=True)
    assert results[1].pop("mismatch_reported") is True
    expected = {"peer_mapped": False, "ordered": True, "timed_out": True, "routed": True, "combine": True}
    assert results == [expected] * len(results)


def test_torch_dist_fabric_needs_initialised_group():
    with pytest.raises(FabricError, match="init_process_group"):
        TorchDistFabric()


# ---- polling ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_poll_until_sees_a_value_set_during_the_spin_or_the_sleeps(spin_s):
    """A flag set by another thread 5 ms in is seen (within the spin, or by the sleep backoff after it)."""
    box = [0]
    setter = threading.Timer(0.005, lambda: box.__setitem__(0, 7))
    setter.start()
    start = time.monotonic()
    seen = poll_until(lambda: box[0], 5, start + 10.0, spin_s=spin_s)
    setter.join()
    assert seen == 7 and time.monotonic() - start < 5.0


def test_poll_until_keeps_the_deadline_even_inside_the_spin():
    start = time.monotonic()
    seen = poll_until(lambda: 3, 4, start + 0.01, spin_s=30.0)
    assert seen == 3 and time.monotonic() - start < 2.0  # the spin is cut at the deadline, not run for 30 s


def test_shm_session_spins_only_when_every_rank_can_have_its_own_core():
    cores = len(os.sched_getaffinity(0))
    assert ShmFabric.new_session(cores).spin_s == POLL_SPIN_S
    assert ShmFabric.new_session(cores + 1).spin_s == SHARED_CORE_SPIN_S
    assert ShmFabric.new_session(2, spin_s=0.0).spin_s == 0.0
    with pytest.raises(ValueError, match="spin_s must be >= 0"):
        ShmFabric.new_session(2, spin_s=-1.0)
