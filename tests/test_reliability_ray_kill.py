"""A Ray decode actor killed under live greedy streams takes the same path as a killed process: the driver sees
the actor's death at once (its iteration's task fails; no fabric timeout), shrinks the EP group to the survivors,
re-prefills, and every stream ends with an untouched run's tokens."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from nanocp import LLM
from nanocp.control_plane import _core
from nanocp.control_plane.api.launch import build_engine
from nanocp.data_plane.ray_cluster import RayCluster, RayPlacement
from nanocp.data_plane.sampling import SamplingParams
from nanocp.engine import EngineConfig

ray = pytest.importorskip("ray")

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
FABRIC_TIMEOUT_S = 30.0


@pytest.mark.reliability
def test_a_killed_ray_actor_under_live_streams_is_survived_without_waiting_for_a_fabric_timeout():
    rnd = random.Random(3)
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(10, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model="tiny", decode_instances=3, scheduler_backend=SCHEDULER, timeout_s=FABRIC_TIMEOUT_S)
    with LLM("tiny", backend="inline", decode_instances=3, scheduler_backend=SCHEDULER) as llm:
        clean = [o.token_ids for o in llm.generate(prompts, params)]
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, logging_level="warning")
    try:
        engine = build_engine(replace(config, backend="ray"), RayPlacement(3))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            began = time.monotonic()
            while time.monotonic() - began < 1.0:
                engine.step()
            assert all(0 < len(engine.requests[f"r{i}"].output) < 400 for i in range(len(prompts)))  # mid-stream
            engine.cluster.kill_instance(1)
            killed_at = time.monotonic()
            while not engine.recoveries:
                engine.step()
            recovered_in = time.monotonic() - killed_at
            while engine.has_unfinished():
                engine.step()
            outs = [engine.output_of(f"r{i}").token_ids for i in range(len(prompts))]
            assert [(r.dead_instances, r.survivors) for r in engine.recoveries] == [((1,), 2)], engine.recoveries
            assert isinstance(engine.cluster, RayCluster) and engine.cluster.num_instances == 2
        finally:
            engine.close()
    finally:
        ray.shutdown()
    assert outs == clean
    # the death is seen when the actor's task fails, and the cluster rebuilt without waiting on the survivors
    assert recovered_in < FABRIC_TIMEOUT_S / 2, recovered_in
