"""Prefill queue policies: FCFS (Tetris) commits whole CDSP plans at arrival; LARS (Medha) runs one chunk at a
time by relative slack. Chunks never double-book an instance, cover each prompt once, and keep KV-holding groups
nested; LARS lets urgent short requests overtake a long one without starving it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.prefill.improvement_rate import poisson_arrivals, simulate_prefill
from nanocp.prefill.latency_model import load_profile, profile_path
from nanocp.prefill.planner import CdspPlanner, CoreCdspPlanner, PlannerConfig
from nanocp.prefill.queue_policy import (
    PrefillJob,
    PrefillScheduler,
    QueuePolicyError,
    run_to_completion,
)

A100 = load_profile(profile_path("a100-llama3-8b"))
H200 = load_profile(profile_path("h200-deepseek-v3"))
CONFIG = PlannerConfig(num_nodes=2, instances_per_node=8, max_sp=16)


def jobs_for(scheduler: PrefillScheduler, arrivals, lengths, slo_scale: float = 10.0) -> list[PrefillJob]:
    return [
        PrefillJob(f"r{k}", n, a, a + slo_scale * scheduler.reference.best_latency(0, n))
        for k, (a, n) in enumerate(zip(arrivals, lengths))
    ]


def check_schedule(scheduler: PrefillScheduler, jobs: list[PrefillJob], dispatches) -> None:
    planner = scheduler.reference
    by_rid = {}
    for d in dispatches:
        by_rid.setdefault(d.rid, []).append(d)
    for job in jobs:
        chunks = by_rid[job.rid]
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert [c.context for c in chunks] == [sum(x.tokens for x in chunks[:k]) for k in range(len(chunks))]
        assert sum(c.tokens for c in chunks) == job.length and chunks[-1].last
        assert not any(c.last for c in chunks[:-1])
        assert chunks[0].start >= job.arrival - 1e-9
        for a, b in zip(chunks, chunks[1:]):
            assert set(a.instances) <= set(b.instances)  # the KV's holders are part of the next group
            assert b.start >= a.end - 1e-9
        for c in chunks:
            seconds, _ = planner.prefill_latency(len(c.instances), c.context, c.tokens)
            assert c.end - c.start == pytest.approx(seconds, rel=1e-9)
        assert job.finish == pytest.approx(chunks[-1].end)
    # No instance runs two chunks at once.
    per_instance = {}
    for d in dispatches:
        for i in d.instances:
            per_instance.setdefault(i, []).append((d.start, d.end))
    for spans in per_instance.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["fcfs", "lars"]),
    st.sampled_from(["a100", "h200"]),
    st.floats(0.2, 3.0),
    st.integers(0, 10_000),
)
def test_schedules_are_consistent(policy, profile, rate, seed):
    models = A100 if profile == "a100" else H200
    planner = CdspPlanner(models, CONFIG)
    scheduler = PrefillScheduler(planner, policy, quantum_s=1.0)
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rate, 40, rng)
    lengths = [rng.randint(1, 150_000) for _ in arrivals]
    jobs = jobs_for(scheduler, arrivals, lengths)
    dispatches = run_to_completion(scheduler, jobs)
    check_schedule(scheduler, jobs, dispatches)


def test_fcfs_equals_the_planner_simulation():
    planner = CoreCdspPlanner(A100, CONFIG)
    rng = random.Random(1)
    arrivals = poisson_arrivals(0.8, 200, rng)
    lengths = [rng.randint(4000, 95_000) for _ in arrivals]
    scheduler = PrefillScheduler(planner, "fcfs")
    jobs = jobs_for(scheduler, arrivals, lengths)
    run_to_completion(scheduler, jobs)
    assert [j.ttft for j in jobs] == pytest.approx(simulate_prefill(planner, arrivals, lengths), rel=1e-12)


def test_lars_lets_a_short_request_overtake_a_long_one():
    """Convoy: a 190k prompt takes the pool at t=0, a 4k one arrives just after. FCFS queues the short request
    behind the whole long prefill; LARS runs it at the next chunk boundary."""
    ttft = {}
    for policy in ("fcfs", "lars"):
        scheduler = PrefillScheduler(CdspPlanner(A100, CONFIG), policy, quantum_s=1.0)
        jobs = jobs_for(scheduler, [0.0, 0.05], [190_000, 4_000])
        check_schedule(scheduler, jobs, run_to_completion(scheduler, jobs))
        ttft[policy] = [j.ttft for j in jobs]
    assert ttft["lars"][1] < 0.5 * ttft["fcfs"][1]
    assert ttft["lars"][0] < 2.0 * ttft["fcfs"][0]


def test_lars_does_not_starve_a_long_request():
    """A steady stream of short requests does not keep a long one waiting: its relative slack shrinks until it
    is the most urgent, and it finishes long before the stream ends."""
    scheduler = PrefillScheduler(CdspPlanner(A100, CONFIG), "lars", quantum_s=1.0)
    arrivals = [0.0] + [0.1 + 0.2 * k for k in range(600)]
    lengths = [150_000] + [16_000] * 600
    jobs = jobs_for(scheduler, arrivals, lengths, slo_scale=5.0)
    check_schedule(scheduler, jobs, run_to_completion(scheduler, jobs))
    assert jobs[0].finish < arrivals[-1] / 2


def test_bad_configuration_and_jobs():
    planner = CdspPlanner(A100, CONFIG)
    with pytest.raises(QueuePolicyError, match="queue policy"):
        PrefillScheduler(planner, "edf")
    with pytest.raises(QueuePolicyError, match="quantum_s"):
        PrefillScheduler(planner, "lars", quantum_s=0)
    scheduler = PrefillScheduler(planner, "lars")
    scheduler.submit(PrefillJob("a", 10, 0.0), 0.0)
    with pytest.raises(QueuePolicyError, match="already queued"):
        scheduler.submit(PrefillJob("a", 10, 0.0), 0.0)
    with pytest.raises(QueuePolicyError, match="positive int"):
        scheduler.submit(PrefillJob("b", 0, 0.0), 0.0)
    with pytest.raises(QueuePolicyError, match="same pool"):
        scheduler.use_planner(CdspPlanner(A100, PlannerConfig(1, 8, 8)))
