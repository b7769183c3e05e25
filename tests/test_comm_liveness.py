"""The liveness board: an abort word every shared-memory fabric wait polls, and heartbeats an owner watches."""

from __future__ import annotations

import threading
import time

import pytest

from nanocp.comm.fabric import FabricAborted, FabricTimeout
from nanocp.comm.liveness import Heartbeat, HeartbeatMonitor, LivenessBoard, heartbeat_period
from nanocp.comm.shm_fabric import ShmFabric


@pytest.fixture
def board():
    b = LivenessBoard.create(2)
    yield b
    b.close()


def _fabrics(board: LivenessBoard, generation: int) -> list[ShmFabric]:
    info = ShmFabric.new_session(2, num_flags=4)
    out: list[ShmFabric | None] = [None, None]

    def make(rank: int) -> None:
        out[rank] = ShmFabric(info, rank, connect_timeout_s=10, abort=board.abort_word(generation))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_an_abort_releases_a_wait_at_once_and_spares_the_next_generation(board):
    fabrics = _fabrics(board, generation=1)
    try:
        threading.Timer(0.2, board.abort, args=(1,)).start()
        began = time.monotonic()
        with pytest.raises(FabricAborted):
            fabrics[0].wait(0, 1, timeout_s=30.0)  # rank 1 never signals: only the abort ends this wait
        assert time.monotonic() - began < 5.0
        with pytest.raises(FabricAborted):  # sticky: every later wait of the generation fails at once
            fabrics[1].wait(0, 1, timeout_s=30.0)
    finally:
        for f in fabrics:
            f.close()
    rebuilt = _fabrics(board, generation=2)
    try:
        rebuilt[1].signal(0, 0, 5)
        assert rebuilt[0].wait(0, 5, timeout_s=1.0) == 5
        with pytest.raises(FabricTimeout):  # not aborted: a missing signal times out as before
            rebuilt[0].wait(1, 1, timeout_s=0.05)
    finally:
        for f in rebuilt:
            f.close()


def test_the_abort_word_never_goes_back(board):
    board.abort(3)
    board.abort(2)
    assert board.aborted(3) and not board.aborted(4)


def test_a_silent_slot_is_reported_after_the_timeout_and_a_beat_clears_it(board):
    now = [100.0]
    monitor = HeartbeatMonitor(board, timeout_s=3.0, clock=lambda: now[0])
    monitor.watch([0, 1])
    now[0] += 2.9
    board.beat(1)
    assert monitor.silent() == []
    now[0] += 0.2  # slot 0 silent for 3.1 s, slot 1 beat 0.2 s ago
    assert monitor.silent() == [0]
    board.beat(0)
    assert monitor.silent() == []
    monitor.unwatch(0)
    now[0] += 10
    assert monitor.silent() == [1]


def test_a_heartbeat_thread_beats_until_stopped(board):
    heart = Heartbeat(board, 1, period_s=0.01)
    try:
        first = board.beats(1)
        deadline = time.monotonic() + 5
        while board.beats(1) < first + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.beats(1) >= first + 3
    finally:
        heart.stop()
    stopped = board.beats(1)
    time.sleep(0.05)
    assert board.beats(1) == stopped and board.beats(0) == 0


def test_bad_arguments_are_refused(board):
    with pytest.raises(ValueError, match="slot 2 outside"):
        board.beat(2)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        HeartbeatMonitor(board, 0)
    with pytest.raises(ValueError, match="generation must be >= 1"):
        board.abort_word(0)
    assert 0 < heartbeat_period(3.0) <= 0.25
