"""Lowering: an iteration's bindings -> one flat int32 routing table per instance, in one fixed binary layout.

The C++ core writes exactly this layout (csrc/scheduler.cpp, `lower`); `lower_reference` is the plain statement of
it; `RoutingTables` reads it back as zero-copy numpy views. Layout (all int32, little endian):

    header[16]: MAGIC, VERSION, instance, iteration, n_moe, n_shards, n_blocks,
                n_q_send, n_q_recv, n_res_send, n_res_recv, total_ints, 0, 0, 0, 0
    moe      [n_moe, 3]      batch_index, position of the new token, local shard index of its tail shard
    shards   [n_shards, 5]   batch_index, q_source (-1: query is local, else row of the Q receive buffer),
                             n_tokens, block_offset (into blocks), n_blocks
    blocks   [n_blocks]      physical frames on this instance, per shard in token order
    q_send   [n_q_send, 3]   moe row, destination instance, row in the destination's Q receive buffer
    q_recv   [n_q_recv, 2]   source instance, shard index that consumes this received query
    res_send [n_res_send, 3] shard index, destination (MoE) instance, row in its result receive buffer
    res_recv [n_res_recv, 2] source instance, moe row the received partial result belongs to

`batch_index` indexes the iteration's batch (IterationPlan.batch). Receive rows on an instance are numbered in
batch order, so sender and receiver agree without exchanging anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x4E435031  # "NCP1"
VERSION = 1
HEADER_INTS = 16
SECTIONS = (
    ("moe", 3),
    ("shards", 5),
    ("blocks", 1),
    ("q_send", 3),
    ("q_recv", 2),
    ("res_send", 3),
    ("res_recv", 2),
)
# header slot holding each section's row count
_COUNT_SLOT = {"moe": 4, "shards": 5, "blocks": 6, "q_send": 7, "q_recv": 8, "res_send": 9, "res_recv": 10}


class RoutingTableError(ValueError):
    """A routing table that fails validation (bad magic/version/length)."""


@dataclass(frozen=True)
class ExecShape:
    """Execution shape of one instance in one iteration: what the graph engine buckets on."""

    moe_batch: int
    shard_rows: int
    q_recv: int
    res_recv: int


@dataclass
class RoutingTables:
    """Zero-copy views into one instance's lowered table."""

    instance: int
    iteration: int
    moe: np.ndarray  # [n_moe, 3]
    shards: np.ndarray  # [n_shards, 5]
    blocks: np.ndarray  # [n_blocks]
    q_send: np.ndarray  # [n_q_send, 3]
    q_recv: np.ndarray  # [n_q_recv, 2]
    res_send: np.ndarray  # [n_res_send, 3]
    res_recv: np.ndarray  # [n_res_recv, 2]

    @property
    def shape(self) -> ExecShape:
        return ExecShape(len(self.moe), len(self.shards), len(self.q_recv), len(self.res_recv))

    @classmethod
    def parse(cls, table: np.ndarray | bytes | memoryview) -> RoutingTables:
        arr = np.frombuffer(table, dtype="<i4") if not isinstance(table, np.ndarray) else table
        if arr.dtype != np.int32 or arr.ndim != 1:
            raise RoutingTableError(f"routing table must be a flat int32 array, got {arr.dtype} {arr.shape}")
        if len(arr) < HEADER_INTS or int(arr[0]) != MAGIC or int(arr[1]) != VERSION:
            raise RoutingTableError("routing table has a bad header (magic/version)")
        if int(arr[11]) != len(arr):
            raise RoutingTableError(f"routing table length {len(arr)} != header total {int(arr[11])}")
        views, offset = {}, HEADER_INTS
        for name, width in SECTIONS:
            count = int(arr[_COUNT_SLOT[name]])
            end = offset + count * width
            if count < 0 or end > len(arr):
                raise RoutingTableError(f"routing table section {name} overruns the table")
            views[name] = arr[offset:end] if width == 1 else arr[offset:end].reshape(count, width)
            offset = end
        if offset != len(arr):
            raise RoutingTableError("routing table has trailing data")
        return cls(instance=int(arr[2]), iteration=int(arr[3]), **views)


def lower_reference(
    num_instances: int,
    iteration: int,
    batch: list[tuple[int, int, list[tuple[int, int, list[int]]]]],
) -> list[np.ndarray]:
    """Lower one iteration. `batch` lists, in batch order, (moe_instance, context_len, shards) per request with
    shards = [(instance, n_tokens, frames), ...] in binding order."""
    sec = [{name: [] for name, _ in SECTIONS} for _ in range(num_instances)]
    for g, (moe, context_len, shards) in enumerate(batch):
        moe_row = len(sec[moe]["moe"])
        moe_entry = [g, context_len - 1, -1]
        sec[moe]["moe"].append(moe_entry)
        for inst, n_tokens, frames in shards:
            t = sec[inst]
            shard_idx = len(t["shards"])
            source = -1
            if inst == moe:
                moe_entry[2] = shard_idx
            else:
                source = len(t["q_recv"])
                t["q_recv"].append([moe, shard_idx])
                sec[moe]["q_send"].append([moe_row, inst, source])
                res_row = len(sec[moe]["res_recv"])
                sec[moe]["res_recv"].append([inst, moe_row])
                t["res_send"].append([shard_idx, moe, res_row])
            t["shards"].append([g, source, n_tokens, len(t["blocks"]), len(frames)])
            t["blocks"].extend([f] for f in frames)
    return [_pack(i, iteration, sec[i]) for i in range(num_instances)]


def _pack(instance: int, iteration: int, sections: dict[str, list[list[int]]]) -> np.ndarray:
    body = [np.asarray(sections[name], dtype=np.int32).reshape(-1) for name, _ in SECTIONS]
    total = HEADER_INTS + sum(len(b) for b in body)
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:4] = (MAGIC, VERSION, instance, iteration)
    for name, _ in SECTIONS:
        header[_COUNT_SLOT[name]] = len(sections[name])
    header[11] = total
    return np.concatenate([header, *body])
