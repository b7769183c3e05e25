"""Metrics of a simulated serving run: per-request latencies, per-iteration balance, per-run summaries.

Definitions follow `vllm bench serve`: TTFT = first token (end of prefill) - arrival; TPOT = (E2E - TTFT) /
(output_len - 1), so it includes any waiting after the first token (queueing, KV transfer, preemption); requests
with one output token have no TPOT and meet any TPOT SLO. E2E = last token - arrival. A request meets the SLO when
it finished and its TPOT (and TTFT, if that SLO is set) are within bounds; unfinished and rejected requests never
meet it. Goodput = requests meeting the SLO per second of makespan (first arrival to last finish).

Imbalance of a per-instance quantity x is max(x) / mean(x) - 1 (0 when the mean is 0); a run's imbalance summary
covers the iterations that start within the arrival window (the loaded period, not the final drain).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FINISHED, REJECTED, UNFINISHED = "finished", "rejected", "unfinished"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    tpot_s: float = 0.050
    ttft_s: float = math.inf
    attainment: float = 0.99  # fraction of requests that must meet the SLO for a rate to count as sustained

    def __post_init__(self) -> None:
        if not self.tpot_s > 0 or not self.ttft_s > 0:
            raise ValueError(f"SLO bounds must be > 0, got tpot {self.tpot_s}, ttft {self.ttft_s}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment}")


@dataclass
class RequestRecord:
    """One request's life in the simulator (times in seconds since the workload's start)."""

    rid: str
    arrival_s: float
    input_len: int
    output_len: int
    first_token_s: float = math.nan  # end of prefill: the first output token
    finish_s: float = math.nan  # end of the iteration that produced the last token
    decode_time_s: float = 0.0  # sum of the iterations the request was in
    ideal_decode_time_s: float = 0.0  # the same iterations charged at the balanced, CP-free ideal
    decode_iterations: int = 0
    preemptions: int = 0
    max_cp: int = 0  # largest KV-binding size seen
    status: str = UNFINISHED

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """NaN for single-token outputs (no inter-token time) and for requests that did not finish."""
        if self.output_len < 2 or self.status != FINISHED:
            return math.nan
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)

    @property
    def ideal_tpot_s(self) -> float:
        if self.output_len < 2 or self.status != FINISHED:
            return math.nan
        return self.ideal_decode_time_s / (self.output_len - 1)

    def meets(self, slo: SLO) -> bool:
        if self.status != FINISHED:
            return False
        tpot_ok = self.output_len < 2 or self.tpot_s <= slo.tpot_s
        return tpot_ok and self.ttft_s <= slo.ttft_s


def imbalance(values: Sequence[float] | np.ndarray) -> float:
    """max / mean - 1 of a per-instance quantity; 0 when it is all zero."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("imbalance of an empty array")
    mean = float(x.mean())
    return float(x.max()) / mean - 1.0 if mean > 0 else 0.0


def distribution(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean, P50, P90, P99 of the finite values (NaN everywhere when there are none)."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {"mean": math.nan} | {f"p{p}": math.nan for p in PERCENTILES}
    return {"mean": float(x.mean())} | {f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}


@dataclass
class IterationLog:
    """Column store of per-iteration measurements (appended by the simulator, one row per decode iteration)."""

    columns: dict[str, list[float]] = field(default_factory=dict)

    def append(self, **row: float) -> None:
        for key, value in row.items():
            self.columns.setdefault(key, []).append(value)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def array(self, key: str) -> np.ndarray:
        return np.asarray(self.columns.get(key, []), dtype=float)


@dataclass
class RunMetrics:
    num_requests: int
    finished: int
    rejected: int
    unfinished: int
    makespan_s: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    slo: dict[str, float]
    slo_attainment: float
    goodput_rps: float
    request_throughput_rps: float
    output_throughput_tps: float
    preemptions: int
    iterations: int
    iteration_s: dict[str, float]
    kv_imbalance: dict[str, float]
    batch_imbalance: dict[str, float]
    hol_blocked_iterations: int
    hol_blocked_time_s: float
    cp_request_fraction: float
    cp_traffic_bytes: float
    slowest_layer_us: dict[str, float]  # mean over iterations of the slowest instance's per-layer breakdown
    ideal: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(requests: Sequence[RequestRecord], log: IterationLog, slo: SLO) -> RunMetrics:
    """Per-run summary of request records and the iteration log."""
    finished = [r for r in requests if r.status == FINISHED]
    arrivals = [r.arrival_s for r in requests]
    ends = [r.finish_s for r in finished]
    makespan = (max(ends) - min(arrivals)) if finished else 0.0
    good = sum(r.meets(slo) for r in requests)
    dt = log.array("dt")
    ideal_dt = log.array("ideal_dt")
    # Balance is summarised over the loaded period (iterations starting within the arrival window), not the
    # drain at the end, where a handful of requests make max/mean meaningless.
    t = log.array("t")
    window = (t >= min(arrivals)) & (t <= max(arrivals)) if requests and len(log) else np.ones(len(log), bool)
    if not window.any():
        window = np.ones(len(log), dtype=bool)
    kv_imb, batch_imb = log.array("kv_imbalance")[window], log.array("batch_imbalance")[window]
    per_layer = {k: distribution(log.array(f"slowest_{k}") * 1e6)["mean"] for k in _LAYER_KEYS}
    admitted = [r for r in requests if r.max_cp > 0]
    ideal_tpot = [r.ideal_tpot_s for r in finished]
    ideal_good = sum(1 for r in finished if r.output_len < 2 or r.ideal_tpot_s <= slo.tpot_s)
    n = len(requests)
    return RunMetrics(
        num_requests=n,
        finished=len(finished),
        rejected=sum(r.status == REJECTED for r in requests),
        unfinished=sum(r.status == UNFINISHED for r in requests),
        makespan_s=makespan,
        ttft_s=distribution([r.ttft_s for r in requests if math.isfinite(r.first_token_s)]),
        tpot_s=distribution([r.tpot_s for r in finished]),
        e2e_s=distribution([r.e2e_s for r in finished]),
        slo=asdict(slo),
        slo_attainment=good / n if n else math.nan,
        goodput_rps=good / makespan if makespan > 0 else math.nan,
        request_throughput_rps=len(finished) / makespan if makespan > 0 else math.nan,
        output_throughput_tps=sum(r.output_len for r in finished) / makespan if makespan > 0 else math.nan,
        preemptions=sum(r.preemptions for r in requests),
        iterations=len(log),
        iteration_s=distribution(dt),
        kv_imbalance=distribution(kv_imb) | {"max": _max(kv_imb)},
        batch_imbalance=distribution(batch_imb) | {"max": _max(batch_imb)},
        hol_blocked_iterations=int(log.array("hol_blocked").sum()),
        hol_blocked_time_s=float((log.array("hol_blocked") * dt).sum()),
        cp_request_fraction=sum(r.max_cp > 1 for r in admitted) / len(admitted) if admitted else 0.0,
        cp_traffic_bytes=float(log.array("cp_bytes").sum()),
        slowest_layer_us=per_layer,
        ideal={
            "iteration_s": distribution(ideal_dt),
            "tpot_s": distribution(ideal_tpot),
            "slo_attainment": ideal_good / n if n else math.nan,
            "busy_time_ratio": float(dt.sum() / ideal_dt.sum()) if ideal_dt.sum() > 0 else math.nan,
        },
    )


_LAYER_KEYS = ("attention", "moe_a2a", "cp_comm", "other")


def _max(x: np.ndarray) -> float:
    return float(x.max()) if x.size else math.nan


@dataclass
class CapacityResult:
    """Largest tested rate meeting the SLO attainment target, and every (rate, attainment) tried."""

    rate: float
    history: list[tuple[float, float]]


def bisect_capacity(
    attainment_at: Callable[[float], float],
    lo: float,
    hi: float,
    target: float = 0.99,
    rel_tol: float = 0.05,
    max_runs: int = 16,
) -> CapacityResult:
    """Bisection for the largest rate with attainment_at(rate) >= target, assuming attainment falls with rate.

    `hi` is doubled while it still meets the target (within max_runs). Returns rate 0 if even `lo` fails.
    """
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    history: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        history.append((rate, a))
        return a >= target

    if not ok(lo):
        return CapacityResult(0.0, history)
    while ok(hi):
        lo, hi = hi, hi * 2
        if len(history) >= max_runs:
            return CapacityResult(lo, history)
    while (hi - lo) > rel_tol * lo and len(history) < max_runs:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(lo, history)


def search_capacity(
    attainment_at: Callable[[float], float],
    guess: float,
    target: float = 0.99,
    rel_tol: float = 0.05,
    max_runs: int = 8,
    step: float = 1.5,
) -> CapacityResult:
    """Largest rate with attainment_at(rate) >= target, bracketed from `guess` in both directions (x or / `step`),
    then bisected until the bracket is within rel_tol or max_runs runs were spent. Assumes attainment falls with
    rate. Returns rate 0 when no tried rate meets the target.
    """
    if not guess > 0 or not step > 1 or max_runs < 1:
        raise ValueError(f"need guess > 0, step > 1, max_runs >= 1; got {guess}, {step}, {max_runs}")
    history: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        history.append((rate, attainment_at(rate)))
        return history[-1][1] >= target

    lo, hi = (guess, math.inf) if ok(guess) else (0.0, guess)
    while len(history) < max_runs and (math.isinf(hi) or lo == 0.0):
        if math.isinf(hi):  # still passing: go up
            rate = lo * step
            lo, hi = (rate, hi) if ok(rate) else (lo, rate)
        else:  # still failing: go down
            rate = hi / step
            lo, hi = (rate, hi) if ok(rate) else (lo, rate)
    while lo > 0 and math.isfinite(hi) and hi - lo > rel_tol * lo and len(history) < max_runs:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return CapacityResult(lo, history)
