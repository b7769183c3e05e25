"""Every policy on random small traces keeps the simulator's invariants: each request ends finished, rejected or
unfinished at the horizon (exactly one); a finished request decoded each of its tokens once, after its arrival;
the iterations' batches add up to the decoded tokens; no iteration beats its balanced ideal; when nothing is left
the scheduler has every page back. Traces include bursts, contexts up to (and past) what one instance or the whole
cluster holds, and KV small enough to force preemptions."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_bench_simulator import config, fixed_prefill, toy_profile

from nanocp.bench.simulator import ClusterSimulator
from nanocp.bench.workloads import Request

POLICIES = ["nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp:2", "medha:512", "csps", "csps:512"]
CAPACITY = 1024  # tokens per instance: 4 instances over 2 nodes


def trace(n: int, seed: int, burst: bool, max_input: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    arrivals = np.sort(rng.random(n) * (0.01 if burst else 2.0))
    inputs = rng.integers(1, max_input + 1, n)
    outputs = rng.integers(1, 120, n)
    return [Request(f"r{i}", float(t), int(a), int(b)) for i, (t, a, b) in enumerate(zip(arrivals, inputs, outputs))]


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    burst=st.booleans(),
    max_input=st.sampled_from([200, CAPACITY, 3 * CAPACITY, 5 * CAPACITY]),
    horizon=st.sampled_from([math.inf, 1.0]),
    backend=st.sampled_from(["python", "cpp"]),
)
@example(
    policy="medha:512", n=24, seed=8, burst=True, max_input=3 * CAPACITY, horizon=math.inf, backend="cpp"
)  # preempted and rejected at once: KeyError
@example(
    policy="csps", n=1, seed=0, burst=False, max_input=3 * CAPACITY, horizon=math.inf, backend="python"
)  # longer than an instance, shorter than S: never placed
def test_every_policy_keeps_the_simulators_invariants(policy, n, seed, burst, max_input, horizon, backend):
    reqs = trace(n, seed, burst, max_input)
    cfg = config(
        num_nodes=2,
        profile=toy_profile(0.005, per_batch_s=1e-4, per_kv_token_s=1e-8),
        policy=policy,
        kv_capacity_tokens=CAPACITY,
        page_size=16,
        backend=backend,
        max_sim_time_s=horizon,
    )
    sim = ClusterSimulator(cfg, fixed_prefill(0.01))
    res = sim.run(reqs)
    m = res.metrics
    assert {r.status for r in res.requests} <= {"finished", "rejected", "unfinished"}
    assert m.finished + m.rejected + m.unfinished == n
    for r in res.requests:
        if r.status == "finished":
            assert r.decode_iterations == r.output_len - 1
            assert r.arrival_s <= r.first_token_s <= r.finish_s
        assert r.decode_iterations <= r.output_len - 1
        assert r.ideal_decode_time_s <= r.decode_time_s * (1 + 1e-9) + 1e-15
    assert (res.log.array("ideal_dt") <= res.log.array("dt") * (1 + 1e-12)).all()
    if m.unfinished == 0:  # every stint closed: the batches add up to every decoded token, every page is back
        assert res.log.array("running").sum() == sum(r.decode_iterations for r in res.requests)
        loads = sim.sched.loads()
        assert sum(x.kv_tokens for x in loads) == 0 and sum(x.moe_batch for x in loads) == 0
        assert all(x.free_pages == CAPACITY // 16 for x in loads)
