"""KV hand-off from the prefill tier to the decode cluster with handshake-based backend allocation (Tetris Sec. 4.2).

The decode scheduler decides a request's KV binding and pages first (`KVDestination`: shards in binding order, each
receiving a contiguous run of context positions into its frames). Every prefill instance writes the rows it
computed for a chunk straight into those pages through a `KVSink` (`write_kv(instance, frames, start_slot, kv)`);
nothing is gathered on one instance.

Transfer management: a piece = the rows one prefill instance (sender) computed for one chunk that land on one decode
instance (receiver). The sender's send manager handshakes with the receiver's `ReceiveManager` when the chunk is
dispatched (before it is computed, so the handshake overlaps compute); the piece's data is attached when the chunk
is done; it moves once it holds a receive backend. Each decode instance has a bounded number of receive backends:
- with at least one backend per sender, each sender uses its own dedicated backend (pieces go at once);
- with fewer, requests are served in order of their first handshake at that receiver, every piece of a request
  before any piece of the next (Tetris: backends stay reserved for a request until all its chunks have arrived),
  so no request is starved and a partly filled cache does not sit waiting behind later requests.
`TransferEngine` runs the copies on worker threads, overlapped with the compute of the next chunks, and tells the
caller when all pieces of a request have landed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


class HandoffError(RuntimeError):
    """A transfer failed or did not finish in time."""


@runtime_checkable
class KVSink(Protocol):
    """Where prefilled KV lands: `kv` [L, n, Dkv] becomes slots start_slot .. start_slot + n - 1 of the shard
    whose pages (in token order) are `frames` on decode instance `instance`."""

    def write_kv(self, instance: int, frames: Sequence[int], start_slot: int, kv: torch.Tensor) -> None: ...


class PoolSink:
    """A `KVSink` over decode KV pools (`data_plane.kv_pool.PagedKVPool`, e.g. a local cluster's `pools`)."""

    def __init__(self, pools: Sequence) -> None:
        self.pools = list(pools)

    def write_kv(self, instance: int, frames: Sequence[int], start_slot: int, kv: torch.Tensor) -> None:
        if not 0 <= instance < len(self.pools):
            raise ValueError(f"decode instance {instance} outside [0, {len(self.pools)})")
        pool = self.pools[instance]
        if start_slot < 0 or start_slot + kv.shape[1] > len(frames) * pool.page_size:
            raise ValueError(
                f"slots [{start_slot}, {start_slot + kv.shape[1]}) do not fit {len(frames)} pages of "
                f"{pool.page_size} on instance {instance}"
            )
        pool.write_range(list(frames), start_slot, kv)


def as_sink(target) -> KVSink:
    """A sink from a decode cluster (every cluster is a KV sink: `write_kv`), a `KVSink`, or bare KV pools."""
    if hasattr(target, "write_kv"):
        return target
    if hasattr(target, "pools"):
        return PoolSink(target.pools)
    raise TypeError(f"{type(target).__name__} is neither a KVSink nor a cluster with KV pools")


@dataclass(frozen=True)
class ShardDest:
    """One shard of a request's KV binding: `tokens` context positions land in slots 0.. of `frames`."""

    instance: int
    tokens: int
    frames: tuple[int, ...]


@dataclass(frozen=True)
class KVWrite:
    """One contiguous write: rows [row_lo, row_hi) of a run go to slots from `start_slot` of a shard."""

    instance: int
    frames: tuple[int, ...]
    start_slot: int
    row_lo: int
    row_hi: int


@dataclass(frozen=True)
class KVDestination:
    """A request's decode-side KV binding: shards in binding order hold consecutive context positions."""

    shards: tuple[ShardDest, ...]

    def __post_init__(self) -> None:
        if not self.shards or any(s.tokens < 0 for s in self.shards):
            raise ValueError("a KV destination needs at least one shard and no negative token counts")

    @classmethod
    def from_shard_pages(
        cls, shard_pages: Sequence[tuple[int, int, Sequence[int]]], moe_instance: int, window: int = 1
    ) -> KVDestination:
        """From `GlobalScheduler.shard_pages(rid)`: (instance, n_tokens, frames) per shard in binding order; the
        MoE instance's shard keeps its last `window` slots for the tokens the iteration decodes (one without
        multi-step), so it receives n_tokens - window context tokens."""
        shards = tuple(
            ShardDest(int(i), int(n) - (window if int(i) == moe_instance else 0), tuple(int(f) for f in frames))
            for i, n, frames in shard_pages
        )
        return cls(shards)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def writes(self, start: int, n: int) -> list[KVWrite]:
        """Where positions [start, start + n) land: one write per shard they touch, rows relative to `start`."""
        if start < 0 or n < 0 or start + n > self.total_tokens:
            raise ValueError(f"positions [{start}, {start + n}) outside the destination's {self.total_tokens} tokens")
        out, base = [], 0
        for shard in self.shards:
            lo, hi = max(start, base), min(start + n, base + shard.tokens)
            if lo < hi:
                out.append(KVWrite(shard.instance, shard.frames, lo - base, lo - start, hi - start))
            base += shard.tokens
        return out


# ---------------------------------------------------------------------------------------------------------------
# Receive side: backend allocation


@dataclass
class Piece:
    """What one sender computed for one chunk of a request that lands on one receiver."""

    rid: str
    chunk: int
    sender: int
    receiver: int
    handshake_seq: int = -1
    data: list[tuple[tuple[int, ...], int, torch.Tensor]] | None = None  # (frames, start_slot, kv [L, n, Dkv])

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.rid, self.chunk, self.sender, self.receiver)


class ReceiveManager:
    """Receive backends of one decode instance and the order in which requests get them."""

    def __init__(self, receiver: int, num_backends: int | None, num_senders: int) -> None:
        if num_backends is not None and num_backends < 1:
            raise ValueError(f"num_backends must be >= 1 or None (dedicated), got {num_backends}")
        self.receiver = receiver
        self.dedicated = num_backends is None or num_backends >= num_senders
        self.num_backends = num_senders if self.dedicated else num_backends
        self.free = list(range(self.num_backends))
        self.expected: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.order: deque[str] = deque()  # requests by first handshake (limited mode)
        self.waiting: dict[str, deque[Piece]] = {}  # handshaken, not granted, per request
        self.per_sender: dict[int, deque[Piece]] = {}  # dedicated mode: FIFO per sender backend
        self.busy_senders: set[int] = set()

    def expect(self, rid: str, pieces: int) -> None:
        if pieces < 1:
            raise ValueError(f"request {rid!r}: expected pieces must be >= 1, got {pieces}")
        if rid in self.expected:
            raise ValueError(f"request {rid!r} is already expected on receiver {self.receiver}")
        self.expected[rid] = pieces
        self.completed[rid] = 0

    def handshake(self, piece: Piece) -> None:
        if piece.rid not in self.expected:
            raise ValueError(f"receiver {self.receiver}: handshake for unexpected request {piece.rid!r}")
        if self.dedicated:
            self.per_sender.setdefault(piece.sender, deque()).append(piece)
            return
        if piece.rid not in self.waiting:
            self.waiting[piece.rid] = deque()
            self.order.append(piece.rid)
        self.waiting[piece.rid].append(piece)

    def grant(self) -> list[tuple[Piece, int]]:
        """Pieces that get a backend now, with its id."""
        granted = []
        if self.dedicated:
            for sender, queue in self.per_sender.items():
                if queue and sender not in self.busy_senders:
                    self.busy_senders.add(sender)
                    granted.append((queue.popleft(), sender))
            return granted
        if not self.order:
            return granted
        head = self.waiting[self.order[0]]  # only the earliest request holds backends
        while head and self.free:
            granted.append((head.popleft(), self.free.pop(0)))
        return granted

    def complete(self, piece: Piece, backend: int) -> bool:
        """A granted piece has landed; True when it was its request's last piece on this receiver."""
        self.completed[piece.rid] += 1
        done = self.completed[piece.rid] == self.expected[piece.rid]
        if self.dedicated:
            self.busy_senders.discard(backend)
        else:
            self.free.append(backend)
            self.free.sort()
            if done:
                if self.order[0] != piece.rid or self.waiting[piece.rid]:
                    raise HandoffError(f"receiver {self.receiver}: request {piece.rid!r} finished out of order")
                self.order.popleft()
                del self.waiting[piece.rid]
        if done:
            del self.expected[piece.rid], self.completed[piece.rid]
        return done


# ---------------------------------------------------------------------------------------------------------------
# The transfer engine


@dataclass(frozen=True)
class TransferRecord:
    """One finished piece: its backend and the global event order of its start and end."""

    rid: str
    chunk: int
    sender: int
    receiver: int
    backend: int
    handshake_seq: int
    start_seq: int
    end_seq: int
    seconds: float


@dataclass
class _Pending:
    receivers: set[int] = field(default_factory=set)
    event: threading.Event = field(default_factory=threading.Event)


class TransferEngine:
    """Send managers, receive managers and the copy workers of one prefill tier."""

    def __init__(
        self, sink: KVSink, num_receivers: int, num_senders: int, backends: int | None = None, workers: int = 2
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.sink = sink
        self.managers = [ReceiveManager(r, backends, num_senders) for r in range(num_receivers)]
        self.log: list[TransferRecord] = []
        self._lock = threading.Lock()
        self._events = itertools.count()
        self._handshakes = itertools.count()
        self._pieces: dict[tuple[str, int, int, int], Piece] = {}
        self._granted: dict[tuple[str, int, int, int], int] = {}  # piece -> backend, not yet started
        self._pending: dict[str, _Pending] = {}
        self._errors: list[BaseException] = []
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="nanocp-kv-transfer")

    def expect(self, rid: str, pieces_per_receiver: dict[int, int]) -> None:
        """Announce how many pieces of `rid` each receiver gets (before the first handshake)."""
        with self._lock:
            if rid in self._pending:
                raise ValueError(f"request {rid!r} already has transfers in flight")
            for receiver, count in pieces_per_receiver.items():
                self._manager(receiver).expect(rid, count)
            self._pending[rid] = _Pending(set(pieces_per_receiver))
            if not pieces_per_receiver:
                self._pending[rid].event.set()

    def handshake(self, rid: str, chunk: int, sender: int, receiver: int) -> None:
        """Send manager: ask `receiver` for a backend for this piece (at dispatch, overlapping its compute)."""
        piece = Piece(rid, chunk, sender, receiver)
        with self._lock:
            if piece.key in self._pieces:
                raise ValueError(f"piece {piece.key} handshaken twice")
            self._manager(receiver).handshake(piece)
            piece.handshake_seq = next(self._handshakes)
            self._pieces[piece.key] = piece
            self._pump()

    def ready(self, rid: str, chunk: int, sender: int, receiver: int, data) -> None:
        """The chunk is computed: attach the piece's writes [(frames, start_slot, kv [L, n, Dkv])]."""
        with self._lock:
            piece = self._pieces.get((rid, chunk, sender, receiver))
            if piece is None:
                raise ValueError(f"piece {(rid, chunk, sender, receiver)} was never handshaken")
            piece.data = list(data)
            self._pump()

    def wait(self, rids: Sequence[str], timeout_s: float = 30.0) -> None:
        """Block until every piece of `rids` has landed (raises HandoffError on a failed copy or timeout)."""
        deadline = time.monotonic() + timeout_s
        for rid in rids:
            pending = self._pending.get(rid)
            if pending is None:
                raise KeyError(f"request {rid!r} has no transfers")
            while not pending.event.wait(0.05):
                self._raise_errors()
                if time.monotonic() > deadline:
                    raise HandoffError(f"KV of request {rid!r} did not land within {timeout_s:.1f} s")
            self._raise_errors()
        with self._lock:
            for rid in rids:
                self._pending.pop(rid, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _raise_errors(self) -> None:
        if self._errors:
            raise HandoffError(f"KV transfer failed: {self._errors[0]!r}") from self._errors[0]

    def _manager(self, receiver: int) -> ReceiveManager:
        if not 0 <= receiver < len(self.managers):
            raise ValueError(f"receiver {receiver} outside [0, {len(self.managers)})")
        return self.managers[receiver]

    def _pump(self) -> None:
        """Under the lock: grant backends, then start every granted piece whose data is there."""
        for manager in self.managers:
            for piece, backend in manager.grant():
                self._granted[piece.key] = backend
        for key in [k for k, _ in self._granted.items() if self._pieces[k].data is not None]:
            backend = self._granted.pop(key)
            piece = self._pieces[key]
            self._pool.submit(self._copy, piece, backend, next(self._events))

    def _copy(self, piece: Piece, backend: int, start_seq: int) -> None:
        began = time.perf_counter()
        try:
            for frames, start_slot, kv in piece.data:
                self.sink.write_kv(piece.receiver, frames, start_slot, kv)
        except BaseException as exc:  # noqa: BLE001 - reported to whoever waits for the request
            self._errors.append(exc)
            return
        seconds = time.perf_counter() - began
        with self._lock:
            record = TransferRecord(
                piece.rid,
                piece.chunk,
                piece.sender,
                piece.receiver,
                backend,
                piece.handshake_seq,
                start_seq,
                next(self._events),
                seconds,
            )
            self.log.append(record)
            del self._pieces[piece.key]
            if self.managers[piece.receiver].complete(piece, backend):
                pending = self._pending[piece.rid]
                pending.receivers.discard(piece.receiver)
                if not pending.receivers:
                    pending.event.set()
            self._pump()
