"""Q/Res routing backend: move exactly the marked rows between instances over a fabric.

A send list holds (dst_rank, src_row, dst_row) entries: row `src_row` of the local source tensor goes to row
`dst_row` of dst's receive buffer. Only listed rows move (absent pairs are not padded); entries whose
destination rows are consecutive on the same rank become one put. After its puts, the sender signals every
rank that received something with the iteration's sequence number on the flag reserved for the sender;
the receiver knows from its own receive list which sources to wait for.

The receive buffer is overwritten by the next iteration's puts: consume it before the peers can start
the next iteration (in a decode step the MoE all-to-all orders this).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from nanocp.comm.fabric import DEFAULT_TIMEOUT_S, Fabric


@dataclass
class RouteStats:
    """What one or more `send` calls moved."""

    puts: int = 0
    rows: int = 0
    bytes: int = 0
    signals: int = 0

    def add(self, other: RouteStats) -> None:
        self.puts += other.puts
        self.rows += other.rows
        self.bytes += other.bytes
        self.signals += other.signals


@dataclass(frozen=True)
class PutRun:
    """One coalesced put: `src_rows` [n] of the source go to dst's rows [dst_row, dst_row + n)."""

    dst: int
    dst_row: int
    src_rows: torch.Tensor  # int64 [n]

    @property
    def src_slice(self) -> slice | None:
        """The source rows as a slice when they are consecutive too (no gather copy needed)."""
        n = self.src_rows.numel()
        first = int(self.src_rows[0])
        if n == 1 or bool((self.src_rows[1:] - self.src_rows[:-1] == 1).all()):
            return slice(first, first + n)
        return None


def as_send_list(entries) -> torch.Tensor:
    """Normalise (dst, src_row, dst_row) entries (tensor or sequence of triples) to int64 [n, 3]."""
    if isinstance(entries, torch.Tensor) and (entries.is_floating_point() or entries.is_complex()):
        raise TypeError(f"send list must hold integers, got {entries.dtype}")
    table = torch.as_tensor(entries if len(entries) else torch.empty(0, 3), dtype=torch.int64)
    if table.dim() != 2 or table.shape[1] != 3:
        raise ValueError(f"send list must have shape [n, 3] (dst, src_row, dst_row), got {tuple(table.shape)}")
    return table


def plan_puts(send_list: torch.Tensor) -> list[PutRun]:
    """Group a send list [n, 3] into runs of consecutive destination rows per destination rank."""
    if send_list.shape[0] == 0:
        return []
    order = torch.argsort(send_list[:, 0] * (int(send_list[:, 2].max()) + 1) + send_list[:, 2], stable=True)
    dst, src, drow = send_list[order].unbind(1)
    breaks = torch.ones_like(dst, dtype=torch.bool)
    breaks[1:] = (dst[1:] != dst[:-1]) | (drow[1:] != drow[:-1] + 1)
    starts = torch.nonzero(breaks).flatten().tolist() + [dst.numel()]
    return [PutRun(int(dst[a]), int(drow[a]), src[a:b].clone()) for a, b in zip(starts[:-1], starts[1:], strict=True)]


class RoutingBackend:
    """Symmetric receive buffer [rows, *row_shape] plus one flag per source rank, on one fabric."""

    def __init__(
        self,
        fabric: Fabric,
        name: str,
        rows: int,
        row_shape: Sequence[int],
        dtype: torch.dtype,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.fabric = fabric
        self.name = name
        self.row_shape = tuple(int(d) for d in row_shape)
        self.recv = fabric.register(name, (rows, *self.row_shape), dtype, timeout_s)  # [rows, *row_shape]
        self.flag_base = fabric.reserve_flags(fabric.world_size)  # flag_base + src: last seq from src
        self.last = RouteStats()
        self.total = RouteStats()
        self._last_seq = 0

    def send(self, send_list, src: torch.Tensor, seq: int) -> RouteStats:
        """Put the listed rows of `src` [n_src, *row_shape] and signal each receiving rank with `seq`."""
        table = as_send_list(send_list)
        self._check(table, src, seq)
        stats = RouteStats()
        runs = plan_puts(table)
        for run in runs:
            cut = run.src_slice
            rows = src[cut] if cut is not None else src.index_select(0, run.src_rows.to(src.device))
            self.fabric.put(run.dst, self.name, run.dst_row, rows)
            stats.puts += 1
            stats.rows += rows.shape[0]
            stats.bytes += rows.numel() * rows.element_size()
        for dst in sorted({run.dst for run in runs}):
            self.fabric.signal(dst, self.flag_base + self.fabric.rank, seq)
            stats.signals += 1
        self._last_seq = seq
        self.last = stats
        self.total.add(stats)
        return stats

    def wait(self, sources: Iterable[int], seq: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
        """Wait until every rank in `sources` has signalled `seq`; returns the receive buffer."""
        for src in sorted(set(int(s) for s in sources)):
            if not 0 <= src < self.fabric.world_size:
                raise ValueError(f"source rank {src} out of range [0, {self.fabric.world_size})")
            self.fabric.wait(self.flag_base + src, seq, timeout_s)
        return self.recv

    def wait_flags(self, sources: Iterable[int], seq: int) -> list[tuple[int, int]]:
        """The (flag, value) pairs `wait(sources, seq)` blocks on, for callers that poll instead of blocking."""
        return [(self.flag_base + int(src), seq) for src in sorted(set(int(s) for s in sources))]

    def route(
        self, send_list, src: torch.Tensor, sources: Iterable[int], seq: int, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> torch.Tensor:
        """send() then wait(): one iteration's exchange."""
        self.send(send_list, src, seq)
        return self.wait(sources, seq, timeout_s)

    def _check(self, table: torch.Tensor, src: torch.Tensor, seq: int) -> None:
        if seq <= self._last_seq:
            raise ValueError(f"sequence numbers must increase: {seq} after {self._last_seq}")
        if tuple(src.shape[1:]) != self.row_shape:
            raise ValueError(f"source rows {tuple(src.shape[1:])} do not match the buffer's rows {self.row_shape}")
        if table.shape[0] == 0:
            return
        dst, srow, drow = table.unbind(1)
        world, rows = self.fabric.world_size, self.recv.shape[0]
        if int(dst.min()) < 0 or int(dst.max()) >= world:
            raise ValueError(f"send list names a destination outside [0, {world})")
        if int(srow.min()) < 0 or int(srow.max()) >= src.shape[0]:
            raise ValueError(f"send list names a source row outside [0, {src.shape[0]})")
        if int(drow.min()) < 0 or int(drow.max()) >= rows:
            raise ValueError(f"send list names a destination row outside [0, {rows})")
        if torch.unique(dst * rows + drow).numel() != table.shape[0]:
            raise ValueError("send list writes the same destination row twice")
