"""Overlapped iterations (EngineConfig.overlap, processes backend): iteration t + 1 is sent before iteration t's
tokens are back, its continuing rows fed by the tokens their MoE instance kept. The outputs must be exactly those of
one iteration at a time, whatever ends, joins, is preempted or has its routing table lost on the way."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_data_plane import assert_logits_close

from nanocp import SamplingParams
from nanocp.comm.metadata_channel import Fault
from nanocp.control_plane import CPBucketTable
from nanocp.control_plane.lowering import RoutingTables
from nanocp.data_plane.cluster import ClusterConfig, InlineCluster, InstanceFailure
from nanocp.data_plane.instance import KEPT_TOKEN, Handoff, InstanceLimits, RowInput
from nanocp.engine import Engine, EngineConfig

FORCE_CP = CPBucketTable((24, 10**9), (1, 2))  # prompts longer than 24 tokens are split over 2 instances


def random_prompts(n: int, seed: int, low: int = 4, high: int = 40) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(rnd.randint(low, high))] for _ in range(n)]


STOP_TOKENS = tuple(range(0, 256, 4))  # a quarter of the byte vocabulary: most requests that stop on them stop early


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, early stops on tokens, different lengths."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 3
        max_tokens = rnd.randint(6, 20)
        if kind == 0:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=40, seed=rnd.randrange(1 << 20)))
        else:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=STOP_TOKENS))
    return out


def engine(overlap: bool, **kwargs) -> Engine:
    config = dict(model="tiny", decode_instances=2, backend="processes", cp_buckets=FORCE_CP, page_size=8)
    config.update(kwargs)
    return Engine(EngineConfig(overlap=overlap, **config))


def run_staggered(eng: Engine, prompts, params, keep_logits: bool = False, faults=None) -> dict:
    """Requests join two per step while others decode; `faults` (step -> [(instance, Fault)]) are injected into
    the routing-table pushes of later steps. -> request id -> its RequestOutput (released from the engine)."""
    waiting = list(enumerate(zip(prompts, params)))
    outs, step = {}, 0
    while waiting or eng.has_unfinished():
        for _ in range(min(2, len(waiting))):
            i, (prompt, p) = waiting.pop(0)
            eng.add_request(f"r{i}", prompt, p, keep_logits=keep_logits)
        for instance, fault in (faults or {}).get(step, []):
            eng.cluster.inject_metadata_fault(instance, fault)
        for out in eng.step():
            outs[out.request_id] = out
            eng.release(out.request_id)
        step += 1
    return outs


def tokens_of(outs: dict) -> dict:
    return {rid: (out.token_ids, out.finish_reason) for rid, out in outs.items()}


@pytest.fixture(scope="module")
def engines():
    pair = {overlap: engine(overlap) for overlap in (False, True)}
    yield pair
    for eng in pair.values():
        eng.close()


def test_overlapped_iterations_give_the_same_tokens_and_logits(engines):
    prompts = random_prompts(10, seed=5)
    params = mixed_params(len(prompts), seed=7)
    results = {o: run_staggered(eng, prompts, params, keep_logits=True) for o, eng in engines.items()}
    sync, overlapped = results[False], results[True]
    assert sync.keys() == overlapped.keys() == {f"r{i}" for i in range(len(prompts))}
    assert any(out.finish_reason == "stop" for out in sync.values())  # early stops were exercised
    assert tokens_of(sync) == tokens_of(overlapped)
    for rid, out in sync.items():
        # a request that stopped stays in the next iteration's batch, so later batches differ: equal to fp32 noise
        assert_logits_close(overlapped[rid].logits, out.logits)
    assert engines[True].overlapped_iterations > 0
    assert engines[False].overlapped_iterations == 0


def test_steady_decode_overlaps_every_iteration_but_the_first_and_the_last(engines):
    eng = engines[True]
    before = eng.overlapped_iterations
    prompts = random_prompts(6, seed=11)
    new_tokens = 9
    for i, prompt in enumerate(prompts):
        eng.add_request(f"s{i}", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    # new_tokens - 1 decode iterations: the first admits (it is sent alone), each later one goes out before the
    # previous one's tokens are back
    assert eng.overlapped_iterations - before == new_tokens - 2
    for i in range(len(prompts)):
        out = eng.output_of(f"s{i}")
        assert len(out.token_ids) == new_tokens and out.finish_reason == "length"
        eng.release(f"s{i}")


def test_plans_that_end_or_move_requests_still_overlap(engines, monkeypatch):
    # every request joins in the first step, then they end one after another (length) and the policy moves some
    # to rebalance: only the admitting plan waits; a moved request's kept token is handed to its new instance
    eng = engines[True]
    decisions = []
    can_overlap = eng._can_overlap

    def recorded(plan, rows):
        before = eng._inflight.rows.moe_instance
        moved = any(before.get(rid, i) != i for rid, i in rows.moe_instance.items())
        decisions.append((bool(plan.finished), moved, can_overlap(plan, rows)))
        return decisions[-1][2]

    monkeypatch.setattr(eng, "_can_overlap", recorded)
    lengths = [3, 5, 8, 11, 4, 9]
    prompts = random_prompts(len(lengths), seed=13)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        eng.add_request(f"e{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert [overlapped for _, _, overlapped in decisions[:-1]] == [True] * (len(decisions) - 1)
    assert any(ends for ends, _, _ in decisions) and any(moved for _, moved, _ in decisions)
    outs = {f"e{i}": eng.output_of(f"e{i}").token_ids for i in range(len(lengths))}
    for rid in outs:
        eng.release(rid)
    sequential = engines[False]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        sequential.add_request(f"e{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while sequential.has_unfinished():
        sequential.step()
    assert outs == {rid: sequential.output_of(rid).token_ids for rid in outs}
    for rid in outs:
        sequential.release(rid)


def test_multistep_windows_overlap_with_the_same_tokens():
    prompts = random_prompts(5, seed=21)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 7, 10, 5, 12)]
    results = {}
    for overlap in (False, True):
        eng = engine(overlap, num_steps=3, decode_instances=2)
        try:
            results[overlap] = tokens_of(run_staggered(eng, prompts, params))
            overlapped = eng.overlapped_iterations
        finally:
            eng.close()
    assert results[False] == results[True]
    assert overlapped > 0


def test_preemption_under_overlap_keeps_outputs_identical():
    # 64 tokens of KV per instance: growing requests must be preempted and recomputed
    prompts = random_prompts(6, seed=31, low=8, high=20)
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True) for _ in prompts]
    results, preempted = {}, {}
    for overlap in (False, True):
        eng = engine(overlap, kv_capacity_tokens=64, cp_buckets=None)
        try:
            outs = run_staggered(eng, prompts, params)
            results[overlap] = tokens_of(outs)
            preempted[overlap] = sum(out.metrics.preemptions for out in outs.values())
            overlapped = eng.overlapped_iterations
        finally:
            eng.close()
    assert preempted[True] > 0 and overlapped > 0
    assert results[False] == results[True]


def test_an_abort_while_iterations_are_in_flight_loses_nothing_else(engines):
    prompts = random_prompts(5, seed=51)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for overlap, eng in engines.items():
        for i, prompt in enumerate(prompts):
            eng.add_request(f"a{i}", prompt, params)
        for _ in range(4):
            eng.step()
        eng.abort("a2")
        while eng.has_unfinished():
            eng.step()
        results[overlap] = {f"a{i}": eng.output_of(f"a{i}") for i in range(len(prompts))}
        for i in range(len(prompts)):
            eng.release(f"a{i}")
    for overlap in engines:
        assert results[overlap]["a2"].finish_reason == "abort"
    kept = [f"a{i}" for i in (0, 1, 3, 4)]
    assert {rid: results[True][rid].token_ids for rid in kept} == {rid: results[False][rid].token_ids for rid in kept}
    assert all(len(results[True][rid].token_ids) == 12 for rid in kept)


def test_lost_tables_of_queued_iterations_are_resent(engines):
    prompts = random_prompts(6, seed=41)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) for _ in prompts]
    clean = run_staggered(engines[False], prompts, params)
    eng = engine(True, metadata_timeout_s=0.5)
    try:
        # steps 4 and 6 send an iteration while the previous one runs (no admission left by then)
        faults = {4: [(1, Fault.DROP)], 6: [(0, Fault.CORRUPT), (1, Fault.TEAR)]}
        faulty = run_staggered(eng, prompts, params, faults=faults)
        assert eng.cluster.resyncs == 3
        assert eng.overlapped_iterations > 0
        assert not eng.recoveries
    finally:
        eng.close()
    assert tokens_of(faulty) == tokens_of(clean)


def test_process_cluster_launch_order_is_checked(engines):
    cluster = engines[True].cluster
    with pytest.raises(RuntimeError, match="oldest outstanding"):
        cluster.collect(object())


def test_a_kept_token_the_instance_does_not_have_is_a_clear_error():
    cfg = ClusterConfig("tiny", 1, InstanceLimits(4, 4, 4), frames_per_instance=8, page_size=8)
    cluster = InlineCluster(cfg)
    try:
        from nanocp.control_plane import ClusterSpec, GlobalScheduler

        sched = GlobalScheduler(ClusterSpec(1, 1, 64, 8), "nanocp")
        sched.add_request("a", 5, 4)
        plan = sched.step()
        rows = [{0: RowInput(KEPT_TOKEN, SamplingParams(max_tokens=4), 1, 0, key=77)}]
        with pytest.raises(InstanceFailure, match="kept token of request key 77"):
            cluster.run_iteration(plan.full_tables(), rows)
        tables = [np.asarray(t) for t in plan.full_tables()]
        out = cluster.run_iteration(tables, [{0: RowInput(3, SamplingParams(max_tokens=4), 1, 0, key=77)}])
        assert len(out) == 1
        # the token kept for key 77 can be handed off; one for a key this instance never sampled cannot
        instance, table = cluster.instances[0], RoutingTables.parse(plan.full_tables()[0])
        row = {0: RowInput(3, SamplingParams(max_tokens=4), 1, 0, key=77)}
        with pytest.raises(ValueError, match=r"no kept token to hand off for request keys \[78\]"):
            instance.run_iteration(table, row, False, [Handoff(78, 0, 0)])
    finally:
        cluster.close()


class DeferredCluster(InlineCluster):
    """An inline cluster that runs an iteration only when it is collected: whatever the driver writes while an
    iteration is in flight (an admission's prefill KV) lands before that iteration reads or writes any page. The
    processes backend's race at its worst, made deterministic."""

    overlaps = True

    def launch(self, tables, rows, return_logits, full_tables, handoffs):
        sent = [self.feed.pick(r, tables, full_tables) for r in range(len(tables))]  # the plan is live only now
        for r, table in enumerate(sent):
            self.feed.held_now(r, table)
        return sent, rows, return_logits, handoffs

    def collect(self, launch) -> list:
        sent, rows, return_logits, handoffs = launch
        return self.run_iteration(sent, rows, return_logits, None, handoffs)


def deferred_engine(**kwargs) -> Engine:
    eng = engine(False, backend="inline", **kwargs)
    cfg = eng.cluster.cfg
    eng.cluster.close()
    eng.cluster = DeferredCluster(cfg)
    eng.overlaps = True
    return eng


def recorded_admissions(eng: Engine, monkeypatch) -> list[bool]:
    """The overlap decision of every plan that admits while an iteration is in flight."""
    decisions = []
    can_overlap = eng._can_overlap

    def recorded(plan, rows):
        overlapped = can_overlap(plan, rows)
        if plan.admitted:
            decisions.append(overlapped)
        return overlapped

    monkeypatch.setattr(eng, "_can_overlap", recorded)
    return decisions


@pytest.mark.parametrize("seed", [3, 8])
def test_admissions_overlap_only_into_pages_no_iteration_in_flight_touches(seed, monkeypatch):
    # requests join two per step while others end on tokens and on length: freed pages are reused first, so some
    # admissions get pages a request of the iteration in flight had; those must wait, the others may overlap
    prompts = random_prompts(16, seed=seed)
    params = mixed_params(len(prompts), seed=seed + 1)
    reference = engine(False, backend="inline")
    deferred = deferred_engine()
    try:
        decisions = recorded_admissions(deferred, monkeypatch)
        expected = tokens_of(run_staggered(reference, prompts, params))
        assert tokens_of(run_staggered(deferred, prompts, params)) == expected
        assert True in decisions and False in decisions  # both outcomes of the check were exercised
        assert deferred.overlapped_iterations > 0
    finally:
        reference.close()
        deferred.close()


def admit_into_the_pages_of_a_request_in_its_last_iteration(eng: Engine) -> tuple[list[int], list[int]]:
    """A decodes 3 tokens; B arrives while A's last iteration is in flight, when the scheduler has freed A's pages
    (length end at that plan) and hands them to B first. -> A's and B's tokens."""
    a, b = random_prompts(2, seed=21, low=30, high=40)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("a", a, greedy)
    eng.step()  # admits A
    eng.step()  # A's second iteration goes out before the first one's token is back
    eng.add_request("b", b, greedy)
    while eng.has_unfinished():
        eng.step()
    return eng.output_of("a").token_ids, eng.output_of("b").token_ids


def test_an_admission_into_pages_the_iteration_in_flight_reads_waits_for_it(monkeypatch):
    reference = engine(False, backend="inline")
    deferred = deferred_engine()
    try:
        decisions = recorded_admissions(deferred, monkeypatch)
        expected = admit_into_the_pages_of_a_request_in_its_last_iteration(reference)
        assert admit_into_the_pages_of_a_request_in_its_last_iteration(deferred) == expected
        assert decisions == [False]  # B waits for A's last iteration (A was admitted with nothing in flight)
        assert deferred.early_prefills == 1  # B's prefill was computed while A's last iteration was in flight
    finally:
        reference.close()
        deferred.close()


def test_without_the_page_check_that_admission_corrupts_outputs(monkeypatch):
    # the deferred cluster makes the hazard visible: admitted anyway, B's prompt KV lands in A's pages before A's
    # last iteration reads them and writes its own KV into one of them
    reference = engine(False, backend="inline")
    deferred = deferred_engine()
    try:
        monkeypatch.setattr(deferred, "_admission_is_safe", lambda plan: True)
        expected = admit_into_the_pages_of_a_request_in_its_last_iteration(reference)
        assert admit_into_the_pages_of_a_request_in_its_last_iteration(deferred) != expected
    finally:
        reference.close()
        deferred.close()


@pytest.mark.parametrize("overlap_admissions", [True, False])
def test_overlap_admissions_switch_and_counters(overlap_admissions):
    prompts = random_prompts(12, seed=17)
    params = mixed_params(len(prompts), seed=18)
    reference = engine(False, backend="inline")
    deferred = deferred_engine(overlap_admissions=overlap_admissions)
    try:
        expected = tokens_of(run_staggered(reference, prompts, params))
        assert tokens_of(run_staggered(deferred, prompts, params)) == expected
        assert deferred.admissions_in_flight > 0
        if overlap_admissions:
            assert 0 < deferred.overlapped_admissions <= deferred.admissions_in_flight
        else:
            assert deferred.overlapped_admissions == deferred.early_prefills == 0
    finally:
        reference.close()
        deferred.close()


def test_the_pages_recorded_for_a_length_end_are_those_of_its_last_iteration():
    # A's record is taken at each of its last launches: the one the scheduler frees after includes the page its
    # last iteration grew into (page_size 8: the last tokens cross a page boundary)
    eng = deferred_engine()
    try:
        prompt = random_prompts(1, seed=31, low=22, high=22)[0]  # 22 + 4 tokens: the last one opens a fourth page
        eng.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        records = []
        while eng.has_unfinished():
            eng.step()
            if "a" in eng._released_pages and "a" in eng.scheduler and eng.scheduler.request_state("a").running:
                records.append((eng._released_pages["a"], eng._pages_of("a")))
        assert len(records) >= 2  # recorded at more than one launch
        assert all(recorded == current for recorded, current in records)
        assert len(records[-1][1]) > len(records[0][1])  # it grew between them
    finally:
        eng.close()
