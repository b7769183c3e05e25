"""bench.experiments (micro, capacity, balance, summary) at toy size, the capacity search, the simulator's routing
from lowered tables, the latency model's shared-core / host / merge terms, the CPU profile fit and fidelity."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_traces import needs_traces

from nanocp.bench import experiments as ex
from nanocp.bench import simulator as sim_mod
from nanocp.bench.cpu_profile import (
    StepSample,
    SweepConfig,
    fit_cpu_profile,
    profile_records,
    tiny_model_shape,
    zero_base,
)
from nanocp.bench.latency_profile import BREAKDOWN, LatencyProfile, RouteCounts
from nanocp.bench.sim_metrics import SLO, search_capacity
from nanocp.bench.simulator import SimConfig, UnboundedPrefillTier, simulate
from nanocp.bench.workloads import EmpiricalLengths, GithubIssueLengths, MixedLengths, synthetic_workload
from nanocp.cli import main as cli_main
from nanocp.control_plane import CPBucketTable
from nanocp.data_plane.timing import PhaseRecord

TOY = ex.ClusterShape(num_nodes=1, instances_per_node=8, backend="python")
PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ labels, policies


def test_policy_labels_follow_the_paper():
    labels = [ex.policy_label(p, 32) for p in ("nanocp", "least-batch", "least-cache", "uniform-cp:2", "uniform-cp:8")]
    assert labels == ["NanoCP", "32DP LeastBatch", "32DP LeastCache", "16DP2CP", "4DP8CP"]
    assert ex.policy_label("uniform-cp:4", 8) == "2DP4CP"


def test_available_policies_reports_what_it_leaves_out():
    included, skipped = ex.available_policies(TOY, ["nanocp", "no-such-policy", "uniform-cp:3"])
    assert included == ["nanocp"]
    assert set(skipped) == {"no-such-policy", "uniform-cp:3"} and all(skipped.values())


# ------------------------------------------------------------------------------------------------ micro


def toy_micro() -> ex.MicroConfig:
    return ex.MicroConfig(TOY, shorts_per_instance=3, short_len=512, long_len=40_000, longs_per_node=(1, 2))


def test_micro_toy_schema_and_invariants(tmp_path):
    result = ex.run_micro(toy_micro(), ["nanocp", "least-batch", "uniform-cp:4"])
    assert result["experiment"] == "micro" and "model outputs" in result["note"]
    assert len(result["results"]) == 2 * 3
    for r in result["results"]:
        assert set(r["slowest_layer_us"]) == set(BREAKDOWN)
        assert r["layer_us"] == pytest.approx(sum(r["slowest_layer_us"].values()))
        per = np.sum([r["per_instance_layer_us"][k] for k in BREAKDOWN], axis=0)  # [I]
        np.testing.assert_allclose(per, r["layer_us"], rtol=1e-9)  # lock-step: one layer time for everyone
        assert r["waiting"] == 0 and r["running"] == 8 * 3 + r["longs_per_node"]
    by = {(r["longs_per_node"], r["policy"]): r for r in result["results"]}
    for n in (1, 2):
        assert by[(n, "least-batch")]["cp_queries"] == 0
        assert by[(n, "nanocp")]["cp_requests"] == n  # only the long requests use CP
        assert by[(n, "uniform-cp:4")]["cp_requests"] == 8 * 3 + n
        assert by[(n, "nanocp")]["max_attention_us"] < by[(n, "least-batch")]["max_attention_us"]
    paths = ex.write_micro(result, tmp_path)
    assert {p.name for p in paths} == {"sim_micro.json", "sim_micro.md", "sim_micro.png"}
    assert json.loads((tmp_path / "sim_micro.json").read_text())["results"][0]["policy"] == "nanocp"
    assert "model outputs" in (tmp_path / "sim_micro.md").read_text().lower()
    assert (tmp_path / "sim_micro.png").read_bytes()[:8] == PNG


def test_micro_request_order():
    cfg = toy_micro()
    ordered = ex.micro_requests(cfg, 2)
    assert [n for _, n in ordered] == [512] * 24 + [40_000] * 2
    shuffled = ex.micro_requests(replace(cfg, shuffle=True), 2)
    assert sorted(shuffled) == sorted(ordered) and shuffled != ordered


def test_cli_sim_micro(tmp_path):
    args = ["sim", "micro", "--nodes", "1", "--longs", "1", "--shorts-per-instance", "2", "--long-len", "40000"]
    args += ["--policies", "nanocp,least-cache", "--scheduler-backend", "python", "--results-dir", str(tmp_path)]
    assert cli_main(args) == 0
    data = json.loads((tmp_path / "sim_micro.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["nanocp", "least-cache"]


@pytest.mark.slow
def test_micro_full_size_reproduces_the_papers_ordering():
    result = ex.run_micro(ex.MicroConfig(), list(ex.CORE_POLICIES))
    for n in (1, 3, 5, 7):
        rows = [r for r in result["results"] if r["longs_per_node"] == n]
        best = min(rows, key=lambda r: r["layer_us"])
        assert best["policy"] == "nanocp"
        cp = {r["policy"]: r["slowest_layer_us"]["cp_comm"] for r in rows}
        assert max(cp, key=cp.get) == "uniform-cp:8" and cp["nanocp"] < 0.1 * cp["uniform-cp:8"]


# ------------------------------------------------------------------------------------------------ workloads, search


@needs_traces
def test_workload_pool_is_one_workload_at_every_rate():
    pool = ex.WorkloadPool("sharegpt4", seed=1)
    slow, fast = pool.at(50.0, 100.0), pool.at(100.0, 100.0)  # the fast one needs a second chunk
    assert len(fast) > ex.POOL_CHUNK and len(slow) < len(fast)
    assert [r.rid for r in slow] == [r.rid for r in fast[: len(slow)]]
    for a, b in zip(slow, fast):
        assert (a.input_len, a.output_len) == (b.input_len, b.output_len)
        assert a.arrival_s == pytest.approx(2 * b.arrival_s)
    assert all(r.arrival_s < 100.0 for r in fast)
    assert ex.WorkloadPool("sharegpt4", seed=1).at(50.0, 100.0) == slow  # deterministic
    with pytest.raises(ex.ExperimentError):
        pool.at(0.0, 10.0)


@given(st.floats(0.05, 500.0), st.floats(0.5, 50.0), st.integers(4, 14))
@settings(max_examples=60, deadline=None)
def test_search_capacity_brackets_the_knee(knee, guess, max_runs):
    found = search_capacity(lambda r: 1.0 if r <= knee else 0.5, guess, 0.99, rel_tol=0.05, max_runs=max_runs)
    assert len(found.history) <= max_runs
    assert all((a >= 0.99) == (r <= knee) for r, a in found.history)
    passing = [r for r, a in found.history if a >= 0.99]
    assert found.rate == (max(passing) if passing else 0.0) and found.rate <= knee
    failing = [r for r, a in found.history if a < 0.99]
    if passing and failing and len(found.history) < max_runs:
        assert min(failing) <= found.rate * 1.05 + 1e-12  # stopped because the bracket is tight


def test_search_capacity_rejects_bad_arguments():
    for kwargs in ({"guess": 0.0}, {"guess": 1.0, "step": 1.0}, {"guess": 1.0, "max_runs": 0}):
        with pytest.raises(ValueError):
            search_capacity(lambda r: 1.0, **kwargs)


# ------------------------------------------------------------------------------------------------ capacity, balance


@needs_traces
def test_capacity_toy_schema(tmp_path):
    cfg = ex.CapacityConfig(
        TOY, workloads=("sharegpt4",), window_s={"sharegpt4": 2.0}, guess_rps={"sharegpt4": 8.0}, max_runs=3
    )
    result = ex.run_capacity(cfg, ["nanocp", "least-batch"], log=lambda *_: None)
    w = result["workloads"]["sharegpt4"]
    assert set(w["policies"]) == {"nanocp", "least-batch", ex.IDEAL} and w["reference_rate_rps"] >= 0
    # the balanced ideal never costs more than the plan: its capacity bounds nanocp's (within the search's bracket)
    assert w["policies"][ex.IDEAL]["capacity_rps"] >= w["policies"]["nanocp"]["capacity_rps"]
    for e in w["policies"].values():
        assert 1 <= len(e["history"]) <= 3 and e["capacity_rps"] >= 0
        passing = [h["rate"] for h in e["history"] if h["slo_attainment"] >= 0.99]
        assert e["capacity_rps"] == (max(passing) if passing else 0.0)
        if e["capacity_rps"] > 0:
            assert e["at_capacity"]["slo_attainment"] >= 0.99 and not e["at_capacity"]["stopped_early"]
        ref = e.get("at_reference")
        if w["reference_rate_rps"] > 0:
            assert ref["rate"] == w["reference_rate_rps"] and set(ref["tpot_ms"]) == {"mean", "p50", "p90", "p99"}
    paths = ex.write_capacity(result, tmp_path)
    assert {p.name for p in paths} == {"sim_capacity.json", "sim_capacity.md", "sim_capacity.png"}
    assert "model outputs" in (tmp_path / "sim_capacity.md").read_text().lower()


@needs_traces
def test_balance_toy_schema_and_summary(tmp_path):
    cfg = ex.BalanceConfig(
        TOY, "mix:0.02", low_rps=3.0, high_rps=12.0, window_s=2.0, policies=("nanocp", "least-cache")
    )
    result = ex.run_balance(cfg, log=lambda *_: None)
    assert [(r["load"], r["policy"]) for r in result["runs"]] == [
        ("low", "nanocp"),
        ("low", "least-cache"),
        ("high", "nanocp"),
        ("high", "least-cache"),
    ]
    for r in result["runs"]:
        assert r["kv_imbalance"]["mean"] >= 0 and 0 <= r["hol_blocked_fraction"] <= 1
        assert set(r["instance_layer_us"]) == set(BREAKDOWN) and len(r["instance_layer_us"]["attention"]) == 8
        assert all(
            p >= m - 1e-9 for p, m in zip(r["instance_layer_peak_us"]["attention"], r["instance_layer_us"]["attention"])
        )
    paths = ex.write_balance(result, tmp_path)
    names = {p.name for p in paths}
    assert names == {"sim_balance.json", "sim_balance.md", "sim_balance.png", "breakdown_sim_balance.png"}
    assert "_series" not in json.loads((tmp_path / "sim_balance.json").read_text())
    ex.write_micro(ex.run_micro(toy_micro(), ["nanocp", "least-batch"]), tmp_path)
    summary = ex.write_summary(tmp_path).read_text()
    assert "Micro-benchmark" in summary and "Load balance" in summary and "Where and why ours differ" in summary
    assert "74.1%" in summary  # the paper's low-load KV imbalance is quoted next to ours


def test_summary_needs_results(tmp_path):
    with pytest.raises(ex.ExperimentError):
        ex.write_summary(tmp_path)


@needs_traces
def test_the_ideal_run_charges_every_iteration_its_balanced_ideal():
    reqs = ex.WorkloadPool("mix:0.05", seed=0).at(20.0, 2.0)
    profile = TOY.load_profile()
    ideal, plan = (ex.serve(reqs, TOY, profile, p, SLO()) for p in (ex.IDEAL, "nanocp"))
    assert np.array_equal(ideal.log.array("dt"), ideal.log.array("ideal_dt"))
    assert ideal.metrics.ideal["busy_time_ratio"] == pytest.approx(1.0)
    assert plan.metrics.ideal["busy_time_ratio"] >= 1.0
    assert ideal.config.policy == "nanocp" and ideal.config.charge_ideal and not plan.config.charge_ideal


@needs_traces
def test_fail_fast_stops_an_overloaded_run():
    reqs = ex.WorkloadPool("sharegpt4", seed=0).at(400.0, 2.0)
    profile = TOY.load_profile()
    res = ex.serve(reqs, TOY, profile, "least-batch", SLO(tpot_s=0.005), fail_fast=True)
    assert res.stopped_early and res.metrics.slo_attainment < 0.99
    assert res.metrics.finished < len(reqs)


# ------------------------------------------------------------------------------------------------ simulator routes


@pytest.mark.parametrize("policy,few", [("nanocp", 64), ("nanocp", 0), ("uniform-cp:2", 64), ("least-batch", 64)])
def test_routes_from_lowered_tables_match_the_bindings(monkeypatch, policy, few):
    """Per iteration, the routed queries the simulator charges equal those listed in plan.bindings, on both the
    per-request path and the lowered-table path (few = 0), with growth onto other instances under memory pressure."""
    monkeypatch.setattr(sim_mod, "FEW_MULTI_SHARD", few)
    inner = sim_mod.ClusterSimulator._routes
    checked = []

    def checking(self, plan, total_shards, running):
        routes = inner(self, plan, total_shards, running)
        pairs = [(m, i) for m, split in plan.bindings.values() for i in split if i != m]
        expect = RouteCounts.from_pairs(pairs, self.spec.num_instances).count if pairs else 0
        np.testing.assert_array_equal(routes.count if routes is not None else 0, expect)
        assert set(self._multi) == {r for r, (_, split) in plan.bindings.items() if len(split) > 1}
        checked.append(len(pairs))
        return routes

    monkeypatch.setattr(sim_mod.ClusterSimulator, "_routes", checking)
    short = EmpiricalLengths(np.array([300, 1200, 2500]), np.array([40, 90, 150]))
    long = GithubIssueLengths(input_knots=((0.0, 8_000), (1.0, 20_000)), output_p50=60, output_p90=90)
    reqs = synthetic_workload(MixedLengths(short, long, 0.15), 120, 60.0, seed=4)
    cfg = SimConfig(
        num_nodes=2,
        instances_per_node=2,
        policy=policy,
        backend="python",
        kv_capacity_tokens=12_000,
        page_size=16,
        cp_buckets=CPBucketTable((4_000, 1 << 30), (1, 2)),
        progress=False,
    )
    res = simulate(reqs, cfg, UnboundedPrefillTier(lambda n: 0.0))
    assert res.metrics.finished + res.metrics.rejected == len(reqs) and checked
    if policy != "least-batch":
        assert max(checked) > 0


# ------------------------------------------------------------------------------------------------ latency model terms


def toy_dict(**cluster) -> dict:
    zero = {"const": 0.0}
    return {
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
            "num_experts": 4,
            "top_k": 1,
        },
        "cluster": {
            "instances_per_node": 4,
            "links": {"nvlink": {"GBps": 1.0, "latency_us": 0.0}, "rdma": {"GBps": 1.0, "latency_us": 0.0}},
        }
        | cluster,
        "phases": {
            "attention": {"const": 0.0, "kv_tokens": 1.0},
            "merge": {"const": 0.5, "partials": 0.0, "batch": 0.25},
            "dense": zero,
            "shared_expert": zero,
            "dense_mlp": zero,
            "expert": {"const": 1.0},
            "moe_dispatch": {"const": 0.0, "batch": 1.0},
            "moe_combine": zero,
            "iteration": zero,
            "host": {"const": 2.0, "batch": 0.5},
        },
    }


def test_host_merge_and_shared_cores_by_hand():
    kv, shards, batch = [10, 2, 2, 2], [1, 1, 1, 1], [1, 3, 1, 1]
    dedicated = LatencyProfile.from_dict(toy_dict())
    # pre_i = attention + merge (0.5 + 0.25 b): [10.75, 3.25, 2.75, 2.75]; a2a at max batch 3; expert 1; host 2 + 3
    lockstep = 10.75 + 3.0 + 1.0
    assert dedicated.iteration_cost(kv, shards, batch).total_s == pytest.approx(lockstep + 5.0)
    shared = LatencyProfile.from_dict(toy_dict(shared_cores=1))
    # work_i = pre_i + a2a(own batch) + expert: [12.75, 7.25, 4.75, 4.75] -> 29.5 on one core
    cost = shared.iteration_cost(kv, shards, batch)
    assert cost.total_s == pytest.approx(29.5 + 5.0)
    assert LatencyProfile.from_dict(toy_dict(shared_cores=4)).iteration_cost(kv, shards, batch).total_s == (
        pytest.approx(lockstep + 5.0)  # 29.5 / 4 < the lock-step time
    )
    np.testing.assert_allclose(sum(cost.per_instance[k] for k in BREAKDOWN), cost.total_s)
    assert shared.ideal_iteration_time(16, 6, 4) <= cost.total_s
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError):
            LatencyProfile.from_dict(toy_dict(shared_cores=bad))


def test_host_phase_is_optional():
    d = toy_dict()
    del d["phases"]["host"]
    p = LatencyProfile.from_dict(d)
    assert p.iteration_cost([10, 2, 2, 2], [1] * 4, [1, 3, 1, 1]).total_s == pytest.approx(10.75 + 3.0 + 1.0)


# ------------------------------------------------------------------------------------------------ CPU profile fit


def synthetic_cpu_run(truth: LatencyProfile, rng, host=(0.004, 0.0002), iterations=60):
    """PhaseRecords and step samples of a fake 4-instance CPU cluster whose phases follow `truth` exactly."""
    shape, n = truth.model, 4
    c = truth._coefs(n)
    records, samples = [], []
    for it in range(iterations):
        batch = rng.integers(1, 12, n)
        rows = batch + rng.integers(0, 6, n)
        kv = rng.integers(50, 5000, n)
        q = rng.integers(0, 8, n)
        res = rng.integers(0, 8, n)
        mean_b = float(batch.mean())
        for i in range(n):
            ctx = dict(iteration=it, instance=i, moe_batch=int(batch[i]), shard_rows=int(rows[i]), kv_tokens=int(kv[i]))
            ctx |= dict(q_recv=int(q[i]), res_recv=int(res[i]))
            m = max(q[i], res[i])
            link = truth.links["nvlink"]
            for layer in range(shape.num_layers):
                t = {
                    "projection": c.dense + c.dense_b * batch[i],
                    "attention": c.attn + c.attn_kv * kv[i] + c.attn_rows * rows[i],
                    "merge": c.merge + c.merge_partial * res[i] + c.merge_b * batch[i],
                    "q_route": float(link.time(m * shape.q_bytes)),
                    "res_route": float(link.time(m * shape.res_bytes)),
                }
                if layer < shape.num_dense_layers:
                    t["dense"] = c.mlp + c.mlp_b * batch[i]
                else:
                    t["dispatch"] = c.a2a + c.a2a_b * batch[i]  # moe_combine is 0 in `truth`
                    t["experts"] = c.expert + c.expert_b * mean_b
                    t["combine"] = 0.0
                records += [PhaseRecord(layer=layer, phase=p, seconds=float(s), **ctx) for p, s in t.items()]
            records.append(PhaseRecord(layer=-1, phase="sampling", seconds=float(c.it + c.it_b * batch[i]), **ctx))
        sample = StepSample(it, 0.0, 0, kv.tolist(), rows.tolist(), batch.tolist())
        sample.wall_s = sample.predict(truth, n) + host[0] + host[1] * int(batch.sum())
        samples.append(sample)
    return records, samples


def truth_profile() -> LatencyProfile:
    base = zero_base(tiny_model_shape(), 4)
    base["phases"] |= {
        "attention": {"const": 2e-4, "kv_tokens": 3e-7, "shards": 2e-5},
        "merge": {"const": 3e-4, "partials": 4e-5, "batch": 1e-5},
        "dense": {"const": 5e-4, "batch": 3e-5},
        "dense_mlp": {"const": 4e-4, "batch": 2e-5},
        "expert": {"const": 6e-4, "batch": 5e-5},
        "moe_dispatch": {"const": 7e-4, "batch": 4e-5},
        "iteration": {"const": 1e-4, "batch": 6e-5},
    }
    base["cluster"]["links"] = {k: {"GBps": 0.05, "latency_us": 30.0} for k in ("nvlink", "rdma")}
    base["cluster"]["shared_cores"] = 1.0
    return LatencyProfile.from_dict(base)


def test_profile_records_map_phases_onto_the_profile():
    truth = truth_profile()
    records, _ = synthetic_cpu_run(truth, np.random.default_rng(0), iterations=3)
    recs = profile_records(records, truth.model)
    phases = {r["phase"] for r in recs}
    assert phases == {
        "attention",
        "dense",
        "merge",
        "dense_mlp",
        "moe_dispatch",
        "expert",
        "moe_combine",
        "iteration",
        "cp_comm",
    }
    n_cells = 3 * 4 * truth.model.num_layers
    assert sum(r["phase"] == "attention" for r in recs) == n_cells
    assert sum(r["phase"] == "expert" for r in recs) == 3 * 4 * truth.model.num_moe_layers
    assert {r["link"] for r in recs if r["phase"] == "cp_comm"} == {"nvlink", "rdma"}


def test_cpu_fit_recovers_a_known_cluster():
    truth = truth_profile()
    records, samples = synthetic_cpu_run(truth, np.random.default_rng(1))
    profile, stats = fit_cpu_profile(samples, records, truth.model, 4, "inline")
    for phase in ("attention", "merge", "dense", "dense_mlp", "expert", "moe_dispatch", "iteration"):
        expect = truth.raw["phases"][phase]
        assert profile["phases"][phase] == pytest.approx(expect, rel=1e-6, abs=1e-12), phase
    assert profile["phases"]["host"] == pytest.approx({"const": 0.004, "batch": 0.0002}, rel=1e-6)
    link = profile["cluster"]["links"]["nvlink"]
    assert (link["GBps"], link["latency_us"]) == pytest.approx((0.05, 30.0), rel=1e-6)
    assert stats["sweep_median_ape"] < 1e-9 and stats["shared_cores"] == 1.0
    with pytest.raises(RuntimeError, match="at least 4"):
        fit_cpu_profile(samples[:3], records, truth.model, 4, "inline")


def test_cpu_fit_drops_contention_spikes():
    """Other processes only slow phases down: 5% of records at 5x and 5% of steps at 3x leave the fit unchanged."""
    truth = truth_profile()
    rng = np.random.default_rng(2)
    records, samples = synthetic_cpu_run(truth, rng)
    spiky = [replace(r, seconds=r.seconds * 5) if rng.random() < 0.05 and r.seconds > 1e-4 else r for r in records]
    for s in samples:
        if rng.random() < 0.05:
            s.wall_s *= 3
    profile, stats = fit_cpu_profile(samples, spiky, truth.model, 4, "inline")
    assert stats["fit_records_dropped_as_spikes"] > 0 and stats["iterations_dropped_as_spikes_in_host_fit"] > 0
    for phase in ("attention", "dense", "expert", "moe_dispatch"):
        assert profile["phases"][phase] == pytest.approx(truth.raw["phases"][phase], rel=1e-6, abs=1e-12), phase
    assert profile["phases"]["host"] == pytest.approx({"const": 0.004, "batch": 0.0002}, rel=1e-6)


def test_sweep_config_validation():
    with pytest.raises(RuntimeError):
        SweepConfig(cp_degrees=(8,))
    with pytest.raises(RuntimeError):
        SweepConfig(batch_sizes=())
    cfg = SweepConfig(batch_sizes=(3, 10), kv_lens=(100,), iterations=2, page_size=16)
    assert cfg.kv_capacity_tokens() % 16 == 0 and cfg.kv_capacity_tokens() >= 10 * 104


# ------------------------------------------------------------------------------------------------ real CPU cluster


def test_profile_and_fidelity_on_the_real_cpu_cluster_at_toy_size(tmp_path):
    """A toy sweep of the real data plane fits a loadable profile; the fidelity run compares real steps with it."""
    from nanocp.bench import cpu_profile, fidelity

    sweep = SweepConfig(batch_sizes=(2, 6), kv_lens=(16, 48), cp_degrees=(1, 4), iterations=2)
    profile, stats = cpu_profile.profile_decode(sweep, command="pytest", log=lambda *_: None)
    path = cpu_profile.write_profile(profile, tmp_path / "cpu-tiny.json")
    loaded = LatencyProfile.load(path)
    assert loaded.kind == "measured" and loaded.shared_cores == 1.0 and loaded.model.num_layers == 3
    prov = profile["provenance"]
    assert {"machine", "date", "command", "sweep", "fit"} <= set(prov) and prov["command"] == "pytest"
    assert stats["iterations"] == 2 * 2 * 2 * 2 and math.isfinite(stats["sweep_median_ape"])
    cfg = fidelity.FidelityConfig(
        profile=str(path),
        num_requests=6,
        repeats=2,
        long_fraction=0.5,
        short_len=(8, 32),
        long_len=(40, 80),
        max_tokens=(3, 6),
        cp_max_lens=(32, 1 << 30),
        cp_degrees=(1, 2),
        second_wave_step=2,
    )
    result = fidelity.run_fidelity(cfg, log=lambda *_: None)
    s = result["summary"]
    assert s["iterations"] == len(result["iterations"]) > 0 and s["repeat_states_identical"]
    assert s["repeat_spread_median"] >= 1.0 and s["median_ape_vs_fastest_repeat"] >= 0
    assert s["cp_iterations"] > 0 and all(r["ape"] >= 0 for r in result["iterations"])
    paths = fidelity.write_fidelity(result, tmp_path)
    assert "median absolute percentage error" in paths[1].read_text()
