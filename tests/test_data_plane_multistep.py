"""Multi-step execution and incremental block tables in the decode data plane.

`LLM(..., num_steps=k)` must give exactly the outputs of k = 1 (greedy, seeded sampling, stops inside a window,
preemption, CP > 1, graph path, every cluster backend). The block-table store rebuilt from incremental tables must
equal the full snapshot; a store that missed a table must refuse the next incremental one, and the clusters must
then send the full snapshot.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanocp import LLM, SamplingParams
from nanocp.control_plane import ClusterSpec, CPBucketTable, GlobalScheduler, RoutingTables
from nanocp.data_plane.block_store import BlockTableStore, StaleBlockTableError
from nanocp.data_plane.cluster import ClusterConfig, InlineCluster, InstanceFailure, ThreadCluster
from nanocp.data_plane.instance import InstanceLimits, RowInput
from nanocp.data_plane.process_cluster import ProcessCluster

FORCE_CP = CPBucketTable((24, 10**9), (1, 4))  # prompts longer than 24 tokens are split over 4 instances
GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(rnd.randint(low, high))] for _ in range(n)]


def generate(prompts, params, num_steps: int, **kwargs):
    with LLM("tiny", num_steps=num_steps, **kwargs) as llm:
        outs = llm.generate(prompts, params, return_logits=True)
        assert all(ld.kv_tokens == 0 for ld in llm.engine.scheduler.loads()), "pages were not all returned"
    return outs


def assert_same_outputs(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert len(g.logits) == len(w.logits)
        for a, b in zip(g.logits, w.logits):
            assert float((a - b).abs().max() / b.abs().max()) < 1e-5


SCENARIOS = {
    # name: (prompts, sampling params, LLM kwargs)
    "greedy-cp": (random_prompts(6, 1), GREEDY, dict(decode_instances=4, cp_buckets=FORCE_CP, page_size=4)),
    "seeded": (
        random_prompts(4, 9, 10, 50),
        SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True),
        dict(decode_instances=4, cp_buckets=FORCE_CP),
    ),
    "preemption": (
        random_prompts(8, 5, 20, 40),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        dict(decode_instances=2, policy="least-batch", kv_capacity_tokens=96, page_size=4),
    ),
}


@pytest.mark.parametrize("num_steps", [2, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_multi_step_outputs_equal_single_step(scenario, num_steps):
    prompts, params, kwargs = SCENARIOS[scenario]
    want = generate(prompts, params, 1, **kwargs)
    got = generate(prompts, params, num_steps, **kwargs)
    assert_same_outputs(got, want)
    if scenario == "preemption":
        assert sum(o.metrics.preemptions for o in got) > 0, "the test did not exercise preemption"


@pytest.mark.parametrize("num_steps", [2, 4])
def test_a_stop_inside_a_window_drops_the_rest_of_it(num_steps):
    prompts = random_prompts(4, 17, 5, 30)
    free = generate(prompts, GREEDY, 1, decode_instances=2)
    # Stop request 0 at an output token past its first decode step: with k >= 2 it is produced inside a window.
    tokens = free[0].token_ids
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(tokens[index],), ignore_eos=True)
    want = generate(prompts, params, 1, decode_instances=2)
    got = generate(prompts, params, num_steps, decode_instances=2)
    assert want[0].finish_reason == "stop" and want[0].token_ids == tokens[: index + 1]
    assert_same_outputs(got, want)


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_cluster_backends_and_graph_path_run_multi_step(backend):
    prompts = random_prompts(4, 13, 10, 50)
    kwargs = dict(decode_instances=4, cp_buckets=FORCE_CP, page_size=8, max_batch_per_instance=8)
    want = generate(prompts, GREEDY, 1, **kwargs)
    assert_same_outputs(generate(prompts, GREEDY, 3, backend=backend, **kwargs), want)
    if backend == "threads":
        assert_same_outputs(generate(prompts, GREEDY, 3, use_graphs=True, **kwargs), want)


def test_bad_num_steps_is_rejected():
    with pytest.raises(ValueError, match="num_steps"):
        LLM("tiny", num_steps=0)


# ------------------------------------------------------------------ block-table store

LIMITS = InstanceLimits(8, 32, 32)


def random_plans(seed: int, steps: int, spec: ClusterSpec, skip: float = 0.0):
    """Plans of a scheduler under random arrivals, random num_steps and finishes; some are not lowered."""
    rnd = random.Random(seed)
    sched = GlobalScheduler(spec, "nanocp", cp_buckets=CPBucketTable((20, 10**9), (1, 3)), backend="cpp")
    added = []
    for _ in range(steps):
        for _ in range(rnd.randint(0, 3)):
            added.append(f"r{len(added)}")
            sched.add_request(added[-1], rnd.randint(1, 150), rnd.randint(2, 30))
        live = [rid for rid in added if rid in sched]
        if live and rnd.random() < 0.1:
            sched.finish(rnd.choice(live))
        plan = sched.step(rnd.choice([1, 2, 4]))
        if rnd.random() >= skip:
            yield plan


def test_store_rebuilt_from_incremental_tables_equals_the_full_snapshot():
    spec = ClusterSpec(1, 4, 512, 4)
    stores = [BlockTableStore.for_instance(LIMITS, spec.frames_per_instance) for _ in range(spec.num_instances)]
    checked = 0
    for plan in random_plans(3, 60, spec, skip=0.2):
        for i, store in enumerate(stores):
            table = RoutingTables.parse(plan.tables[i])
            store.apply(table)
            fresh = BlockTableStore.for_instance(LIMITS, spec.frames_per_instance, fill=-7)
            full = RoutingTables.parse(plan.full_tables()[i])
            fresh.apply(full)
            assert fresh.seq == store.seq == plan.iteration
            width = max(1, table.max_blocks)
            blocks = -(-table.shards[:, 2] // spec.page_size)  # [s] blocks of each shard
            a, b = store.rows(table.shards[:, 3], width).numpy(), fresh.rows(full.shards[:, 3], width).numpy()
            used = np.arange(width)[None, :] < blocks[:, None]
            assert np.array_equal(a[used], b[used]) and (b[used] >= 0).all()
            checked += int(used.sum())
    assert checked > 0


def test_store_refuses_a_table_built_on_another_state():
    spec = ClusterSpec(1, 2, 256, 4)
    plans = random_plans(4, 12, spec)
    store = BlockTableStore.for_instance(LIMITS, spec.frames_per_instance)
    first = RoutingTables.parse(next(plans).tables[0])
    store.apply(first)
    next(plans).tables  # noqa: B018 - lowered, never applied: the store misses it
    third = next(plans)
    with pytest.raises(StaleBlockTableError, match="full snapshot"):
        store.apply(RoutingTables.parse(third.tables[0]))
    assert store.seq == first.iteration  # nothing applied
    store.apply(RoutingTables.parse(third.full_tables()[0]))
    assert store.seq == third.iteration
    bad = third.full_tables()[0].copy()
    table = RoutingTables.parse(bad)
    if len(table.updates):
        table.updates[0, 2] = spec.frames_per_instance  # a frame the scheduler does not own
        with pytest.raises(ValueError, match="frame"):
            BlockTableStore.for_instance(LIMITS, spec.frames_per_instance).apply(table)


def cluster_rows(plan, n: int) -> list[dict[int, RowInput]]:
    rows = [{} for _ in range(n)]
    for i in range(n):
        for b in plan.routing(i).moe[:, 0].tolist():
            rows[i][b] = RowInput(b % 200, GREEDY, 1, b)
    return rows


@pytest.mark.parametrize("cluster_type", [InlineCluster, ThreadCluster])
def test_clusters_send_full_snapshots_when_a_store_is_behind(cluster_type):
    spec = ClusterSpec(1, 2, 256, 4)
    cfg = ClusterConfig("tiny", 2, LIMITS, spec.frames_per_instance, spec.page_size, timeout_s=10.0)
    cluster = cluster_type(cfg)
    try:
        plans = (p for p in random_plans(6, 40, spec) if p.batch)
        plan = next(plans)
        cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)
        assert all(inst.block_store.seq == plan.iteration for inst in cluster.instances)
        next(plans).tables  # noqa: B018 - lowered but never run: the stores miss it
        plan = next(plans)
        with pytest.raises(InstanceFailure, match="builds on"):  # tables as given: the stores refuse them
            cluster.run_iteration(plan.tables, cluster_rows(plan, 2))
        cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)  # the driver knows
        plan = next(plans)
        cluster.instances[1].block_store.seq = -1  # an instance that lost its store behind the driver's back
        outputs = cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)
        first_steps = [b for b, step in zip(outputs.batch_indices, outputs.steps) if step == 0]
        assert sorted(first_steps) == list(range(len(plan.batch)))
        assert [inst.block_store.seq for inst in cluster.instances] == [plan.iteration] * 2
        for i, inst in enumerate(cluster.instances):  # and both stores hold the full block tables
            full = RoutingTables.parse(plan.full_tables()[i])
            want = BlockTableStore.for_instance(LIMITS, spec.frames_per_instance)
            want.apply(full)
            got, ref = inst.block_store.rows(full.shards[:, 3], 64), want.rows(full.shards[:, 3], 64)
            blocks = -(-full.shards[:, 2] // spec.page_size)
            used = torch.arange(64)[None, :] < torch.from_numpy(blocks)[:, None]
            assert torch.equal(got[used], ref[used])
    finally:
        cluster.close()


def test_process_instances_refuse_stale_tables_and_get_snapshots():
    spec = ClusterSpec(1, 2, 256, 4)
    cfg = ClusterConfig("tiny", 2, LIMITS, spec.frames_per_instance, spec.page_size, timeout_s=10.0)
    cluster = ProcessCluster(cfg)
    try:
        plans = (p for p in random_plans(8, 40, spec) if p.batch)
        plan = next(plans)
        cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)  # fresh: snapshots
        next(plans).tables  # noqa: B018 - lowered but never run: the stores miss it
        plan = next(plans)
        with pytest.raises(InstanceFailure, match="builds on"):
            cluster.run_iteration(plan.tables, cluster_rows(plan, 2))
        plan = next(plans)
        # A driver that wrongly believes both stores are current: the instances refuse, the snapshots go out.
        cluster.feed.held = [int(RoutingTables.parse(t).base_seq) for t in plan.tables]
        resyncs = cluster.resyncs
        outputs = cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)
        assert cluster.resyncs == resyncs + 2
        first_steps = [b for b, step in zip(outputs.batch_indices, outputs.steps) if step == 0]
        assert sorted(first_steps) == list(range(len(plan.batch)))
        plan = next(plans)  # and the next iteration builds on the snapshots incrementally
        cluster.run_iteration(plan.tables, cluster_rows(plan, 2), full_tables=plan.full_tables)
        assert cluster.resyncs == resyncs + 2
    finally:
        cluster.close()
