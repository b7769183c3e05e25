"""Liveness of a group of ranks run by one owner (the driver): an abort word and per-rank heartbeats.

One shared-memory segment of int64 words, created by the owner, attached by each rank's process:

    [0] abort epoch: every fabric wait of work handed out in an earlier epoch raises FabricAborted
    [1 + slot] heartbeat counter of the process in `slot` (bumped by a thread of that process)

The owner watches its ranks' processes (their exit, and their heartbeats: a stopped or wedged process stops
beating) and, as soon as one is lost, raises the abort word to a new epoch, so the survivors' fabric waits for work
of the old epoch return within one poll instead of running into their timeout; work handed out afterwards carries
the new epoch (an `AbortWord` of generation epoch + 1) and runs normally. Slots name processes, not ranks: a process
keeps its slot when the group is rebuilt around it with new ranks.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nanocp.comm import _shm
from nanocp.comm.fabric import AbortWord

ABORT_INDEX = 0


@dataclass(frozen=True)
class LivenessInfo:
    """Picklable address of a liveness board; pass it to each rank's process."""

    name: str
    slots: int


class LivenessBoard:
    """The shared words; `create` on the owner (which unlinks the segment on close), `attach` in each process."""

    def __init__(self, info: LivenessInfo, owner: bool):
        if owner:
            self._seg = _shm.create_segment(info.name, (1 + info.slots) * 8)
        else:
            self._seg = _shm.attach_segment(info.name)
        self.info, self._owner = info, owner
        self.words = self._seg.buf.cast("q")

    @classmethod
    def create(cls, slots: int) -> LivenessBoard:
        if slots < 1:
            raise ValueError(f"a liveness board needs >= 1 slot, got {slots}")
        return cls(LivenessInfo(f"ncpl{secrets.token_hex(6)}", slots), owner=True)

    @classmethod
    def attach(cls, info: LivenessInfo) -> LivenessBoard:
        return cls(info, owner=False)

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.info.slots:
            raise ValueError(f"slot {slot} outside [0, {self.info.slots})")
        return slot

    # ---- abort ------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.words[ABORT_INDEX]

    def abort(self, epoch: int) -> None:
        """Abort every wait of work from epochs before `epoch` (never lowers the word)."""
        if epoch > self.words[ABORT_INDEX]:
            self.words[ABORT_INDEX] = epoch

    def aborted(self, generation: int) -> bool:
        return self.words[ABORT_INDEX] >= generation

    def abort_word(self, generation: int) -> AbortWord:
        """What a fabric polls (ShmFabric's `abort`) for work of epoch generation - 1."""
        return AbortWord(self.words, ABORT_INDEX, generation)

    # ---- heartbeats -------------------------------------------------------------------------------------
    def beat(self, slot: int) -> None:
        i = 1 + self._check_slot(slot)
        self.words[i] = self.words[i] + 1

    def beats(self, slot: int) -> int:
        return self.words[1 + self._check_slot(slot)]

    def close(self) -> None:
        if self._seg is None:
            return
        self.words.release()
        self._seg.close()
        if self._owner:
            _shm.unlink_segment(self.info.name)
        self._seg = None


class Heartbeat:
    """A daemon thread of a rank's process that bumps its slot every `period_s`. It stops when the process is
    stopped (SIGSTOP) or dies, and when a wedged call holds the GIL, which is what the owner's monitor detects."""

    def __init__(self, board: LivenessBoard, slot: int, period_s: float):
        if not period_s > 0:
            raise ValueError(f"heartbeat period must be > 0, got {period_s}")
        self.board, self.slot, self.period_s = board, slot, period_s
        self._stop = threading.Event()
        board.beat(slot)
        self._thread = threading.Thread(target=self._run, name=f"nanocp-heartbeat-{slot}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.board.beat(self.slot)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def heartbeat_period(timeout_s: float) -> float:
    """How often a process beats (and its owner looks) for a heartbeat timeout: several beats per timeout."""
    return min(0.25, timeout_s / 8)


class HeartbeatMonitor:
    """Owner side: which watched slots have not beaten for `timeout_s`. A slot is judged by the owner's own clock
    (when it last saw the counter change), so an owner that was busy for a while does not misjudge a live rank:
    a counter that moved meanwhile counts as a beat."""

    def __init__(self, board: LivenessBoard, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"heartbeat timeout must be > 0, got {timeout_s}")
        self.board, self.timeout_s, self.clock = board, timeout_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # slot -> (counter, when it last changed)

    def watch(self, slots: Iterable[int]) -> None:
        """Start (or restart) watching these slots from now."""
        now = self.clock()
        for slot in slots:
            self._seen[slot] = (self.board.beats(slot), now)

    def unwatch(self, slot: int) -> None:
        self._seen.pop(slot, None)

    def silent(self) -> list[int]:
        """Watched slots whose counter has not moved for timeout_s, ascending."""
        now, silent = self.clock(), []
        for slot, (count, since) in self._seen.items():
            beats = self.board.beats(slot)
            if beats != count:
                self._seen[slot] = (beats, now)
            elif now - since >= self.timeout_s:
                silent.append(slot)
        return sorted(silent)
