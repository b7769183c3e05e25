"""Persistent block tables of one decode instance, kept current by the routing tables' incremental updates.

The control plane gives every shard a stable slot on its instance and lists, per routing table, only the frames
added since the previous table of that instance (control_plane/lowering.py). The store is one static int32 tensor
[max_slots, max_blocks] (graph friendly: it never moves); `apply` writes a table's updates into it after checking
that the table builds on the last table applied (`base_seq`), so a store that missed a table is never patched.

Bounds (from the instance's limits and its frame count): slot numbers stay below the most shard rows a table of
the instance has had, so max_slots = min(frames, max_moe_batch + max_q_recv) (every shard row is a MoE row's tail
shard or a received query; a shard holds at least one frame); one shard can hold every frame: max_blocks = frames.
One more row, the empty row (index max_slots), is never written: it stays at `fill` (the graph path's scratch
frame) for padding shards. For DeepSeek-V3 on NanoCP's shape (1M tokens in pages of 64 = 16384 frames, MoE batch
256, 64 received queries) that is 321 x 16384 int32 = 21 MB per instance.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from nanocp.control_plane.lowering import EMPTY_STORE, RoutingTableError, RoutingTables

if TYPE_CHECKING:
    from .instance import InstanceLimits


class StaleBlockTableError(RoutingTableError):
    """An incremental routing table that does not build on the store's state: the store missed a table (or never
    had one). The remedy is a full snapshot (`IterationPlan.full_tables()`)."""


def store_slots(limits: InstanceLimits, num_frames: int) -> int:
    """Slots of an instance's store (see the module docstring for the bound)."""
    return max(1, min(num_frames, limits.max_moe_batch + limits.max_q_recv))


class BlockTableStore:
    def __init__(self, max_slots: int, max_blocks: int, num_frames: int, fill: int = 0, device="cpu") -> None:
        if max_slots < 1 or max_blocks < 1 or num_frames < 1:
            raise ValueError(f"block-table store needs positive bounds, got {max_slots} x {max_blocks}, {num_frames}")
        self.max_slots = max_slots
        self.empty_row = max_slots  # never written: padding shards read it
        self.num_frames = num_frames  # frames a table may name (the pool's scratch frame is not one of them)
        self.host = np.full((max_slots + 1, max_blocks), fill, dtype=np.int32)  # [slots + 1, blocks]
        device = torch.device(device)
        # On CPU the device table is the host array itself; elsewhere a copy kept in step by `apply`.
        host = torch.from_numpy(self.host)
        self.on_host = device.type == "cpu"
        self.table = host if self.on_host else host.to(device)
        self.seq = EMPTY_STORE  # sequence (iteration) of the last table applied

    @classmethod
    def for_instance(cls, limits: InstanceLimits, num_frames: int, fill: int = 0, device="cpu") -> BlockTableStore:
        return cls(store_slots(limits, num_frames), num_frames, num_frames, fill, device)

    @property
    def max_blocks(self) -> int:
        return self.host.shape[1]

    def check(self, table: RoutingTables) -> None:
        """Raise unless `table` can be applied: it builds on this store's state and names slots, blocks and frames
        inside the store's bounds."""
        if not table.full and table.base_seq != self.seq:
            raise StaleBlockTableError(
                f"instance {table.instance}: routing table {table.iteration} builds on table {table.base_seq}, the "
                f"block-table store holds table {self.seq}; a full snapshot is needed"
            )
        shards, updates = table.shards, table.updates
        if len(shards) and (int(shards[:, 3].min()) < 0 or int(shards[:, 3].max()) >= self.max_slots):
            raise RoutingTableError(f"instance {table.instance}: a shard slot is outside the store's {self.max_slots}")
        if table.max_blocks > self.max_blocks:
            raise RoutingTableError(
                f"instance {table.instance}: a shard of {table.max_blocks} blocks exceeds the store's {self.max_blocks}"
            )
        if len(updates):
            lo, hi = updates.min(axis=0), updates.max(axis=0)  # [3]: slot, block, frame
            if lo[0] < 0 or hi[0] >= self.max_slots or lo[1] < 0 or hi[1] >= self.max_blocks or lo[2] < 0:
                raise RoutingTableError(f"instance {table.instance}: a block update is outside the store")
            if hi[2] >= self.num_frames:
                raise RoutingTableError(
                    f"instance {table.instance}: routing table names frame {int(hi[2])}, but the pool's frames "
                    f">= {self.num_frames} are not the scheduler's (the graph path's scratch frame is the last)"
                )

    def apply(self, table: RoutingTables) -> None:
        """Write the table's block updates (after `check`); the store then holds the table's state."""
        self.check(table)
        updates = table.updates  # [u, 3]: slot, block, frame
        if len(updates):
            self.host[updates[:, 0], updates[:, 1]] = updates[:, 2]
            if not self.on_host:
                u = torch.from_numpy(np.ascontiguousarray(updates)).to(self.table.device, torch.int64)
                self.table[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)
        self.seq = table.iteration

    def rows(self, slots: np.ndarray, width: int) -> torch.Tensor:
        """Block tables of the given slots, `width` blocks wide: [len(slots), width] int32 (a copy)."""
        index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.table.device)
        return self.table[index, :width]
