"""Overload and long runs. Short in-process versions run by default (a flood against a small admission bound, a
soak with cancellations and stop strings, checked against the engine's own state); the long versions drive
`nanocp serve` in a subprocess through bench/reliability.py (10x the measured sustainable rate, a soak of a
thousand requests) and are marked `reliability`."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import pytest

from nanocp.bench.reliability import (
    Outcome,
    OverloadConfig,
    SoakConfig,
    new_client,
    run_overload,
    run_soak,
    send,
    soak_requests,
)
from nanocp.control_plane import _core
from nanocp.control_plane.api.local import ServerThread
from nanocp.control_plane.api.server import OpenAIServer, ServerConfig
from nanocp.engine import Engine, EngineConfig

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"


def in_process_server(max_pending: int) -> OpenAIServer:
    config = EngineConfig(model="tiny", decode_instances=2, kv_capacity_tokens=4096, scheduler_backend=SCHEDULER)
    return OpenAIServer(ServerConfig(model="tiny", max_pending_requests=max_pending), lambda: Engine(config))


def assert_nothing_left(server: OpenAIServer) -> None:
    engine = server.loop.engine
    assert not engine.requests and not engine.has_unfinished()
    assert server.admission.pending == 0 and server.loop.inbox_size == 0
    assert all(load.kv_tokens == 0 for load in engine.scheduler.loads())
    spec = engine.spec
    assert sum(load.free_pages for load in engine.scheduler.loads()) == spec.frames_per_instance * spec.num_instances
    assert server.loop.state.value == "ready"


def test_flood_gets_429s_never_5xx_and_every_accepted_request_finishes():
    server = in_process_server(max_pending=6)
    rnd = random.Random()
    with ServerThread(server.app) as thread:

        async def flood() -> list[Outcome]:
            outcomes = [Outcome("flood", 0.0) for _ in range(150)]
            async with new_client() as client:

                async def one(o: Outcome) -> None:
                    body = {"model": "tiny", "prompt": [rnd.randrange(256) for _ in range(rnd.randint(3, 40))]}
                    body |= {"max_tokens": rnd.randint(2, 12), "ignore_eos": True, "stream": rnd.random() < 0.5}
                    await send(client, thread.url, "/v1/completions", body, o)

                await asyncio.gather(*(one(o) for o in outcomes))
            return outcomes

        outcomes = asyncio.run(flood())
        statuses = Counter(o.status for o in outcomes)
        assert set(statuses) == {200, 429} and statuses[429] > 0, statuses
        for o in outcomes:
            if o.status == 429:
                assert o.retry_after is not None and int(o.retry_after) >= 1
            else:
                assert not o.error and o.finish_reason == "length"
        assert_nothing_left(server)


def test_short_soak_with_cancellations_and_stops_leaves_nothing_behind():
    server = in_process_server(max_pending=64)
    cfg = SoakConfig(requests=150, concurrency=8, prompt_len=(1, 120), max_tokens=(1, 24), cancel_share=0.25, seed=3)
    with ServerThread(server.app) as thread:
        outcomes = asyncio.run(soak_requests(thread.url, cfg))
        assert len(outcomes) == cfg.requests
        errors = [o.error for o in outcomes if o.error]
        assert not errors, errors[:3]
        cancelled = [o for o in outcomes if o.cancelled]
        finished = [o for o in outcomes if not o.cancelled]
        assert cancelled and all(o.status == 200 for o in finished)
        assert {o.finish_reason for o in finished} == {"stop", "length"}
        for _ in range(200):  # aborts of the cancelled requests reach the engine loop asynchronously
            if not server.loop.engine.requests and server.admission.pending == 0:
                break
            time.sleep(0.05)
        assert_nothing_left(server)


# ---- long runs against `nanocp serve` ------------------------------------------------------------------------


@pytest.mark.reliability
def test_overload_at_10x_the_sustainable_rate(tmp_path):
    # 0.3x outside the burst: the machine is shared, so the capacity measured first is not guaranteed later on
    cfg = OverloadConfig(10.0, before_s=10.0, burst_s=20.0, after_s=40.0, normal_load=0.3, max_pending=32)
    doc = run_overload(cfg, tmp_path)
    assert doc["sustainable"]["failed"] == 0 and doc["sustainable"]["rate_rps"] > 0
    assert doc["server_errors_5xx"] == 0 and doc["other_4xx"] == 0 and doc["transport_errors"] == 0
    assert doc["accepted_failed"] == 0 and doc["retry_after_missing"] == 0
    phases = doc["phases"]
    assert phases["burst"]["rejected_429"] > 0 and phases["burst"]["accepted"] > 0
    assert phases["before"]["rejected_429"] == 0
    growth = doc["rss_mb"]["peak_server"] - doc["rss_mb"]["baseline_server"]
    assert growth < 150, doc["rss_mb"]
    assert doc["settle_s"] < 60
    settled, before = phases["after_settled"], phases["before"]
    assert settled["accepted"] > 0
    assert settled["p99_latency_ms"] <= 3 * before["p99_latency_ms"] + 2000, phases
    assert doc["health_after"] == 200 and not any(doc["idle_after"].values())


@pytest.mark.reliability
def test_soak_of_a_thousand_requests(tmp_path):
    cfg = SoakConfig(requests=1000, concurrency=16, warmup=150)
    doc = run_soak(cfg, tmp_path)
    assert doc["errors"] == 0, doc["error_samples"]
    assert doc["stuck"] == 0 and doc["requests"] == 1000
    assert doc["cancelled_by_client"] > 0 and set(doc["finish_reasons"]) == {"stop", "length"}
    assert not any(doc["gauges_after"].values()), doc["gauges_after"]  # every KV page free, nothing waiting
    assert doc["rss_mb"]["growth_server"] < 100, doc["rss_mb"]
    assert doc["health_after"] == 200


def test_a_full_server_refuses_before_reading_the_body():
    """While every slot is taken, even an unparsable body gets the 429 (the refusal costs no parsing), counted in
    the rejection metric; the 429 comes with an OpenAI rate-limit error."""
    server = in_process_server(max_pending=1)
    with ServerThread(server.app) as thread:
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", thread.url + "/v1/completions", json=body, timeout=60) as held:
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            assert held.status_code == 200 and next(lines).startswith("data:")
            for content in (b"{not json", b'{"model": "tiny", "prompt": "x"}'):
                r = httpx.post(thread.url + "/v1/completions", content=content, timeout=30)
                assert r.status_code == 429 and r.headers["retry-after"].isdigit()
                assert r.json()["error"]["type"] == "rate_limit_error"
            metrics = httpx.get(thread.url + "/metrics").text
            assert 'nanocp:request_rejected_total{model_name="tiny",status="429"} 2.0' in metrics
            assert 'nanocp:num_requests_admitted{model_name="tiny"} 1.0' in metrics
        for _ in range(200):
            if server.admission.pending == 0:
                break
            time.sleep(0.05)
        r = httpx.post(thread.url + "/v1/completions", content=b"{not json", timeout=30)
        assert r.status_code == 400  # with a free slot the same body is parsed and refused as bad input
        assert_nothing_left(server)
