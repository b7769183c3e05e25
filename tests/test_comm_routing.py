"""Q/Res routing backend: only marked rows move, contiguous rows coalesce, per-source sequence flags."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.comm import FabricTimeout, InProcessFabric, RoutingBackend, plan_puts
from nanocp.comm.launch import run_threads

SENTINEL = -7.0


def test_plan_puts_coalesces_consecutive_destination_rows():
    table = torch.tensor([[1, 4, 2], [1, 5, 3], [0, 9, 0], [1, 0, 4], [1, 7, 9], [0, 8, 1]])
    runs = plan_puts(table)
    summary = [(r.dst, r.dst_row, r.src_rows.tolist(), r.src_slice) for r in runs]
    assert summary == [
        (0, 0, [9, 8], None),  # consecutive destination rows, source rows gathered
        (1, 2, [4, 5, 0], None),
        (1, 9, [7], slice(7, 8)),
    ]
    assert plan_puts(torch.empty(0, 3, dtype=torch.int64)) == []
    assert plan_puts(torch.tensor([[2, 3, 5], [2, 4, 6]]))[0].src_slice == slice(3, 5)


def build(world: int, rows: int, row_shape=(4,)):
    fabrics = InProcessFabric.create(world)
    backends = run_threads(lambda r: RoutingBackend(fabrics[r], "q", rows, row_shape, torch.float32), world)
    for b in backends:
        b.recv.fill_(SENTINEL)
    return fabrics, backends


def random_exchange(world: int, rows: int, density: float, seed: int):
    """Random send lists: each (src, dst, dst_row) slot is used with probability `density`.
    Returns per-rank sources [rows, 4], send lists, and the expected receive buffers."""
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(rows, 4, generator=gen) for _ in range(world)]
    sends = [[] for _ in range(world)]
    expect = [torch.full((rows, 4), SENTINEL) for _ in range(world)]
    receive_from = [set() for _ in range(world)]
    for dst in range(world):
        owners = torch.randint(0, world, (rows,), generator=gen)  # who may write each destination row
        used = torch.rand(rows, generator=gen) < density
        for row in torch.nonzero(used).flatten().tolist():
            src, src_row = int(owners[row]), int(torch.randint(0, rows, (1,), generator=gen))
            sends[src].append((dst, src_row, row))
            expect[dst][row] = sources[src][src_row]
            receive_from[dst].add(src)
    return sources, sends, expect, receive_from


@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([1, 2, 3]),
    rows=st.integers(1, 10),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_only_marked_rows_move(world, rows, density, seed):
    fabrics, backends = build(world, rows)
    sources, sends, expect, receive_from = random_exchange(world, rows, density, seed)

    def step(rank: int):
        b = backends[rank]
        stats = b.send(sends[rank], sources[rank], seq=1)
        return stats, b.wait(receive_from[rank], seq=1, timeout_s=10).clone()

    results = run_threads(step, world)
    for rank, (stats, recv) in enumerate(results):
        assert torch.equal(recv, expect[rank])  # unmarked rows keep the sentinel: nothing else was written
        assert stats.rows == len(sends[rank])
        assert stats.bytes == len(sends[rank]) * 4 * 4
        assert stats.puts == len(plan_puts(torch.tensor(sends[rank]).reshape(-1, 3)))
        assert stats.signals == len({d for d, _, _ in sends[rank]})


def test_contiguous_block_is_one_put_and_no_padding():
    fabrics, backends = build(2, 8)
    src = torch.randn(8, 4)
    sends = [(1, 2 + i, 3 + i) for i in range(4)] + [(1, 0, 0)]  # rows 3..6 in one put, row 0 in another

    def step(rank: int):
        if rank == 0:
            return backends[0].send(sends, src, seq=1)
        return backends[1].wait([0], seq=1, timeout_s=10).clone()

    stats, recv = run_threads(step, 2)
    assert (stats.puts, stats.rows, stats.bytes, stats.signals) == (2, 5, 5 * 16, 1)
    assert torch.equal(recv[3:7], src[2:6]) and torch.equal(recv[0], src[0])
    assert bool((recv[[1, 2, 7]] == SENTINEL).all())
    assert backends[0].total.rows == 5


def test_sequence_numbers_gate_each_iteration():
    fabrics, backends = build(2, 4)
    src = torch.randn(4, 4)
    backends[0].send([(1, 0, 0)], src, seq=1)
    backends[1].wait([0], seq=1, timeout_s=1)
    with pytest.raises(FabricTimeout):
        backends[1].wait([0], seq=2, timeout_s=0.05)  # iteration 2 not sent yet
    with pytest.raises(FabricTimeout):
        backends[1].wait([1], seq=1, timeout_s=0.05)  # rank 1 itself sent nothing
    backends[0].send([(1, 1, 1)], src, seq=2)
    assert torch.equal(backends[1].wait([0], seq=2, timeout_s=1)[:2], src[:2])


def test_bad_send_lists_are_rejected():
    fabrics, backends = build(2, 4)
    b, src = backends[0], torch.randn(4, 4)
    with pytest.raises(ValueError, match="destination outside"):
        b.send([(2, 0, 0)], src, seq=1)
    with pytest.raises(ValueError, match="source row"):
        b.send([(1, 4, 0)], src, seq=1)
    with pytest.raises(ValueError, match="destination row"):
        b.send([(1, 0, 4)], src, seq=1)
    with pytest.raises(ValueError, match="twice"):
        b.send([(1, 0, 1), (1, 2, 1)], src, seq=1)
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        b.send([(1, 0)], src, seq=1)
    with pytest.raises(TypeError, match="integers"):
        b.send(torch.tensor([[1.0, 0.0, 0.0]]), src, seq=1)
    with pytest.raises(ValueError, match="rows"):
        b.send([(1, 0, 0)], torch.randn(4, 5), seq=1)
    b.send([(1, 0, 0)], src, seq=3)
    with pytest.raises(ValueError, match="increase"):
        b.send([(1, 0, 0)], src, seq=3)
    with pytest.raises(ValueError, match="source rank"):
        b.wait([5], seq=3, timeout_s=0.01)


def test_wait_flags_lists_what_wait_blocks_on():
    fabrics, backends = build(3, 4)
    b = backends[2]
    assert b.wait_flags([1, 0, 1], seq=4) == [(b.flag_base, 4), (b.flag_base + 1, 4)]
    backends[0].send([(2, 0, 0)], torch.randn(4, 4), seq=4)
    assert [fabrics[2].read_flag(f) >= v for f, v in b.wait_flags([0, 1], seq=4)] == [True, False]
