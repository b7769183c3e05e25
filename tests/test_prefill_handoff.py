"""KV hand-off: destinations map positions to decode pages exactly; with fewer receive backends than senders every
piece of every request lands, requests in order of first handshake, each request's pieces before the next's."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.data_plane.kv_pool import PagedKVPool
from nanocp.prefill.handoff import (
    HandoffError,
    KVDestination,
    Piece,
    ReceiveManager,
    ShardDest,
    TransferEngine,
    as_sink,
)

LAYERS, DIM, PAGE = 2, 3, 4


@given(st.lists(st.integers(0, 20), min_size=1, max_size=5), st.data())
def test_destination_writes_cover_each_position_once(shard_tokens, data):
    dest = KVDestination(tuple(ShardDest(i, n, tuple(range(-(-n // PAGE)))) for i, n in enumerate(shard_tokens)))
    total = dest.total_tokens
    start = data.draw(st.integers(0, total))
    n = data.draw(st.integers(0, total - start))
    writes = dest.writes(start, n)
    covered = []
    for w in writes:
        base = sum(shard_tokens[: w.instance])
        assert 0 <= w.start_slot and w.start_slot + (w.row_hi - w.row_lo) <= shard_tokens[w.instance]
        covered.extend(range(base + w.start_slot, base + w.start_slot + w.row_hi - w.row_lo))
        assert list(range(start + w.row_lo, start + w.row_hi)) == covered[-(w.row_hi - w.row_lo) :]
    assert covered == list(range(start, start + n))
    with pytest.raises(ValueError, match="outside"):
        dest.writes(start, total - start + 1)


def test_destination_from_shard_pages_keeps_the_moe_slot():
    dest = KVDestination.from_shard_pages([(2, 9, [5, 6, 7]), (0, 4, [1])], moe_instance=2)
    assert [(s.instance, s.tokens, s.frames) for s in dest.shards] == [(2, 8, (5, 6, 7)), (0, 4, (1,))]
    assert dest.total_tokens == 12


def test_pool_sink_writes_pages_in_token_order():
    pools = [PagedKVPool.allocate(LAYERS, 6, PAGE, DIM, torch.float32) for _ in range(2)]
    sink = as_sink(type("Cluster", (), {"pools": pools})())
    kv = torch.randn(LAYERS, 7, DIM)
    sink.write_kv(1, [4, 0], 1, kv)  # slots 1..7 over frames 4 then 0
    slots = torch.cat([pools[1].kv[:, 4], pools[1].kv[:, 0]], dim=1)  # [L, 8, D]
    torch.testing.assert_close(slots[:, 1:8], kv, rtol=0, atol=0)
    assert float(pools[0].kv.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="do not fit"):
        sink.write_kv(1, [4, 0], 2, kv)
    with pytest.raises(ValueError, match="outside"):
        sink.write_kv(2, [0], 0, kv[:, :1])
    with pytest.raises(TypeError):
        as_sink(object())


class RecordingSink:
    """Writes into dicts, slowly enough that copies overlap on the worker threads."""

    def __init__(self, delay_s: float = 0.002) -> None:
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.written: dict[tuple[int, tuple[int, ...], int], torch.Tensor] = {}

    def write_kv(self, instance, frames, start_slot, kv):
        time.sleep(self.delay_s)
        with self.lock:
            key = (instance, tuple(frames), start_slot)
            assert key not in self.written, f"{key} written twice"
            self.written[key] = kv.clone()


def drive_transfers(engine: TransferEngine, seed: int, num_requests: int, senders: int, receivers: int):
    """Requests with 1-3 chunks each; chunks of different requests interleave; each chunk is handshaken at
    dispatch and made ready later, in random order. Returns the handshake order and the expected writes."""
    rng = random.Random(seed)
    chunks = []  # (rid, chunk, {sender: [receivers]})
    for r in range(num_requests):
        for c in range(rng.randint(1, 3)):
            group = rng.sample(range(senders), rng.randint(1, senders))
            chunks.append((f"r{r}", c, {s: rng.sample(range(receivers), rng.randint(1, receivers)) for s in group}))
    for rid in sorted({c[0] for c in chunks}, key=lambda x: int(x[1:])):
        counts = {}
        for r, _, pieces in chunks:
            if r == rid:
                for targets in pieces.values():
                    for t in targets:
                        counts[t] = counts.get(t, 0) + 1
        engine.expect(rid, counts)
    # Dispatch order: a random interleaving that keeps each request's chunks in order.
    queues = {}
    for item in chunks:
        queues.setdefault(item[0], []).append(item)
    order, handshakes, expected = [], [], {}
    while queues:
        rid = rng.choice(sorted(queues))
        order.append(queues[rid].pop(0))
        if not queues[rid]:
            del queues[rid]
    in_flight = []
    for rid, chunk, pieces in order:
        for sender, targets in pieces.items():
            for t in targets:
                engine.handshake(rid, chunk, sender, t)
                handshakes.append((t, rid))
                in_flight.append((rid, chunk, sender, t))
        rng.shuffle(in_flight)
        for _ in range(rng.randint(0, len(in_flight))):  # some computed chunks become ready now
            rid_, chunk_, sender_, t_ = in_flight.pop()
            kv = torch.full((LAYERS, 1, DIM), float(hash((rid_, chunk_, sender_, t_)) % 1000))
            engine.ready(rid_, chunk_, sender_, t_, [((sender_, chunk_), int(rid_[1:]), kv)])
            expected[(t_, (sender_, chunk_), int(rid_[1:]))] = kv
    for rid_, chunk_, sender_, t_ in in_flight:
        kv = torch.full((LAYERS, 1, DIM), float(hash((rid_, chunk_, sender_, t_)) % 1000))
        engine.ready(rid_, chunk_, sender_, t_, [((sender_, chunk_), int(rid_[1:]), kv)])
        expected[(t_, (sender_, chunk_), int(rid_[1:]))] = kv
    return handshakes, expected


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3))
def test_limited_backends_serve_requests_whole_in_first_handshake_order(seed, backends):
    senders, receivers = 4, 3
    sink = RecordingSink()
    engine = TransferEngine(sink, receivers, senders, backends=backends, workers=4)
    try:
        handshakes, expected = drive_transfers(engine, seed, 6, senders, receivers)
        engine.wait([f"r{r}" for r in range(6)], timeout_s=30)
    finally:
        engine.close()
    assert set(sink.written) == set(expected)  # every piece of every request arrived, once
    for key, kv in expected.items():
        torch.testing.assert_close(sink.written[key], kv, rtol=0, atol=0)
    for receiver in range(receivers):
        first = []
        for t, rid in handshakes:
            if t == receiver and rid not in first:
                first.append(rid)
        records = [r for r in engine.log if r.receiver == receiver]
        assert all(0 <= r.backend < backends for r in records)
        # Whole requests in order of first handshake: every piece of an earlier request ends before any piece
        # of a later one starts.
        for a, b in zip(first, first[1:]):
            assert max(r.end_seq for r in records if r.rid == a) < min(r.start_seq for r in records if r.rid == b)
        # Never more pieces in flight than backends.
        events = sorted([(r.start_seq, 1) for r in records] + [(r.end_seq, -1) for r in records])
        level = peak = 0
        for _, delta in events:
            level += delta
            peak = max(peak, level)
        assert peak <= backends


def test_enough_backends_give_each_sender_its_own():
    senders, receivers = 3, 2
    sink = RecordingSink()
    engine = TransferEngine(sink, receivers, senders, backends=senders, workers=4)
    try:
        _, expected = drive_transfers(engine, 7, 5, senders, receivers)
        engine.wait([f"r{r}" for r in range(5)])
    finally:
        engine.close()
    assert set(sink.written) == set(expected)
    assert all(r.backend == r.sender for r in engine.log)
    for receiver in range(receivers):
        for sender in range(senders):
            spans = sorted((r.start_seq, r.end_seq) for r in engine.log if (r.receiver, r.sender) == (receiver, sender))
            assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # one piece at a time per backend


def test_a_request_waits_for_its_late_chunks_and_others_queue_behind_it():
    manager = ReceiveManager(0, num_backends=1, num_senders=2)
    manager.expect("a", 2)
    manager.expect("b", 1)
    a0, b0, a1 = Piece("a", 0, 0, 0), Piece("b", 0, 1, 0), Piece("a", 1, 1, 0)
    manager.handshake(a0)
    manager.handshake(b0)
    assert manager.grant() == [(a0, 0)]
    assert manager.complete(a0, 0) is False
    assert manager.grant() == []  # "a" still owns the backends: its second chunk is not handshaken yet
    manager.handshake(a1)
    assert manager.grant() == [(a1, 0)]
    assert manager.complete(a1, 0) is True
    assert manager.grant() == [(b0, 0)]


def test_handoff_errors():
    engine = TransferEngine(RecordingSink(0.0), 1, 2, backends=1)
    try:
        with pytest.raises(ValueError, match="unexpected request"):
            engine.handshake("x", 0, 0, 0)
        engine.expect("x", {0: 1})
        with pytest.raises(ValueError, match="already"):
            engine.expect("x", {0: 1})
        with pytest.raises(ValueError, match="outside"):
            engine.expect("y", {5: 1})
        engine.handshake("x", 0, 0, 0)
        with pytest.raises(ValueError, match="twice"):
            engine.handshake("x", 0, 0, 0)
        with pytest.raises(ValueError, match="never handshaken"):
            engine.ready("x", 0, 1, 0, [])
        with pytest.raises(KeyError):
            engine.wait(["nope"])
    finally:
        engine.close()
    with pytest.raises(ValueError, match="num_backends"):
        ReceiveManager(0, 0, 2)


def test_a_failing_sink_surfaces_on_wait():
    class Broken:
        def write_kv(self, instance, frames, start_slot, kv):
            raise OSError("link down")

    engine = TransferEngine(Broken(), 1, 1, backends=None)
    try:
        engine.expect("x", {0: 1})
        engine.handshake("x", 0, 0, 0)
        engine.ready("x", 0, 0, 0, [((0,), 0, torch.zeros(1, 1, 1))])
        with pytest.raises(HandoffError, match="link down"):
            engine.wait(["x"], timeout_s=5)
    finally:
        engine.close()
