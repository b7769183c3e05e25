"""Symmetric-memory fabric: one-sided puts into peers' registered buffers plus 64-bit signal flags.

A fabric connects `world_size` ranks (one rank = one decode instance). Every rank registers the same named
receive buffers in the same order (collective); any rank may then `put` rows into a peer's buffer and
`signal` a flag on that peer once the puts are visible; the peer `wait`s until its flag reaches a value.
This is the NVSHMEM put/put_signal/signal_wait model reduced to what the Q/Res routing and MoE
dispatch/combine need. Every wait has a timeout and raises `FabricTimeout`: a missing peer never deadlocks.

Flags are `set` (not added): give each source its own flag (see `reserve_flags`) and use increasing
sequence numbers. Flags `[0, num_flags)` belong to the user; `world_size` more are reserved for `barrier`.

Backends: `InProcessFabric` (threads in one process, below), `ShmFabric` (processes on one host,
comm/shm_fabric.py), `TorchDistFabric` (processes on several hosts over torch.distributed,
comm/dist_fabric.py).
"""

from __future__ import annotations

import operator
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

MAX_FLAG_VALUE = 2**63 - 1
DEFAULT_TIMEOUT_S = 30.0
POLL_SLEEP_S = (1e-5, 2e-4)  # first and longest sleep between polls once the spin is over
# How long a waiter polls without sleeping. A peer at an exchange is usually well under this behind, and a sleeping
# process costs more than its sleep on a VM: its idle vCPU is descheduled by the host and the wake-up can take far
# longer than the wait. 2-process decode on this project's 2-vCPU VM, paired runs against a 20 us spin: 5 of 6 pairs
# faster (medians 1.4-3.1x) in a quiet spell, 1 of 3 in a spell when the host was busy. Each waiter is meant to have
# its own core; callers that may share a core with the peer pass SHARED_CORE_SPIN_S.
POLL_SPIN_S = 2e-3
SHARED_CORE_SPIN_S = 2e-5


class FabricError(RuntimeError):
    """A fabric operation failed (peer missing, backend failure, use after close)."""


class FabricAborted(FabricError):
    """The iteration was aborted from outside (a peer died or hung): every wait returns at once with this error."""

    def __init__(self, rank: int, what: str):
        super().__init__(f"rank {rank}: {what} aborted (a peer died or stopped answering)")


class AbortWord:
    """A shared int64 word that aborts every wait once it holds a value >= `generation`. The owner of a group of
    ranks raises it (comm/liveness.py) when one of them dies or hangs, so the survivors' waits return at once
    instead of running into their timeout. The owner hands each unit of work the generation it belongs to (set
    `generation` before running it): work handed out after an abort has a higher generation and is not aborted."""

    def __init__(self, words: memoryview, index: int, generation: int):
        if generation < 1:
            raise ValueError(f"an abort generation must be >= 1, got {generation}")
        self.words, self.index, self.generation = words, index, generation

    def fired(self) -> bool:
        return self.words[self.index] >= self.generation


class FabricTimeout(FabricError, TimeoutError):
    """`wait` (or `barrier`) did not see the flag reach its value in time."""

    def __init__(self, flag: int | str, rank: int, value: int, observed: int, timeout_s: float):
        self.flag, self.rank, self.value, self.observed = flag, rank, value, observed
        super().__init__(
            f"rank {rank}: flag {flag} did not reach {value} within {timeout_s:.3f}s (last seen {observed})"
        )


@dataclass(frozen=True)
class BufferSpec:
    """Shape and dtype of one symmetric buffer; rows are the first dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def make(name: str, shape, dtype: torch.dtype) -> BufferSpec:
        if not isinstance(name, str) or not name:
            raise ValueError(f"buffer name must be a non-empty string, got {name!r}")
        shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"buffer '{name}' needs a non-empty shape of positive dims, got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"buffer '{name}' dtype must be a torch.dtype, got {dtype!r}")
        return BufferSpec(name, shape, dtype)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_bytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.row_shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def _as_int(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r}") from None


def poll_until(read, value: int, deadline: float, spin_s: float = POLL_SPIN_S) -> int:
    """Poll `read()` until it returns >= value or the deadline passes: spin for spin_s, then sleeps doubling
    from 10 us to 200 us. Returns the last value read (the caller compares)."""
    delay, longest = POLL_SLEEP_S
    seen = read()
    if seen >= value:
        return seen
    spin_end = min(time.monotonic() + spin_s, deadline)
    while time.monotonic() < spin_end:
        seen = read()
        if seen >= value:
            return seen
    while True:
        seen = read()
        if seen >= value:
            return seen
        now = time.monotonic()
        if now >= deadline:
            return seen
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, longest)


class Fabric(ABC):
    """Common interface and argument checking; backends implement the underscored hooks."""

    def __init__(self, rank: int, world_size: int, num_flags: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if num_flags < 1:
            raise ValueError(f"num_flags must be >= 1, got {num_flags}")
        self.rank = rank
        self.world_size = world_size
        self.num_flags = num_flags  # user flags; barrier flags follow them
        self._specs: dict[str, BufferSpec] = {}
        self._index: dict[str, int] = {}
        self._next_flag = 0
        self._barrier_epoch = 0
        self._closed = False

    # ---- public API -------------------------------------------------------------------------------------
    def register(self, name: str, shape, dtype: torch.dtype, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
        """Collective: create this rank's buffer `name` (zero-filled) and wait until every rank has one."""
        self._check_open()
        spec = BufferSpec.make(name, shape, dtype)
        if name in self._specs:
            raise ValueError(f"buffer '{name}' is already registered")
        index = len(self._specs)
        self._create_buffer(index, spec)
        self._specs[name], self._index[name] = spec, index
        self.barrier(timeout_s)
        self._after_register(index, spec)
        return self.buffer(name)

    def buffer(self, name: str) -> torch.Tensor:
        """This rank's receive buffer `name` (the same tensor every call)."""
        self._check_open()
        self.spec(name)
        return self._local_buffer(self._index[name])

    def peer_buffer(self, dst: int, name: str) -> torch.Tensor | None:
        """dst's buffer `name` mapped into this process, to be written in place (a load/store fabric: shared memory,
        or threads of one process), or None where rows travel only by `put`. Writes into it are published by a
        later `signal` to dst, exactly like a put's rows; this rank's own buffer is `buffer(name)`."""
        self._check_open()
        self.spec(name)
        return self._peer_buffer(self._check_rank(dst, "dst"), self._index[name])

    def spec(self, name: str) -> BufferSpec:
        if name not in self._specs:
            raise KeyError(f"buffer '{name}' is not registered (known: {sorted(self._specs)})")
        return self._specs[name]

    def put(self, dst: int, name: str, row_offset: int, tensor: torch.Tensor) -> None:
        """One-sided write of `tensor` [n, *row_shape] into rows [row_offset, row_offset + n) of dst's buffer."""
        self._check_open()
        dst = self._check_rank(dst, "dst")
        spec = self.spec(name)
        row_offset = _as_int(row_offset, "row_offset")
        self._check_rows(spec, row_offset, tensor)
        if tensor.shape[0] == 0:
            return
        self._put(dst, self._index[name], spec, row_offset, tensor.contiguous())

    def signal(self, dst: int, flag: int, value: int) -> None:
        """Set flag `flag` on rank dst to `value`, after every earlier put from this rank to dst is visible."""
        self._check_open()
        self._signal(self._check_rank(dst, "dst"), self._check_flag(flag), self._check_value(value))

    def wait(self, flag: int, value: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
        """Block until this rank's flag >= value; returns the flag. Raises FabricTimeout after timeout_s."""
        self._check_open()
        return self._wait(self._check_flag(flag), self._check_value(value), float(timeout_s))

    def read_flag(self, flag: int) -> int:
        """Current value of this rank's flag (no waiting)."""
        self._check_open()
        return self._read_flag(self._check_flag(flag))

    def reserve_flags(self, count: int) -> int:
        """Hand out `count` consecutive user flags; returns the first. Deterministic, so ranks that reserve
        in the same order get the same indices (reserve like you register). Reservations start at flag 0:
        code that also picks raw flag numbers must take them from here too."""
        if count < 1 or self._next_flag + count > self.num_flags:
            raise ValueError(
                f"cannot reserve {count} flags: {self.num_flags - self._next_flag} of {self.num_flags} left"
            )
        base, self._next_flag = self._next_flag, self._next_flag + count
        return base

    def barrier(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Collective: return once every rank has entered this barrier (raises FabricTimeout otherwise)."""
        self._check_open()
        self._barrier_epoch += 1
        epoch, deadline = self._barrier_epoch, time.monotonic() + timeout_s
        for dst in range(self.world_size):
            self._signal(dst, self.num_flags + self.rank, epoch)
        for src in range(self.world_size):
            try:
                self._wait(self.num_flags + src, epoch, max(0.0, deadline - time.monotonic()))
            except FabricTimeout as exc:
                raise FabricTimeout(
                    f"barrier[{epoch}] from rank {src}", self.rank, epoch, exc.observed, timeout_s
                ) from None

    def close(self) -> None:
        """Release this rank's resources (idempotent); further calls raise FabricError."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- checks -----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise FabricError(f"rank {self.rank}: fabric is closed")

    def _check_rank(self, rank: int, what: str) -> int:
        rank = _as_int(rank, f"{what} rank")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"{what} rank {rank} out of range [0, {self.world_size})")
        return rank

    def _check_flag(self, flag: int) -> int:
        flag = _as_int(flag, "flag")
        if not 0 <= flag < self.num_flags:
            raise ValueError(f"flag {flag} out of range [0, {self.num_flags})")
        return flag

    @staticmethod
    def _check_value(value: int) -> int:
        value = _as_int(value, "flag value")
        if not 0 <= value <= MAX_FLAG_VALUE:
            raise ValueError(f"flag value {value} outside [0, 2**63)")
        return value

    @staticmethod
    def _check_rows(spec: BufferSpec, row_offset: int, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put into '{spec.name}' needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != spec.dtype:
            raise TypeError(f"put into '{spec.name}': dtype {tensor.dtype} != buffer dtype {spec.dtype}")
        if tensor.dim() != len(spec.shape) or tuple(tensor.shape[1:]) != spec.row_shape:
            raise ValueError(
                f"put into '{spec.name}': rows of shape {tuple(tensor.shape)} do not fit rows {spec.row_shape}"
            )
        if row_offset < 0 or row_offset + tensor.shape[0] > spec.rows:
            raise ValueError(
                f"put into '{spec.name}': rows [{row_offset}, {row_offset + tensor.shape[0]}) outside [0, {spec.rows})"
            )

    # ---- backend hooks ----------------------------------------------------------------------------------
    @abstractmethod
    def _create_buffer(self, index: int, spec: BufferSpec) -> None: ...

    def _after_register(self, index: int, spec: BufferSpec) -> None:
        """Runs after the registration barrier (every rank's buffer exists); nothing to do by default."""
        return None

    @abstractmethod
    def _local_buffer(self, index: int) -> torch.Tensor: ...

    @abstractmethod
    def _put(self, dst: int, index: int, spec: BufferSpec, row_offset: int, rows: torch.Tensor) -> None: ...

    def _peer_buffer(self, dst: int, index: int) -> torch.Tensor | None:
        """dst's buffer mapped here; None by default (a transport that only puts)."""
        return None

    @abstractmethod
    def _signal(self, dst: int, flag: int, value: int) -> None: ...

    @abstractmethod
    def _wait(self, flag: int, value: int, timeout_s: float) -> int: ...

    @abstractmethod
    def _read_flag(self, flag: int) -> int: ...

    @abstractmethod
    def _close(self) -> None: ...


# ---- in-process backend ---------------------------------------------------------------------------------
@dataclass
class _RankState:
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    flags: list[int] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class InProcessFabric(Fabric):
    """Ranks are threads of one process sharing storage; waits sleep on a condition variable."""

    def __init__(self, states: list[_RankState], rank: int, num_flags: int, device: torch.device):
        super().__init__(rank, len(states), num_flags)
        self._states = states
        self._device = device

    @classmethod
    def create(cls, world_size: int, num_flags: int = 256, device: str | torch.device = "cpu") -> list[InProcessFabric]:
        """All `world_size` rank handles of one fabric; hand one to each thread."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if num_flags < 1:
            raise ValueError(f"num_flags must be >= 1, got {num_flags}")
        states = [_RankState(flags=[0] * (num_flags + world_size)) for _ in range(world_size)]
        return [cls(states, r, num_flags, torch.device(device)) for r in range(world_size)]

    @property
    def _me(self) -> _RankState:
        return self._states[self.rank]

    def _create_buffer(self, index: int, spec: BufferSpec) -> None:
        self._me.buffers[index] = torch.zeros(spec.shape, dtype=spec.dtype, device=self._device)

    def _local_buffer(self, index: int) -> torch.Tensor:
        return self._me.buffers[index]

    def _put(self, dst: int, index: int, spec: BufferSpec, row_offset: int, rows: torch.Tensor) -> None:
        target = self._states[dst].buffers.get(index)
        if target is None:
            raise FabricError(f"rank {dst} has not registered buffer '{spec.name}'")
        target[row_offset : row_offset + rows.shape[0]].copy_(rows)

    def _peer_buffer(self, dst: int, index: int) -> torch.Tensor | None:
        return self._states[dst].buffers.get(index)

    def _signal(self, dst: int, flag: int, value: int) -> None:
        state = self._states[dst]
        with state.cond:
            state.flags[flag] = value
            state.cond.notify_all()

    def _wait(self, flag: int, value: int, timeout_s: float) -> int:
        me = self._me
        with me.cond:
            if not me.cond.wait_for(lambda: me.flags[flag] >= value, timeout=max(timeout_s, 0.0)):
                raise FabricTimeout(flag, self.rank, value, me.flags[flag], timeout_s)
            return me.flags[flag]

    def _read_flag(self, flag: int) -> int:
        return self._me.flags[flag]

    def _close(self) -> None:
        self._me.buffers.clear()
