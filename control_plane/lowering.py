"""Lowering: an iteration's bindings -> one flat int32 routing table per instance, in one fixed binary layout.

The C++ core writes exactly this layout (csrc/scheduler_lower.cpp); `lower_reference` is the plain statement of it;
`RoutingTables` reads it back as zero-copy numpy views. Layout (all int32, little endian):

    header[16]: MAGIC, VERSION, instance, iteration, n_moe, n_shards, n_updates,
                n_q_send, n_q_recv, n_res_send, n_res_recv, total_ints, num_steps, base_seq, full, max_blocks
    moe      [n_moe, 4]      batch_index, position of the first new token, local shard index of its tail shard,
                             window (decode steps this plan covers for the request: the last `window` tokens of
                             its tail shard are reserved for them; 1 without multi-step)
    shards   [n_shards, 4]   batch_index, q_source (-1: query is local, else row of the Q receive buffer),
                             n_tokens, slot (the shard's row in the instance's block-table store)
    updates  [n_updates, 3]  slot, block_index, frame: block-table entries added since the store's base
    q_send   [n_q_send, 3]   moe row, destination instance, row in the destination's Q receive buffer
    q_recv   [n_q_recv, 2]   source instance, shard index that consumes this received query
    res_send [n_res_send, 3] shard index, destination (MoE) instance, row in its result receive buffer
    res_recv [n_res_recv, 2] source instance, moe row the received partial result belongs to

`batch_index` indexes the iteration's batch (IterationPlan.batch). Receive rows on an instance are numbered in
batch order, so sender and receiver agree without exchanging anything.

Block tables are incremental. Every shard holds a slot on its instance from the end of the step that created it
until its request finishes or is preempted (the most recently freed slot first, else the lowest never used; slots
are handed out after the step's releases, so slot numbers stay below the most shards the instance held at the end
of a step: at most max_moe_batch + max_q_recv for an instance within its limits, and at most its frame count since
a shard holds a frame). The instance keeps a block-table store [slots, blocks per shard]; `updates` lists only the
frames added since the last table lowered for this instance, in shard order and block order within a shard (a new
shard, also one in a reused slot, from block 0). The header's `iteration` is the table's sequence number and
`base_seq` the sequence of the table it builds on (the last one lowered for this instance, -1 for none: an empty
store; lowering an iteration again gives a table that builds on the first and lists nothing new); a consumer must
apply a table only to a store whose last applied table is `base_seq`. A full snapshot (`full` = 1, `base_seq` = -1)
lists every frame of every live shard and applies to any store: it serves a fresh or restarted instance. Both kinds
bring the store to the same state, so the next incremental table builds on either. `num_steps` is the number of
decode sub-steps every instance runs (lock-step: the MoE exchange is a barrier); `max_blocks` is the block count of
the instance's longest shard (the width a block table needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x4E435031  # "NCP1"
VERSION = 2
HEADER_INTS = 16
SECTIONS = (
    ("moe", 4),
    ("shards", 4),
    ("updates", 3),
    ("q_send", 3),
    ("q_recv", 2),
    ("res_send", 3),
    ("res_recv", 2),
)
# header slot holding each section's row count
_COUNT_SLOT = {"moe": 4, "shards": 5, "updates": 6, "q_send": 7, "q_recv": 8, "res_send": 9, "res_recv": 10}
TOTAL_SLOT, NUM_STEPS_SLOT, BASE_SEQ_SLOT, FULL_SLOT, MAX_BLOCKS_SLOT = 11, 12, 13, 14, 15
EMPTY_STORE = -1  # base_seq of a table that builds on an empty store (and of every full snapshot)


class RoutingTableError(ValueError):
    """A routing table that fails validation (bad magic/version/length/header)."""


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
    iteration: int  # also the table's sequence number
    num_steps: int  # decode sub-steps of this iteration, the same on every instance
    base_seq: int  # sequence of the table whose store state the updates build on (-1: empty store)
    full: bool  # a full snapshot: every block of every live shard
    max_blocks: int  # blocks of the longest shard
    moe: np.ndarray  # [n_moe, 4]
    shards: np.ndarray  # [n_shards, 4]
    updates: np.ndarray  # [n_updates, 3]
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
        if int(arr[TOTAL_SLOT]) != len(arr):
            raise RoutingTableError(f"routing table length {len(arr)} != header total {int(arr[TOTAL_SLOT])}")
        num_steps, base_seq, full = (int(arr[k]) for k in (NUM_STEPS_SLOT, BASE_SEQ_SLOT, FULL_SLOT))
        if num_steps < 1 or full not in (0, 1) or (full and base_seq != EMPTY_STORE) or base_seq < EMPTY_STORE:
            raise RoutingTableError(
                f"routing table header is inconsistent: num_steps {num_steps}, base_seq {base_seq}, full {full}"
            )
        views, offset = {}, HEADER_INTS
        for name, width in SECTIONS:
            count = int(arr[_COUNT_SLOT[name]])
            end = offset + count * width
            if count < 0 or end > len(arr):
                raise RoutingTableError(f"routing table section {name} overruns the table")
            views[name] = arr[offset:end].reshape(count, width)
            offset = end
        if offset != len(arr):
            raise RoutingTableError("routing table has trailing data")
        return cls(
            instance=int(arr[2]),
            iteration=int(arr[3]),
            num_steps=num_steps,
            base_seq=base_seq,
            full=bool(full),
            max_blocks=int(arr[MAX_BLOCKS_SLOT]),
            **views,
        )


def moe_section(table: np.ndarray) -> np.ndarray:
    """The `moe` rows [n_moe, 4] of a lowered table, as a view; unlike `RoutingTables.parse` it reads nothing else
    (the section comes first) and validates nothing: for a table this process lowered."""
    count = int(table[_COUNT_SLOT["moe"]])
    return table[HEADER_INTS : HEADER_INTS + 4 * count].reshape(count, 4)


def pack_tables(tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-instance tables -> (every table back to back [total] int32, int64 offsets [n + 1]): the packed form a
    core's `lower_packed` returns."""
    offsets = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tables], out=offsets[1:])
    packed = np.concatenate(tables).astype(np.int32, copy=False) if tables else np.zeros(0, dtype=np.int32)
    return packed, offsets


def split_tables(packed: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The packed tables -> one view per instance (no copies)."""
    bounds = offsets.tolist()
    return [packed[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class ShardInput:
    """One shard as the lowering sees it: where it lives, its tokens, its store slot and its frames."""

    instance: int
    n_tokens: int
    slot: int
    frames: list[int]  # in token order
    emitted: int  # frames already in the instance's store (the table lists frames[emitted:])


def lower_reference(
    num_instances: int,
    iteration: int,
    num_steps: int,
    batch: list[tuple[int, int, int, list[ShardInput]]],
    base_seqs: list[int],
    full: bool = False,
) -> list[np.ndarray]:
    """Lower one iteration. `batch` lists, in batch order, (moe_instance, context_len, window, shards) per request
    with shards in binding order; context_len counts the window's tokens. `base_seqs[i]` is the sequence of the last
    table lowered for instance i (-1: none). A full snapshot lists every frame and builds on nothing."""
    sec = [{name: [] for name, _ in SECTIONS} for _ in range(num_instances)]
    max_blocks = [0] * num_instances
    for g, (moe, context_len, window, shards) in enumerate(batch):
        moe_row = len(sec[moe]["moe"])
        moe_entry = [g, context_len - window, -1, window]
        sec[moe]["moe"].append(moe_entry)
        for shard in shards:
            inst = shard.instance
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
            t["shards"].append([g, source, shard.n_tokens, shard.slot])
            first = 0 if full else shard.emitted
            t["updates"].extend([shard.slot, b, shard.frames[b]] for b in range(first, len(shard.frames)))
            max_blocks[inst] = max(max_blocks[inst], len(shard.frames))
    header = [
        (num_steps, EMPTY_STORE if full else base_seqs[i], int(full), max_blocks[i]) for i in range(num_instances)
    ]
    return [_pack(i, iteration, header[i], sec[i]) for i in range(num_instances)]


def _pack(instance: int, iteration: int, tail: tuple[int, int, int, int], sections: dict[str, list]) -> np.ndarray:
    body = [np.asarray(sections[name], dtype=np.int32).reshape(-1) for name, _ in SECTIONS]
    total = HEADER_INTS + sum(len(b) for b in body)
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:4] = (MAGIC, VERSION, instance, iteration)
    for name, _ in SECTIONS:
        header[_COUNT_SLOT[name]] = len(sections[name])
    header[TOTAL_SLOT] = total
    header[NUM_STEPS_SLOT:] = tail
    return np.concatenate([header, *body])
