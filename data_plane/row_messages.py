"""The wire form of an iteration's row inputs and sampled rows between the driver and an instance process.

Pickled row by row, the dataclasses cost microseconds per row on each side (64 RowInputs with their own
SamplingParams: about 230 us to pickle and 260 us to unpickle on this project's CPU machine), which grows with the
cluster's batch on the driver. Here a message is a few columns of plain ints (pickled in C) and each distinct
SamplingParams object once; `unpack_*` rebuilds exactly what was packed (tests/test_data_plane_row_messages.py).
"""

from __future__ import annotations

from .instance import RowInput, RowOutput

# batch indices, tokens, output indices, fallback seeds, keys, params index per row, the distinct params, handoffs
# (row position -> (instance, buffer row), only for the rows that have one)
PackedRows = tuple[list[int], list[int], list[int], list[int], list[int], list[int], list, dict[int, tuple[int, int]]]
# batch indices, tokens, sub-steps, logits (None when no row carries any, else one entry per row)
PackedOutputs = tuple[list[int], list[int], list[int], list | None]


def pack_rows(rows: dict[int, RowInput]) -> PackedRows:
    """An instance's rows (batch index -> RowInput) as columns; SamplingParams shared by rows are sent once."""
    index_of: dict[int, int] = {}  # id(params) -> position in `params`
    params, param_index, handoffs = [], [], {}
    for position, row in enumerate(rows.values()):
        at = index_of.get(id(row.params))
        if at is None:
            at = index_of[id(row.params)] = len(params)
            params.append(row.params)
        param_index.append(at)
        if row.handoff is not None:
            handoffs[position] = row.handoff
    values = rows.values()
    return (
        list(rows),
        [r.token for r in values],
        [r.output_index for r in values],
        [r.fallback_seed for r in values],
        [r.key for r in values],
        param_index,
        params,
        handoffs,
    )


def unpack_rows(packed: PackedRows) -> dict[int, RowInput]:
    batch, tokens, output_indices, seeds, keys, param_index, params, handoffs = packed
    rows = {}
    for position, b in enumerate(batch):
        rows[b] = RowInput(
            tokens[position],
            params[param_index[position]],
            output_indices[position],
            seeds[position],
            keys[position],
            handoffs.get(position),
        )
    return rows


def pack_outputs(outputs: list[RowOutput]) -> PackedOutputs:
    logits = [o.logits for o in outputs]
    return (
        [o.batch_index for o in outputs],
        [o.token for o in outputs],
        [o.step for o in outputs],
        None if all(lg is None for lg in logits) else logits,
    )


def unpack_outputs(packed: PackedOutputs) -> list[RowOutput]:
    batch, tokens, steps, logits = packed
    if logits is None:
        logits = [None] * len(batch)
    return [RowOutput(b, t, lg, s) for b, t, lg, s in zip(batch, tokens, logits, steps)]
