"""The engine loop: one thread owns the Engine (which is not thread safe).

HTTP handlers never touch the engine. They `submit` requests and `abort` them through a thread-safe inbox; the
loop thread applies the inbox, calls `engine.step()` while there is work and sleeps on a condition when idle,
and publishes each request's events to its asyncio queue with `loop.call_soon_threadsafe`:

    Accepted | Rejected(message, status) the answer to add_request (validation happens in the engine)
    Tokens(token_ids)                  new output tokens (streams only; not those of the step that ends it)
    Finished(output)                   the RequestOutput, once; finish_reason stop | length | abort | error

The loop thread also records token timings (TTFT from the server's arrival time, inter-token gaps from the
engine's per-token times) and the load gauges. An engine failure (an instance died) ends every request with
"error" and leaves the loop FAILED: /health then reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from nanocp.data_plane.sampling import SamplingParams

from .metrics import ServingMetrics

log = logging.getLogger("nanocp.api")


@dataclass
class Accepted:
    pass


@dataclass
class Rejected:
    message: str
    status: int = 400  # 400: the engine refused the request; 503: the engine is not serving


@dataclass
class Tokens:
    token_ids: list[int]


@dataclass
class Finished:
    output: object  # nanocp.engine.RequestOutput


Event = Accepted | Rejected | Tokens | Finished


class LoopState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class RequestStream:
    """The asyncio side of one request: events arrive on `queue` from the loop thread."""

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False  # set on the event loop when Finished is taken from the queue

    def publish(self, event: Event) -> None:
        """Called from the loop thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    async def get(self) -> Event:
        event = await self.queue.get()
        if isinstance(event, Finished):
            self.finished = True
        return event


@dataclass
class _Submit:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    arrival: float  # monotonic time the server received the request
    stream_tokens: bool


@dataclass
class _Abort:
    rid: str


@dataclass
class _Tracked:
    """Loop-thread bookkeeping of a live request."""

    stream: RequestStream
    arrival: float
    prompt_len: int
    stream_tokens: bool
    sent: int = 0  # output tokens already published / timed
    last_token_time: float | None = None
    preemptions: int = 0


@dataclass
class LoadSnapshot:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    iterations: int = 0


class EngineLoop:
    def __init__(
        self,
        engine_factory: Callable[[], object],
        metrics: ServingMetrics | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self._factory = engine_factory
        self.metrics = metrics
        self._on_ready = on_ready
        self.engine = None
        self.state = LoopState.STARTING
        self.error: str | None = None
        self.load = LoadSnapshot()
        self._inbox: deque[_Submit | _Abort] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}
        self._settled = threading.Event()  # READY or FAILED reached
        self._thread = threading.Thread(target=self._run, name="nanocp-engine-loop", daemon=True)

    # ---- control (any thread) -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        self._settled.wait(timeout_s)
        return self.state is LoopState.READY

    def stop(self, timeout_s: float = 60.0) -> None:
        """Abort what is in flight, close the engine (its cluster), join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("engine loop did not stop within %.0f s", timeout_s)

    # ---- requests (from the event loop) -------------------------------------------------------------------

    def submit(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, arrival: float, stream_tokens: bool = True
    ) -> RequestStream:
        """Queue a request; its first event is Accepted or Rejected. Call from inside the running event loop."""
        stream = RequestStream(rid, asyncio.get_running_loop())
        with self._cond:
            if self.state is not LoopState.READY or self._stopping:
                stream.publish(Rejected(f"engine is {self.state.value}", 503))
                return stream
            self._inbox.append(_Submit(rid, list(prompt_ids), params, stream, arrival, stream_tokens))
            self._cond.notify()
        return stream

    def abort(self, rid: str) -> None:
        with self._cond:
            self._inbox.append(_Abort(rid))
            self._cond.notify()

    @property
    def inbox_size(self) -> int:
        return len(self._inbox)

    # ---- the loop thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except Exception as e:  # noqa: BLE001 - reported through /health
            log.exception("engine failed to start")
            self._fail(f"engine failed to start: {e!r}")
            return
        with self._cond:
            self.state = LoopState.READY
        self._settled.set()
        if self._on_ready is not None:
            self._on_ready()
        driving = getattr(self.engine, "driving", contextlib.nullcontext)  # (test doubles have none)
        try:
            with driving():
                self._serve()
        except Exception as e:  # noqa: BLE001 - an instance died: every request ends with an error
            log.exception("engine loop failed")
            self._fail(f"engine failed: {e!r}")
        finally:
            self._shutdown()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_unfinished():
                    self._cond.wait()
                if self._stopping:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            for command in commands:
                self._apply(command)
            if engine.has_unfinished():
                done = engine.step()
                self._publish_step(done)
            self._record_load()

    def _apply(self, command: _Submit | _Abort) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            tracked = self._tracked.pop(command.rid, None)
            if tracked is None:
                return
            engine.abort(command.rid)
            output = engine.output_of(command.rid)
            engine.release(command.rid)
            self._observe_finish(output, tracked)
            tracked.stream.publish(Finished(output))
            return
        try:
            engine.add_request(command.rid, command.prompt_ids, command.params)
        except ValueError as e:  # SchedulerError, token ids outside the vocabulary, context too long, ...
            command.stream.publish(Rejected(str(e)))
            return
        self._tracked[command.rid] = _Tracked(
            command.stream, command.arrival, len(command.prompt_ids), command.stream_tokens
        )
        command.stream.publish(Accepted())

    def _publish_step(self, done: list) -> None:
        engine = self.engine
        ended = {output.request_id for output in done}
        for rid in dict.fromkeys(engine.last_updated):
            tracked, req = self._tracked.get(rid), engine.requests.get(rid)
            if tracked is not None and req is not None:
                # a request's last tokens travel with its final output (its text may be cut at a stop string)
                self._publish_tokens(tracked, req, stream=rid not in ended)
        for output in done:
            tracked = self._tracked.pop(output.request_id, None)
            engine.release(output.request_id)
            if tracked is None:  # aborted earlier: already answered
                continue
            self._observe_finish(output, tracked)
            tracked.stream.publish(Finished(output))
        if self.metrics is not None:
            for rid, tracked in self._tracked.items():
                req = engine.requests.get(rid)
                if req is not None and req.metrics.preemptions > tracked.preemptions:
                    self.metrics.observe_preemptions(req.metrics.preemptions - tracked.preemptions)
                    tracked.preemptions = req.metrics.preemptions

    def _publish_tokens(self, tracked: _Tracked, req, stream: bool) -> None:
        new = req.output[tracked.sent :]
        if not new:
            return
        times = req.metrics.token_times[tracked.sent :]
        ttft = times[0] - tracked.arrival if tracked.sent == 0 else None
        gaps, prev = [], tracked.last_token_time
        for t in times:
            if prev is not None:
                gaps.append(t - prev)
            prev = t
        tracked.sent, tracked.last_token_time = len(req.output), prev
        if self.metrics is not None:
            self.metrics.observe_tokens(ttft, gaps)
        if stream and tracked.stream_tokens:
            tracked.stream.publish(Tokens(list(new)))

    def _observe_finish(self, output, tracked: _Tracked) -> None:
        if self.metrics is not None:
            end = output.metrics.finish_time or time.monotonic()
            reason, tpot = output.finish_reason, output.metrics.tpot
            self.metrics.observe_finish(reason, end - tracked.arrival, tracked.prompt_len, tpot)

    def _record_load(self) -> None:
        engine = self.engine
        sched = engine.scheduler
        loads = sched.loads()
        total = engine.spec.frames_per_instance * engine.spec.num_instances
        used = total - sum(load.free_pages for load in loads)
        snap = self.load
        snap.running, snap.waiting = sched.num_running, sched.num_waiting + len(self._inbox)
        snap.kv_usage, snap.iterations = used / total, engine.iterations
        if self.metrics is not None:
            self.metrics.set_load(snap.running, snap.waiting, snap.kv_usage)

    def _fail(self, message: str) -> None:
        with self._cond:
            self.state = LoopState.FAILED
            self.error = message
            pending = [c for c in self._inbox if isinstance(c, _Submit)]
            self._inbox.clear()
        self._settled.set()
        for command in pending:
            command.stream.publish(Rejected(message, 503))
        for rid, tracked in list(self._tracked.items()):
            output = self._error_output(rid, message)
            self._observe_finish(output, tracked)
            tracked.stream.publish(Finished(output))
        self._tracked.clear()

    def _error_output(self, rid: str, message: str):
        from nanocp.engine import RequestMetrics, RequestOutput

        req = self.engine.requests.get(rid) if self.engine is not None else None
        metrics = req.metrics if req is not None else RequestMetrics(arrival_time=time.monotonic())
        metrics.finish_time = time.monotonic()
        prompt = req.prompt if req is not None else []
        tokens = list(req.output) if req is not None else []
        return RequestOutput(rid, prompt, tokens, "", True, "error", metrics, None, message)

    def _shutdown(self) -> None:
        engine = self.engine
        with self._cond:
            pending = [c for c in self._inbox if isinstance(c, _Submit)]
            self._inbox.clear()
            if self.state is not LoopState.FAILED:
                self.state = LoopState.STOPPED
        for command in pending:
            command.stream.publish(Rejected("server is shutting down", 503))
        for rid, tracked in list(self._tracked.items()):
            try:
                engine.abort(rid)  # its pages back now
                output = replace(engine.output_of(rid), error="server is shutting down")
            except Exception:  # noqa: BLE001 - the engine may be broken; answer with an error instead
                output = self._error_output(rid, "server is shutting down")
            tracked.stream.publish(Finished(output))
        self._tracked.clear()
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("closing the engine failed")
