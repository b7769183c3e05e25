"""RayCluster against a local Ray cluster: outputs equal the in-process cluster's over both fabrics, the engine
survives a killed actor, and close() / ray.shutdown() leave no actor, placement group or process behind."""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

from nanocp.control_plane import _core
from nanocp.control_plane.api.launch import build_engine
from nanocp.data_plane.ray_cluster import RayCluster, RayPlacement
from nanocp.data_plane.sampling import SamplingParams
from nanocp.engine import Engine, EngineConfig

ray = pytest.importorskip("ray")

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
REPO = Path(__file__).resolve().parents[1]


def run(engine: Engine, prompts: list[list[int]], n: int) -> list:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, keep_logits=True)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    return [done[f"r{i}"] for i in range(len(prompts))]


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.2)
    return alive


def test_ray_cluster_matches_the_in_process_cluster_and_cleans_up():
    rnd = random.Random()
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(3, 50))] for _ in range(3)]
    n = 6
    config = EngineConfig(model="tiny", decode_instances=2, scheduler_backend=SCHEDULER, page_size=8)
    reference = Engine(config)
    try:
        expected = run(reference, prompts, n)
    finally:
        reference.close()
    before = descendants()
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, logging_level="warning")
    try:
        for fabric in ("shm", "dist"):
            engine = build_engine(replace(config, backend="ray"), RayPlacement(2, fabric=fabric))
            cluster = engine.cluster
            assert isinstance(cluster, RayCluster) and cluster.fabric == fabric
            pids = {loc.pid for loc in cluster.locations}
            assert len(pids) == 2 and os.getpid() not in pids and len({loc.node_id for loc in cluster.locations}) == 1
            try:
                got = run(engine, prompts, n)
            finally:
                engine.close()
            for a, b in zip(got, expected):
                assert a.token_ids == b.token_ids
                for x, y in zip(a.logits, b.logits):
                    assert torch.allclose(x, y, rtol=1e-5, atol=1e-5)
            assert not wait_gone(pids), "actor processes outlived close()"
            groups = ray.util.placement_group_table().values()
            assert all(g["state"] == "REMOVED" for g in groups)
        # An actor dies mid-run: the engine rebuilds a one-instance Ray cluster and finishes every request.
        engine = build_engine(replace(config, backend="ray"), RayPlacement(2))
        try:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            engine.step()
            victim = engine.cluster.locations[1].pid
            engine.cluster.kill_instance(1)
            done = {}
            while engine.has_unfinished():
                done.update((o.request_id, o) for o in engine.step())
            assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == [e.token_ids for e in expected]
            assert [(r.dead_instances, r.survivors) for r in engine.recoveries] == [((1,), 1)]
            assert isinstance(engine.cluster, RayCluster) and engine.cluster.num_instances == 1
            assert not wait_gone({victim})
        finally:
            engine.close()
        with pytest.raises(ValueError, match="do not fill whole nodes"):
            RayCluster(engine.cluster.cfg, RayPlacement(3))
    finally:
        ray.shutdown()
    assert not wait_gone(descendants() - before), "Ray processes left after shutdown"
