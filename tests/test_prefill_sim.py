"""Prefill simulator and experiments: length shapes, timestamp scaling, FCFS simulation equal to the planner's own
simulation, a small end-to-end experiment and CLI run, and the CPU profiler's fit on a tiny grid."""

from __future__ import annotations

import json
import random

import pytest
import torch

from nanocp.cli import main
from nanocp.models import load_model
from nanocp.prefill.experiments import ExperimentConfig, run_experiments, write_results
from nanocp.prefill.improvement_rate import simulate_prefill
from nanocp.prefill.latency_model import load_profile, profile_path
from nanocp.prefill.planner import CoreCdspPlanner, PlannerConfig
from nanocp.prefill.profiling import profile_cpu_prefill, write_report
from nanocp.prefill.sim import TETRIS_SHAPES, Arm, LengthShape, PlannerSet, Workload, simulate

A100 = load_profile(profile_path("a100-llama3-8b"))


@pytest.mark.parametrize("name", sorted(TETRIS_SHAPES))
def test_length_shapes_hit_the_paper_ranges_and_means(name):
    shape = TETRIS_SHAPES[name]
    lengths = shape.sample(20_000, random.Random(0))
    assert min(lengths) >= shape.lo and max(lengths) <= shape.hi
    assert abs(sum(lengths) / len(lengths) - shape.mean) < 0.02 * shape.mean
    with pytest.raises(ValueError):
        LengthShape("bad", 10, 5, 7)


def test_workload_scales_timestamps():
    w = Workload.draw(TETRIS_SHAPES["short"], 50, seed=3)
    one, four = w.at(1.0), w.at(4.0)
    assert four == pytest.approx([t / 4 for t in one])
    assert all(b > a for a, b in zip(one, one[1:]))
    with pytest.raises(ValueError):
        w.at(0.0)


def test_fcfs_cdsp_simulation_equals_the_planner_simulation():
    config = PlannerConfig(2, 8, 16)
    w = Workload.draw(TETRIS_SHAPES["medium"], 300, seed=1)
    arm = Arm("CDSP", dynamic_rate=False)
    planners = PlannerSet(A100, config, arm, [0.3])
    result = simulate(planners, arm, w.at(2.0), w.lengths, slo_scale=10.0, fixed_rate=0.3)
    reference = simulate_prefill(CoreCdspPlanner(A100, config), w.at(2.0), w.lengths)
    assert result.ttft == pytest.approx(reference, rel=1e-12)
    assert 0.0 <= result.attainment(10.0) <= 1.0
    assert result.percentile(50) <= result.percentile(99) <= max(result.ttft)


def test_small_experiment_writes_its_reports(tmp_path):
    config = ExperimentConfig(
        profiles=("a100-llama3-8b",), traces=("short",), requests=80, search_requests=40, loads=(0.2, 0.6),
        rates=(0.05, 0.3), seeds=(0,), bisect_steps=2,
    )  # fmt: skip
    results = run_experiments(config)
    paths = write_results(results, config, tmp_path / "prefill_sim", 1.0)
    data = json.loads((tmp_path / "prefill_sim.json").read_text())
    assert "model outputs" in data["kind"] and len(data["cases"]) == 1
    case = data["cases"][0]
    assert set(case["curves"]) == set(config.arms) and all(len(c) == 2 for c in case["curves"].values())
    assert all(cap >= 0 for cap in case["capacity"].values())
    md = (tmp_path / "prefill_sim.md").read_text()
    assert "model outputs" in md and "CDSP" in md
    assert (tmp_path / "prefill_sim_a100-llama3-8b.png").exists() and len(paths) == 3


def test_cli_prefill_sim(tmp_path, capsys):
    out = tmp_path / "sim"
    argv = ["prefill-sim", "--profiles", "h200-deepseek-v3", "--traces", "long", "--requests", "40", "--seeds", "1",
            "--loads", "0.3", "--arms", "CDSP", "Fixed SP8", "--jobs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.with_suffix(".json").read_text())["config"]["arms"] == ["CDSP", "Fixed SP8"]
    assert main(["prefill-sim", "--arms", "Nope", "--jobs", "1", "--out", str(out)]) == 2


def test_cpu_profiler_fits_eq1_on_a_tiny_grid(tmp_path):
    threads = torch.get_num_threads()
    models = profile_cpu_prefill(
        load_model("tiny"), tmp_path / "cpu.json", sp_sizes=(1, 2), contexts=(0, 32), lengths=(16, 48),
        modes=("ring", "ulysses"), repeats=1,
    )  # fmt: skip
    assert torch.get_num_threads() == threads
    loaded = load_profile(tmp_path / "cpu.json")
    assert [m.attention for m in loaded] == ["ring", "ulysses"]
    for m in loaded:
        assert m.sp_sizes == [1, 2] and set(m.fit_quality) == {1, 2}
        assert m.provenance["samples"][m.attention]["1"][0][:2] == [0, 16]
        assert all(m.latency(sp, 32, 48) > 0 for sp in (1, 2))
    report = write_report(models, tmp_path / "cpu.json", tmp_path / "cpu.md")
    assert "R^2" in report.read_text()
