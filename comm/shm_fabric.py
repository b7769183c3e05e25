"""Shared-memory fabric: one process per rank on one host.

Each rank owns one flag segment (int64 [num_flags + world_size]: user flags, then barrier flags) and one
segment per registered buffer, named `ncp<session>_<rank>_f` / `ncp<session>_<rank>_b<index>`. A put is a
memcpy into the peer's mapped buffer; a signal is one aligned 8-byte store into the peer's flag segment,
issued after the put's copy has returned, so a reader that sees the flag sees the rows (store order is
preserved on x86-64's TSO memory model; weaker CPUs would need a fence that Python cannot issue, so on them
run this backend only with payloads that carry their own checksum). Waiting polls the flag without sleeping for
up to the session's spin_s (2 ms when every rank can have a core of its own: a sleeping process wakes late on a VM;
20 us when ranks share cores), then with a 10 us..200 us sleep backoff; a rank given an `AbortWord` checks it at
every poll and raises `FabricAborted` once it fires (its owner saw a peer die or hang). The creating rank unlinks
its segments in `close()`; `ShmFabric.cleanup(info)` removes what a crashed session left.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

import torch

from nanocp.comm import _shm
from nanocp.comm.fabric import (
    DEFAULT_TIMEOUT_S,
    MAX_FLAG_VALUE,
    POLL_SPIN_S,
    SHARED_CORE_SPIN_S,
    AbortWord,
    BufferSpec,
    Fabric,
    FabricAborted,
    FabricError,
    FabricTimeout,
    poll_until,
)


@dataclass(frozen=True)
class ShmFabricInfo:
    """Picklable description of one shared-memory fabric; pass it to each rank's process."""

    session: str
    world_size: int
    num_flags: int = 256
    spin_s: float = POLL_SPIN_S  # how long a waiter polls before sleeping (fabric.POLL_SPIN_S)

    @property
    def prefix(self) -> str:
        return f"ncp{self.session}_"

    def flag_segment(self, rank: int) -> str:
        return f"{self.prefix}{rank}_f"

    def buffer_segment(self, rank: int, index: int) -> str:
        return f"{self.prefix}{rank}_b{index}"


class ShmFabric(Fabric):
    """Rank `rank` of the fabric described by `info`; construct one per process (or thread)."""

    @staticmethod
    def new_session(world_size: int, num_flags: int = 256, spin_s: float | None = None) -> ShmFabricInfo:
        """A new session. spin_s defaults to POLL_SPIN_S when every rank can have a core of its own (world_size <=
        the cores this process may run on), else to SHARED_CORE_SPIN_S: a waiter spinning on a core its peer needs
        would only slow the peer down."""
        if world_size < 1 or num_flags < 1:
            raise ValueError(f"need world_size >= 1 and num_flags >= 1, got {world_size}, {num_flags}")
        if spin_s is None:
            spin_s = POLL_SPIN_S if world_size <= len(os.sched_getaffinity(0)) else SHARED_CORE_SPIN_S
        if not spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        return ShmFabricInfo(secrets.token_hex(6), world_size, num_flags, float(spin_s))

    @staticmethod
    def segments(info: ShmFabricInfo) -> list[str]:
        """Live segment names of this session (empty once every rank has closed)."""
        return _shm.list_prefix(info.prefix)

    @staticmethod
    def cleanup(info: ShmFabricInfo) -> int:
        """Unlink whatever segments of this session are left (after a crash); returns how many."""
        return _shm.unlink_prefix(info.prefix)

    def __init__(
        self,
        info: ShmFabricInfo,
        rank: int,
        connect_timeout_s: float = DEFAULT_TIMEOUT_S,
        abort: AbortWord | None = None,
    ):
        super().__init__(rank, info.world_size, info.num_flags)
        _shm.require_shm_dir()
        self.info = info
        self.abort = abort
        self._owned: list[str] = []  # segment names this rank created (and unlinks)
        self._flag_segs = {}  # rank -> SharedMemory of that rank's flags
        self._flag_views: dict[int, memoryview] = {}  # rank -> int64 view of its flags
        self._buffers: dict[int, list[torch.Tensor | None]] = {}  # index -> per-rank mapped tensor
        total_flags = info.num_flags + info.world_size
        name = info.flag_segment(rank)
        seg = _shm.create_segment(name, total_flags * 8)
        self._owned.append(name)
        self._adopt_flags(rank, seg)
        self._attach_peer_flags(connect_timeout_s)

    def _adopt_flags(self, rank: int, seg) -> None:
        self._flag_segs[rank] = seg
        self._flag_views[rank] = seg.buf.cast("q")

    def _attach_peer_flags(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            while True:
                try:
                    self._adopt_flags(peer, _shm.attach_segment(self.info.flag_segment(peer)))
                    break
                except (FileNotFoundError, ValueError):  # not created yet, or created but not yet sized
                    if time.monotonic() >= deadline:
                        self.close()
                        raise FabricTimeout(f"segment of rank {peer}", self.rank, 1, 0, timeout_s) from None
                    time.sleep(1e-3)

    # ---- hooks ------------------------------------------------------------------------------------------
    def _create_buffer(self, index: int, spec: BufferSpec) -> None:
        name = self.info.buffer_segment(self.rank, index)
        _shm.create_segment(name, spec.nbytes).close()
        self._owned.append(name)
        views: list[torch.Tensor | None] = [None] * self.world_size
        views[self.rank] = _shm.map_tensor(name, spec.shape, spec.dtype)
        self._buffers[index] = views

    def _after_register(self, index: int, spec: BufferSpec) -> None:
        views = self._buffers[index]
        for peer in range(self.world_size):
            if views[peer] is None:
                views[peer] = _shm.map_tensor(self.info.buffer_segment(peer, index), spec.shape, spec.dtype)

    def _local_buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index][self.rank]

    def _put(self, dst: int, index: int, spec: BufferSpec, row_offset: int, rows: torch.Tensor) -> None:
        target = self._buffers[index][dst]
        if target is None:
            raise FabricError(f"rank {self.rank}: buffer '{spec.name}' of rank {dst} is not mapped")
        target[row_offset : row_offset + rows.shape[0]].copy_(rows)

    def _peer_buffer(self, dst: int, index: int) -> torch.Tensor | None:
        return self._buffers[index][dst]

    def _signal(self, dst: int, flag: int, value: int) -> None:
        self._flag_views[dst][flag] = value

    def _wait(self, flag: int, value: int, timeout_s: float) -> int:
        view = self._flag_views[self.rank]
        abort = self.abort
        if abort is None:
            read = lambda: view[flag]
        else:  # an aborted wait reads past any value, so the poll returns at once
            words, index, generation = abort.words, abort.index, abort.generation
            read = lambda: view[flag] if words[index] < generation else MAX_FLAG_VALUE + 1
        seen = poll_until(read, value, time.monotonic() + timeout_s, spin_s=self.info.spin_s)
        if abort is not None and abort.fired():
            raise FabricAborted(self.rank, f"wait for flag {flag} >= {value}")
        if seen < value:
            raise FabricTimeout(flag, self.rank, value, seen, timeout_s)
        return seen

    def _read_flag(self, flag: int) -> int:
        return self._flag_views[self.rank][flag]

    def _close(self) -> None:
        self._buffers.clear()
        for view in self._flag_views.values():
            view.release()
        self._flag_views.clear()
        for seg in self._flag_segs.values():
            seg.close()
        self._flag_segs.clear()
        for name in self._owned:
            _shm.unlink_segment(name)
        self._owned.clear()
