"""bench.breakdown: per-layer split from timing logs and simulator results, slowest instance, reports, the CLI."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.bench.breakdown import (
    COMPONENTS,
    Breakdown,
    BreakdownError,
    format_table,
    from_result,
    from_timing_records,
    group_by_prefix,
    load_breakdowns,
    plot_breakdowns,
    read_timing_records,
)
from nanocp.cli import main as cli_main

LAYER_PHASES = ("projection", "q_route", "attention", "res_route", "merge")
MOE_PHASES = ("dispatch", "experts", "combine")


def record(iteration, instance, layer, phase, seconds):
    return {
        "iteration": iteration,
        "instance": instance,
        "layer": layer,
        "phase": phase,
        "seconds": seconds,
        "moe_batch": 3,
        "shard_rows": 4,
        "kv_tokens": 100,
        "q_recv": 1,
        "res_recv": 1,
    }


def synthetic_log(rng, iterations=3, instances=2, dense_layers=1, moe_layers=2):
    """Timing records of a model with dense layers first; returns (records, seconds[(it, inst, layer, phase)])."""
    recs, secs = [], {}
    for it in range(iterations):
        for inst in range(instances):
            for layer in range(dense_layers + moe_layers):
                phases = LAYER_PHASES + (("dense",) if layer < dense_layers else MOE_PHASES)
                for phase in phases:
                    t = float(rng.uniform(1e-4, 1e-2))
                    recs.append(record(it, inst, layer, phase, t))
                    secs[(it, inst, layer, phase)] = t
                if layer >= dense_layers:  # the CPU data plane logs combine in two halves
                    t = float(rng.uniform(1e-4, 1e-3))
                    recs.append(record(it, inst, layer, "combine", t))
                    secs[(it, inst, layer, "combine")] += t
            recs.append(record(it, inst, -1, "sampling", 0.5))
    return recs, secs


def test_timing_log_split_by_hand():
    rng = np.random.default_rng(0)
    recs, secs = synthetic_log(rng)
    b = from_timing_records(recs, "real")
    assert b.num_instances == 2
    moe = (1, 2)  # MoE layers only; sampling and the dense layer are left out
    groups = {
        "attention": ("attention",),
        "moe_a2a": ("dispatch", "combine"),
        "cp_comm": ("q_route", "res_route"),
        "other": ("projection", "merge", "experts"),
    }
    for inst in range(2):
        n = 3 * len(moe)
        expect = {
            k: sum(secs[(it, inst, la, p)] for it in range(3) for la in moe for p in phases)
            for k, phases in groups.items()
        }
        for k in COMPONENTS:
            assert b.per_instance_us[k][inst] == pytest.approx(expect[k] * 1e6 / n)


def test_dense_only_logs_use_every_layer():
    recs = [record(0, 0, layer, "attention", 0.001 * (layer + 1)) for layer in range(3)]
    recs += [record(0, 0, layer, "dense", 0.002) for layer in range(3)]
    b = from_timing_records(recs, "dense")
    assert b.per_instance_us["attention"][0] == pytest.approx(2000.0)  # mean of 1, 2, 3 ms
    assert b.per_instance_us["other"][0] == pytest.approx(2000.0)


@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(1, 3))
@settings(max_examples=25, deadline=None)
def test_timing_log_totals_are_conserved(seed, instances, moe_layers):
    rng = np.random.default_rng(seed)
    recs, secs = synthetic_log(rng, iterations=2, instances=instances, dense_layers=0, moe_layers=moe_layers)
    b = from_timing_records(recs, "x")
    for inst in range(instances):
        total = sum(t for (it, i, la, p), t in secs.items() if i == inst)
        assert b.total_us[inst] == pytest.approx(total * 1e6 / (2 * moe_layers))
    assert 0 <= b.slowest < instances


def test_slowest_is_the_straggler_not_the_waiter():
    per = {"attention": [100, 300, 50], "moe_a2a": [400, 200, 450], "cp_comm": [0, 0, 0], "other": [100, 100, 100]}
    b = Breakdown("x", per)
    assert b.slowest == 1  # least time waiting inside the all-to-all
    assert b.slowest_split() == {"attention": 300, "moe_a2a": 200, "cp_comm": 0, "other": 100}
    a = b.across()
    assert a["attention"] == {"max": 300, "median": 100, "min": 50, "mean": pytest.approx(150)}


def test_bad_inputs(tmp_path):
    with pytest.raises(BreakdownError, match="no timing records"):
        from_timing_records([], "x")
    with pytest.raises(BreakdownError, match="unknown timing phases"):
        from_timing_records([record(0, 0, 0, "warp-drive", 1.0)], "x")
    with pytest.raises(BreakdownError, match="lacks components"):
        Breakdown("x", {"attention": [1.0]})
    with pytest.raises(BreakdownError, match="equal non-empty"):
        Breakdown("x", {"attention": [1.0], "moe_a2a": [1.0, 2.0], "cp_comm": [0.0], "other": [0.0]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"phase": "attention", "seconds": 1}\nnot json\n')
    with pytest.raises(BreakdownError, match="not JSON"):
        read_timing_records(bad)
    with pytest.raises(BreakdownError, match="no such file"):
        load_breakdowns(tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(BreakdownError, match="not a simulator"):
        load_breakdowns(other)


def test_results_of_the_simulator_and_reports(tmp_path):
    rng = np.random.default_rng(3)
    per = {k: rng.uniform(0, 100, 8).tolist() for k in COMPONENTS}
    run = {"config": {"policy": "nanocp"}, "instance_layer_us": per}
    [b] = from_result(run)
    assert b.label == "nanocp" and np.allclose(b.per_instance_us["other"], per["other"])
    micro = {
        "experiment": "micro",
        "results": [
            {"longs_per_node": n, "label": lbl, "per_instance_layer_us": per} for n in (1, 3) for lbl in ("A", "B")
        ],
    }
    items = from_result(micro)
    assert [x.label for x in items] == ["1 long/node: A", "1 long/node: B", "3 long/node: A", "3 long/node: B"]
    groups = group_by_prefix(items)
    assert list(groups) == ["1 long/node", "3 long/node"] and len(groups["1 long/node"]) == 2
    table = format_table(items)
    assert "3 long/node: B" in table and "MoE all-to-all" in table
    png = plot_breakdowns(groups, tmp_path / "b.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / "micro.json"
    path.write_text(json.dumps(micro))
    assert len(load_breakdowns(path)) == 4


def test_cli_on_a_timing_log(tmp_path, capsys):
    recs, _ = synthetic_log(np.random.default_rng(1))
    log = tmp_path / "timing.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    png, out = tmp_path / "b.png", tmp_path / "b.json"
    assert cli_main(["breakdown", str(log), "--png", str(png), "--json", str(out), "--label", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "| cpu |" in text and png.is_file()
    data = json.loads(out.read_text())
    assert data["breakdowns"][0]["label"] == "cpu" and len(data["breakdowns"][0]["per_instance_us"]["attention"]) == 2
    assert cli_main(["breakdown", str(log), str(log), "--label", "only-one", "--no-png"]) == 2
