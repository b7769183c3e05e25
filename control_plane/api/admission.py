"""Bounded admission: at most `max_pending` requests (waiting + running) in the server at once.

A request that finds the server full is refused with 429 and a Retry-After estimated from the recent rate of
completions (one slot frees after about 1 / rate seconds), clamped to [1, 60] s.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque


class AdmissionQueue:
    def __init__(self, max_pending: int, rate_window_s: float = 30.0) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.max_pending = max_pending
        self.rate_window_s = rate_window_s
        self.pending = 0
        self._finishes: deque[float] = deque()  # monotonic times of recent completions
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.pending >= self.max_pending:
                return False
            self.pending += 1
            return True

    @property
    def full(self) -> bool:
        return self.pending >= self.max_pending

    def leave(self, completed: bool = True) -> None:
        """Free a slot; `completed` False for a request refused after admission (it says nothing of the rate)."""
        now = time.monotonic()
        with self._lock:
            if self.pending <= 0:
                raise RuntimeError("AdmissionQueue.leave() without a matching try_enter()")
            self.pending -= 1
            if completed:
                self._finishes.append(now)
            self._trim(now)

    def retry_after_s(self) -> int:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._finishes:
                return 1
            rate = len(self._finishes) / self.rate_window_s  # completions per second
        return int(min(60, max(1, math.ceil(1.0 / rate))))

    def _trim(self, now: float) -> None:
        while self._finishes and self._finishes[0] < now - self.rate_window_s:
            self._finishes.popleft()
