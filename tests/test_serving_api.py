"""The OpenAI-compatible server end to end: the official `openai` client (and raw HTTP) against a served tiny
model; outputs checked against the single-instance reference model."""

from __future__ import annotations

import json
import random
import string
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanocp.control_plane import _core
from nanocp.control_plane.api.local import ServerThread
from nanocp.control_plane.api.server import OpenAIServer, ServerConfig
from nanocp.engine import Engine, EngineConfig
from nanocp.models import greedy_generate, load_model
from nanocp.models.tokenizer import ByteTokenizer

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
KEY = "sk-test-" + "".join(random.choices(string.ascii_letters, k=12))
TOK = ByteTokenizer()
KV_PER_INSTANCE = 2048  # two instances: the cluster holds 4096 tokens
LONG = [7] * 16000  # the tiny model's context is 16384


def engine_factory(**kw):
    config = EngineConfig(
        model="tiny", decode_instances=2, kv_capacity_tokens=KV_PER_INSTANCE, scheduler_backend=SCHEDULER, **kw
    )
    return lambda: Engine(config)


@dataclass
class Served:
    url: str
    server: OpenAIServer
    client: openai.OpenAI

    def post(self, path: str, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, headers=headers, timeout=60, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def served():
    server = OpenAIServer(ServerConfig(model="tiny", api_key=KEY, max_body_bytes=256 << 10), engine_factory())
    with ServerThread(server.app) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key=KEY, max_retries=0)
        yield Served(thread.url, server, client)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def random_text(rnd: random.Random, n: int) -> str:
    return "".join(rnd.choices(string.ascii_letters + " ", k=n))


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)


# ---- basics --------------------------------------------------------------------------------------------------


def test_models_listing_and_health(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(served.url + "/health")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ready"


@pytest.mark.parametrize(
    "method,path",
    [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")],
)
def test_missing_or_wrong_key_is_401(served, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, served.url + path, headers=headers, json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_wrong_key_gets_authentication_error(served):
    bad = openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)


# ---- generation ----------------------------------------------------------------------------------------------


def test_completion_matches_reference_and_stream_equals_non_stream(served, model):
    rnd = random.Random()
    ids = [rnd.randrange(256) for _ in range(rnd.randint(4, 60))]
    n = rnd.randint(8, 20)
    expected = TOK.decode(greedy_generate(model, ids, n))
    args = dict(model="tiny", prompt=ids, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    full = served.client.completions.create(**args)
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        len(ids),
        n,
        len(ids) + n,
    )
    chunks = list(served.client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1])


def test_text_prompt_gets_bos_and_seeded_sampling_is_reproducible(served):
    rnd = random.Random()
    text = random_text(rnd, rnd.randint(5, 30))
    args = dict(model="tiny", prompt=text, max_tokens=12, temperature=1.0, top_p=0.9, seed=rnd.randrange(1 << 30))
    a = served.client.completions.create(**args)
    b = served.client.completions.create(**args, stream=True)
    assert a.usage.prompt_tokens == len(text) + 1  # one byte per character, plus <|bos|>
    assert "".join(c.choices[0].text for c in b) == a.choices[0].text


def test_chat_uses_the_template_and_matches_reference(served, model):
    rnd = random.Random()
    system, user = random_text(rnd, 12), random_text(rnd, rnd.randint(5, 40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = [256] + list(f"<|system|>{system}".encode()) + [257] + list(f"<|user|>{user}".encode()) + [257]
    prompt += list(b"<|assistant|>")
    n = 10
    expected = TOK.decode(greedy_generate(model, prompt, n))
    args = dict(model="tiny", messages=messages, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    full = served.client.chat.completions.create(**args)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == expected
    assert full.usage.prompt_tokens == len(prompt) and full.usage.completion_tokens == n
    chunks = list(served.client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def find_stop_case(model, rnd: random.Random) -> tuple[list[int], str, str]:
    """A random prompt whose greedy text has a 2-letter ASCII piece after a few characters: (prompt, stop, text)."""
    for _ in range(200):
        prompt = [rnd.randrange(256) for _ in range(rnd.randint(3, 20))]
        text = TOK.decode(greedy_generate(model, prompt, 40))
        spots = [i for i in range(3, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isprintable()]
        if spots:
            i = rnd.choice(spots)
            return prompt, text[i : i + 2], text
    raise AssertionError("no usable stop string in 200 random prompts")


def test_stop_sequences_cut_the_text_in_stream_and_non_stream(served, model):
    rnd = random.Random()
    prompt, stop, text = find_stop_case(model, rnd)
    expected = text[: text.find(stop)]
    for stops in (stop, [stop, "\x00never\x00"]):
        args = dict(
            model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stops, extra_body={"ignore_eos": True}
        )
        full = served.client.completions.create(**args)
        assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
        pieces = [c.choices[0].text for c in served.client.completions.create(**args, stream=True)]
        assert "".join(pieces) == expected
        assert all(stop not in p for p in pieces)


# ---- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,payload,status,code",
    [
        ("/v1/completions", b"{not json", 400, "invalid_json"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "invalid_value"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "invalid_value"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2}, 400, "unsupported_parameter"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 999]}, 400, "invalid_prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": [7] * 16385}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 400}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": "tiny", "prompt": [7] * 5000}, 400, "invalid_prompt"),  # > the cluster's KV
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * (300 << 10)}, 413, "payload_too_large"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                  "chat_template": "{{ 7 * 7 }}"}, 400, "unsupported_parameter"),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "invalid_value"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(served, path, payload, status, code):
    kw = {"content": payload} if isinstance(payload, bytes) else {"json": payload}
    r = served.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"


def test_cluster_capacity_error_names_the_cause(served):
    r = served.post("/v1/completions", json={"model": "tiny", "prompt": [7] * 5000})
    assert "4096" in r.json()["error"]["message"]  # the whole cluster holds 2 x 2048 tokens


def test_openai_client_raises_bad_request(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client.completions.create(model="tiny", prompt="hi", n=2)
    assert info.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-4", prompt="hi")


# ---- metrics -------------------------------------------------------------------------------------------------


def test_metrics_count_what_was_served(served):
    rnd = random.Random()
    before = served.metrics()
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(3, 30))] for _ in range(3)]
    lengths = [rnd.randint(2, 9) for _ in prompts]
    for prompt, n in zip(prompts, lengths):
        served.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, extra_body={"ignore_eos": True})
    list(served.client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, stream=True,
                                          extra_body={"ignore_eos": True}))  # fmt: skip
    after = served.metrics()

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    tokens = sum(lengths) + 4
    assert delta("nanocp:request_success_total", (("finished_reason", "length"),)) == 4
    assert delta("nanocp:generation_tokens_total") == tokens
    assert delta("nanocp:prompt_tokens_total") == sum(map(len, prompts)) + len(prompts[0])
    assert delta("nanocp:time_to_first_token_seconds_count") == 4
    assert delta("nanocp:e2e_request_latency_seconds_count") == 4
    assert delta("nanocp:inter_token_latency_seconds_count") == tokens - 4
    assert after[("nanocp:num_requests_running", ())] == 0
    assert after[("nanocp:kv_cache_usage_perc", ())] == 0.0
    assert ("nanocp:num_preemptions_total", ()) in after and ("nanocp:num_requests_waiting", ()) in after


# ---- disconnects ---------------------------------------------------------------------------------------------


def gauge(served: Served, name: str) -> float:
    return served.metrics()[(name, ())]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_pages(served, stream):
    before = served.metrics().get(("nanocp:request_success_total", (("finished_reason", "abort"),)), 0.0)
    body = {"model": "tiny", "prompt": list(range(1, 200)), "max_tokens": 3000, "stream": stream, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    if stream:
        with httpx.stream("POST", served.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert gauge(served, "nanocp:kv_cache_usage_perc") > 0  # still streaming: its pages are in use
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", json=body, headers=headers, timeout=1.5)
    wait_until(lambda: gauge(served, "nanocp:num_requests_running") == 0, what="request aborted")
    assert gauge(served, "nanocp:kv_cache_usage_perc") == 0.0
    wait_until(lambda: len(served.server.loop.engine.requests) == 0, what="engine forgot the request")
    after = served.metrics()[("nanocp:request_success_total", (("finished_reason", "abort"),))]
    assert after == before + 1
    assert served.server.admission.pending == 0


# ---- admission, readiness, failures -------------------------------------------------------------------------


def test_full_admission_queue_answers_429_with_retry_after():
    server = OpenAIServer(ServerConfig(model="tiny", max_pending_requests=2), engine_factory())
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with ServerThread(server.app) as thread, httpx.Client(base_url=thread.url, timeout=60) as c1:
        with httpx.Client(base_url=thread.url, timeout=60) as c2:
            with (
                c1.stream("POST", "/v1/completions", json=body) as s1,
                c2.stream("POST", "/v1/completions", json=body) as s2,
            ):
                lines = [s.iter_lines() for s in (s1, s2)]  # kept open: a dropped iterator closes its stream
                for s, it in zip((s1, s2), lines):
                    assert s.status_code == 200 and next(it).startswith("data:")
                r = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
                assert int(r.headers["Retry-After"]) >= 1
                client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model="tiny", prompt="x", max_tokens=2)
        wait_until(lambda: server.admission.pending == 0, what="slots freed after the streams closed")
        ok = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    assert server.loop.state.value == "stopped"


def test_health_is_503_until_the_cluster_is_up():
    gate = threading.Event()
    build = engine_factory()

    def slow_factory():
        gate.wait(60)
        return build()

    server = OpenAIServer(ServerConfig(model="tiny"), slow_factory)
    thread = ServerThread(server.app).start(wait_healthy=False)
    try:
        health = httpx.get(thread.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        r = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        gate.set()
        wait_until(lambda: httpx.get(thread.url + "/health").status_code == 200, what="ready")
        r = httpx.post(thread.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        gate.set()
        thread.stop()


def test_a_cluster_that_fails_to_start_is_reported_by_health():
    def broken():
        raise RuntimeError("instance 3 could not map its KV pool")

    server = OpenAIServer(ServerConfig(model="tiny"), broken)
    thread = ServerThread(server.app).start(wait_healthy=False)
    try:
        wait_until(lambda: httpx.get(thread.url + "/health").json()["status"] == "failed", what="failure reported")
        health = httpx.get(thread.url + "/health")
        assert health.status_code == 503 and "could not map its KV pool" in health.json()["error"]
        r = httpx.post(thread.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert r.status_code == 503
    finally:
        thread.stop()


def test_sse_wire_format(served):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "ignore_eos": True}
    r = served.post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
