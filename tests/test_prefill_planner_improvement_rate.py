"""Load-aware improvement rate: prefill simulation, offline search, table lookup, online monitor."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.prefill.improvement_rate import (
    DEFAULT_RATES,
    ArrivalRateMonitor,
    ImprovementRateError,
    ImprovementRateTable,
    build_table,
    poisson_arrivals,
    search_improvement_rates,
    simulate_prefill,
)
from nanocp.prefill.latency_model import LatencyCoeffs, PrefillLatencyModel, load_profile, profile_path
from nanocp.prefill.planner import CdspPlanner, CoreCdspPlanner, PlannerConfig

A100 = load_profile(profile_path("a100-llama3-8b"))


def test_default_rates_span_the_paper_range():
    assert DEFAULT_RATES[0] == 0.05 and DEFAULT_RATES[-1] == 0.75 and len(DEFAULT_RATES) == 15


def test_poisson_arrivals_have_the_requested_rate():
    times = poisson_arrivals(4.0, 20_000, random.Random(1))
    assert times == sorted(times) and times[0] > 0
    assert len(times) / times[-1] == pytest.approx(4.0, rel=0.03)
    with pytest.raises(ImprovementRateError):
        poisson_arrivals(0.0, 10, random.Random(1))


def test_simulation_queues_requests_behind_each_other():
    model = PrefillLatencyModel("ring", {1: LatencyCoeffs(0.5, 1e-4, 0.0, 0.0)})
    planner = CdspPlanner(model, PlannerConfig(num_nodes=1, instances_per_node=1, max_sp=1))
    # 1.5 s each; the second arrives 1 s into the first and waits 0.5 s; the third finds the instance idle
    ttfts = simulate_prefill(planner, [0.0, 1.0, 10.0], [10_000, 10_000, 10_000])
    assert ttfts == pytest.approx([1.5, 2.0, 1.5])
    with pytest.raises(ImprovementRateError, match="sorted"):
        simulate_prefill(planner, [1.0, 0.0], [10, 10])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rate=st.floats(1.0, 20.0))
def test_simulation_with_core_equals_python(seed, rate):
    rng = random.Random(seed)
    config = PlannerConfig(num_nodes=2, instances_per_node=4, max_sp=8, improvement_rate=rng.uniform(0.05, 0.75))
    arrivals = poisson_arrivals(rate, 40, rng)
    lengths = [int(2 ** rng.uniform(10, 17)) for _ in arrivals]
    want = simulate_prefill(CdspPlanner(A100, config), arrivals, lengths)
    got = simulate_prefill(CoreCdspPlanner(A100, config), arrivals, lengths)
    assert got == pytest.approx(want, rel=1e-9)
    assert all(t > 0 for t in got)


def test_search_picks_the_lowest_mean_ttft():
    config = PlannerConfig(num_nodes=2, instances_per_node=4, max_sp=8)
    lengths = [4096, 16384, 65536]
    rates = (0.05, 0.3, 0.6)
    results = search_improvement_rates(A100, config, [1.0, 8.0], lengths, rates=rates, num_requests=60, seed=3)
    for r in results:
        assert set(r.mean_ttft) == set(rates)
        assert r.best_rate == min(rates, key=lambda x: (r.mean_ttft[x], x))
    # the search is reproducible and matches a direct simulation
    again = search_improvement_rates(A100, config, [1.0, 8.0], lengths, rates=rates, num_requests=60, seed=3)
    assert again == results
    table = build_table(results, {"note": "unit test"})
    assert table.entries == [(1.0, results[0].best_rate), (8.0, results[1].best_rate)]
    assert "mean_ttft_s" in table.provenance
    with pytest.raises(ImprovementRateError):
        search_improvement_rates(A100, config, [1.0], [], rates=rates)
    with pytest.raises(ImprovementRateError):
        search_improvement_rates(A100, config, [1.0], lengths, rates=(1.2,))


def test_table_lookup_and_round_trip(tmp_path):
    table = ImprovementRateTable([(4.0, 0.5), (0.5, 0.1), (2.0, 0.3)], {"src": "test"})
    assert table.entries == [(0.5, 0.1), (2.0, 0.3), (4.0, 0.5)]
    assert table.lookup(0.0) == 0.1 and table.lookup(1.2) == 0.1 and table.lookup(1.3) == 0.3
    assert table.lookup(1.25) == 0.1  # equidistant: the lower arrival rate
    assert table.lookup(100.0) == 0.5
    path = tmp_path / "t.json"
    table.save(path)
    assert ImprovementRateTable.load(path) == table
    with pytest.raises(ImprovementRateError):
        ImprovementRateTable([])
    with pytest.raises(ImprovementRateError):
        ImprovementRateTable([(1.0, 1.5)])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_monitor_follows_the_window_and_updates_every_interval():
    table = ImprovementRateTable([(1.0, 0.1), (5.0, 0.4), (10.0, 0.7)])
    clock = FakeClock()
    monitor = ArrivalRateMonitor(table, window_s=10.0, update_interval_s=30.0, clock=clock)
    assert monitor.improvement_rate() == 0.1  # no traffic yet: closest to 0 req/s
    for k in range(100):  # 10 req/s for 10 s
        clock.now = 20.0 + 0.1 * k
        monitor.record_arrival()
    clock.now = 29.95
    assert monitor.arrival_rate() == pytest.approx(10.0)
    assert monitor.improvement_rate() == 0.1  # not yet 30 s since the last update
    clock.now = 30.0
    assert monitor.improvement_rate() == 0.7
    for k in range(50):  # 5 req/s from 30 s on
        clock.now = 30.0 + 0.2 * k
        monitor.record_arrival()
    clock.now = 45.0
    assert monitor.improvement_rate() == 0.7  # held until the next update
    clock.now = 60.0
    assert monitor.arrival_rate() == 0.0 and monitor.improvement_rate() == 0.1
    monitor.record_arrival(61.0)
    with pytest.raises(ImprovementRateError, match="time order"):
        monitor.record_arrival(60.5)
    with pytest.raises(ImprovementRateError):
        ArrivalRateMonitor(table, window_s=0.0)


def test_shipped_table_is_loadable():
    table = ImprovementRateTable.load(profile_path("improvement-rates-a100-llama3-8b-mooncake"))
    assert len(table.entries) >= 10
    assert all(r in DEFAULT_RATES for _, r in table.entries)
    assert table.provenance["profile"] == "a100-llama3-8b"
