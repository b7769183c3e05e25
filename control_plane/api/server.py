"""The OpenAI-compatible HTTP server (FastAPI) in front of the engine loop.

    app = create_app(ServerConfig(model="tiny"), engine_factory=lambda: Engine(EngineConfig(model="tiny")))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming or one JSON body), GET /v1/models,
GET /health (200 only once the cluster is up), GET /metrics (Prometheus text). With an API key every endpoint
but /health needs `Authorization: Bearer <key>`. A request passes: auth -> ready -> admission (429 + Retry-After,
before the body is read, so refusals stay cheap under overload) -> body size (413) -> JSON and field checks (400)
-> engine validation (400) -> generation. A client that goes away has its request aborted, which frees its KV
pages at once.

Streamed text never runs ahead of a stop string (streaming.py), so the concatenated stream equals the
non-streamed text.

A request the server accepted but cannot complete (the decode cluster failed, lost the capacity to hold it after an
instance failure, or the server is shutting down) ends with an explicit error: an SSE error event followed by
`[DONE]` on a stream, a 503 otherwise. An unexpected exception is a 500 with an OpenAI-style body; bad input is
always a 4xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanocp.data_plane.sampling import SamplingParams
from nanocp.models import encode_chat, encode_prompt, load_config, load_tokenizer

from . import errors
from .admission import AdmissionQueue
from .chat_template import ChatTemplate
from .engine_loop import EngineLoop, Finished, LoopState, Rejected, RequestStream, Tokens
from .errors import APIError
from .metrics import ServingMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    model_list,
    parse_request,
    usage,
    usage_chunk,
    with_token_ids,
)
from .streaming import TextStreamer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Temperatures below this sample the argmax anyway (as in vLLM); dividing logits by a subnormal one overflows to inf
# and would fail the whole decode iteration, so they are served greedily.
GREEDY_BELOW_TEMPERATURE = 1e-5

log = logging.getLogger("nanocp.api")


@dataclass
class ServerConfig:
    model: str = "tiny"
    served_model_name: str | None = None  # default: "tiny" or the checkpoint directory's name
    api_key: str | None = None
    max_pending_requests: int = 256  # waiting + running; more -> 429
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 256  # chat requests without max_tokens (capped by the context left)

    @property
    def model_name(self) -> str:
        return self.served_model_name or (self.model if self.model == "tiny" else Path(self.model).name)


@dataclass
class _Job:
    """One accepted generation request, as the handlers see it."""

    rid: str
    kind: str  # "completion" | "chat"
    created: int
    prompt_len: int
    params: SamplingParams
    stream: RequestStream | None
    include_usage: bool


@dataclass
class _Prepared:
    """A request read, checked and tokenized, before it is admitted to the engine."""

    kind: str  # "completion" | "chat"
    ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool  # extension (vLLM): the prompt's and the output's token ids in the answer


class OpenAIServer:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], object], on_ready=None) -> None:
        self.config = config
        self.model_config = load_config(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.chat_template = ChatTemplate.for_tokenizer(self.tokenizer)
        self.metrics = ServingMetrics(config.model_name)
        self.admission = AdmissionQueue(config.max_pending_requests)
        self.loop = EngineLoop(engine_factory, self.metrics, on_ready)
        self.app = self._build_app()

    # ---- app wiring ---------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app: FastAPI):
            self.loop.start()
            try:
                yield
            finally:
                await asyncio.to_thread(self.loop.stop)

        app = FastAPI(title="nanocp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(APIError, self._on_api_error)
        app.add_exception_handler(StarletteHTTPException, self._on_http_error)
        app.add_exception_handler(Exception, self._on_unexpected_error)
        app.add_middleware(_FullServerGate, server=self)
        app.get("/health")(self.health)
        protected = APIRouter(dependencies=[Depends(self._authorize)])
        protected.get("/v1/models")(self.models)
        protected.get("/metrics")(self.prometheus)
        protected.post("/v1/completions")(self.completions)
        protected.post("/v1/chat/completions")(self.chat_completions)
        app.include_router(protected)
        app.state.server = self
        return app

    async def _on_api_error(self, _request: Request, exc: APIError) -> JSONResponse:
        if exc.status >= 400 and exc.status not in (404, 429):  # 429s are counted where they are raised
            self.metrics.observe_rejection(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def _on_http_error(self, _request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(
            exc.status_code, str(exc.detail), "invalid_request_error", "not_found" if exc.status_code == 404 else None
        )
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def _on_unexpected_error(self, _request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in a request handler", exc_info=exc)
        err = errors.server_error(f"internal error: {type(exc).__name__}")
        return JSONResponse(err.body(), status_code=err.status)

    async def _authorize(self, request: Request) -> None:
        if not self.key_ok(request.headers.get("authorization", "")):
            raise errors.unauthorized()

    def key_ok(self, authorization: str) -> bool:
        """Does an Authorization header value carry the API key (always, without a key)?"""
        key = self.config.api_key
        if key is None:
            return True
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def too_many_requests(self) -> APIError:
        self.metrics.observe_rejection(429)
        return errors.too_many_requests(self.admission.retry_after_s(), self.admission.pending)

    def _require_ready(self) -> None:
        if self.loop.state is not LoopState.READY:
            detail = f": {self.loop.error}" if self.loop.error else ""
            raise errors.unavailable(f"the decode cluster is {self.loop.state.value}{detail}")

    # ---- simple endpoints ---------------------------------------------------------------------------------

    async def health(self) -> JSONResponse:
        state = self.loop.state
        body = {"status": state.value}
        if self.loop.error:
            body["error"] = self.loop.error
        return JSONResponse(body, status_code=200 if state is LoopState.READY else 503)

    async def models(self) -> JSONResponse:
        return JSONResponse(model_list(self.config.model_name, self.model_config.max_position_embeddings))

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- generation endpoints -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._admitted(request, self._prepare_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._admitted(request, self._prepare_chat)

    async def _admitted(self, request: Request, prepare) -> Response:
        """ready -> admission -> `prepare` (body, checks, tokens) -> generation. The admission slot is taken before
        the body is read or tokenized, so that refusing excess requests stays cheap under overload."""
        self._require_ready()
        arrival = time.monotonic()
        if not self.admission.try_enter():
            raise self.too_many_requests()
        self.metrics.set_admitted(self.admission.pending)
        try:
            prepared = await prepare(request)
        except BaseException:
            self.admission.leave(completed=False)
            self.metrics.set_admitted(self.admission.pending)
            raise
        return await self._generate(request, arrival, prepared)

    async def _prepare_completion(self, request: Request) -> _Prepared:
        req = parse_request(CompletionRequest, await self._read_body(request))
        self._check_model(req.model)
        prompt = req.single_prompt()
        ids = encode_prompt(self.tokenizer, prompt)
        params = self._sampling_params(req, req.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
        return _Prepared("completion", ids, params, req.stream, req.include_usage, req.return_token_ids)

    async def _prepare_chat(self, request: Request) -> _Prepared:
        req = parse_request(ChatCompletionRequest, await self._read_body(request))
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.chat_template.render(messages, req.add_generation_prompt)
        ids = encode_chat(self.tokenizer, text)
        params = self._sampling_params(req, req.requested_max_tokens(), len(ids), self.config.default_max_tokens)
        return _Prepared("chat", ids, params, req.stream, req.include_usage, req.return_token_ids)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.payload_too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise errors.payload_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise errors.not_found(
                f"model {model!r} does not exist; this server serves {self.config.model_name!r}", "model_not_found"
            )

    def _sampling_params(self, req, max_tokens: int | None, prompt_len: int, default: int) -> SamplingParams:
        if prompt_len == 0:
            raise errors.bad_request("the prompt is empty", "invalid_prompt", "prompt")
        context = self.model_config.max_position_embeddings
        room = context - prompt_len
        if max_tokens is None:
            max_tokens = min(default, room)
        if room < 1 or prompt_len + max_tokens > context:
            raise errors.bad_request(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
                f"{context} tokens",
                "context_length_exceeded",
                "max_tokens",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0 if 0.0 <= req.temperature < GREEDY_BELOW_TEMPERATURE else req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=req.stop_list(),
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:
            raise errors.bad_request(str(e), "invalid_value") from None

    async def _generate(self, request: Request, arrival: float, prepared: _Prepared) -> Response:
        """Run an admitted request; its admission slot is freed when it leaves the server (_Cleanup)."""
        kind, ids, params, stream = prepared.kind, prepared.ids, prepared.params, prepared.stream
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        job = _Job(rid, kind, int(time.time()), len(ids), params, None, prepared.include_usage)
        cleanup = _Cleanup(self, job)
        try:
            job.stream = self.loop.submit(rid, ids, params, arrival, stream_tokens=stream)
            first = await job.stream.get()
            if isinstance(first, Rejected):
                job.stream.finished = True
                if first.status == 503:
                    raise errors.unavailable(first.message)
                raise errors.bad_request(first.message, "invalid_prompt", "prompt")
        except BaseException:
            cleanup()
            raise
        if stream:
            return _SSEResponse(self._sse(job), cleanup)
        try:
            output = await self._wait_output(request, job.stream)
        finally:
            cleanup()
        if output is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if output.finish_reason in ("error", "abort"):
            raise _incomplete(rid, output)
        use = usage(job.prompt_len, len(output.token_ids))
        name = self.config.model_name
        build = chat_body if kind == "chat" else completion_body
        body = build(rid, name, job.created, output.text, output.finish_reason, use)
        if prepared.return_token_ids:
            with_token_ids(body, ids, output.token_ids)
        return JSONResponse(body)

    async def _wait_output(self, request: Request, stream: RequestStream):
        """The request's RequestOutput, or None if the client disconnected first."""
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                get = asyncio.ensure_future(stream.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                event = get.result()
                if isinstance(event, Finished):
                    return event.output
        finally:
            disconnect.cancel()

    async def _sse(self, job: _Job) -> AsyncIterator[str]:
        """SSE lines of one request: chunks, the finish chunk, the usage chunk if asked, [DONE]."""
        name, chat = self.config.model_name, job.kind == "chat"
        streamer = TextStreamer(self.tokenizer, job.params.stop)

        def chunk(text: str | None, finish_reason: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                body = chat_chunk(job.rid, name, job.created, delta, finish_reason)
            else:
                body = completion_chunk(job.rid, name, job.created, text or "", finish_reason)
            if job.include_usage:
                body["usage"] = None
            return _sse_line(body)

        if chat:
            first = chat_chunk(job.rid, name, job.created, {"role": "assistant", "content": ""}, None)
            if job.include_usage:
                first["usage"] = None
            yield _sse_line(first)
        while True:
            event = await job.stream.get()
            if isinstance(event, Tokens):
                piece = streamer.push(event.token_ids)
                if piece:
                    yield chunk(piece, None)
            elif isinstance(event, Finished):
                output = event.output
                if output.finish_reason in ("error", "abort"):
                    yield _sse_line(_incomplete(job.rid, output).body())
                    break
                rest = streamer.finish(output.text)
                if chat:
                    if rest:
                        yield chunk(rest, None)
                    yield chunk(None, output.finish_reason)
                else:
                    yield chunk(rest, output.finish_reason)
                if job.include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield _sse_line(
                        usage_chunk(job.rid, name, job.created, obj, usage(job.prompt_len, len(output.token_ids)))
                    )
                break
        yield "data: [DONE]\n\n"


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class _FullServerGate:
    """Pure ASGI middleware: while every admission slot is taken, an authorized generation request gets its 429
    here, before routing, body reading, parsing or tokenization. Refusing must stay cheap: an overloaded server
    spends its CPU (and the GIL its engine thread needs) on the requests it has accepted."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            server = self.server
            if server.admission.full and server.loop.state is LoopState.READY:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if server.key_ok(auth.decode("latin-1")):
                    err = server.too_many_requests()
                    body = json.dumps(err.body()).encode()
                    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
                    await send({"type": "http.response.start", "status": err.status, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)


class _Cleanup:
    """Runs once when a request leaves the server: frees its admission slot; aborts it if still running."""

    def __init__(self, server: OpenAIServer, job: _Job) -> None:
        self.server, self.job, self.done = server, job, False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.server.admission.leave()
        self.server.metrics.set_admitted(self.server.admission.pending)
        stream = self.job.stream
        if stream is not None and not stream.finished:
            self.server.loop.abort(self.job.rid)


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the response ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _incomplete(rid: str, output) -> APIError:
    """An accepted request that ended without its answer (engine failure, capacity lost after an instance
    failure, shutdown): 503, the service could not finish it; never the client's fault."""
    return errors.unavailable(f"request {rid} could not be completed: {output.error or output.finish_reason}")


# Characters JSON leaves raw that str.splitlines() (httpx's iter_lines, many SSE readers) takes for line ends.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse_line(body: dict) -> str:
    """One SSE event. Generated text may hold U+0085 / U+2028 / U+2029: they are escaped, so that a client that splits
    the stream with str.splitlines() still sees one event per line (JSON control characters are escaped anyway)."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)
    return f"data: {data}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(config: ServerConfig, engine_factory: Callable[[], object], on_ready=None) -> FastAPI:
    """The FastAPI app; the engine is built by `engine_factory` on the engine loop thread at startup."""
    return OpenAIServer(config, engine_factory, on_ready).app
