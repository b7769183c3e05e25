"""Real checkpoint kinds end to end, offline (`LLM`) and served (the OpenAI server): a Kimi-K2-style checkpoint
(model_type kimi_k2, FP8 block-quantized weights, tiktoken tokenizer, no BOS) and a DeepSeek-V3-style one (FP8,
tokenizer.json, tokenizer_config.json's add_bos_token), both with a padded vocabulary (the embedding has more rows
than the tokenizer has tokens).

The same prompt gives the same tokens offline and served; a padded id decodes as empty text and keeps its place in
token_ids; a tokenizer that fails on one request's tokens ends that request only.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from fp8_checkpoints import write_fp8_checkpoint
from tokenizer_dirs import write_hf_tokenizer, write_kimi_tokenizer

from nanocp import LLM, SamplingParams
from nanocp.cli import main
from nanocp.control_plane import _core
from nanocp.control_plane.api.local import ServerThread
from nanocp.control_plane.api.server import OpenAIServer, ServerConfig
from nanocp.engine import Engine, EngineConfig
from nanocp.models import ModelConfig, load_tokenizer

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"
BASE = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
PADDING = 96  # embedding rows past the tokenizer's vocabulary
PROMPTS = ["hello world", "你好世界 hello", "the model's answer is 42", "def f(x):\n    return x", "Kimi", "x y z"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _checkpoint(directory, kind: str):
    """Tokenizer files first (their vocabulary sizes the model's), then FP8 weights and config.json."""
    if kind == "kimi_k2":
        write_kimi_tokenizer(directory)
    else:
        tok_config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
        write_hf_tokenizer(directory, tokenizer_config=tok_config)
    tok = load_tokenizer(str(directory))
    config = dataclasses.replace(
        BASE,
        model_type=kind,
        vocab_size=tok.vocab_size + PADDING,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_ids[0],),
        pad_token_id=None,
        n_group=1 if kind == "kimi_k2" else BASE.n_group,
        topk_group=1 if kind == "kimi_k2" else BASE.topk_group,
    )
    tokenizer_files = {p.name: p.read_bytes() for p in directory.iterdir()}
    write_fp8_checkpoint(directory, config, seed=21, block=(16, 32), max_shard_bytes=80_000)
    for name, data in tokenizer_files.items():  # config.json is the model's; the tokenizer files stay
        if name != "config.json":
            (directory / name).write_bytes(data)
    return directory


ENGINE = dict(decode_instances=2, kv_capacity_tokens=1024, scheduler_backend=SCHEDULER, load_progress=False)


def _engine(directory) -> Engine:
    return Engine(EngineConfig(model=str(directory), **ENGINE))


@pytest.fixture(scope="module", params=["kimi_k2", "deepseek_v3"])
def checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def offline(checkpoint):
    with LLM(str(checkpoint), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(checkpoint):
    server = OpenAIServer(ServerConfig(model=str(checkpoint)), lambda: _engine(checkpoint))
    with ServerThread(server.app) as thread:
        yield thread.url, server


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_offline_and_served_greedy_outputs_agree_token_for_token(checkpoint, offline, served):
    url, server = served
    name = server.config.model_name
    tok = offline.tokenizer
    for prompt, out in zip(PROMPTS, offline.generate(PROMPTS, GREEDY)):
        body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        choice = _post(url, "/v1/completions", {**body, "return_token_ids": True})["choices"][0]
        assert choice["prompt_token_ids"] == out.prompt_token_ids and choice["token_ids"] == out.token_ids
        assert choice["text"] == out.text
        has_bos = out.prompt_token_ids[0] == tok.bos_token_id
        assert has_bos == ("deepseek_v3" in checkpoint.name)  # as each tokenizer_config.json says
    messages = [{"role": "user", "content": "hello world"}]
    chat = offline.chat(messages, GREEDY)[0]
    body = {"model": name, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = _post(url, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert answer["prompt_token_ids"] == chat.prompt_token_ids and answer["choices"][0]["token_ids"] == chat.token_ids
    assert answer["choices"][0]["message"]["content"] == chat.text


def test_nanocp_generate_tokenizes_as_llm_does(checkpoint, offline, capsys):
    args = ["generate", *PROMPTS[:2], "--model", str(checkpoint), "--decode-instances", "2", "--backend", "threads"]
    args += ["--kv-capacity-tokens", "1024", "--max-tokens", "8", "--ignore-eos"]
    for chat in (False, True):
        assert main(args + ["--chat"] * chat) == 0
        printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        if chat:
            expected = offline.chat([[{"role": "user", "content": p}] for p in PROMPTS[:2]], GREEDY)
        else:
            expected = offline.generate(PROMPTS[:2], GREEDY)
        assert [p["token_ids"] for p in printed] == [o.token_ids for o in expected]
        assert [p["prompt"] for p in printed] == [offline.tokenizer.decode(o.prompt_token_ids) for o in expected]


def test_padded_ids_decode_as_empty_text_and_keep_their_place_offline_and_served(offline, served):
    url, server = served
    tok = offline.tokenizer
    outs = offline.generate(PROMPTS, GREEDY)
    padded = [o for o in outs if any(t >= tok.vocab_size for t in o.token_ids)]
    assert padded  # the fixture's random weights do sample padded ids
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        assert out.text == tok.decode([t for t in out.token_ids if t < tok.vocab_size])
    # served, every prompt at once: none of them fails
    body = {"model": server.config.model_name, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        answers = [client.post(url + "/v1/completions", json={**body, "prompt": p, "stream": True}) for p in PROMPTS]
    for out, answer in zip(outs, answers):
        assert answer.status_code == 200
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == out.text
        assert events[-1]["choices"][0]["finish_reason"] == "length"


class _FailsOn:
    """A tokenizer whose decode fails on one token id (as third-party tokenizer code may, with any exception)."""

    def __init__(self, tokenizer, bad_id: int) -> None:
        self._tokenizer, self.bad_id = tokenizer, bad_id

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.bad_id in ids:
            raise KeyError(f"no bytes for token {self.bad_id}")
        return self._tokenizer.decode(ids, skip_special_tokens)


def _bad_id_and_victims(outs) -> tuple[int, list[int]]:
    """A token id that some outputs have and others do not: (id, indices of the outputs that have it)."""
    for token in outs[0].token_ids:
        victims = [i for i, o in enumerate(outs) if token in o.token_ids]
        if len(victims) < len(outs):
            return token, victims
    raise AssertionError("every output has every token of the first one")


def test_a_tokenizer_failure_ends_only_its_own_request_offline(checkpoint, offline):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=["\x00never"])  # decodes per token
    reference = offline.generate(PROMPTS, params)
    bad, victims = _bad_id_and_victims(reference)
    with LLM(str(checkpoint), **ENGINE) as llm:
        llm.engine.tokenizer = _FailsOn(llm.engine.tokenizer, bad)
        outs = llm.generate(PROMPTS, params)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        if i in victims:
            assert out.finish_reason == "error" and "cannot be decoded" in out.error and "KeyError" in out.error
            assert ref.token_ids[: len(out.token_ids)] == out.token_ids and out.token_ids[-1] == bad
        else:
            assert (out.finish_reason, out.token_ids, out.text) == ("length", ref.token_ids, ref.text)


def test_a_tokenizer_failure_ends_only_its_own_request_served(checkpoint, offline):
    reference = offline.generate(PROMPTS, GREEDY)
    bad, victims = _bad_id_and_victims(reference)

    def failing_engine():
        engine = _engine(checkpoint)
        engine.tokenizer = _FailsOn(engine.tokenizer, bad)
        return engine

    server = OpenAIServer(ServerConfig(model=str(checkpoint)), failing_engine)
    server.tokenizer = _FailsOn(server.tokenizer, bad)  # the streams' decoding too
    body = {"model": server.config.model_name, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ServerThread(server.app) as thread, httpx.Client(timeout=60) as client:
        plain = [client.post(thread.url + "/v1/completions", json={**body, "prompt": p}) for p in PROMPTS]
        streamed = [
            client.post(thread.url + "/v1/completions", json={**body, "prompt": p, "stream": True}) for p in PROMPTS
        ]
        assert httpx.get(thread.url + "/health").status_code == 200  # the engine loop is still serving
    for i, (answer, stream, ref) in enumerate(zip(plain, streamed, reference)):
        if i in victims:
            assert answer.status_code == 503 and "cannot be decoded" in answer.json()["error"]["message"]
            assert '"error"' in stream.text and "cannot be decoded" in stream.text
        else:
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == ref.text
            assert "cannot be decoded" not in stream.text
