"""The driver benchmark's instant cluster and measurement (the benchmark itself runs under `python -m`)."""

from __future__ import annotations

import gc

import pytest

from nanocp import SamplingParams
from nanocp.bench.bench_driver import instant_engine, measure


def test_instant_cluster_answers_every_row_and_requests_finish():
    eng = instant_engine(instances=4, batch=6, new_tokens=5, prompt_len=12)
    try:
        for i in range(6):
            eng.add_request(f"r{i}", [i + 1] * (10 + i), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step()})
    finally:
        eng.close()
    assert sorted(outs) == [f"r{i}" for i in range(6)]
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs.values())


def test_measure_times_every_stage_of_a_step():
    row = measure(instances=2, batch=8, steps=3, prompt_len=8, seed=1)
    assert row["batch"] == 8 and row["rows_running"] == 8
    assert row["driver_ms_per_step"] > 0 and row["us_per_row"] > 0
    stages = row["stage_ms_per_step"]
    assert set(stages) == {
        "plan: scheduler step",
        "plan: lowering + MoE rows",
        "row inputs",
        "instant instances (not the driver)",
        "appends + stop checks",
    }
    assert all(ms >= 0 for ms in stages.values())


def test_gc_modes_are_restored_and_checked():
    frozen_before = gc.get_freeze_count()
    for mode in ("frozen", "disabled"):
        assert measure(instances=2, batch=4, steps=2, prompt_len=8, seed=2, gc_mode=mode)["gc"] == mode
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before
    with pytest.raises(ValueError, match="gc_mode"):
        measure(instances=2, batch=4, steps=2, prompt_len=8, seed=2, gc_mode="off")
