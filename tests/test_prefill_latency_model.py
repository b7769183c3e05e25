"""Prefill latency model (Tetris Eq. 1): fit, chunk-length solver, profile files."""

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.prefill.latency_model import (
    LatencyCoeffs,
    LatencyModelError,
    PrefillLatencyModel,
    evaluate_fit,
    fit,
    largest_len_within,
    load_profile,
    profile_path,
    save_profile,
)
from nanocp.prefill.profiles import build

coeff_values = st.tuples(
    st.floats(0.0, 1.0),  # a [s]
    st.floats(1e-7, 1e-3),  # b [s/token]
    st.floats(0.0, 1e-8),  # c [s/token^2]
    st.floats(0.0, 1e-8),  # d [s/token^2]
)


def brute_force_len(coeffs: LatencyCoeffs, context: int, budget: float, limit: int) -> int:
    """Largest L in [1, limit] with T(C, L) <= budget by binary search on the integer predicate."""
    if coeffs(context, 1) > budget:
        return 0
    lo, hi = 1, limit  # T(lo) <= budget invariant
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if coeffs(context, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def test_coeffs_reject_bad_values():
    with pytest.raises(LatencyModelError, match="non-negative"):
        LatencyCoeffs(0.1, -1e-5, 0.0, 0.0)
    with pytest.raises(LatencyModelError, match="finite"):
        LatencyCoeffs(math.nan, 1e-5, 0.0, 0.0)
    with pytest.raises(LatencyModelError, match="b \\+ d"):
        LatencyCoeffs(0.1, 0.0, 1e-9, 0.0)


def test_coeffs_evaluate_eq1():
    k = LatencyCoeffs(0.5, 2e-5, 3e-10, 1e-10)
    assert k(1000, 2000) == pytest.approx(0.5 + 2e-5 * 2000 + 3e-10 * 1000 * 2000 + 1e-10 * 2000**2)


@settings(max_examples=60, deadline=None)
@given(values=coeff_values, seed=st.integers(0, 2**31 - 1))
def test_fit_recovers_noiseless_coefficients(values, seed):
    truth = LatencyCoeffs(*values)
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 200_000, size=40)
    tokens = rng.integers(1, 200_000, size=40)
    samples = [(int(c), int(n), truth(int(c), int(n))) for c, n in zip(context, tokens)]
    coeffs, quality = fit(samples)
    predicted = np.array([coeffs(c, n) for c, n, _ in samples])
    measured = np.array([t for *_, t in samples])
    assert np.max(np.abs(predicted - measured) / measured) < 1e-6
    assert quality.max_rel_err < 1e-6 and quality.num_samples == 40


@settings(max_examples=40, deadline=None)
@given(values=coeff_values, seed=st.integers(0, 2**31 - 1), noise=st.floats(0.0, 0.3))
def test_fit_is_non_negative_and_reports_its_error(values, seed, noise):
    truth = LatencyCoeffs(*values)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(30):
        c, n = int(rng.integers(0, 100_000)), int(rng.integers(1, 100_000))
        samples.append((c, n, truth(c, n) * float(1 + noise * rng.uniform(-1, 1)) + 1e-6))
    coeffs, quality = fit(samples)
    assert min(coeffs.as_list()) >= 0 and coeffs.b + coeffs.d > 0
    again = evaluate_fit(coeffs, samples)
    assert again == quality
    rel = [abs(coeffs(c, n) - t) / t for c, n, t in samples]
    assert quality.max_rel_err == pytest.approx(max(rel)) and quality.mean_rel_err == pytest.approx(np.mean(rel))


def test_fit_rejects_bad_samples():
    with pytest.raises(LatencyModelError):
        fit([])
    with pytest.raises(LatencyModelError):
        fit([(0, 100, -1.0)])
    with pytest.raises(LatencyModelError):
        fit([(0, 0, 1.0)])
    with pytest.raises(LatencyModelError):
        fit([(0, 100)])


@settings(max_examples=300, deadline=None)
@given(
    values=coeff_values,
    context=st.integers(0, 1_000_000),
    budget=st.floats(-1.0, 200.0),
    limit=st.integers(1, 2_000_000),
)
def test_largest_len_within_matches_integer_search(values, context, budget, limit):
    coeffs = LatencyCoeffs(*values)
    got = largest_len_within(coeffs, context, budget, limit)
    assert got == brute_force_len(coeffs, context, budget, limit)
    if got > 0:
        assert coeffs(context, got) <= budget
    if 0 < got < limit:
        assert coeffs(context, got + 1) > budget


def test_solve_chunk_len_without_limit_and_errors():
    model = PrefillLatencyModel("ring", {1: LatencyCoeffs(0.1, 1e-4, 0.0, 0.0)})
    assert model.solve_chunk_len(1, 0, 1.1) == 10_000
    assert model.solve_chunk_len(1, 0, 0.05) == 0
    with pytest.raises(LatencyModelError, match="SP size 2"):
        model.solve_chunk_len(2, 0, 1.0)
    with pytest.raises(LatencyModelError):
        model.latency(1, -1, 10)
    with pytest.raises(LatencyModelError):
        PrefillLatencyModel("ring", {0: LatencyCoeffs(0.1, 1e-4, 0.0, 0.0)})


def test_profile_round_trip(tmp_path):
    ring = PrefillLatencyModel.fit_samples(
        "ring", {1: [(0, 1000, 0.2), (0, 4000, 0.5), (2000, 1000, 0.3)]}, provenance={"src": "unit test"}
    )
    ulysses = PrefillLatencyModel("ulysses", {1: LatencyCoeffs(0.1, 1e-4, 1e-9, 5e-10)})
    path = tmp_path / "p.json"
    save_profile(path, [ring, ulysses], name="t", provenance={"k": 1})
    loaded = load_profile(path)
    assert [m.attention for m in loaded] == ["ring", "ulysses"]
    assert loaded[0].coeffs == ring.coeffs and loaded[0].fit_quality == ring.fit_quality
    assert loaded[0].provenance == {"src": "unit test"}
    assert PrefillLatencyModel.load(path, "ulysses").coeffs == ulysses.coeffs
    with pytest.raises(LatencyModelError, match="no 'tree'"):
        PrefillLatencyModel.load(path, "tree")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(LatencyModelError, match="format"):
        load_profile(bad)


def test_a100_profile_matches_table1_and_rebuilds():
    (model,) = load_profile(profile_path("a100-llama3-8b"))
    rebuilt, _ = build.build_a100_llama3_8b()
    # the shipped file is what the builder produces (up to the fit's last-bit rounding, which differs between BLAS
    # builds and CPUs)
    assert model.coeffs.keys() == rebuilt[0].coeffs.keys()
    for sp, coeffs in rebuilt[0].coeffs.items():
        assert dataclasses.astuple(model.coeffs[sp]) == pytest.approx(dataclasses.astuple(coeffs), rel=1e-9, abs=0)
    for sp, row in build.TABLE1_SECONDS.items():
        for prompt, seconds in zip(build.TABLE1_PROMPTS, row):
            if seconds is not None:
                assert model.latency(sp, 0, prompt) == pytest.approx(seconds, rel=0.11)
        k = model.coeffs[sp]
        assert k.c == pytest.approx(2 * k.d, rel=0.05)  # the causal-attention identity gives c = 2d
    assert "context_term" in model.provenance and "table1_quality" in model.provenance


def test_a100_profile_prefers_the_table_best_sp():
    (model,) = load_profile(profile_path("a100-llama3-8b"))
    best = {n: min(model.sp_sizes, key=lambda s: model.latency(s, 0, n)) for n in (4096, 65536, 262144)}
    assert best[4096] == 4 and best[65536] == 16 and best[262144] == 16


def test_h200_profile_is_first_principles():
    models = load_profile(profile_path("h200-deepseek-v3"))
    assert [m.attention for m in models] == ["ring", "ulysses"]
    flops = models[0].provenance["gemm_flops_per_token"]
    assert 2 * 30e9 < flops < 2 * 40e9  # DeepSeek-V3 activates ~37B parameters per token
    for model in models:
        for sp, k in model.coeffs.items():
            assert k == build.dsv3_h200_coeffs(sp, model.attention)
        # long prompts get faster with SP; a 1M prompt at SP 128 takes tens of seconds, at SP 1 about 1.5 hours
        long = [model.latency(s, 0, 1 << 20) for s in model.sp_sizes]
        assert all(x > y for x, y in zip(long, long[1:]))
    ring, ulysses = models
    assert ulysses.latency(128, 0, 4096) < ring.latency(128, 0, 4096)  # few ring hops beat 127 for short chunks
    assert ring.latency(8, 0, 131072) < ulysses.latency(8, 0, 131072)
