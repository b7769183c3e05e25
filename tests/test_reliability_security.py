"""Security defaults of the service: loopback binding unless configured, the API key on every endpoint but /health,
bounded bodies and prompts, no user-provided template or code ever evaluated, the metadata channel's token."""

from __future__ import annotations

import inspect
import random
import string

import httpx
import pytest

from nanocp.cli import build_parser
from nanocp.comm.metadata_tcp import TcpMetadataReceiver
from nanocp.control_plane import _core
from nanocp.control_plane.api import launch
from nanocp.control_plane.api.chat_template import ChatTemplate
from nanocp.control_plane.api.errors import APIError
from nanocp.control_plane.api.local import ServerThread
from nanocp.control_plane.api.server import OpenAIServer, ServerConfig
from nanocp.engine import Engine, EngineConfig
from nanocp.models import greedy_generate, load_model
from nanocp.models.tokenizer import ByteTokenizer

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
KEY = "sk-sec-" + "".join(random.choices(string.ascii_letters, k=16))
BODY_LIMIT = 128 << 10  # a context-filling token list (~50 KB) fits


@pytest.fixture(scope="module")
def served():
    config = EngineConfig(model="tiny", decode_instances=2, kv_capacity_tokens=4096, scheduler_backend=SCHEDULER)
    server = OpenAIServer(ServerConfig(model="tiny", api_key=KEY, max_body_bytes=BODY_LIMIT), lambda: Engine(config))
    with ServerThread(server.app) as thread:
        yield server, thread


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ---- binding -------------------------------------------------------------------------------------------------


def test_everything_binds_to_loopback_by_default(served):
    parser = build_parser()
    for command in (["serve"], ["deploy"]):
        assert parser.parse_args(command).host == "127.0.0.1"
    for fn in (launch.serve, launch.deploy, ServerThread.__init__, TcpMetadataReceiver.__init__):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn
    _server, thread = served
    bound = {sock.getsockname()[0] for s in thread.server.servers for sock in s.sockets}
    assert bound == {"127.0.0.1"}


def test_metadata_channel_needs_a_cluster_token():
    assert inspect.signature(TcpMetadataReceiver.__init__).parameters["token"].default is inspect.Parameter.empty
    with pytest.raises(ValueError, match="token must not be empty"):
        TcpMetadataReceiver(0, 1024, token="")


# ---- the API key ---------------------------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health(served):
    server, thread = served
    paths = server.app.openapi()["paths"]  # every route the app serves (generated, though never exposed)
    routes = [(method.upper(), path) for path, ops in paths.items() for method in ops]
    assert ("GET", "/health") in routes and len(routes) >= 5
    body = {"model": "tiny", "prompt": [1, 2], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for method, path in routes:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            r = httpx.request(method, thread.url + path, headers=headers, json=body, timeout=60)
            if path == "/health":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.request(method, thread.url + path, headers=auth(), json=body, timeout=60)
        assert r.status_code == 200, (method, path, r.text)


def test_no_schema_or_docs_endpoints_are_exposed(served):
    _server, thread = served
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        assert httpx.get(thread.url + path, headers=auth()).status_code == 404


# ---- bounds --------------------------------------------------------------------------------------------------


def test_request_bodies_are_bounded_declared_or_chunked(served):
    _server, thread = served
    big = b'{"model": "tiny", "prompt": "' + b"a" * BODY_LIMIT + b'"}'
    r = httpx.post(thread.url + "/v1/completions", content=big, headers=auth(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: the server counts what it reads
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    r = httpx.post(thread.url + "/v1/completions", content=chunks(), headers=auth(), timeout=60)
    assert r.status_code == 413


def test_prompt_length_is_bounded_by_the_context_and_the_cluster(served):
    server, thread = served
    context = server.model_config.max_position_embeddings  # and 9000 tokens > the KV of 2 x 4096
    for prompt, code in (([5] * (context + 1), "context_length_exceeded"), ([5] * 9000, "invalid_prompt")):
        big = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        r = httpx.post(thread.url + "/v1/completions", json=big, headers=auth(), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == code
    assert not server.loop.engine.requests


# ---- no user templates or code -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["chat_template", "chat_template_kwargs"])
def test_a_request_cannot_bring_its_own_template(served, field):
    _server, thread = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], field: "{{ 7 * 7 }}"}
    r = httpx.post(thread.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


def test_template_syntax_in_messages_is_plain_text(served):
    _server, thread = served
    content = "{{ 7 * 7 }}{% for x in range(3) %}{{ x }}{% endfor %}{{ ''.__class__.__mro__ }}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    body |= {"temperature": 0, "ignore_eos": True}
    r = httpx.post(thread.url + "/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200
    prompt = [256] + list(f"<|user|>{content}".encode()) + [257] + list(b"<|assistant|>")
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)  # rendered literally, not evaluated
    expected = ByteTokenizer().decode(greedy_generate(load_model("tiny"), prompt, 4))
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
    ],
)
def test_model_templates_run_sandboxed(source):
    """Even the checkpoint's own template cannot reach Python internals or mutate the request: such access is
    refused (a 400) or yields nothing."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = ChatTemplate(source, "<s>", "</s>").render(messages)
    except APIError as e:
        assert e.status == 400
    else:
        assert not any(leak in text for leak in ("class", "builtins", "function", "module"))
    assert messages == [{"role": "user", "content": "hi"}]
