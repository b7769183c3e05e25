"""Serving building blocks without HTTP: request parsing, chat templates, stop-safe streaming, admission, metrics,
and the engine loop driving a real tiny engine."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from nanocp.control_plane import _core
from nanocp.control_plane.api.admission import AdmissionQueue
from nanocp.control_plane.api.chat_template import ChatTemplate, ChatTemplateError
from nanocp.control_plane.api.engine_loop import Accepted, EngineLoop, Finished, LoopState, Rejected, Tokens
from nanocp.control_plane.api.errors import APIError
from nanocp.control_plane.api.metrics import ServingMetrics
from nanocp.control_plane.api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from nanocp.control_plane.api.streaming import TextStreamer
from nanocp.data_plane.cluster import InstanceFailure
from nanocp.data_plane.sampling import SamplingParams
from nanocp.engine import Engine, EngineConfig
from nanocp.models import greedy_generate, load_model
from nanocp.models.tokenizer import ByteTokenizer

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
TOK = ByteTokenizer()


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", **fields}).encode()


# ---- request parsing -----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    max_tokens=st.integers(1, 10_000),
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.001, 1.0),
    stop=st.one_of(st.none(), st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
    seed=st.one_of(st.none(), st.integers(-(2**40), 2**40)),
    stream=st.booleans(),
)
def test_valid_completion_requests_parse_to_their_values(max_tokens, temperature, top_p, stop, seed, stream):
    raw = body(prompt="hi", max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
               stream=stream, user="someone")  # fmt: skip
    req = parse_request(CompletionRequest, raw)
    assert (req.max_tokens, req.temperature, req.top_p, req.seed, req.stream) == (
        max_tokens, temperature, top_p, seed, stream
    )  # fmt: skip
    expected_stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    assert req.stop_list() == expected_stop
    params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            stop=req.stop_list(), seed=req.seed)  # fmt: skip
    assert params.stop == expected_stop


@pytest.mark.parametrize(
    "raw,param,code",
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (body(prompt="x", max_tokens="5"), "max_tokens", "invalid_value"),
        (body(prompt="x", max_tokens=0), "max_tokens", "invalid_value"),
        (body(prompt="x", max_tokens=True), "max_tokens", "invalid_value"),
        (body(prompt="x", temperature=2.5), "temperature", "invalid_value"),
        (body(prompt="x", top_p=0), "top_p", "invalid_value"),
        (body(prompt="x", n=3), "n", "unsupported_parameter"),
        (body(prompt="x", stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
        (body(prompt="x", stop=[""]), "stop", "invalid_value"),
        (body(prompt="x", stream=False, stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (body(prompt="x", stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", None),
        (body(prompt="x", logprobs=3), "logprobs", "unsupported_parameter"),
        (body(prompt="x", echo=True), "echo", "unsupported_parameter"),
        (body(prompt="x", stream=True, return_token_ids=True), "return_token_ids", "unsupported_parameter"),
        (body(prompt="x", return_token_ids=1), "return_token_ids", None),
        (body(prompt=3), "prompt", "invalid_value"),
        (body(), "prompt", "invalid_value"),
        (json.dumps({"prompt": "x"}).encode(), "model", "invalid_value"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_field(raw, param, code):
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, raw)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param
    if code is not None:
        assert err.code == code
    assert set(err.body()["error"]) >= {"message", "type", "code"}


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(messages=[{"role": "user", "content": "x"}], chat_template="{{ 7 * 7 }}"), "chat_template"),
        (dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={}), "chat_template"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
        (dict(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
        (dict(messages=[{"role": "user", "content": "x"}], max_tokens=3, max_completion_tokens=4), None),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), "tools"),
    ],
)
def test_bad_chat_requests_are_400(fields, param):
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, body(**fields))
    assert info.value.status == 400 and info.value.param == param


def test_completion_prompt_forms():
    assert parse_request(CompletionRequest, body(prompt="abc")).single_prompt() == "abc"
    assert parse_request(CompletionRequest, body(prompt=[5, 6])).single_prompt() == [5, 6]
    assert parse_request(CompletionRequest, body(prompt=["abc"])).single_prompt() == "abc"
    assert parse_request(CompletionRequest, body(prompt=[[1, 2]])).single_prompt() == [1, 2]
    for bad in (["a", "b"], [[1], [2]], []):
        with pytest.raises(APIError) as info:
            parse_request(CompletionRequest, body(prompt=bad)).single_prompt()
        assert info.value.status == 400 and info.value.param == "prompt"


# ---- chat template -------------------------------------------------------------------------------------------


def test_tiny_chat_template_renders_the_documented_format():
    t = ChatTemplate.for_tokenizer(TOK)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert t.render(msgs) == "<|bos|><|system|>be brief<|eos|><|user|>hi there<|eos|><|assistant|>"
    assert t.render(msgs, add_generation_prompt=False).endswith("hi there<|eos|>")
    ids = TOK.encode(t.render(msgs))
    assert ids[0] == TOK.bos_token_id and ids.count(TOK.eos_token_ids[0]) == 2


def test_checkpoint_template_features_and_rejections():
    source = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"
    )
    t = ChatTemplate(source, "<s>", "</s>")
    assert t.render([{"role": "user", "content": "héllo"}]) == '<s>[user]"héllo"'
    with pytest.raises(APIError) as info:
        t.render([{"role": "assistant", "content": "x"}])
    assert info.value.status == 400 and "first message must be from the user" in info.value.message


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(source):
    t = ChatTemplate(source, "<s>", "</s>")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(APIError) as info:
        t.render(messages)
    assert info.value.status == 400 and "unsafe" in info.value.message
    assert messages == [{"role": "user", "content": "x"}]  # never mutated


def test_uncompilable_checkpoint_template_is_a_configuration_error():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}", None, None)


# ---- stop-safe streaming -------------------------------------------------------------------------------------


def engine_stop_text(ids: list[int], stops: list[str]) -> tuple[int, str]:
    """Plain reference of the engine's stop rule: (tokens generated, final text)."""
    for n in range(1, len(ids) + 1):
        text = TOK.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n, text[: min(hits)]
    return len(ids), TOK.decode(ids)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.one_of(st.sampled_from(list(b"abc ")), st.integers(0, 257)), min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), max_size=3),
    steps=st.lists(st.integers(1, 3), min_size=40, max_size=40),
)
def test_streamed_text_never_passes_a_stop_and_adds_up_to_the_final_text(ids, stops, steps):
    n, final = engine_stop_text(ids, stops)
    streamer, sent, start = TextStreamer(TOK, stops), "", 0
    for size in steps:
        end = min(start + size, n)
        if end >= n:  # the step that ends the request: its tokens come with the final output
            break
        sent += streamer.push(ids[start:end])
        assert final.startswith(sent), (sent, final)
        start = end
    sent += streamer.finish(final)
    assert sent == final


# ---- admission -----------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(capacity=st.integers(1, 5), ops=st.lists(st.booleans(), max_size=60))
def test_admission_never_exceeds_its_bound(capacity, ops):
    q, inside = AdmissionQueue(capacity), 0
    for enter in ops:
        if enter:
            admitted = q.try_enter()
            assert admitted == (inside < capacity)
            inside += admitted
        elif inside:
            q.leave()
            inside -= 1
        assert q.pending == inside <= capacity
        assert 1 <= q.retry_after_s() <= 60
    with pytest.raises(RuntimeError):
        for _ in range(inside + 1):
            q.leave()
    with pytest.raises(ValueError):
        AdmissionQueue(0)


# ---- metrics -------------------------------------------------------------------------------------------------


def samples(metrics: ServingMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_record_exactly_what_they_are_given():
    rnd = random.Random()
    m = ServingMetrics("tiny")
    lab = (("model_name", "tiny"),)
    ttfts = [rnd.uniform(0.001, 2) for _ in range(5)]
    gaps = [[rnd.uniform(0.001, 0.2) for _ in range(rnd.randint(0, 6))] for _ in ttfts]
    for ttft, g in zip(ttfts, gaps):
        m.observe_tokens(ttft, g)
    m.observe_finish("stop", 1.5, 10, 0.04)
    m.observe_finish("length", 2.5, 7)
    m.observe_preemptions(3)
    m.set_load(4, 2, 0.25)
    s = samples(m)
    assert s[("nanocp:time_to_first_token_seconds_count", lab)] == len(ttfts)
    assert s[("nanocp:time_to_first_token_seconds_sum", lab)] == pytest.approx(sum(ttfts))
    assert s[("nanocp:inter_token_latency_seconds_count", lab)] == sum(map(len, gaps))
    assert s[("nanocp:generation_tokens_total", lab)] == len(ttfts) + sum(map(len, gaps))
    assert s[("nanocp:prompt_tokens_total", lab)] == 17
    assert s[("nanocp:e2e_request_latency_seconds_sum", lab)] == pytest.approx(4.0)
    assert s[("nanocp:request_success_total", (("finished_reason", "stop"), *lab))] == 1
    assert s[("nanocp:num_preemptions_total", lab)] == 3
    assert s[("nanocp:request_time_per_output_token_seconds_count", lab)] == 1
    assert s[("nanocp:request_time_per_output_token_seconds_sum", lab)] == pytest.approx(0.04)
    assert s[("nanocp:num_requests_running", lab)] == 4
    assert s[("nanocp:num_requests_waiting", lab)] == 2
    assert s[("nanocp:kv_cache_usage_perc", lab)] == 0.25


# ---- the engine loop -----------------------------------------------------------------------------------------


def tiny_engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", decode_instances=2, scheduler_backend=SCHEDULER, **kw))


async def collect(stream) -> list:
    events = [await stream.get()]
    while not isinstance(events[-1], (Finished, Rejected)):
        events.append(await stream.get())
    return events


def test_engine_loop_streams_the_reference_greedy_tokens():
    rnd = random.Random()
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(3, 40))] for _ in range(3)]
    n = 9
    loop = EngineLoop(tiny_engine)
    loop.start()
    assert loop.wait_ready(60)

    async def run():
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        streams = [loop.submit(f"r{i}", p, params, 0.0) for i, p in enumerate(prompts)]
        streams.append(loop.submit("too-long", [1] * 20000, params, 0.0))
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(run())
    finally:
        loop.stop()
    model = load_model("tiny")
    for prompt, events in zip(prompts, results):
        assert isinstance(events[0], Accepted) and isinstance(events[-1], Finished)
        streamed = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        out = events[-1].output
        assert out.token_ids == greedy_generate(model, prompt, n) and out.finish_reason == "length"
        assert streamed == out.token_ids[: len(streamed)] and len(streamed) < n  # the last step comes with Finished
    assert isinstance(results[-1][0], Rejected) and "context" in results[-1][0].message
    assert loop.state is LoopState.STOPPED


def test_engine_loop_stop_aborts_in_flight_requests_and_refuses_new_ones():
    loop = EngineLoop(tiny_engine)
    loop.start()
    assert loop.wait_ready(60)

    async def run():
        params = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
        stream = loop.submit("long", [1, 2, 3], params, 0.0)
        assert isinstance(await stream.get(), Accepted)
        assert isinstance(await stream.get(), Tokens)
        await asyncio.to_thread(loop.stop)
        events = await collect(stream)
        late = await collect(loop.submit("late", [1, 2], params, 0.0))
        return events[-1].output, late[0]

    output, late = asyncio.run(run())
    assert output.finish_reason == "abort" and 0 < len(output.token_ids) < 5000
    assert isinstance(late, Rejected) and late.status == 503


def test_engine_loop_reports_a_failed_start():
    gate = threading.Event()

    def broken():
        gate.set()
        raise RuntimeError("no GPUs here")

    loop = EngineLoop(broken)
    loop.start()
    assert not loop.wait_ready(30)
    assert gate.is_set() and loop.state is LoopState.FAILED and "no GPUs here" in loop.error
    loop.stop()


class DyingEngine(Engine):
    """Every decode cluster it builds (the first and those rebuilt by its failure recovery) fails every iteration."""

    def _build_cluster(self, spec) -> None:
        super()._build_cluster(spec)

        def die(*_args, **_kw):
            raise InstanceFailure("decode iteration failed: instance 1 died (exit code -9)")

        self.cluster.run_iteration = die


def test_engine_loop_fails_every_request_when_the_engine_gives_up():
    config = EngineConfig(model="tiny", decode_instances=2, scheduler_backend=SCHEDULER)
    loop = EngineLoop(lambda: DyingEngine(config))
    loop.start()
    assert loop.wait_ready(60)

    async def run():
        params = SamplingParams(max_tokens=50, temperature=0.0)
        events = await asyncio.gather(*(collect(loop.submit(f"r{i}", [1, 2, 3 + i], params, 0.0)) for i in range(2)))
        late = await collect(loop.submit("late", [4, 5], params, 0.0))
        return events, late

    try:
        events, late = asyncio.run(run())
    finally:
        loop.stop()
    assert loop.state is LoopState.FAILED and loop.error
    for ev in events:
        assert ev[-1].output.finish_reason == "error" and ev[-1].output.error == loop.error
    assert isinstance(late[0], Rejected) and late[0].status == 503
