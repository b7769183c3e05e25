"""bench.workloads: arrival processes, length sources, trace replay, determinism, bad input."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_traces import needs_traces

from nanocp.bench.workloads import (
    GITHUB_ISSUE_INPUT_KNOTS,
    LENGTH_BIN_EDGES,
    OPENROUTER_BINS,
    BinnedLengths,
    EmpiricalLengths,
    GithubIssueLengths,
    MixedLengths,
    Request,
    WorkloadError,
    build_workload,
    fixed_rate_arrivals,
    gamma_arrivals,
    length_source,
    load_azure_trace,
    load_generic_trace,
    load_mooncake_trace,
    load_trace,
    poisson_arrivals,
    resolve_trace,
    retime_to_rate,
    scale_arrivals,
    sharegpt4_lengths,
    synthetic_workload,
    truncate_to_duration,
)

# ------------------------------------------------------------------------------------------------ arrivals


def test_gamma_mean_interval_and_burstiness():
    rng = np.random.default_rng(7)
    for burstiness in (0.25, 1.0, 4.0):
        t = gamma_arrivals(200_001, 5.0, burstiness, rng)
        gaps = np.diff(t)
        assert t[0] == 0.0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.02)
        # Gamma(k, theta): squared coefficient of variation = 1 / k
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.05)


@given(st.integers(1, 300), st.floats(0.1, 100), st.floats(0.1, 100), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_same_seed_different_rates_differ_only_by_time_scaling(n, r1, r2, seed):
    a = poisson_arrivals(n, r1, np.random.default_rng(seed))
    b = poisson_arrivals(n, r2, np.random.default_rng(seed))
    np.testing.assert_allclose(a * r1, b * r2, rtol=1e-9, atol=1e-12)


def test_arrivals_deterministic_under_seed_and_infinite_rate():
    a = gamma_arrivals(100, 3.0, 0.5, np.random.default_rng(1))
    b = gamma_arrivals(100, 3.0, 0.5, np.random.default_rng(1))
    c = gamma_arrivals(100, 3.0, 0.5, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(poisson_arrivals(5, math.inf, np.random.default_rng(0)), np.zeros(5))
    assert np.array_equal(fixed_rate_arrivals(4, 2.0), [0.0, 0.5, 1.0, 1.5])


@pytest.mark.parametrize(
    "call",
    [
        lambda: poisson_arrivals(10, 0.0, np.random.default_rng(0)),
        lambda: poisson_arrivals(-1, 1.0, np.random.default_rng(0)),
        lambda: gamma_arrivals(10, 1.0, 0.0, np.random.default_rng(0)),
        lambda: fixed_rate_arrivals(3, -2.0),
        lambda: synthetic_workload(GithubIssueLengths(), 3, 1.0, arrival="weibull"),
        lambda: scale_arrivals([Request("a", 0.0, 1, 1)], 0.0),
        lambda: retime_to_rate([Request("a", 0.0, 1, 1)], 1.0),
        lambda: length_source("nonsense"),
        lambda: length_source("mix:abc"),
        lambda: MixedLengths(GithubIssueLengths(), GithubIssueLengths(), 1.5),
        lambda: BinnedLengths((1.0, 2.0), outputs_from=GithubIssueLengths()),
    ],
)
def test_bad_arguments_raise(call):
    with pytest.raises(WorkloadError):
        call()


def test_scale_and_retime():
    reqs = [Request(f"r{i}", t, 10, 5) for i, t in enumerate([0.0, 1.0, 3.0, 4.0])]
    assert [r.arrival_s for r in scale_arrivals(reqs, 0.5)] == [0.0, 0.5, 1.5, 2.0]
    fast = retime_to_rate(reqs, 6.0)  # 3 intervals over 4 s -> 0.75/s; to 6/s
    assert (len(fast) - 1) / (fast[-1].arrival_s - fast[0].arrival_s) == pytest.approx(6.0)
    assert [r.rid for r in truncate_to_duration(reqs, 3.0)] == ["r0", "r1"]


# ------------------------------------------------------------------------------------------------ lengths


def test_github_issue_quantile_passes_through_knots():
    src = GithubIssueLengths()
    qs = np.array([q for q, _ in GITHUB_ISSUE_INPUT_KNOTS])
    np.testing.assert_allclose(src.input_quantile(qs), [t for _, t in GITHUB_ISSUE_INPUT_KNOTS], rtol=1e-12)


def test_github_issue_matches_medha_percentiles_and_nanocp_bins():
    inputs, outputs = GithubIssueLengths().sample(200_000, np.random.default_rng(3))
    assert inputs.min() >= 100_000 and inputs.max() <= 1_000_000
    assert np.percentile(inputs, 50) == pytest.approx(393_000, rel=0.01)
    assert np.percentile(inputs, 90) == pytest.approx(839_000, rel=0.01)
    assert (inputs < 500_000).mean() == pytest.approx(0.6506, abs=0.005)
    assert np.percentile(outputs, 50) == pytest.approx(518, rel=0.01)
    assert np.percentile(outputs, 90) == pytest.approx(808, rel=0.015)
    assert outputs.min() >= 1


def test_binned_lengths_follow_bin_shares():
    outputs = EmpiricalLengths(np.array([5, 6]), np.array([7, 8]))
    inputs, outs = BinnedLengths(OPENROUTER_BINS, outputs_from=outputs).sample(100_000, np.random.default_rng(4))
    counts = np.histogram(inputs, bins=LENGTH_BIN_EDGES)[0] / len(inputs)
    np.testing.assert_allclose(counts, np.array(OPENROUTER_BINS) / sum(OPENROUTER_BINS), atol=0.006)
    assert set(outs.tolist()) <= {7, 8}


@given(st.integers(0, 400), st.floats(0, 1), st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_mix_has_exact_long_count(n, ratio, seed):
    short = EmpiricalLengths(np.array([100, 2000]), np.array([10, 20]))
    inputs, outputs = MixedLengths(short, GithubIssueLengths(), ratio).sample(n, np.random.default_rng(seed))
    assert len(inputs) == len(outputs) == n
    assert int((inputs >= 100_000).sum()) == int(round(ratio * n))
    assert ((inputs == 100) | (inputs == 2000) | (inputs >= 100_000)).all()


@needs_traces
def test_sharegpt4_resamples_joint_rows():
    src = sharegpt4_lengths()
    rows = set(zip(src.inputs.tolist(), src.outputs.tolist()))
    assert len(src.inputs) == 20_000 and src.inputs.max() <= 8192
    inputs, outputs = src.sample(500, np.random.default_rng(0))
    assert all((a, b) in rows for a, b in zip(inputs.tolist(), outputs.tolist()))


@needs_traces
@pytest.mark.parametrize("name", ["sharegpt4", "openrouter", "sharegpt4o", "mix:5%", "mix:0.01", "github-issue"])
def test_synthetic_workload_is_deterministic(name):
    a = synthetic_workload(name, 300, 4.0, arrival="gamma", burstiness=0.5, seed=11)
    b = synthetic_workload(name, 300, 4.0, arrival="gamma", burstiness=0.5, seed=11)
    c = synthetic_workload(name, 300, 4.0, arrival="gamma", burstiness=0.5, seed=12)
    assert a == b and a != c
    assert [r.rid for r in a] == [f"r{i}" for i in range(300)]
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:]))
    assert all(r.input_len > 0 and r.output_len > 0 for r in a)


@needs_traces
def test_mix_ratio_spec_forms_agree():
    assert synthetic_workload("mix:5%", 200, 1.0, seed=3) == synthetic_workload("mix:0.05", 200, 1.0, seed=3)
    longs = [r for r in synthetic_workload("mix:1", 50, 1.0, seed=3) if r.input_len >= 100_000]
    assert len(longs) == 50


# ------------------------------------------------------------------------------------------------ traces


@needs_traces
def test_azure_trace_replay():
    reqs = load_azure_trace("azure-conv")
    assert len(reqs) == 19_366
    assert reqs[0].arrival_s == 0.0 and all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:]))
    assert np.mean([r.input_len for r in reqs]) == pytest.approx(1155, rel=0.01)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(211, rel=0.01)
    assert reqs[-1].arrival_s == pytest.approx(3501.7, abs=1.0)  # 18:15:46.68 .. 19:14:08.40


@needs_traces
def test_mooncake_trace_replay():
    reqs = load_trace("mooncake")
    assert len(reqs) == 12_031
    assert reqs[-1].arrival_s == pytest.approx(3536.999)  # milliseconds -> seconds
    assert np.mean([r.input_len for r in reqs]) == pytest.approx(12_035, rel=0.01)


def test_generic_trace_round_trip_and_errors(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival,input_len,output_len\n2.5,100,7\n1.0,50,3\n4.0,0,9\n")
    reqs = load_generic_trace(path)
    # sorted by time, shifted to start at 0, the row with a zero length dropped
    assert reqs == [Request("r0", 0.0, 50, 3), Request("r1", 1.5, 100, 7)]
    assert load_trace(path) == reqs
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt,out\n1,2,3\n")
    with pytest.raises(WorkloadError):
        load_trace(bad)
    broken = tmp_path / "m.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(WorkloadError, match="m.jsonl:1"):
        load_mooncake_trace(broken)
    with pytest.raises(WorkloadError, match="not found"):
        resolve_trace(tmp_path / "missing.csv")


def test_traces_dir_env_override(tmp_path, monkeypatch):
    (tmp_path / "azure_llm_2023_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:05.0,20,3\n"
    )
    monkeypatch.setenv("NANOCP_TRACES", str(tmp_path))
    reqs = load_trace("azure-code")
    assert [(r.input_len, r.output_len) for r in reqs] == [(10, 2), (20, 3)]
    assert reqs[1].arrival_s == pytest.approx(1.02004, abs=1e-6)


@needs_traces
def test_build_workload_entry_point(tmp_path):
    syn = build_workload("mix:5%", rate=10.0, duration_s=30.0, seed=4)
    assert syn and all(r.arrival_s < 30.0 for r in syn) and len(syn) == pytest.approx(300, rel=0.3)
    assert build_workload("mix:5%", rate=10.0, duration_s=30.0, seed=4) == syn
    assert len(build_workload("sharegpt4", rate=5.0, num_requests=17)) == 17
    azure = build_workload("azure-code", rate=20.0, duration_s=60.0)
    assert all(r.arrival_s < 60.0 for r in azure) and len(azure) == pytest.approx(1200, rel=0.2)
    scaled = build_workload("mooncake", time_scale=0.5, num_requests=100)
    assert scaled == scale_arrivals(load_trace("mooncake"), 0.5)[:100]
    with pytest.raises(WorkloadError, match="rate"):
        build_workload("github-issue", duration_s=10.0)
