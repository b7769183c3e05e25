"""bench.simulator + bench.sim_metrics: hand-computed runs, conservation, determinism, balance metrics, capacity."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.bench.latency_profile import LatencyProfile
from nanocp.bench.sim_metrics import (
    SLO,
    IterationLog,
    RequestRecord,
    bisect_capacity,
    distribution,
    imbalance,
    summarize,
)
from nanocp.bench.simulator import (
    ClusterSimulator,
    QueuedPrefillTier,
    SimConfig,
    SimulationError,
    UnboundedPrefillTier,
    capacity_search,
    iteration_cost_of,
    simulate,
    write_result,
)
from nanocp.bench.workloads import EmpiricalLengths, GithubIssueLengths, MixedLengths, Request, synthetic_workload
from nanocp.control_plane import ClusterSpec, CPBucketTable, GlobalScheduler

ZERO = {"const": 0.0}


def toy_profile(iteration_s=0.01, per_batch_s=0.0, per_kv_token_s=0.0, transfer_latency_s=0.0) -> LatencyProfile:
    """One MoE layer; an iteration costs iteration_s + per_batch_s * max batch + per_kv_token_s * max KV."""
    return LatencyProfile.from_dict(
        {
            "schema": "nanocp-latency-profile/1",
            "name": "toy",
            "time_unit": "s",
            "model": {
                "num_layers": 1,
                "num_dense_layers": 0,
                "num_heads": 1,
                "kv_lora_rank": 4,
                "qk_rope_head_dim": 4,
                "kv_bytes_per_element": 1,
                "act_bytes_per_element": 1,
                "num_experts": 2,
                "top_k": 1,
            },
            "cluster": {
                "instances_per_node": 2,
                "links": {
                    "nvlink": {"GBps": 1e6, "latency_us": 0.0},
                    "rdma": {"GBps": 1e6, "latency_us": transfer_latency_s * 1e6},
                },
            },
            "phases": {
                "attention": {"const": 0.0, "kv_tokens": per_kv_token_s},
                "merge": ZERO,
                "dense": ZERO,
                "shared_expert": ZERO,
                "dense_mlp": ZERO,
                "expert": ZERO,
                "moe_dispatch": {"const": 0.0, "batch": per_batch_s},
                "moe_combine": ZERO,
                "iteration": {"const": iteration_s},
            },
        }
    )


def config(**kw) -> SimConfig:
    base = dict(num_nodes=1, instances_per_node=2, backend="python", kv_capacity_tokens=100_000, page_size=16)
    return SimConfig(**(base | {"progress": False} | kw))


def fixed_prefill(seconds: float) -> UnboundedPrefillTier:
    return UnboundedPrefillTier(lambda n: seconds)


# ------------------------------------------------------------------------------------------------ metrics


def test_imbalance_formula():
    assert imbalance([3, 3, 3]) == 0.0
    assert imbalance([0, 0, 0, 4]) == pytest.approx(3.0)
    assert imbalance([2, 4]) == pytest.approx(4 / 3 - 1)
    assert imbalance([0, 0]) == 0.0
    with pytest.raises(ValueError):
        imbalance([])


@given(st.lists(st.floats(0, 1e9), min_size=1, max_size=64), st.floats(1e-3, 1e3))
@settings(max_examples=80, deadline=None)
def test_imbalance_properties(values, scale):
    x = np.array(values)
    v = imbalance(x)
    assert v >= -1e-12
    if x.max() == x.min():
        assert v == pytest.approx(0.0, abs=1e-12)
    assert imbalance(x * scale) == pytest.approx(v, rel=1e-9, abs=1e-9)
    assert v <= len(x) - 1 + 1e-9  # max <= sum


def test_distribution_ignores_nan():
    d = distribution([1.0, math.nan, 3.0, 2.0])
    assert d["mean"] == 2.0 and d["p50"] == 2.0
    assert math.isnan(distribution([math.nan])["p99"])


def test_summarize_by_hand():
    recs = [
        RequestRecord("a", 0.0, 10, 3, first_token_s=0.5, finish_s=1.5, status="finished"),  # TPOT 0.5
        RequestRecord("b", 2.0, 10, 5, first_token_s=2.2, finish_s=2.6, status="finished", max_cp=2),  # TPOT 0.1
        RequestRecord("c", 1.0, 10, 2, status="rejected"),
        RequestRecord("d", 1.5, 10, 1, first_token_s=1.6, finish_s=1.6, status="finished", max_cp=1),
    ]
    log = IterationLog()
    for t, kv_imb in ((0.0, 0.1), (1.0, 0.2), (2.0, 0.3), (5.0, 9.0)):  # the last one is after the arrivals
        log.append(t=t, dt=0.5, ideal_dt=0.25, kv_imbalance=kv_imb, batch_imbalance=0.0, hol_blocked=float(t == 1.0))
    m = summarize(recs, log, SLO(tpot_s=0.2))
    assert (m.finished, m.rejected, m.unfinished) == (3, 1, 0)
    assert m.makespan_s == 2.6 and m.slo_attainment == 0.5  # b and d (one token, no TPOT) meet it
    assert m.goodput_rps == pytest.approx(2 / 2.6) and m.output_throughput_tps == pytest.approx(9 / 2.6)
    assert m.tpot_s["mean"] == pytest.approx(0.3) and m.ttft_s["p50"] == pytest.approx(0.2)
    assert m.kv_imbalance["mean"] == pytest.approx(0.2) and m.kv_imbalance["max"] == pytest.approx(0.3)
    assert m.hol_blocked_iterations == 1 and m.hol_blocked_time_s == 0.5
    assert m.cp_request_fraction == 0.5 and m.ideal["busy_time_ratio"] == 2.0


def test_slo_validation():
    with pytest.raises(ValueError):
        SLO(tpot_s=0.0)
    with pytest.raises(ValueError):
        SLO(attainment=1.5)


# ------------------------------------------------------------------------------------------------ hand-made runs


def test_two_requests_by_hand():
    """Iterations of 10 ms, prefill 100 ms, KV transfer 20 ms.

    r0 (t=0, 5 tokens): first token 0.10, joins at 0.12, 4 decode iterations -> done 0.16; TPOT 0.06/4.
    r1 (t=0.05, 3 tokens): first token 0.15, joins at 0.17 (cluster idle from 0.16), 2 iterations -> 0.19.
    """
    reqs = [Request("r0", 0.0, 100, 5), Request("r1", 0.05, 100, 3)]
    cfg = config(profile=toy_profile(transfer_latency_s=0.02), slo=SLO(tpot_s=0.018))
    res = simulate(reqs, cfg, fixed_prefill(0.1))
    r0, r1 = res.requests
    assert (r0.ttft_s, r0.finish_s, r0.tpot_s) == pytest.approx((0.1, 0.16, 0.015))
    assert (r1.ttft_s, r1.finish_s, r1.tpot_s) == pytest.approx((0.1, 0.19, 0.02))
    assert (r0.decode_iterations, r1.decode_iterations) == (4, 2)
    m = res.metrics
    assert (m.finished, m.slo_attainment, m.makespan_s) == pytest.approx((2, 0.5, 0.19))
    assert m.goodput_rps == pytest.approx(1 / 0.19)
    assert m.output_throughput_tps == pytest.approx(8 / 0.19)
    assert m.tpot_s["mean"] == pytest.approx(0.0175) and m.e2e_s["p50"] == pytest.approx((0.16 + 0.14) / 2)
    assert m.iterations == 6 and res.log.array("dt").sum() == pytest.approx(0.06)
    assert m.preemptions == 0 and m.cp_request_fraction == 0.0


def test_queued_prefill_serialises_and_batching_shares_iterations():
    """One prefill instance (50 ms each): r1's prefill waits for r0's; both decode in the same iterations."""
    reqs = [Request("a", 0.0, 10, 3), Request("b", 0.0, 10, 3)]
    res = simulate(reqs, config(profile=toy_profile(), kv_transfer=False), QueuedPrefillTier(1, lambda n: 0.05))
    a, b = res.requests
    assert (a.first_token_s, b.first_token_s) == pytest.approx((0.05, 0.10))
    # a decodes 0.05-0.07; b joins at the boundary 0.10 (after the idle gap) and decodes 0.10-0.12
    assert (a.finish_s, b.finish_s) == pytest.approx((0.07, 0.12))
    both = simulate(reqs, config(profile=toy_profile(), kv_transfer=False), fixed_prefill(0.05)).requests
    assert [r.finish_s for r in both] == pytest.approx([0.07, 0.07])


def test_single_token_outputs_need_no_decode():
    res = simulate([Request("x", 0.0, 10, 1)], config(profile=toy_profile()), fixed_prefill(0.01))
    rec = res.requests[0]
    assert rec.status == "finished" and rec.decode_iterations == 0 and math.isnan(rec.tpot_s)
    assert rec.finish_s == rec.first_token_s == 0.01 and res.metrics.iterations == 0
    assert res.metrics.slo_attainment == 1.0


def test_bad_workloads_and_reuse():
    sim = ClusterSimulator(config(profile=toy_profile()), fixed_prefill(0.0))
    with pytest.raises(SimulationError, match="unique"):
        sim.run([Request("a", 0.0, 5, 5), Request("a", 1.0, 5, 5)])
    sim = ClusterSimulator(config(profile=toy_profile()), fixed_prefill(0.0))
    with pytest.raises(SimulationError, match="input_len"):
        sim.run([Request("a", 0.0, 0, 5)])
    sim = ClusterSimulator(config(profile=toy_profile()), fixed_prefill(0.0))
    sim.run([Request("a", 0.0, 5, 5)])
    with pytest.raises(SimulationError, match="one workload"):
        sim.run([Request("b", 0.0, 5, 5)])


def test_requests_that_never_fit_are_rejected():
    reqs = [Request("big", 0.0, 5000, 3), Request("ok", 0.0, 100, 3)]
    m = simulate(reqs, config(profile=toy_profile(), policy="least-batch", kv_capacity_tokens=1008), fixed_prefill(0))
    assert (m.metrics.rejected, m.metrics.finished) == (1, 1)
    assert [r.status for r in m.requests] == ["rejected", "finished"]


def test_write_result(tmp_path):
    res = simulate([Request("a", 0.0, 5, 4)], config(profile=toy_profile()), fixed_prefill(0.0))
    json_path, md_path = write_result(res, "toy-run", tmp_path)
    data = json.loads(json_path.read_text())
    assert data["metrics"]["finished"] == 1 and data["config"]["profile"] == "toy"
    assert "model outputs" in data["note"] and "model outputs" in md_path.read_text()


@pytest.mark.parametrize("policy,remote_per_request", [("uniform-cp:4", 3), ("least-batch", 0)])
def test_iteration_cost_of_a_static_state(policy, remote_per_request):
    """A micro-benchmark state: 16 short requests and one long one on a 4-instance node, one iteration."""
    prof = LatencyProfile.load("h200-deepseek-v3")
    sched = GlobalScheduler(ClusterSpec(1, 4, 2_000_000, 64), policy, backend="python")
    for i in range(16):
        sched.add_request(f"s{i}", 2048, 100)
    sched.add_request("long", 512_000, 100)
    plan = sched.step()
    cost = iteration_cost_of(sched, prof, plan)
    remote = sum(len(split) - 1 for _, split in plan.bindings.values())
    assert remote == remote_per_request * 17
    assert (cost.per_instance["cp_comm"].sum() > 0) == (remote > 0)
    if policy == "least-batch":  # the long request's instance is the attention straggler
        assert cost.slowest == plan.bindings["long"][0]
        assert cost.slowest_layer["attention"] > 4 * cost.per_instance["attention"].min() / 61


# ------------------------------------------------------------------------------------------------ invariants


def mixed_workload(n, rate, seed, long_ratio=0.1):
    short = EmpiricalLengths(np.array([200, 900, 3000]), np.array([20, 60, 5]))
    long = GithubIssueLengths(input_knots=((0.0, 20_000), (1.0, 60_000)), output_p50=30, output_p90=50)
    return synthetic_workload(MixedLengths(short, long, long_ratio), n, rate, seed=seed)


def run_mixed(policy="nanocp", capacity=100_000, n=80, seed=0, **kw):
    cfg = config(
        num_nodes=2,
        profile=toy_profile(0.005, per_batch_s=1e-4, per_kv_token_s=1e-8),
        policy=policy,
        kv_capacity_tokens=capacity,
        cp_buckets=CPBucketTable((10_000, 1 << 30), (1, 2)),
        **kw,
    )
    return simulate(mixed_workload(n, 30.0, seed), cfg, fixed_prefill(0.02))


@pytest.mark.parametrize("policy", ["nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp:2"])
def test_conservation_every_request_finishes_with_its_tokens(policy):
    res = run_mixed(policy)
    assert all(r.status == "finished" for r in res.requests)
    assert [r.decode_iterations for r in res.requests] == [r.output_len - 1 for r in res.requests]
    # the batch sizes over all iterations add up to every decoded token
    assert res.log.array("running").sum() == sum(r.output_len - 1 for r in res.requests)
    assert (res.log.array("ideal_dt") <= res.log.array("dt") * (1 + 1e-12)).all()
    for r in res.requests:
        assert r.first_token_s >= r.arrival_s and r.finish_s >= r.first_token_s


@pytest.mark.parametrize("policy", ["nanocp", "least-batch"])
def test_conservation_under_preemption(policy):
    """4 instances x 2000 tokens; 20 requests of 900 + 300 tokens: memory runs out as they grow."""
    rng = np.random.default_rng(0)
    reqs = [
        Request(f"r{i}", float(t), 900, int(o))
        for i, (t, o) in enumerate(zip(rng.random(20), rng.integers(200, 300, 20)))
    ]
    cfg = config(num_nodes=2, profile=toy_profile(), policy=policy, kv_capacity_tokens=2000)
    res = simulate(reqs, cfg, fixed_prefill(0.01))
    m = res.metrics
    assert m.preemptions > 0
    assert m.finished == 20 and m.rejected == 0 and m.unfinished == 0
    assert [r.decode_iterations for r in res.requests] == [r.output_len - 1 for r in res.requests]
    assert res.log.array("running").sum() == sum(r.output_len - 1 for r in res.requests)
    for r in res.requests:
        # TPOT covers the decode stints plus the waits for recomputed KV in between
        assert r.tpot_s * (r.output_len - 1) >= r.decode_time_s - 1e-12
        assert r.decode_time_s == pytest.approx(0.01 * r.decode_iterations)


def test_determinism_under_seed():
    a, b, c = run_mixed(seed=5), run_mixed(seed=5), run_mixed(seed=6)
    assert a.requests == b.requests and a.metrics == b.metrics
    assert a.requests != c.requests


def test_cp_only_with_a_cp_policy():
    cp = run_mixed("nanocp").metrics
    dp = run_mixed("least-batch").metrics
    assert cp.cp_request_fraction > 0 and cp.cp_traffic_bytes > 0
    assert dp.cp_request_fraction == 0 and dp.cp_traffic_bytes == 0
    uniform = run_mixed("uniform-cp:2").metrics
    assert uniform.cp_request_fraction > 0.9


def test_head_of_line_blocking_is_counted_only_when_a_node_could_hold_the_head():
    """2 instances x 1000 tokens, DP placement. Two 600-token requests take one instance each; a third waits
    although the node has 2 x ~400 free tokens (HoL). With 900-token requests the node is truly full (no HoL)."""
    prof = toy_profile()
    tier = fixed_prefill(0.0)
    for size, expect_hol in ((600, True), (900, False)):
        reqs = [Request(f"r{i}", 0.0, size, 40) for i in range(3)]
        cfg = config(profile=prof, policy="least-batch", kv_capacity_tokens=1008, kv_transfer=False)
        m = simulate(reqs, cfg, tier).metrics
        assert m.finished == 3
        assert (m.hol_blocked_iterations > 0) == expect_hol
        assert m.hol_blocked_time_s == pytest.approx(0.01 * m.hol_blocked_iterations)


def test_a_real_profile_run_reports_balance_and_ideal():
    cfg = SimConfig(num_nodes=1, instances_per_node=8, backend="python", progress=False)
    res = simulate(synthetic_workload(mixed_workload_lengths(), 120, 40.0, seed=1), cfg)
    m = res.metrics
    assert m.finished == 120 and m.iterations == len(res.log)
    assert m.kv_imbalance["mean"] >= 0 and m.batch_imbalance["max"] <= 7.0 + 1e-9
    assert 0 < m.ideal["iteration_s"]["mean"] <= m.iteration_s["mean"]
    assert set(m.slowest_layer_us) == {"attention", "moe_a2a", "cp_comm", "other"}
    assert m.ideal["busy_time_ratio"] >= 1.0


def mixed_workload_lengths():
    return MixedLengths(EmpiricalLengths(np.array([1500, 3000]), np.array([50, 80])), GithubIssueLengths(), 0.02)


# ------------------------------------------------------------------------------------------------ capacity


def test_bisection_finds_the_knee():
    res = bisect_capacity(lambda r: 1.0 if r <= 7.3 else 0.5, lo=1.0, hi=2.0, rel_tol=0.01)
    assert 7.3 / 1.011 <= res.rate <= 7.3
    assert all((a >= 0.99) == (r <= 7.3) for r, a in res.history)
    assert bisect_capacity(lambda r: 0.0, 1.0, 2.0).rate == 0.0
    with pytest.raises(ValueError):
        bisect_capacity(lambda r: 1.0, 2.0, 1.0)


def test_capacity_search_on_a_toy_profile_is_monotone():
    """Iteration time grows with the batch, so attainment falls with the rate; the search brackets the knee."""
    prof = toy_profile(0.002, per_batch_s=0.002)
    cfg = config(profile=prof, policy="least-batch", slo=SLO(tpot_s=0.02, attainment=0.95), kv_transfer=False)
    lengths = EmpiricalLengths(np.array([100, 200]), np.array([30, 40]))

    def workload(rate):
        return synthetic_workload(lengths, 150, rate, seed=3)

    attain = [simulate(workload(r), cfg, fixed_prefill(0.0)).metrics.slo_attainment for r in (5, 40, 80, 160)]
    assert all(x >= y for x, y in zip(attain, attain[1:])) and attain[0] == 1.0 and attain[-1] < 0.95
    found = capacity_search(workload, cfg, lo=5.0, hi=10.0, rel_tol=0.1, prefill_tier_factory=lambda: fixed_prefill(0))
    passing = [r for r, a in found.history if a >= 0.95]
    failing = [r for r, a in found.history if a < 0.95]
    assert found.rate == max(passing) and failing and min(failing) > found.rate
    assert min(failing) <= found.rate * 1.1 + 1e-9


# ------------------------------------------------------------------------------------------------ backends


def _cpp_available() -> bool:
    from nanocp.control_plane import _core

    return hasattr(_core, "SchedulerCore")


@pytest.mark.skipif(not _cpp_available(), reason="C++ scheduler core not built")
def test_cpp_and_python_backends_agree():
    py = run_mixed(seed=2)
    cpp = run_mixed(seed=2, backend="cpp")
    assert py.requests == cpp.requests and py.metrics == cpp.metrics
