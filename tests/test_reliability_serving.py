"""The served path under faults: the engine failing under live streams, the router shutting down and restarting.

Every accepted request ends with an answer: a stream with an SSE error event and `[DONE]`, a non-streamed request
with a 503 carrying an OpenAI-style error; `/health` is 503 until the (new) cluster is up."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanocp.control_plane import _core
from nanocp.control_plane.api.local import ServerThread, free_port
from nanocp.control_plane.api.server import OpenAIServer, ServerConfig, _sse_line
from nanocp.data_plane.cluster import InstanceFailure
from nanocp.engine import Engine, EngineConfig
from nanocp.models import greedy_generate, load_model
from nanocp.models.tokenizer import ByteTokenizer

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
TOK = ByteTokenizer()


def engine_factory():
    config = EngineConfig(model="tiny", decode_instances=2, kv_capacity_tokens=4096, scheduler_backend=SCHEDULER)
    return lambda: Engine(config)


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)


class StreamReader:
    """A streamed completion read on its own thread: status, SSE payloads (JSON or "[DONE]"), any error."""

    def __init__(self, url: str, body: dict) -> None:
        self.status: int | None = None
        self.events: list = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        payload = line[6:]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e
        finally:
            self.first.set()
            self.done.set()

    def join(self, timeout_s: float = 60.0) -> None:
        assert self.done.wait(timeout_s), "stream did not end"

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and e.get("choices"))

    def assert_ended_with_error(self, *fragments: str) -> None:
        assert self.error is None and self.status == 200
        assert self.events[-1] == "[DONE]", self.events[-3:]
        err = self.events[-2]["error"]
        assert err["type"] == "server_error" and err["code"] == "service_unavailable"
        for fragment in fragments:
            assert fragment in err["message"]
        assert all("error" not in e for e in self.events[:-2])


def long_body(rnd: random.Random) -> dict:
    prompt = [rnd.randrange(256) for _ in range(rnd.randint(5, 40))]
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


def post_in_thread(url: str, body: dict) -> dict:
    """A non-streamed request on its own thread; the dict gets its response."""
    out: dict = {}

    def run() -> None:
        out["response"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_engine_failure_ends_every_stream_with_an_error_event_and_health_reports_it():
    rnd = random.Random()
    server = OpenAIServer(ServerConfig(model="tiny"), engine_factory())
    with ServerThread(server.app) as thread:
        streams = [StreamReader(thread.url, long_body(rnd)) for _ in range(3)]
        plain = post_in_thread(thread.url, long_body(rnd))
        for s in streams:
            assert s.first.wait(60) and s.status == 200
        wait_until(lambda: server.loop.load.running == 4, what="all four requests running")
        cluster = server.loop.engine.cluster

        def lost(*_args, **_kw):
            raise InstanceFailure("decode iteration failed: instance 0 died (exit code -9)")

        cluster.dead_instances = lambda: [0, 1]  # both instances gone: nothing left to recover on
        cluster.run_iteration = lost
        for s in streams:
            s.join()
            s.assert_ended_with_error("every decode instance is gone")
            assert len(s.text) > 0  # tokens streamed before the failure were delivered
        plain["thread"].join(60)
        r = plain["response"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        health = httpx.get(thread.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "every decode instance is gone" in health.json()["error"]
        r = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert server.admission.pending == 0


def test_router_restart_ends_streams_with_an_error_and_health_waits_for_the_new_cluster():
    rnd = random.Random()
    port = free_port()
    old = OpenAIServer(ServerConfig(model="tiny"), engine_factory())
    thread = ServerThread(old.app, port=port).start()
    streams = [StreamReader(thread.url, long_body(rnd)) for _ in range(3)]
    plain = post_in_thread(thread.url, long_body(rnd))
    for s in streams:
        assert s.first.wait(60) and s.status == 200
    wait_until(lambda: old.loop.load.running == 4, what="all four requests running")
    began = time.monotonic()
    thread.stop()
    stopped_in = time.monotonic() - began
    for s in streams:
        s.join(10)
        s.assert_ended_with_error("server is shutting down")
    plain["thread"].join(10)
    r = plain["response"]
    assert r.status_code == 503 and "server is shutting down" in r.json()["error"]["message"]
    assert stopped_in < 5, "in-flight requests held the shutdown until the graceful timeout"
    assert old.loop.state.value == "stopped" and old.admission.pending == 0

    gate = threading.Event()
    build = engine_factory()

    def slow_factory():
        gate.wait(60)
        return build()

    new = OpenAIServer(ServerConfig(model="tiny"), slow_factory)
    thread = ServerThread(new.app, port=port).start(wait_healthy=False)
    try:
        for _ in range(3):
            health = httpx.get(thread.url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "starting"
            r = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
            time.sleep(0.1)
        gate.set()
        wait_until(lambda: httpx.get(thread.url + "/health").status_code == 200, what="new cluster ready")
        prompt = [rnd.randrange(256) for _ in range(12)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(thread.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == TOK.decode(greedy_generate(load_model("tiny"), prompt, 6))
    finally:
        gate.set()
        thread.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_unexpected_handler_error_is_an_openai_style_500_and_the_server_keeps_serving(stream):
    server = OpenAIServer(ServerConfig(model="tiny"), engine_factory())
    with ServerThread(server.app) as thread:
        encode = server.tokenizer.encode

        def broken(text, add_special_tokens=False):
            if text == "boom":
                raise RuntimeError("tokenizer bug")
            return encode(text, add_special_tokens)

        server.tokenizer.encode = broken
        body = {"model": "tiny", "prompt": "boom", "max_tokens": 2, "stream": stream}
        r = httpx.post(thread.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "RuntimeError" in r.json()["error"]["message"]
        assert server.admission.pending == 0
        r = httpx.post(thread.url + "/v1/completions", json=body | {"prompt": "fine"}, timeout=60)
        assert r.status_code == 200


@given(st.text())
def test_sse_events_stay_one_line_for_splitlines_readers(text):
    """Found by the soak: generated text with U+0085 / U+2028 / U+2029 split an event for clients that read SSE
    with str.splitlines() (httpx's aiter_lines); every event must stay one line and round-trip."""
    line = _sse_line({"choices": [{"text": text}]})
    assert line.endswith("\n\n") and line.splitlines() == [line[:-2], ""]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text
