"""CUDA-graph replay of the decode pieces against the eager path on a GPU: on random plans, and with every
bucket of a family forced in turn (capture, then replay). On the CPU dry run the same code runs the graph path's
eager replay. The model is the tiny one with the tiny MoE layers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from gpu_target import gpu_marks, gpu_target
from test_graphs_decode import (
    FRAMES,
    MAX_BATCH,
    Cluster,
    N,
    assert_pools_close,
    assert_rows_close,
    fill_random,
    random_plans,
    rows_for,
)

from nanocp.data_plane.cluster import experts_of
from nanocp.data_plane.graph_runner import execution_shape
from nanocp.graphs import BucketFamily
from nanocp.models import ModelConfig, random_weights

pytestmark = gpu_marks()
DEVICE = gpu_target()
# 18 buckets: MoE batch x remote rows x block-table width
FAMILY = BucketFamily.grid((1, 2, MAX_BATCH), (0, 2, MAX_BATCH * N), (1, 4, FRAMES))


def _models(dense_only: bool):
    """The tiny model on DEVICE, per instance with its experts; `dense_only`: every layer dense (no exchanges
    between the MoE pieces)."""
    config = ModelConfig.tiny()
    if dense_only:
        config = dataclasses.replace(config, first_k_dense_replace=config.num_hidden_layers)
    return [
        random_weights(config, expert_ids=experts_of(r, N, config.n_routed_experts), device=DEVICE) for r in range(N)
    ]


@pytest.fixture(scope="module")
def device_models():
    return _models(dense_only=False)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("dense_only", [True, False], ids=["dense", "moe"])
def test_cuda_graph_replay_equals_eager_on_random_plans(dense_only):
    models = _models(dense_only)
    eager, graph = Cluster(models, device=DEVICE), Cluster(models, graphs=True, device=DEVICE)
    fill_random(eager.pools, 5)
    plans = replayable_plans(5, steps=6)
    for _ in range(2):  # first pass captures (its warm-up computes the results), second pass replays
        rnd = random.Random(5)
        for plan, tables in plans:
            for gp, ep in zip(graph.pools, eager.pools):
                gp.kv.copy_(ep.kv)
            rows = rows_for(plan, rnd)
            want = eager.run(tables, rows)
            got = graph.run(tables, rows)
            _sync()
            assert_rows_close(got, want)
            assert_pools_close(graph.pools, eager.pools)
    report = graph.engines[0].report()
    assert report.mode == ("cuda-graphs" if DEVICE == "cuda" else "eager-replay")
    assert (report.captured > 0) == (DEVICE == "cuda")


def replayable_plans(seed: int, steps: int) -> list:
    """(plan, its full-snapshot tables) of a seeded scheduler run: full tables can run again on any instance (an
    incremental table builds on the one before it)."""
    return [(plan, plan.full_tables()) for plan in random_plans(seed, "nanocp", steps)]


def _plan_with_remote_rows():
    """The first plan of a seeded run that routes queries between instances (CP), with its full tables."""
    for plan, tables in replayable_plans(7, steps=12):
        if any(len(plan.routing(i).q_recv) for i in range(N)):
            return plan, tables
    raise AssertionError("no plan with CP rows")


def test_every_bucket_captures_and_replays_like_eager(device_models):
    """Each bucket of FAMILY that covers the plan is forced in turn on every instance: the first run captures its
    pieces, the second replays them; both equal the eager path."""
    eager = Cluster(device_models, device=DEVICE)
    graph = Cluster(device_models, family=FAMILY, graphs=True, device=DEVICE)
    fill_random(eager.pools, 7)
    plan, tables = _plan_with_remote_rows()
    rows = rows_for(plan, random.Random(7))
    forced = 0
    for bucket in FAMILY:
        for engine in graph.engines:
            engine.pick_bucket = lambda shape, b=bucket: b if b.covers(shape) else None
        if not all(e.pick_bucket(s) for e, s in zip(graph.engines, _shapes(plan))):
            continue  # this bucket is too small for the plan on some instance
        forced += 1
        before = [e.report().captured for e in graph.engines]
        for _ in range(2):  # capture, then replay
            for gp, ep in zip(graph.pools, eager.pools):
                gp.kv.copy_(ep.kv)
            want = eager.run(tables, rows)
            got = graph.run(tables, rows)
            _sync()
            assert_rows_close(got, want)
            assert_pools_close(graph.pools, eager.pools)
        grew = [e.report().captured > b for e, b in zip(graph.engines, before)]
        assert all(grew) == (DEVICE == "cuda"), f"bucket {bucket}: captured {grew}"
    assert forced >= 4, f"only {forced} buckets cover the plan"


def _shapes(plan) -> list:
    return [execution_shape(plan.routing(r)) for r in range(N)]
