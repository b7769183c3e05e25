"""The wire form of row inputs and outputs (data_plane/row_messages.py) rebuilds exactly what was packed."""

from __future__ import annotations

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp import SamplingParams
from nanocp.data_plane.instance import KEPT_TOKEN, RowInput, RowOutput
from nanocp.data_plane.row_messages import SampledRows, pack_outputs, pack_rows, unpack_outputs, unpack_rows

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.3]),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
    top_k=st.sampled_from([-1, 1, 40]),
    seed=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 300), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)


@st.composite
def row_dicts(draw) -> dict[int, RowInput]:
    shared = draw(st.lists(params_strategy, min_size=1, max_size=4))  # requests share params objects
    batch = draw(st.lists(st.integers(0, 10_000), unique=True, max_size=40))
    rows = {}
    for b in batch:
        handoff = draw(st.one_of(st.none(), st.tuples(st.integers(0, 7), st.integers(0, 63))))
        rows[b] = RowInput(
            draw(st.one_of(st.just(KEPT_TOKEN), st.integers(0, 259))),
            draw(st.sampled_from(shared)),
            draw(st.integers(0, 4096)),
            draw(st.integers(0, 2**31 - 1)),
            draw(st.integers(0, 10**6)),
            handoff,
        )
    return rows


@settings(max_examples=60, deadline=None)
@given(row_dicts())
def test_rows_round_trip_through_pickle(rows):
    wire = pickle.loads(pickle.dumps(pack_rows(rows)))
    back = unpack_rows(wire)
    assert back == rows
    assert list(back) == list(rows)  # the driver's row order is kept
    by_params = {}
    for b, row in rows.items():  # rows that shared a params object still share one (it was sent once)
        by_params.setdefault(id(row.params), set()).add(id(back[b].params))
    assert all(len(ids) == 1 for ids in by_params.values())
    assert pack_rows(wire) is wire and unpack_rows(rows) is rows  # either form is taken as it is


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 500), st.integers(0, 259), st.integers(0, 7)),
            max_size=12,
            unique_by=lambda f: (f[0], f[2]),
        ),
        max_size=4,
    ),
    st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_sampled_rows_of_several_instances_come_in_batch_then_step_order(parts, with_logits):
    seen, unique_parts = set(), []
    for fields in parts:  # a (batch index, step) pair is sampled once in an iteration
        unique_parts.append([f for f in fields if (f[0], f[2]) not in seen])
        seen |= {(b, step) for b, _, step in fields}
    outputs = [
        [RowOutput(b, t, torch.full((3,), float(t)) if logits else None, s) for b, t, s in fields]
        for fields, logits in zip(unique_parts, with_logits)
    ]
    rows = SampledRows.concat([pack_outputs(part) for part in outputs])
    flat = [o for part in outputs for o in part]
    assert [(o.batch_index, o.token, o.step) for o in unpack_outputs(rows)] == [
        (o.batch_index, o.token, o.step) for o in flat
    ]
    expected = sorted(flat, key=lambda o: (o.batch_index, o.step))
    got = rows.in_order()
    assert [(b, t) for b, t, _ in got] == [(o.batch_index, o.token) for o in expected]
    for (_, _, logits), o in zip(got, expected):
        assert (logits is None) == (o.logits is None) and (logits is None or torch.equal(logits, o.logits))


@settings(max_examples=40, deadline=None)
@given(params_strategy)
def test_sampling_params_pickle_keeps_every_field(params):
    back = pickle.loads(pickle.dumps(params))
    assert back == params and type(back) is SamplingParams
    assert back.greedy == params.greedy


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 259), st.integers(0, 7)), max_size=30), st.booleans())
def test_outputs_round_trip_with_and_without_logits(fields, with_logits):
    outputs = [RowOutput(b, t, torch.randn(11) if with_logits else None, s) for b, t, s in fields]
    back = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(outputs))))
    assert [(o.batch_index, o.token, o.step) for o in back] == fields
    for got, sent in zip(back, outputs):
        if with_logits:
            assert torch.equal(got.logits, sent.logits)
        else:
            assert got.logits is None
