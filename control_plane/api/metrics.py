"""Prometheus metrics of the server, named in vLLM's style with a `nanocp:` prefix.

Every server owns its own CollectorRegistry (several servers in one process, e.g. tests, do not collide).
The engine loop thread records token timings and load; prometheus_client's metrics are thread safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "nanocp:"
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._running = Gauge(PREFIX + "num_requests_running", "Requests in the decode batch.", labels, registry=r)
        self._waiting = Gauge(
            PREFIX + "num_requests_waiting",
            "Requests queued (server inbox + scheduler waiting queue).",
            labels,
            registry=r,
        )
        self._admitted = Gauge(
            PREFIX + "num_requests_admitted",
            "Requests holding an admission slot (accepted by the server, not yet answered).",
            labels,
            registry=r,
        )
        self._kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of the cluster's KV pages in use (1 = full).", labels, registry=r
        )
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival at the server to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival at the server to the last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self._tpot = Histogram(
            PREFIX + "request_time_per_output_token_seconds", "Per request: mean time per token after the first.",
            labels, buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self._prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self._generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels, registry=r)
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._preemptions = Counter(PREFIX + "num_preemptions", "Preemptions of running requests.", labels, registry=r)
        self._rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before reaching the engine, by HTTP status.",
            ["model_name", "status"],
            registry=r,
        )
        self.model_name = model_name
        # Create every series now, so that a scrape shows zeros rather than missing metrics.
        gauges = (self._running, self._waiting, self._admitted, self._kv_usage)
        for metric in (*gauges, self._ttft, self._itl, self._e2e, self._tpot):
            metric.labels(model_name)
        for metric in (self._prompt_tokens, self._generation_tokens, self._preemptions):
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self._running.labels(self.model_name).set(running)
        self._waiting.labels(self.model_name).set(waiting)
        self._kv_usage.labels(self.model_name).set(kv_usage)

    def set_admitted(self, admitted: int) -> None:
        self._admitted.labels(self.model_name).set(admitted)

    def observe_tokens(self, ttft_s: float | None, gaps_s: list[float]) -> None:
        """A request's new tokens: its TTFT if the first token is among them, and the gaps between tokens."""
        m = self.model_name
        if ttft_s is not None:
            self._ttft.labels(m).observe(ttft_s)
        for gap in gaps_s:
            self._itl.labels(m).observe(gap)
        self._generation_tokens.labels(m).inc(len(gaps_s) + (ttft_s is not None))

    def observe_finish(self, reason: str, e2e_s: float, prompt_tokens: int, tpot_s: float | None = None) -> None:
        m = self.model_name
        self._success.labels(m, reason).inc()
        self._e2e.labels(m).observe(e2e_s)
        self._prompt_tokens.labels(m).inc(prompt_tokens)
        if tpot_s is not None:
            self._tpot.labels(m).observe(tpot_s)

    def observe_preemptions(self, count: int) -> None:
        if count:
            self._preemptions.labels(self.model_name).inc(count)

    def observe_rejection(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
