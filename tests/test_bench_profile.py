"""bench.latency_profile: the GPU profiles' numbers, the iteration model, CP communication, the fit."""

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.bench.latency_profile import (
    BREAKDOWN,
    PHASE_FEATURES,
    LatencyProfile,
    ProfileError,
    RouteCounts,
    fit_linear_cost,
    fit_profile_from_timing_log,
)

# DeepEP low-latency kernels, 128 tokens per rank (REFERENCE.md): EP -> (dispatch us, combine us)
DEEPEP_128 = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}


def toy_profile_dict(**phase_overrides) -> dict:
    """A 2-layer (1 dense + 1 MoE) profile in seconds with round coefficients, 2 instances per node."""
    phases = {
        "attention": {"const": 1.0, "kv_tokens": 0.001, "shards": 0.1},
        "merge": {"const": 0.0, "partials": 0.5},
        "dense": {"const": 2.0, "batch": 0.5},
        "shared_expert": {"const": 0.0, "batch": 0.25},
        "dense_mlp": {"const": 1.0, "batch": 1.0},
        "expert": {"const": 3.0, "batch": 1.0},
        "moe_dispatch": {"const": 4.0, "batch": 0.25},
        "moe_combine": {"const": 5.0, "batch": 0.25},
        "iteration": {"const": 10.0, "batch": 1.0},
    }
    phases.update(phase_overrides)
    return {
        "schema": "nanocp-latency-profile/1",
        "name": "toy",
        "time_unit": "s",
        "model": {
            "num_layers": 2,
            "num_dense_layers": 1,
            "num_heads": 2,
            "kv_lora_rank": 4,
            "qk_rope_head_dim": 2,
            "kv_bytes_per_element": 2,
            "act_bytes_per_element": 2,
            "num_experts": 4,
            "top_k": 2,
        },
        "cluster": {
            "instances_per_node": 2,
            "links": {"nvlink": {"GBps": 1e-9, "latency_us": 1e6}, "rdma": {"GBps": 0.5e-9, "latency_us": 2e6}},
        },
        "phases": phases,
    }


@pytest.fixture(scope="module", params=["h200-deepseek-v3", "h800-deepseek-v3"])
def gpu_profile(request):
    return LatencyProfile.load(request.param)


# ------------------------------------------------------------------------------------------------ GPU profiles


def test_gpu_profiles_have_provenance_for_every_phase_and_link(gpu_profile):
    prov = gpu_profile.raw["provenance"]
    for phase in PHASE_FEATURES:
        assert any(k.startswith(f"phases.{phase}") for k in prov), phase
    assert any(k.startswith("links.nvlink") for k in prov) and any(k.startswith("links.rdma") for k in prov)
    assert gpu_profile.kind == "model-derived" and "memory" in prov and "prefill" in prov


def test_deepseek_v3_shapes(gpu_profile):
    m = gpu_profile.model
    assert (m.q_bytes, m.res_bytes, m.kv_bytes_per_token) == (128 * 576 * 2, 128 * (512 * 2 + 4), 61 * 576 * 2)
    assert (m.num_moe_layers, m.num_dense_layers) == (58, 3)


def test_attention_per_token_is_flashmla_compute_bound(gpu_profile):
    per_token = gpu_profile.attention_time(1_000_000, 0) - gpu_profile.attention_time(0, 0)
    flops = 128 * 2 * (576 + 512)
    assert per_token / 1_000_000 == pytest.approx(flops / 660e12, rel=1e-3)


def test_deepep_table_reproduced_at_128_tokens_on_h800():
    p = LatencyProfile.load("h800-deepseek-v3")
    for ep, (dispatch_us, combine_us) in DEEPEP_128.items():
        d, c = p.moe_a2a_time(128, ep)
        assert d * 1e6 == pytest.approx(dispatch_us, abs=0.1) and c * 1e6 == pytest.approx(combine_us, abs=0.1)


def test_h200_keeps_deepep_times_where_the_nic_bounds_them():
    p = LatencyProfile.load("h200-deepseek-v3")
    for ep in (16, 32, 64, 128, 256):
        assert p.moe_a2a_time(128, ep)[0] * 1e6 == pytest.approx(DEEPEP_128[ep][0], abs=0.1)
    assert p.moe_a2a_time(128, 8)[0] * 1e6 < DEEPEP_128[8][0]  # faster NVLink inside an H200 node


def test_ep_interpolation_and_clamping(gpu_profile):
    lo, hi = gpu_profile.moe_a2a_time(100, 16)[1], gpu_profile.moe_a2a_time(100, 32)[1]
    mid = gpu_profile.moe_a2a_time(100, 24)[1]
    assert min(lo, hi) < mid < max(lo, hi)
    assert gpu_profile.moe_a2a_time(100, 4) == gpu_profile.moe_a2a_time(100, 8)
    assert gpu_profile.moe_a2a_time(100, 1024) == gpu_profile.moe_a2a_time(100, 256)


def test_memory_and_transfer(gpu_profile):
    caps = [gpu_profile.kv_capacity_tokens(n) for n in (16, 32, 64)]
    assert caps[0] < caps[1] < caps[2]  # more instances: fewer experts per GPU, more room for KV
    t = gpu_profile.kv_transfer_time(500_000)
    assert t == pytest.approx(6e-6 + 500_000 * 61 * 1152 / (8 * 50e9), rel=1e-9)
    assert gpu_profile.kv_transfer_time(0) == 0.0
    assert gpu_profile.prefill_time(2) == pytest.approx((74e9 * 2 + 3 * 61 * 128 * 2 * 320) / (8 * 660e12))


def test_h200_capacity_is_about_a_million_tokens_at_32_instances():
    assert 0.9e6 < LatencyProfile.load("h200-deepseek-v3").kv_capacity_tokens(32) < 1.3e6  # NanoCP section 1


# ------------------------------------------------------------------------------------------------ iteration model


def test_iteration_cost_by_hand():
    p = LatencyProfile.from_dict(toy_profile_dict())
    cost = p.iteration_cost(kv_tokens=[1000, 3000], shards=[2, 4], batch=[2, 4])
    attn = np.array([1 + 1 + 0.2, 1 + 3 + 0.4])
    dense = np.array([2 + 1, 2 + 2])
    pre = attn + dense + np.array([0.5, 1.0])  # + shared expert
    dlayer = attn + dense + np.array([3.0, 5.0])  # + dense MLP
    a2a = (4 + 1) + (5 + 1)  # max batch 4
    expert = 3 + 3  # mean batch 3
    expected = max(dlayer + pre) + 0 * max(pre) + 1 * (a2a + expert) + (10 + 4)
    assert cost.total_s == pytest.approx(expected)
    assert cost.slowest == 1
    assert cost.slowest_layer == pytest.approx({"attention": 4.4, "cp_comm": 0.0, "moe_a2a": 11.0, "other": 11.0})
    total_per_instance = sum(cost.per_instance[k] for k in BREAKDOWN)
    np.testing.assert_allclose(total_per_instance, cost.total_s)
    assert cost.slowest_breakdown()["attention"] == pytest.approx(2 * 4.4)


def test_cp_comm_by_hand():
    # 2 nodes x 2 instances; instance 0 routes 3 queries to 1 (same node) and 1 query to 2 (other node).
    p = LatencyProfile.from_dict(toy_profile_dict())
    count = np.zeros((4, 4), dtype=int)
    count[0, 1], count[0, 2] = 3, 1
    routes = RouteCounts.from_matrix(count)
    assert np.array_equal(routes.count, count) and routes.total == 4
    q, r = p.model.q_bytes, p.model.res_bytes  # 2*6*2 = 24, 2*(4*2+4) = 24
    assert (q, r) == (24, 24)
    nvl = lambda n, b: 1.0 + n * b / 1.0  # noqa: E731  (latency 1 s, 1 byte/s)
    rdma = lambda n, b: 2.0 + n * b / 0.5  # noqa: E731
    expected = [
        max(nvl(3, q), rdma(1, q)) + max(nvl(3, r), rdma(1, r)),  # sender of both
        2 * nvl(3, q),  # receives 3 over NVLink, returns 3 results
        2 * rdma(1, q),
        0.0,
    ]
    np.testing.assert_allclose(p.cp_comm_time(routes, np.array([0, 0, 1, 1])), expected)
    cost = p.iteration_cost([10] * 4, [1, 2, 2, 1], [4, 1, 1, 1], routes)
    assert cost.per_instance["cp_comm"][0] == pytest.approx(2 * (expected[0] + 0.5 * 4))  # + merge of 4 partials


@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 60), st.integers(0, 40)), min_size=1, max_size=16),
    st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_lock_step_properties(rows, seed):
    p = LatencyProfile.load("h200-deepseek-v3")
    kv = np.array([r[0] for r in rows], dtype=float)
    batch = np.array([r[2] for r in rows], dtype=float)
    shards = batch + np.array([r[1] for r in rows])  # every request has >= 1 shard
    cost = p.iteration_cost(kv, shards, batch)
    # invariant under permuting instances (no CP routes)
    perm = np.random.default_rng(seed).permutation(len(rows))
    assert p.iteration_cost(kv[perm], shards[perm], batch[perm]).total_s == pytest.approx(cost.total_s)
    # more KV anywhere never makes the iteration faster
    bumped = kv.copy()
    bumped[perm[0]] += 1000
    assert p.iteration_cost(bumped, shards, batch).total_s >= cost.total_s
    # the balanced CP-free ideal is a lower bound
    assert p.ideal_iteration_time(kv.sum(), batch.sum(), len(rows)) <= cost.total_s * (1 + 1e-12)
    for phase in BREAKDOWN:
        assert (cost.per_instance[phase] >= -1e-12).all()


def test_ideal_equals_a_balanced_cluster():
    p = LatencyProfile.load("h800-deepseek-v3")
    even = p.iteration_cost(np.full(32, 2e5), np.full(32, 60.0), np.full(32, 60.0)).total_s
    assert p.ideal_iteration_time(32 * 2e5, 32 * 60.0, 32) == pytest.approx(even)


# ------------------------------------------------------------------------------------------------ loading / errors


def test_load_errors(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        LatencyProfile.load("no-such-profile")
    bad = toy_profile_dict()
    bad["schema"] = "v0"
    with pytest.raises(ProfileError, match="schema"):
        LatencyProfile.from_dict(bad)
    missing = toy_profile_dict()
    del missing["phases"]["expert"]
    with pytest.raises(ProfileError, match="expert"):
        LatencyProfile.from_dict(missing)
    unknown = toy_profile_dict(attention={"const": 1.0, "bytes": 2.0})
    with pytest.raises(ProfileError, match="unknown coefficients"):
        LatencyProfile.from_dict(unknown)
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="JSON"):
        LatencyProfile.load(path)
    with pytest.raises(ProfileError, match="memory"):
        LatencyProfile.from_dict(toy_profile_dict()).kv_capacity_tokens(4)
    with pytest.raises(ProfileError):
        LatencyProfile.from_dict(toy_profile_dict()).iteration_cost([1, 2], [1], [1, 1])


# ------------------------------------------------------------------------------------------------ fitting


def synthetic_records(rng, truth: dict, noise: float) -> list[dict]:
    records = []
    for phase, coefs in truth.items():
        for _ in range(40):
            feats = {"kv_tokens": rng.integers(0, 200_000), "shards": rng.integers(1, 64)}
            feats |= {"batch": rng.integers(1, 128), "partials": rng.integers(0, 16)}
            t = coefs["const"] + sum(c * feats[f] for f, c in coefs.items() if f != "const")
            records.append({"phase": phase, "seconds": t * (1 + noise * rng.standard_normal())} | feats)
    return records


def test_fit_recovers_coefficients_exactly_without_noise():
    rng = np.random.default_rng(0)
    truth = {
        "attention": {"const": 2e-5, "kv_tokens": 3e-9, "shards": 4e-7},
        "dense": {"const": 1e-4, "batch": 2e-6},
        "moe_dispatch": {"const": 5e-5, "batch": 1e-6},
    }
    fitted = fit_profile_from_timing_log(synthetic_records(rng, truth, 0.0), toy_profile_dict())
    for phase, coefs in truth.items():
        assert fitted["phases"][phase] == pytest.approx(coefs, rel=1e-6)
    # unfitted phases keep the base profile's coefficients
    assert fitted["phases"]["expert"] == pytest.approx({"const": 3.0, "batch": 1.0})
    profile = LatencyProfile.from_dict(fitted)
    assert profile.kind == "measured" and profile.name == "cpu-tiny"
    assert profile.attention_time(1000, 2) == pytest.approx(2e-5 + 3e-6 + 8e-7)


def test_fit_with_noise_and_links():
    rng = np.random.default_rng(1)
    truth = {"attention": {"const": 1e-4, "kv_tokens": 1e-8, "shards": 2e-6}}
    records = synthetic_records(rng, truth, 0.02)
    for link, (lat, bw) in {"nvlink": (5e-6, 2e9), "rdma": (2e-5, 5e8)}.items():
        for nbytes in rng.integers(1_000, 10_000_000, size=30):
            records.append({"phase": "cp_comm", "link": link, "bytes": int(nbytes), "seconds": lat + nbytes / bw})
    fitted = fit_profile_from_timing_log(records, LatencyProfile.from_dict(toy_profile_dict()))
    att = fitted["phases"]["attention"]
    assert att["kv_tokens"] == pytest.approx(1e-8, rel=0.05) and att["shards"] == pytest.approx(2e-6, rel=0.2)
    links = fitted["cluster"]["links"]
    assert links["nvlink"] == pytest.approx({"GBps": 2.0, "latency_us": 5.0}, rel=1e-6)
    assert links["rdma"] == pytest.approx({"GBps": 0.5, "latency_us": 20.0}, rel=1e-6)


@given(st.floats(0.0, 1e-3), st.floats(-1e-6, 1e-6), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_fit_coefficients_are_never_negative(const, slope, seed):
    rng = np.random.default_rng(seed)
    batch = rng.integers(1, 200, size=20)
    records = [{"batch": int(b), "seconds": const + slope * b + 1e-3} for b in batch]
    fit = fit_linear_cost(records, ("batch",))
    assert fit["const"] >= 0 and fit["batch"] >= 0
    if slope >= 0:
        assert fit["batch"] == pytest.approx(slope, abs=1e-12) and fit["const"] == pytest.approx(const + 1e-3)


def test_fit_errors():
    with pytest.raises(ProfileError, match="at least"):
        fit_linear_cost([{"batch": 1, "seconds": 1.0}], ("batch",))
    with pytest.raises(ProfileError, match="lacks"):
        fit_linear_cost([{"seconds": 1.0}] * 3, ("batch",))
    with pytest.raises(ProfileError, match="unknown phases"):
        fit_profile_from_timing_log([{"phase": "warp", "seconds": 1.0}], toy_profile_dict())
    flat = [{"phase": "cp_comm", "link": "rdma", "bytes": b, "seconds": 1.0} for b in (10, 20, 30)]
    every_phase = synthetic_records(np.random.default_rng(), {p: {"const": 1e-4} for p in PHASE_FEATURES}, 0.0)
    nvlink = [{"phase": "cp_comm", "link": "nvlink", "bytes": b, "seconds": 1e-5 + b * 1e-9} for b in (1, 5, 9)]
    with pytest.raises(ProfileError, match="rdma do not grow with bytes"):
        fit_profile_from_timing_log(every_phase + nvlink + flat, model=toy_profile_dict()["model"])


def test_link_whose_times_do_not_grow_with_bytes_keeps_the_base_bandwidth():
    """Latency-bound (or noisy) transfers cannot resolve a bandwidth: the base's is kept, the latency is fitted."""
    rng = np.random.default_rng()
    base = LatencyProfile.from_dict(toy_profile_dict())
    sizes = np.sort(rng.integers(1, 4096, size=12))
    seconds = 2e-5 + np.sort(rng.random(12))[::-1] * 1e-6  # falls as bytes grow: the noise is all there is
    flat = [{"phase": "cp_comm", "link": "rdma", "bytes": int(b), "seconds": float(t)} for b, t in zip(sizes, seconds)]
    link = LatencyProfile.from_dict(fit_profile_from_timing_log(flat, base)).links["rdma"]
    bandwidth = base.links["rdma"].bandwidth_Bps
    assert link.bandwidth_Bps == pytest.approx(bandwidth)
    assert link.latency_s == pytest.approx(max(0.0, float(np.mean(seconds - sizes / bandwidth))))


def test_profile_dict_not_mutated_by_fit():
    base = toy_profile_dict()
    before = copy.deepcopy(base)
    fit_profile_from_timing_log(synthetic_records(np.random.default_rng(2), {"dense": {"const": 1.0}}, 0.0), base)
    assert base == before


def test_fit_without_base_needs_every_phase_and_link():
    rng = np.random.default_rng(5)
    truth = {p: {"const": 1e-4} for p in PHASE_FEATURES}
    records = synthetic_records(rng, truth, 0.0)
    model = toy_profile_dict()["model"]
    with pytest.raises(ProfileError, match="link"):
        fit_profile_from_timing_log(records, model=model)
    for link in ("nvlink", "rdma"):
        records += [{"phase": "cp_comm", "link": link, "bytes": b, "seconds": 1e-5 + b * 1e-9} for b in (1, 5, 9)]
    with pytest.raises(ProfileError, match="model"):
        fit_profile_from_timing_log(records)
    profile = LatencyProfile.from_dict(fit_profile_from_timing_log(records, model=model, instances_per_node=4))
    assert profile.instances_per_node == 4 and profile.links["rdma"].bandwidth_Bps == pytest.approx(1e9)
    assert profile.attention_time(123, 4) == pytest.approx(1e-4)
    with pytest.raises(ProfileError, match="dense"):
        fit_profile_from_timing_log([r for r in records if r["phase"] != "dense"], model=model)
