"""An iteration's row inputs and sampled rows as columns: what the driver builds and reads, and their wire form to
an instance process (or Ray actor).

Row by row, the dataclasses cost microseconds per row on each side (64 RowInputs with their own SamplingParams:
about 230 us to pickle and 260 us to unpickle on this project's CPU machine), which grows with the cluster's batch on
the driver. Here an instance's rows are a few columns of plain ints (pickled in C) and a column of SamplingParams
objects, each distinct one pickled once (pickle's memo: rows that share an object unpickle sharing one) as a tuple of
its fields (`RowBatch`), its sampled rows likewise (`SampledRows`); the driver builds and reads the columns without
an object per row, an instance works on the rows they stand for (`unpack_rows`, `pack_outputs`). Unpacking rebuilds
exactly what was packed (tests/test_data_plane_row_messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .instance import RowInput, RowOutput
from .sampling import SamplingParams


@dataclass
class RowBatch:
    """One instance's MoE rows of an iteration as columns, row i being what RowInput i says."""

    batch_indices: list[int]
    tokens: list[int]
    output_indices: list[int]
    seeds: list[int]  # fallback seeds
    keys: list[int]
    params: list[SamplingParams]
    handoffs: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (instance, buffer row), if any

    def __reduce__(self):  # pickled as its columns, without a per-field state dict
        columns = (self.batch_indices, self.tokens, self.output_indices, self.seeds, self.keys, self.params)
        return RowBatch, (*columns, self.handoffs)


@dataclass
class SampledRows:
    """An iteration's sampled rows (of one instance or several) as columns, row i being what RowOutput i says."""

    batch_indices: list[int]
    tokens: list[int]
    steps: list[int]
    logits: list[torch.Tensor | None] | None  # None when no row carries logits

    @classmethod
    def concat(cls, parts: list[SampledRows]) -> SampledRows:
        """The rows of every part, part after part."""
        logits = None
        if any(p.logits is not None for p in parts):
            logits = [lg for p in parts for lg in (p.logits if p.logits is not None else [None] * len(p))]
        return cls(
            [b for p in parts for b in p.batch_indices],
            [t for p in parts for t in p.tokens],
            [s for p in parts for s in p.steps],
            logits,
        )

    def __len__(self) -> int:
        return len(self.batch_indices)

    def __reduce__(self):  # pickled as its columns, without a per-field state dict
        return SampledRows, (self.batch_indices, self.tokens, self.steps, self.logits)

    def in_order(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """(batch index, token, logits) of every row, by batch index, then by sub-step."""
        logits = self.logits if self.logits is not None else [None] * len(self)
        order = sorted(zip(self.batch_indices, self.steps, range(len(self))))
        return [(b, self.tokens[i], logits[i]) for b, _, i in order]


Rows = dict[int, RowInput] | RowBatch  # an instance's row inputs: RowInputs by batch index, or their columns


def pack_rows(rows: Rows) -> RowBatch:
    """An instance's rows as columns (a RowBatch already is)."""
    if isinstance(rows, RowBatch):
        return rows
    values = rows.values()
    handoffs = {position: row.handoff for position, row in enumerate(values) if row.handoff is not None}
    return RowBatch(
        list(rows),
        [r.token for r in values],
        [r.output_index for r in values],
        [r.fallback_seed for r in values],
        [r.key for r in values],
        [r.params for r in values],
        handoffs,
    )


def unpack_rows(rows: Rows) -> dict[int, RowInput]:
    """An instance's rows as RowInputs by batch index, in the order they were packed (a dict of them already is)."""
    if not isinstance(rows, RowBatch):
        return rows
    columns = zip(rows.batch_indices, rows.tokens, rows.params, rows.output_indices, rows.seeds, rows.keys)
    return {b: RowInput(t, p, o, s, k, rows.handoffs.get(i)) for i, (b, t, p, o, s, k) in enumerate(columns)}


def pack_outputs(outputs: list[RowOutput]) -> SampledRows:
    """Sampled rows as columns."""
    logits = [o.logits for o in outputs]
    return SampledRows(
        [o.batch_index for o in outputs],
        [o.token for o in outputs],
        [o.step for o in outputs],
        None if all(lg is None for lg in logits) else logits,
    )


def unpack_outputs(rows: SampledRows) -> list[RowOutput]:
    logits = rows.logits if rows.logits is not None else [None] * len(rows)
    return [RowOutput(b, t, lg, s) for b, t, lg, s in zip(rows.batch_indices, rows.tokens, logits, rows.steps)]
