"""Reliability benchmark: faults injected and survived, overload at 10x the sustainable rate, and a soak.

    python -m nanocp.bench.reliability --out bench/results/reliability          # everything (~15 min on 2 cores)
    python -m nanocp.bench.reliability --only overload --burst-s 20 ...         # one part, scaled down

The served parts run `nanocp serve --model tiny` in a subprocess (processes backend, CDSP prefill tier: the defaults
users get) and drive it over HTTP with an asyncio client:

- kill: a decode instance process of the server is SIGKILLed while greedy streams are in flight; every stream must
  still end with the reference text (requests lost must be 0); each stream's stall (longest gap between two of its
  tokens after the kill) is measured.
- overload: the sustainable rate is measured first (closed loop, saturated server); then Poisson arrivals at 0.5x it
  (before), 10x it (burst), 0.5x again (after). Excess requests must get 429 with Retry-After, never a 5xx; every
  accepted request must finish; the server's RSS (process tree) is sampled throughout; p99 latency per phase.
- soak: thousands of requests with random lengths, stop strings, chat / completions, streamed or not, a share of
  them cancelled by the client (disconnects); afterwards no request may be left in the server and every KV page must
  be free (the server's gauges are exactly 0), and the RSS growth is reported.

stall (bench/stall.py): the engine as `nanocp serve` builds it, 12 greedy streams of 1,500 tokens, and one decode
instance killed (SIGKILL) or stopped (SIGSTOP), or one CDSP prefill instance killed or stopped while new requests
are prefilled; per-stream stall p50 and max, and whether every stream equals an untouched run.

The in-process parts inject the other faults: lost / corrupt / torn metadata pushes on a process cluster (outputs
must equal a clean run), prefill-instance deaths in the CDSP tier (KV must equal a single-instance prefill), and a
router restart with streams in flight (each must end with an SSE error event; /health 503 until the new cluster is
up). Results: <out>.json and <out>.md. CPU numbers from this machine; absolute latencies are not GPU figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
ALPHABET = string.ascii_letters + "     "
STOPS = ("e", "th", " a", "zz", "on")


# ---- the served process ----------------------------------------------------------------------------------------


class ServedProcess:
    """`nanocp serve` in a subprocess; its process tree's memory, its decode instance processes."""

    def __init__(self, port: int, extra: list[str] | None = None, log_path: Path | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "nanocp.cli", "serve", "--model", "tiny", "--port", str(port)]
        self.cmd += ["--log-level", "warning", *(extra or [])]
        self.log_path = log_path or Path(os.devnull)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> ServedProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nanocp serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not healthy within {timeout_s} s")

    def tree(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def rss_bytes(self) -> tuple[int, int]:
        """(RSS of the server process, RSS of its whole process tree)."""
        total, own = 0, 0
        for i, p in enumerate(self.tree()):
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            own = rss if i == 0 else own
        return own, total

    def instance_pids(self) -> list[int]:
        """The decode instance processes (spawned multiprocessing children; not the resource tracker)."""
        pids = []
        for p in self.tree()[1:]:
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "multiprocessing" in cmd and "resource_tracker" not in cmd:
                pids.append(p.pid)
        return sorted(pids)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def free_port() -> int:
    from nanocp.control_plane.api.local import free_port as pick

    return pick()


def gauges(url: str) -> dict[str, float]:
    """The server's load gauges (running, waiting, admitted, kv usage)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("num_requests_running", "num_requests_waiting", "num_requests_admitted", "kv_cache_usage_perc")
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            short = sample.name.removeprefix("nanocp:")
            if short in names:
                out[short] = sample.value
    return out


def wait_idle(url: str, timeout_s: float = 60.0) -> tuple[dict[str, float], float]:
    """Poll until every gauge is 0: (the gauges, seconds it took); the last gauges if the deadline passed."""
    began = time.monotonic()
    while True:
        g = gauges(url)
        if all(v == 0 for v in g.values()) or time.monotonic() - began > timeout_s:
            return g, time.monotonic() - began
        time.sleep(0.2)


class RssSampler:
    """Samples a served process tree's RSS on a thread: (t, own, tree) rows."""

    def __init__(self, served: ServedProcess, period_s: float = 0.5) -> None:
        self.served, self.period_s = served, period_s
        self.rows: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            own, tree = self.served.rss_bytes()
            self.rows.append((time.monotonic(), own, tree))
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_mb(self, start: float = 0.0, end: float = float("inf")) -> tuple[float, float]:
        rows = [r for r in self.rows if start <= r[0] <= end] or self.rows[-1:]
        return max(r[1] for r in rows) / 2**20, max(r[2] for r in rows) / 2**20


# ---- the client ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One client request: when it was sent, what came back."""

    phase: str
    sent: float  # monotonic
    status: int | None = None  # HTTP status (None: transport error)
    latency_s: float | None = None  # send -> last byte, accepted requests
    finish_reason: str | None = None
    text: str = ""
    error: str = ""  # an SSE error event, a transport error, an unexpected body
    retry_after: str | None = None
    cancelled: bool = False  # the client went away on purpose
    client_delay_s: float = 0.0  # how late the client sent it (open loop: behind its scheduled arrival)
    chunk_times: list[float] | None = None  # streamed: when each chunk arrived (monotonic)


def random_prompt(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(ALPHABET, k=n))


def workload_body(rng: random.Random, prompt_len: tuple[int, int], max_tokens: tuple[int, int]) -> dict:
    return {
        "model": "tiny",
        "prompt": random_prompt(rng, rng.randint(*prompt_len)),
        "max_tokens": rng.randint(*max_tokens),
        "ignore_eos": True,
    }


async def send(client: httpx.AsyncClient, url: str, path: str, body: dict, outcome: Outcome, cancel_after=None):
    """Send one request; fills `outcome`. cancel_after: stream chunks (or seconds, non-streamed) before the client
    disconnects on purpose."""
    start = time.monotonic()
    chat = path.endswith("chat/completions")
    try:
        if not body.get("stream"):
            try:
                r = await asyncio.wait_for(client.post(url + path, json=body), cancel_after)
            except asyncio.TimeoutError:
                outcome.cancelled = True
                return
            outcome.status = r.status_code
            outcome.retry_after = r.headers.get("retry-after")
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                outcome.text = choice["message"]["content"] if chat else choice["text"]
                outcome.finish_reason = choice["finish_reason"]
            else:
                outcome.error = r.text[:300]
            outcome.latency_s = time.monotonic() - start
            return
        async with client.stream("POST", url + path, json=body) as r:
            outcome.status = r.status_code
            outcome.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                outcome.error = (await r.aread()).decode(errors="replace")[:300]
                return
            chunks = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.error = json.dumps(chunk["error"])[:300]
                    return
                if chunk["choices"]:
                    if outcome.chunk_times is not None:
                        outcome.chunk_times.append(time.monotonic())
                    choice = chunk["choices"][0]
                    chunks.append(choice["delta"].get("content") or "" if chat else choice["text"])
                    outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
                if cancel_after is not None and len(chunks) >= cancel_after:
                    outcome.cancelled = True
                    return  # leaving the block closes the connection: the server aborts the request
            outcome.text = "".join(chunks)
            outcome.latency_s = time.monotonic() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        outcome.error = f"{type(e).__name__}: {e}"


def new_client(concurrency: int = 2000, timeout_s: float = 300.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=min(concurrency, 200))
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits)


def p99_ms(values: list[float]) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, 99)) if values else None


class _StaleConnection(ConnectionError):
    """A kept-alive connection the server had closed: nothing was answered on it."""


class RawHttpClient:
    """A minimal keep-alive HTTP/1.1 client for the load generator (non-streamed POSTs with JSON bodies). httpx
    spends about a millisecond of CPU per request, too much to offer 10x the sustainable rate from the two cores
    the server also runs on; this one parses only the status line, the headers and a Content-Length body."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self._idle:
            try:
                return await self._exchange(self._idle.pop(), path, body)
            except _StaleConnection:  # the server closed it while idle (keep-alive timeout): once more, afresh
                pass
        return await self._exchange(await asyncio.open_connection(self.host, self.port), path, body)

    async def _exchange(self, conn, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        reader, writer = conn
        try:
            head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                raise _StaleConnection()
            status = int(status_line.split(b" ", 2)[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            data = await reader.readexactly(int(headers.get("content-length", "0")))
        except ConnectionResetError as e:
            writer.close()
            raise _StaleConnection() from e
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        return status, headers, data

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def send_raw(client: RawHttpClient, body: dict, outcome: Outcome) -> None:
    """One non-streamed completion through the raw client; fills `outcome`."""
    start = time.monotonic()
    try:
        status, headers, data = await client.post("/v1/completions", json.dumps(body).encode())
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        outcome.error = f"{type(e).__name__}: {e}"
        return
    outcome.status, outcome.retry_after = status, headers.get("retry-after")
    if status != 200:
        outcome.error = "" if status == 429 else data[:300].decode(errors="replace")
        return
    choice = json.loads(data)["choices"][0]
    outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
    outcome.latency_s = time.monotonic() - start


# ---- sustainable rate and overload ---------------------------------------------------------------------------


@dataclass
class OverloadConfig:
    calibrate_s: float = 30.0  # closed loop at `calibrate_concurrency` to measure the sustainable rate
    calibrate_concurrency: int = 16
    before_s: float = 30.0
    burst_s: float = 60.0
    after_s: float = 60.0
    normal_load: float = 0.5  # x the sustainable rate, before and after the burst
    burst_load: float = 10.0
    prompt_len: tuple[int, int] = (8, 96)
    max_tokens: tuple[int, int] = (4, 24)
    max_pending: int = 32  # the server's admission bound (--max-pending-requests)
    client_cap: int = 256  # the client's requests in flight at most
    seed: int = 0


async def measure_sustainable(url: str, cfg: OverloadConfig) -> dict:
    """Completed requests per second of a saturated server (closed loop, `calibrate_concurrency` clients)."""
    rng = random.Random(cfg.seed)
    outcomes: list[Outcome] = []
    client = RawHttpClient(url)
    end = time.monotonic() + cfg.calibrate_s

    async def worker() -> None:
        while time.monotonic() < end:
            o = Outcome("calibrate", time.monotonic())
            await send_raw(client, workload_body(rng, cfg.prompt_len, cfg.max_tokens), o)
            outcomes.append(o)

    began = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(cfg.calibrate_concurrency)))
    elapsed = time.monotonic() - began
    client.close()
    ok = [o for o in outcomes if o.status == 200 and not o.error]
    return {
        "concurrency": cfg.calibrate_concurrency,
        "seconds": elapsed,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "rate_rps": len(ok) / elapsed,
        "p99_latency_ms": p99_ms([o.latency_s for o in ok]),
    }


async def open_loop(url: str, cfg: OverloadConfig, rate: float) -> list[Outcome]:
    """Poisson arrivals: before (normal), burst, after (normal)."""
    rng = random.Random(cfg.seed + 1)
    np_rng = np.random.default_rng(cfg.seed + 2)
    plan, t = [], 0.0
    for phase, seconds, load in (
        ("before", cfg.before_s, cfg.normal_load),
        ("burst", cfg.burst_s, cfg.burst_load),
        ("after", cfg.after_s, cfg.normal_load),
    ):
        end = t + seconds
        while True:
            t += float(np_rng.exponential(1.0 / (rate * load)))
            if t >= end:
                t = end
                break
            plan.append((t, phase))
    outcomes = []
    # A cap on the client's requests in flight, so that a slow moment of the shared machine cannot snowball into
    # thousands of open connections. A request that waits for the cap is sent late; the wait is recorded
    # (client_delay_s) and not counted in its latency.
    cap = asyncio.Semaphore(cfg.client_cap)
    client = RawHttpClient(url)
    t0 = time.monotonic()

    async def one(at: float, phase: str) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        async with cap:
            o = Outcome(phase, time.monotonic(), client_delay_s=time.monotonic() - (t0 + at))
            outcomes.append(o)
            await send_raw(client, workload_body(rng, cfg.prompt_len, cfg.max_tokens), o)

    try:
        await asyncio.gather(*(one(at, phase) for at, phase in plan))
    finally:
        client.close()
    return outcomes


def summarize_overload(outcomes: list[Outcome], t0: float, cfg: OverloadConfig) -> dict:
    """Per phase: counts and latency of the accepted requests. "after_settled" is the part of the after phase sent
    once every request accepted during the burst had finished: the service must be back to normal by then."""
    phases = {}
    burst_end = t0 + cfg.before_s + cfg.burst_s
    burst_done = max(
        [o.sent + o.latency_s for o in outcomes if o.phase == "burst" and o.latency_s is not None], default=burst_end
    )
    for phase in ("before", "burst", "after", "after_settled"):
        if phase == "after_settled":
            group = [o for o in outcomes if o.phase == "after" and o.sent >= burst_done]
        else:
            group = [o for o in outcomes if o.phase == phase]
        statuses = Counter(o.status for o in group)
        ok = [o for o in group if o.status == 200]
        done = [o.latency_s for o in ok if not o.error and o.finish_reason == "length"]
        phases[phase] = {
            "sent": len(group),
            "accepted": len(ok),
            "completed": len(done),
            "rejected_429": statuses.get(429, 0),
            "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
            "p50_latency_ms": float(np.median(done) * 1000) if done else None,
            "p99_latency_ms": p99_ms(done),
        }
    windows = []  # latency over time, by the second a request was sent (10 s windows)
    for start in np.arange(0.0, cfg.before_s + cfg.burst_s + cfg.after_s, 10.0):
        group = [o for o in outcomes if start <= o.sent - t0 < start + 10.0]
        done = [o.latency_s for o in group if o.status == 200 and not o.error and o.latency_s is not None]
        windows.append({
            "from_s": float(start),
            "accepted": len(done),
            "rejected_429": sum(1 for o in group if o.status == 429),
            "p50_latency_ms": float(np.median(done) * 1000) if done else None,
            "p99_latency_ms": p99_ms(done),
        })  # fmt: skip
    rejected = [o for o in outcomes if o.status == 429]
    return {
        "phases": phases,
        "windows": windows,
        "settle_s": burst_done - burst_end,  # burst end -> last request accepted during the burst finished
        "server_errors_5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "other_4xx": sum(1 for o in outcomes if o.status is not None and 400 <= o.status < 500 and o.status != 429),
        "transport_errors": sum(1 for o in outcomes if o.status is None),
        "accepted_failed": sum(1 for o in outcomes if o.status == 200 and (o.error or o.finish_reason != "length")),
        "error_samples": sorted({o.error for o in outcomes if o.error and o.status != 429})[:5],
        "retry_after_missing": sum(1 for o in rejected if not (o.retry_after or "").isdigit()),
        "client_delay_p99_ms": p99_ms([o.client_delay_s for o in outcomes]),
        "client_late_over_1s": sum(1 for o in outcomes if o.client_delay_s > 1.0),
        "retry_after_values_s": sorted({int(o.retry_after) for o in rejected if (o.retry_after or "").isdigit()}),
    }


def run_overload(cfg: OverloadConfig, log_dir: Path) -> dict:
    served = ServedProcess(free_port(), ["--max-pending-requests", str(cfg.max_pending)], log_dir / "overload.log")
    served.start()
    try:
        with RssSampler(served) as rss:
            asyncio.run(measure_sustainable(served.url, OverloadConfig(**{**asdict(cfg), "calibrate_s": 3.0})))
            wait_idle(served.url)
            baseline = served.rss_bytes()
            sustainable = asyncio.run(measure_sustainable(served.url, cfg))
            wait_idle(served.url)
            t0 = time.monotonic()
            outcomes = asyncio.run(open_loop(served.url, cfg, sustainable["rate_rps"]))
            idle, drain_s = wait_idle(served.url)
        burst_end = t0 + cfg.before_s + cfg.burst_s
        summary = summarize_overload(outcomes, t0, cfg)
        summary |= {
            "config": asdict(cfg),
            "sustainable": sustainable,
            "rates_rps": {
                "normal": sustainable["rate_rps"] * cfg.normal_load,
                "burst": sustainable["rate_rps"] * cfg.burst_load,
            },
            "rss_mb": {
                "baseline_server": baseline[0] / 2**20,
                "baseline_tree": baseline[1] / 2**20,
                "peak_server": rss.peak_mb()[0],
                "peak_tree": rss.peak_mb()[1],
                "peak_server_during_burst": rss.peak_mb(t0 + cfg.before_s, burst_end)[0],
                "end_server": rss.rows[-1][1] / 2**20,
            },
            "idle_after": idle,
            "drain_s": drain_s,
            "health_after": httpx.get(served.url + "/health").status_code,
        }
    finally:
        served.stop()
    return summary


# ---- soak ----------------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    requests: int = 3000
    concurrency: int = 24
    warmup: int = 200  # requests before the baseline RSS is taken
    prompt_len: tuple[int, int] = (1, 200)
    max_tokens: tuple[int, int] = (1, 40)
    cancel_share: float = 0.15
    stop_share: float = 0.4
    chat_share: float = 0.3
    stream_share: float = 0.7
    max_pending: int = 256
    seed: int = 0


def soak_request(rng: random.Random, cfg: SoakConfig) -> tuple[str, dict, float | int | None]:
    """(path, body, cancel_after) of one random soak request."""
    chat = rng.random() < cfg.chat_share
    body: dict = {
        "model": "tiny",
        "max_tokens": rng.randint(*cfg.max_tokens),
        "stream": rng.random() < cfg.stream_share,
    }
    text = random_prompt(rng, rng.randint(*cfg.prompt_len))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if rng.random() < cfg.stop_share:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.5:
        body |= {"temperature": rng.uniform(0.0, 1.5), "seed": rng.randrange(2**31)}
    body["ignore_eos"] = rng.random() < 0.8
    cancel = None
    if rng.random() < cfg.cancel_share:
        cancel = rng.randint(1, 5) if body["stream"] else rng.uniform(0.02, 0.5)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, cancel


async def soak_requests(url: str, cfg: SoakConfig, on_progress=None) -> list[Outcome]:
    rng = random.Random(cfg.seed)
    jobs = [soak_request(rng, cfg) for _ in range(cfg.requests)]
    outcomes: list[Outcome] = []
    async with new_client(timeout_s=120.0) as client:
        queue = list(reversed(jobs))

        async def worker() -> None:
            while queue:
                path, body, cancel = queue.pop()
                o = Outcome("soak", time.monotonic())
                await send(client, url, path, body, o, cancel)
                outcomes.append(o)
                if on_progress is not None:
                    on_progress(len(outcomes))

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    return outcomes


def run_soak(cfg: SoakConfig, log_dir: Path) -> dict:
    served = ServedProcess(free_port(), ["--max-pending-requests", str(cfg.max_pending)], log_dir / "soak.log")
    served.start()
    baseline: list[tuple[int, int]] = []

    def progress(done: int) -> None:
        if done == cfg.warmup and not baseline:
            baseline.append(served.rss_bytes())

    try:
        with RssSampler(served, period_s=1.0) as rss:
            began = time.monotonic()
            outcomes = asyncio.run(soak_requests(served.url, cfg, progress))
            elapsed = time.monotonic() - began
            idle, drain_s = wait_idle(served.url)
            end = served.rss_bytes()
        ok = [o for o in outcomes if o.status == 200 and not o.error and not o.cancelled]
        base = baseline[0] if baseline else rss.rows[0][1:]
        result = {
            "config": asdict(cfg),
            "seconds": elapsed,
            "requests": len(outcomes),
            "completed": len(ok),
            "finish_reasons": dict(Counter(o.finish_reason for o in ok)),
            "cancelled_by_client": sum(1 for o in outcomes if o.cancelled),
            "errors": sum(1 for o in outcomes if o.error or (o.status not in (200, None) and not o.cancelled)),
            "error_samples": [o.error for o in outcomes if o.error][:5],
            "stuck": cfg.requests - len(outcomes),
            "gauges_after": idle,
            "drain_s": drain_s,
            "rss_mb": {
                "after_warmup_server": base[0] / 2**20,
                "end_server": end[0] / 2**20,
                "growth_server": (end[0] - base[0]) / 2**20,
                "after_warmup_tree": base[1] / 2**20,
                "end_tree": end[1] / 2**20,
                "peak_tree": rss.peak_mb()[1],
            },
            "health_after": httpx.get(served.url + "/health").status_code,
        }
    finally:
        served.stop()
    return result


# ---- a decode instance killed under a served load ------------------------------------------------------------


def run_served_kill(log_dir: Path, streams: int = 12, n_tokens: int = 1500, seed: int = 0) -> dict:
    """SIGKILL one decode instance process of `nanocp serve` 1.5 s into greedy streams of n_tokens (issue 22's run)."""
    from nanocp import LLM, SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 80))] for _ in range(streams)]
    served = ServedProcess(free_port(), log_path=log_dir / "kill.log")
    served.start()
    try:
        before = served.instance_pids()
        outcomes = [Outcome("kill", 0.0, chunk_times=[]) for _ in prompts]
        progress = [0] * streams

        async def drive() -> float:
            async with new_client() as client:

                async def one(i: int) -> None:
                    body = {"model": "tiny", "prompt": prompts[i], "max_tokens": n_tokens, "temperature": 0}
                    body |= {"ignore_eos": True, "stream": True}
                    outcomes[i].sent = time.monotonic()
                    await send(client, served.url, "/v1/completions", body, outcomes[i])
                    progress[i] = -1

                tasks = [asyncio.ensure_future(one(i)) for i in range(streams)]
                while (await asyncio.to_thread(gauges, served.url))["num_requests_running"] < streams:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.5)  # well into every stream
                killed_at = time.monotonic()
                os.kill(before[len(before) // 2], signal.SIGKILL)
                await asyncio.gather(*tasks)
                return killed_at

        killed_at = asyncio.run(drive())
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        with LLM("tiny", backend="inline") as llm:  # an untouched run (greedy: any cluster gives the same tokens)
            expected = [o.text for o in llm.generate(prompts, params)]
        idle, _ = wait_idle(served.url)
        after = served.instance_pids()
        result = {
            "streams": streams,
            "tokens_per_stream": n_tokens,
            "instances_before": len(before),
            "instances_after": len(after),
            "killed_pid": before[len(before) // 2],
            "completed": sum(1 for o in outcomes if o.status == 200 and not o.error and o.finish_reason == "length"),
            "identical_to_reference": sum(1 for o, e in zip(outcomes, expected) if o.text == e),
            "errors": [o.error for o in outcomes if o.error],
            "lost": sum(1 for o, e in zip(outcomes, expected) if o.text != e or o.error),
            "stall_s": max(o.sent + (o.latency_s or 0.0) for o in outcomes) - killed_at,
            "streams_running_at_kill": sum(1 for o in outcomes if o.chunk_times and o.chunk_times[-1] > killed_at),
            **stream_stalls([o.chunk_times for o in outcomes], killed_at),
            "gauges_after": idle,
            "health_after": httpx.get(served.url + "/health").status_code,
        }
    finally:
        served.stop()
    return result


def stream_stalls(chunk_times: list[list[float]], fault_at: float) -> dict:
    """Per stream, the longest gap between two of its chunks that ends after the fault: p50 and max over streams."""
    stalls = [max((b - a for a, b in zip(t, t[1:]) if b >= fault_at), default=0.0) for t in chunk_times]
    return {"stream_stall_p50_s": float(np.median(stalls)), "stream_stall_max_s": float(max(stalls))}


def run_stalls(tokens: int = 1500, streams: int = 12) -> dict:
    """Kill and stop of a decode and a prefill instance under live streams (bench/stall.py), one run each."""
    from nanocp.bench.stall import FAULTS, TIERS, StallConfig, measure_stall

    out = {}
    for tier in TIERS:
        for fault in FAULTS:
            r = measure_stall(StallConfig(fault, tier, streams=streams, tokens=tokens))
            out[f"{tier}_{fault}"] = {k: v for k, v in r.items() if k != "stall_s"} | {"stall_s": r["stall_s"]}
            print(f"stall {tier} {fault}: p50 {r['stall_p50_s']:.2f} s, max {r['stall_max_s']:.2f} s", file=sys.stderr)
    return out


# ---- in-process fault injection ------------------------------------------------------------------------------


def run_metadata_faults(seed: int = 0, rounds: int = 3) -> dict:
    """Lost / corrupt / torn routing-table pushes on a process cluster: detected, resent, outputs unchanged."""
    from nanocp import LLM, SamplingParams
    from nanocp.comm.metadata_channel import Fault

    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=4, page_size=8)
    with LLM("tiny", backend="inline", **kwargs) as llm:
        clean = [o.token_ids for o in llm.generate(prompts, params)]
    injected: Counter[str] = Counter()
    same = 0
    with LLM("tiny", backend="processes", metadata_timeout_s=0.5, **kwargs) as llm:
        cluster = llm.engine.cluster
        for _ in range(rounds):
            for _ in range(4):
                fault = rng.choice(list(Fault))
                cluster.inject_metadata_fault(rng.randrange(4), fault)
                injected[fault.value] += 1
            same += [o.token_ids for o in llm.generate(prompts, params)] == clean
        resyncs = cluster.resyncs
    return {
        "faults_injected": dict(injected),
        "total_injected": sum(injected.values()),
        "resyncs": resyncs,
        "runs_identical_to_clean": f"{same}/{rounds}",
        "requests_lost": (rounds - same) * len(prompts),
    }


def run_prefill_faults(trials: int = 6, seed: int = 0) -> dict:
    """A prefill instance of the CDSP tier dies at a random point of a call: KV and logits must stay exact."""
    import torch

    from nanocp.data_plane.kv_pool import PagedKVPool
    from nanocp.models import load_model, prefill_forward
    from nanocp.prefill.handoff import KVDestination, PoolSink, ShardDest
    from nanocp.prefill.latency_model import LatencyCoeffs, PrefillLatencyModel
    from nanocp.prefill.tier import CdspPrefillTier, PrefillRequest, TierConfig

    model = load_model("tiny")
    ring = {s: LatencyCoeffs(1e-3, 1e-4 / s, 0.8e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    ulysses = {s: LatencyCoeffs(1.5e-3, 0.8e-4 / s, 1.6e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    models = [PrefillLatencyModel("ring", ring), PrefillLatencyModel("ulysses", ulysses)]
    rng = random.Random(seed)
    kills = replanned = exact = total = 0
    for trial in range(trials):
        config = TierConfig(num_nodes=2, instances_per_node=2, min_chunk_tokens=16, improvement_rate=0.05,
                            max_request_tokens=512, queue_policy=("fcfs", "lars")[trial % 2])  # fmt: skip
        pool = PagedKVPool.allocate(3, 400, 8, model.config.kv_cache_dim, torch.float32)
        free = list(range(400))
        requests = []
        for k in range(5):
            n = rng.randint(60, 280)
            frames = tuple(free.pop(rng.randrange(len(free))) for _ in range(-(-n // 8)))
            tokens = [rng.randrange(256) for _ in range(n)]
            requests.append(PrefillRequest(f"r{k}", tokens, KVDestination((ShardDest(0, n, frames),))))
        with CdspPrefillTier(model, config, models) as tier:
            tier.executor.kill_instance(rng.randrange(4), after_resumes=rng.randint(0, 20))
            logits = tier.prefill(requests, PoolSink([pool]))
            kills += len(tier.failures)
            replanned += sum(len(f.replanned) for f in tier.failures)
        for r in requests:
            ref = prefill_forward(model, torch.tensor(r.tokens))
            frames = list(r.destination.shards[0].frames)
            kv = pool.kv[:, frames].reshape(pool.kv.shape[0], -1, pool.kv.shape[-1])[:, : len(r.tokens)]
            total += 1
            same_kv = torch.allclose(kv, ref.kv, atol=2e-5, rtol=1e-5)
            exact += bool(same_kv and torch.allclose(logits[r.rid], ref.logits[-1], atol=2e-5, rtol=1e-5))
    return {
        "instance_deaths": kills,
        "requests_replanned": replanned,
        "requests": total,
        "exact": exact,
        "requests_lost": total - exact,
    }


def run_restart(streams: int = 4) -> dict:
    """Router restart (in-process servers, process clusters): streams in flight on the old server end with an SSE
    error event; the new server's /health is 503 until its cluster is up."""
    from nanocp.control_plane.api.local import ServerThread
    from nanocp.control_plane.api.server import OpenAIServer, ServerConfig
    from nanocp.engine import Engine, EngineConfig

    config = EngineConfig(model="tiny", decode_instances=4, kv_capacity_tokens=4096, backend="processes")
    port = free_port()
    old = OpenAIServer(ServerConfig(model="tiny"), lambda: Engine(config))
    thread = ServerThread(old.app, port=port).start()
    outcomes = [Outcome("restart", 0.0) for _ in range(streams)]

    async def drive() -> float:
        async with new_client() as client:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            tasks = [asyncio.ensure_future(send(client, thread.url, "/v1/completions", body, o)) for o in outcomes]
            while old.loop.load.running < streams:
                await asyncio.sleep(0.05)
            began = time.monotonic()
            await asyncio.to_thread(thread.stop)
            stopped = time.monotonic() - began
            await asyncio.gather(*tasks)
            return stopped

    stop_s = asyncio.run(drive())
    started = time.monotonic()
    new = OpenAIServer(ServerConfig(model="tiny"), lambda: Engine(config))
    thread = ServerThread(new.app, port=port).start(wait_healthy=False)
    codes = Counter()
    try:
        while (code := httpx.get(thread.url + "/health").status_code) != 200:
            codes[code] += 1
            time.sleep(0.02)
        ready_s = time.monotonic() - started
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        served_after = httpx.post(thread.url + "/v1/completions", json=body, timeout=60).status_code
    finally:
        thread.stop()
    return {
        "streams_in_flight": streams,
        "ended_with_error_event": sum(1 for o in outcomes if "shutting down" in o.error),
        "cut_without_answer": sum(1 for o in outcomes if "shutting down" not in o.error),
        "shutdown_s": stop_s,
        "health_503_polls_before_ready": codes.get(503, 0),
        "other_health_codes": {str(k): v for k, v in codes.items() if k != 503},
        "new_server_ready_s": ready_s,
        "request_after_restart": served_after,
    }


# ---- report ---------------------------------------------------------------------------------------------------


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(doc: dict) -> str:
    lines = ["# Reliability", "", doc["note"], ""]
    if "kill" in doc:
        k = doc["kill"]
        lines += [
            "## Decode instance killed under load (served)",
            "",
            f"`nanocp serve --model tiny` ({k['instances_before']} decode instance processes, CDSP prefill tier); "
            f"{k['streams']} greedy streams of {k['tokens_per_stream']} tokens; one instance process SIGKILLed "
            f"1.5 s after every stream was running ({k.get('streams_running_at_kill', '-')} of them still running "
            "then). A stream's stall is the longest gap between two of its chunks after the kill.",
            "",
            "| faults injected | completed | identical to reference | requests lost | per-stream stall p50 / max | "
            "last stream done after the kill | instances after | gauges after | /health after |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| 1 SIGKILL | {k['completed']}/{k['streams']} | {k['identical_to_reference']}/{k['streams']} | "
            f"{k['lost']} | {_fmt(k.get('stream_stall_p50_s'), 2)} / {_fmt(k.get('stream_stall_max_s'), 2)} s | "
            f"{k['stall_s']:.1f} s | {k['instances_after']} | "
            f"{'all 0' if not any(k['gauges_after'].values()) else k['gauges_after']} | {k['health_after']} |",
            "",
        ]
    if "stall" in doc:
        any_run = next(iter(doc["stall"].values()))["config"]
        lines += [
            "## Stall per stream: an instance killed or stopped under live streams",
            "",
            f"The engine as `nanocp serve` builds it ({any_run['decode_instances']} decode instance processes, CDSP "
            f"tier of {any_run['prefill_instances']}), {any_run['streams']} greedy streams of {any_run['tokens']} "
            f"tokens; {any_run['fault_at_s']} s in, one instance is hit: a decode instance process gets SIGKILL or "
            f"SIGSTOP (declared dead after the {any_run['heartbeat_timeout_s']:g} s heartbeat timeout, then "
            f"killed), or a prefill instance dies or stops answering while {any_run['prefill_wave']} new requests "
            "are prefilled. A stream's stall is the longest gap between two of its tokens after the fault.",
            "",
            "| instance | fault | stall p50 | stall max | longest gap before the fault | completed | identical to "
            "untouched | recovery |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in doc["stall"].items():
            tier, fault = name.split("_")
            how = (r["decode_recoveries"] or r["prefill_failures"] or ["-"])[0]
            lines.append(
                f"| {tier} | {'SIGKILL' if fault == 'kill' else 'SIGSTOP (hang)'} | {r['stall_p50_s']:.2f} s | "
                f"{r['stall_max_s']:.2f} s | {r['gap_before_fault_max_s']:.2f} s | {r['completed']}/"
                f"{r['config']['streams']} | {r.get('identical_to_untouched', '-')}/{r['config']['streams']} | "
                f"{how[:90]} |"
            )
        lines.append("")
    if "metadata" in doc or "prefill" in doc or "restart" in doc:
        lines += ["## Other faults (in process)", "", "| fault | injected | survived / detail | requests lost |"]
        lines += ["|---|---|---|---|"]
        if "metadata" in doc:
            m = doc["metadata"]
            detail = f"{m['resyncs']} resends; runs identical to a clean run: {m['runs_identical_to_clean']}"
            kinds = ", ".join(f"{v} {k}" for k, v in m["faults_injected"].items())
            lines.append(f"| metadata push lost / corrupt / torn | {m['total_injected']} ({kinds}) | {detail} | "
                         f"{m['requests_lost']} |")  # fmt: skip
        if "prefill" in doc:
            p = doc["prefill"]
            lines.append(
                f"| prefill instance death (CDSP tier) | {p['instance_deaths']} | {p['requests_replanned']} requests "
                f"re-planned on the survivors; KV + logits exact for {p['exact']}/{p['requests']} | "
                f"{p['requests_lost']} |"
            )
        if "restart" in doc:
            r = doc["restart"]
            lines.append(
                f"| router restart | 1 (streams in flight: {r['streams_in_flight']}) | "
                f"{r['ended_with_error_event']} streams ended with an SSE error event in {r['shutdown_s']:.2f} s; "
                f"/health 503 ({r['health_503_polls_before_ready']} polls) until ready after "
                f"{r['new_server_ready_s']:.1f} s; next request {r['request_after_restart']} | "
                f"{r['cut_without_answer']} cut without an answer |"
            )
        lines.append("")
    if "overload" in doc:
        o = doc["overload"]
        c, s = o["config"], o["sustainable"]
        lines += [
            "## Overload",
            "",
            f"Sustainable rate: {s['rate_rps']:.2f} req/s (closed loop, {s['concurrency']} clients, "
            f"{s['seconds']:.0f} s; prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} tokens, outputs "
            f"{c['max_tokens'][0]}-{c['max_tokens'][1]}). Poisson arrivals at {c['normal_load']}x it for "
            f"{c['before_s']:.0f} s, {c['burst_load']}x for {c['burst_s']:.0f} s, {c['normal_load']}x for "
            f"{c['after_s']:.0f} s; admission bound {c['max_pending']} requests.",
            "",
            "| phase | sent | accepted | completed | 429 | p50 latency | p99 latency |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, ph in o["phases"].items():
            lines.append(
                f"| {name} | {ph['sent']} | {ph['accepted']} | {ph['completed']} | {ph['rejected_429']} | "
                f"{_fmt(ph['p50_latency_ms'], 0)} ms | {_fmt(ph['p99_latency_ms'], 0)} ms |"
            )
        burst = (c["before_s"], c["before_s"] + c["burst_s"])
        lines += ["", "Over time (by send time; the burst is marked):", "", "| sent at | accepted | 429 | p50 | p99 |"]
        lines += ["|---|---|---|---|---|"]
        for w in o["windows"]:
            mark = " (burst)" if burst[0] <= w["from_s"] < burst[1] else ""
            lines.append(
                f"| {w['from_s']:.0f}-{w['from_s'] + 10:.0f} s{mark} | {w['accepted']} | {w['rejected_429']} | "
                f"{_fmt(w['p50_latency_ms'], 0)} ms | {_fmt(w['p99_latency_ms'], 0)} ms |"
            )
        r = o["rss_mb"]
        lines += [
            "",
            f"5xx: {o['server_errors_5xx']}; other 4xx: {o['other_4xx']}; transport errors: "
            f"{o['transport_errors']}; accepted but not completed: {o['accepted_failed']}; 429 without a valid "
            f"Retry-After: {o['retry_after_missing']} (values seen: {o['retry_after_values_s']} s). "
            f"Server RSS: {r['baseline_server']:.0f} MB before, peak {r['peak_server']:.0f} MB "
            f"(burst {r['peak_server_during_burst']:.0f} MB), {r['end_server']:.0f} MB at the end; process tree "
            f"peak {r['peak_tree']:.0f} MB. The last request accepted in the burst finished {o['settle_s']:.1f} s "
            f"after it ended (after_settled: arrivals from then on); /health {o['health_after']}. Client: at most "
            f"{c['client_cap']} requests in flight; p99 send delay behind the schedule "
            f"{_fmt(o['client_delay_p99_ms'], 0)} ms ({o['client_late_over_1s']} requests over 1 s late).",
            "",
        ]
    if "soak" in doc:
        s = doc["soak"]
        c, r = s["config"], s["rss_mb"]
        lines += [
            "## Soak",
            "",
            f"{s['requests']} requests in {s['seconds']:.0f} s from {c['concurrency']} clients: prompts "
            f"{c['prompt_len'][0]}-{c['prompt_len'][1]} tokens, max_tokens {c['max_tokens'][0]}-{c['max_tokens'][1]}, "
            f"{c['chat_share']:.0%} chat, {c['stream_share']:.0%} streamed, {c['stop_share']:.0%} with stop strings, "
            f"{c['cancel_share']:.0%} cancelled by the client (disconnect).",
            "",
            "| completed | finish reasons | cancelled | errors | stuck | gauges after (running, waiting, admitted, "
            "KV) | server RSS after warmup -> end | growth |",
            "|---|---|---|---|---|---|---|---|",
            f"| {s['completed']} | {s['finish_reasons']} | {s['cancelled_by_client']} | {s['errors']} | "
            f"{s['stuck']} | {'all 0' if not any(s['gauges_after'].values()) else s['gauges_after']} | "
            f"{r['after_warmup_server']:.0f} -> {r['end_server']:.0f} MB | {r['growth_server']:+.1f} MB |",
            "",
        ]
    lines += [f"Command: `{doc['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/reliability", help="writes <out>.json and <out>.md")
    parts = ("kill", "stall", "metadata", "prefill", "restart", "overload", "soak")
    p.add_argument("--only", nargs="+", choices=parts, default=list(parts))
    p.add_argument("--calibrate-s", type=float, default=30.0)
    p.add_argument("--before-s", type=float, default=30.0)
    p.add_argument("--burst-s", type=float, default=60.0)
    p.add_argument("--after-s", type=float, default=60.0)
    p.add_argument("--max-pending", type=int, default=32)
    p.add_argument("--soak-requests", type=int, default=3000)
    p.add_argument("--soak-concurrency", type=int, default=24)
    p.add_argument("--stall-tokens", type=int, default=1500, help="tokens per stream of the stall runs")
    p.add_argument("--log-dir", default=None, help="where the served processes' logs go (default: a temp dir)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="nanocp-reliability-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}", file=sys.stderr)
    doc: dict = {
        "note": "Measured on this machine (shared 2-core CPU, tiny model): CPU figures, not GPU latencies.",
        "command": "python -m nanocp.bench.reliability " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    runners = {
        "kill": lambda: run_served_kill(log_dir),
        "stall": lambda: run_stalls(args.stall_tokens),
        "metadata": run_metadata_faults,
        "prefill": run_prefill_faults,
        "restart": run_restart,
        "overload": lambda: run_overload(
            OverloadConfig(
                args.calibrate_s, 16, args.before_s, args.burst_s, args.after_s, max_pending=args.max_pending
            ),
            log_dir,
        ),
        "soak": lambda: run_soak(SoakConfig(args.soak_requests, args.soak_concurrency), log_dir),
    }
    for part in args.only:
        began = time.monotonic()
        doc[part] = runners[part]()
        print(f"{part}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
