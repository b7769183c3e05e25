"""Discrete-event simulator of a DP-EP decode cluster driven by the real control plane.

Requests arrive (bench.workloads), go through a prefill tier (`PrefillTier.submit(req, now) -> ready_time`, the
first token), their KV is transferred to the decode cluster (bytes over the profile's link), and then they join
the real `GlobalScheduler`'s waiting queue. The decode cluster runs iterations back to back: every iteration calls
`sched.step()` and advances the clock by the latency profile's iteration time for the plan's per-instance KV
tokens, shard rows, MoE batches and routed queries. Requests join the scheduler only at iteration boundaries.

Preemption: the scheduler frees a preempted request's KV. Its KV must be recomputed before it can decode again, so
the simulator ends it in the scheduler (`finish`) and resubmits the rest of it to the prefill tier as a
continuation (prompt + tokens decoded so far, remaining tokens); it re-enters the waiting queue when that KV has
landed. Total decode iterations per request stay output_len - 1.

Every iteration is also charged at an ideal: the same total KV and batch spread perfectly evenly, one shard per
request and no CP traffic (`LatencyProfile.ideal_iteration_time`).

Routed queries come from the plan's lowered routing tables (`IterationPlan.tables`, written by the C++ core and
read here as numpy views) whenever many requests span several instances or a binding grew; with a few multi-shard
requests their bindings are read one by one. Iterations where every request has one shard skip both.

Known simplification: a preempted request's continuation re-enters the scheduler's waiting queue at the tail once
its recomputed KV has landed (the scheduler's API has no way to insert at the front; in the real engine the
scheduler keeps it at the front). Experiments report the number of preemptions, so its weight can be judged.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

from nanocp.control_plane import ClusterSpec, CPBucketTable, GlobalScheduler, RoutingTables, SchedulerError

from .latency_profile import IterationCost, LatencyProfile, RouteCounts
from .sim_metrics import (
    FINISHED,
    REJECTED,
    SLO,
    CapacityResult,
    IterationLog,
    RequestRecord,
    RunMetrics,
    bisect_capacity,
    imbalance,
    summarize,
)
from .workloads import Request

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FEW_MULTI_SHARD = 64  # up to this many multi-shard requests, read their bindings instead of the lowered tables


class SimulationError(RuntimeError):
    """The simulation cannot proceed (no scheduler backend, requests that can never be placed, ...)."""


# ---------------------------------------------------------------------------------------------------------------
# Prefill tier
# ---------------------------------------------------------------------------------------------------------------


class PrefillTier(Protocol):
    def submit(self, req: Request, now: float) -> float:
        """Accept `req` (input_len tokens to prefill) at time `now`; return when its first token is ready."""
        ...


@dataclass
class UnboundedPrefillTier:
    """Every request gets its own prefill resources at once (NanoCP's external prefill): ready = now + time."""

    latency: Callable[[int], float]

    def submit(self, req: Request, now: float) -> float:
        return now + self.latency(req.input_len)


@dataclass
class QueuedPrefillTier:
    """`num_instances` prefill instances, each serving FIFO; a request goes to the earliest-free instance."""

    num_instances: int
    latency: Callable[[int], float]
    _free_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise SimulationError(f"a prefill tier needs >= 1 instance, got {self.num_instances}")
        self._free_at = [0.0] * self.num_instances

    def submit(self, req: Request, now: float) -> float:
        start = max(now, heapq.heappop(self._free_at))
        done = start + self.latency(req.input_len)
        heapq.heappush(self._free_at, done)
        return done


# ---------------------------------------------------------------------------------------------------------------
# Configuration and result
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SimConfig:
    num_nodes: int = 4
    instances_per_node: int = 8
    policy: str = "nanocp"
    backend: str = "cpp"
    profile: str | LatencyProfile = "h200-deepseek-v3"
    kv_capacity_tokens: int | None = None  # per instance; None = from the profile's memory budget
    page_size: int = 64
    max_batch_per_instance: int = 0  # 0 = unbounded
    cp_buckets: CPBucketTable | None = None
    slo: SLO = field(default_factory=SLO)
    kv_transfer: bool = True  # charge prefill -> decode KV transfer time
    max_sim_time_s: float = math.inf  # stop here; requests not done count as unfinished
    stop_when_slo_lost: bool = False  # stop once more requests missed the SLO than the attainment target allows
    progress: bool = True
    # Charge every iteration at its balanced ideal instead of the plan's cost: what a perfectly balanced placement
    # of the same requests would sustain (the policy still decides admissions and memory).
    charge_ideal: bool = False

    @property
    def num_instances(self) -> int:
        return self.num_nodes * self.instances_per_node


@dataclass
class SimResult:
    config: SimConfig
    requests: list[RequestRecord]
    log: IterationLog
    metrics: RunMetrics
    wall_time_s: float
    sim_time_s: float
    instance_layer_us: dict[str, list[float]] = field(default_factory=dict)  # one MoE layer per instance, mean
    instance_layer_peak_us: dict[str, list[float]] = field(default_factory=dict)  # ... and its max over iterations
    stopped_early: bool = False  # stop_when_slo_lost ended the run

    def to_dict(self) -> dict[str, Any]:
        cfg = {k: v for k, v in vars(self.config).items() if k not in ("profile", "cp_buckets", "slo")}
        profile, buckets = self.config.profile, self.config.cp_buckets
        cfg["profile"] = profile if isinstance(profile, str) else profile.name
        cfg["slo"] = asdict(self.config.slo)
        cfg["cp_buckets"] = None if buckets is None else {"max_lens": buckets.max_lens, "cps": buckets.cps}
        return {
            "config": cfg,
            "metrics": self.metrics.to_dict(),
            "wall_time_s": self.wall_time_s,
            "sim_time_s": self.sim_time_s,
            "stopped_early": self.stopped_early,
            "instance_layer_us": self.instance_layer_us,
            "instance_layer_peak_us": self.instance_layer_peak_us,
        }


def write_result(result: SimResult, name: str, results_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """bench/results/<name>.json (config + metrics) and <name>.md (a short summary, labelled as model output)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    data = result.to_dict()
    kind = result.config.profile if isinstance(result.config.profile, str) else result.config.profile.kind
    data["note"] = f"simulated with latency profile {data['config']['profile']} ({kind}): model outputs"
    json_path = results_dir / f"{name}.json"
    json_path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    m = result.metrics
    lines = [
        f"# {name}",
        "",
        f"Simulated run (latency profile `{data['config']['profile']}`; numbers are model outputs, not measurements).",
        "",
        f"- policy `{result.config.policy}`, {result.config.num_nodes}x{result.config.instances_per_node} instances",
        f"- requests {m.num_requests}: finished {m.finished}, rejected {m.rejected}, unfinished {m.unfinished}",
        f"- TPOT mean / P99: {m.tpot_s['mean'] * 1e3:.2f} / {m.tpot_s['p99'] * 1e3:.2f} ms; "
        f"SLO attainment {m.slo_attainment:.4f}",
        f"- ideal TPOT mean: {m.ideal['tpot_s']['mean'] * 1e3:.2f} ms",
        f"- KV imbalance mean {m.kv_imbalance['mean']:.3f}, batch imbalance mean {m.batch_imbalance['mean']:.3f}",
        f"- wall time {result.wall_time_s:.1f} s for {result.sim_time_s:.1f} simulated s",
    ]
    md_path = results_dir / f"{name}.md"
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


# ---------------------------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Live:
    """A scheduler-side request: a workload request or a continuation of one after preemption."""

    index: int  # into the workload / records
    prompt_len: int
    max_new_tokens: int
    admitted_at: int = -1  # iteration index of the current admission


class ClusterSimulator:
    """Runs one workload through the control plane and a latency profile (one instance per run)."""

    def __init__(self, config: SimConfig | None = None, prefill_tier: PrefillTier | None = None) -> None:
        self.config = config = config or SimConfig()
        profile = config.profile
        self.profile = profile if isinstance(profile, LatencyProfile) else LatencyProfile.load(profile)
        n = config.num_instances
        capacity = config.kv_capacity_tokens or self.profile.kv_capacity_tokens(n)
        self.spec = ClusterSpec(config.num_nodes, config.instances_per_node, capacity, config.page_size)
        try:
            self.sched = GlobalScheduler(
                self.spec,
                config.policy,
                cp_buckets=config.cp_buckets,
                max_batch_per_instance=config.max_batch_per_instance,
                backend=config.backend,
            )
        except (ImportError, AttributeError) as e:
            raise SimulationError(f"scheduler backend {config.backend!r} unavailable ({e}); use 'python'") from e
        self.prefill = prefill_tier or UnboundedPrefillTier(self.profile.prefill_time)
        self.node_of = np.arange(n) // config.instances_per_node  # [I]
        self.layers = self.profile.model.num_layers
        self.cp_bytes_per_query = (self.profile.model.q_bytes + self.profile.model.res_bytes) * self.layers

    # -- the run ---------------------------------------------------------------------------------------------

    def run(self, requests: Sequence[Request]) -> SimResult:
        if hasattr(self, "records"):
            raise SimulationError("a ClusterSimulator runs one workload; make a new one (or call simulate())")
        wall0 = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        if len({r.rid for r in reqs}) != len(reqs):
            raise SimulationError("request ids in a workload must be unique")
        bad = [r.rid for r in reqs if r.input_len < 1 or r.output_len < 1]
        if bad:
            raise SimulationError(f"requests need input_len >= 1 and output_len >= 1: {bad[:5]}")
        self._reqs = reqs
        self.records = [RequestRecord(r.rid, r.arrival_s, r.input_len, r.output_len) for r in reqs]
        self.log = IterationLog()
        self._live: dict[str, _Live] = {}  # scheduler id -> live request
        self._ready: list[tuple[float, int, str]] = []  # heap of (ready time, seq, scheduler id)
        self._pending: dict[str, _Live] = {}  # submitted to prefill, not yet in the scheduler
        self._waiting: dict[str, int] = {}  # mirror of the scheduler's queue: id -> tokens needed (insertion order)
        self._multi: dict[str, int] = {}  # running requests whose KV binding spans > 1 instance -> shard count
        self._multi_rows = 0  # sum of self._multi's shard counts
        self._layer_sum: dict[str, np.ndarray] = {}  # per-instance one-layer breakdown summed over the window
        self._layer_peak: dict[str, np.ndarray] = {}  # ... and its per-instance maximum
        self._layer_iterations = 0
        self._missed = 0  # requests that can no longer meet the SLO (finished late or rejected)
        self._max_missed = (1.0 - self.config.slo.attainment) * len(reqs)
        self._self_finished: set[str] = set()  # ids we ended ourselves (preemption), not real completions
        self._cum_dt = [0.0]  # prefix sums of iteration time: cum[k] = sum of dt over iterations < k
        self._cum_ideal = [0.0]
        self._seq = 0
        now = reqs[0].arrival_s if reqs else 0.0
        next_arrival = 0
        horizon = self._horizon = reqs[-1].arrival_s if reqs else 0.0
        stopped = False
        bar = tqdm(
            total=round(horizon, 3),
            disable=not self.config.progress,
            leave=False,
            bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} simulated s [{elapsed}<{remaining}]",
        )
        while True:
            while next_arrival < len(reqs) and reqs[next_arrival].arrival_s <= now:
                r = reqs[next_arrival]
                self._submit(_Live(next_arrival, r.input_len, r.output_len), r.rid, r.arrival_s, first=True)
                next_arrival += 1
            while self._ready and self._ready[0][0] <= now:
                self._enqueue(heapq.heappop(self._ready)[2])
            if now > self.config.max_sim_time_s:
                break
            if self.config.stop_when_slo_lost and self._missed > self._max_missed:
                stopped = True
                break
            if self.sched.num_running == 0 and self.sched.num_waiting == 0:
                upcoming = min(
                    reqs[next_arrival].arrival_s if next_arrival < len(reqs) else math.inf,
                    self._ready[0][0] if self._ready else math.inf,
                )
                if math.isinf(upcoming):
                    break
                now = upcoming
                continue
            dt = self._iteration(now)
            if dt == 0.0 and self.sched.num_running == 0:
                # Nothing runs and the waiting requests cannot be placed on an empty cluster.
                if self.sched.num_waiting and not self._ready and next_arrival >= len(reqs):
                    raise SimulationError(f"{self.sched.num_waiting} waiting requests can never be placed")
                upcoming = min(
                    reqs[next_arrival].arrival_s if next_arrival < len(reqs) else math.inf,
                    self._ready[0][0] if self._ready else math.inf,
                )
                now = max(now, upcoming) if math.isfinite(upcoming) else now
                continue
            bar.update(min(dt, max(0.0, horizon - bar.n)))
            now += dt
        bar.close()
        metrics = summarize(self.records, self.log, self.config.slo)
        n = max(self._layer_iterations, 1)
        layer_us = {k: (v * 1e6 / n).tolist() for k, v in self._layer_sum.items()}
        peak_us = {k: (v * 1e6).tolist() for k, v in self._layer_peak.items()}
        wall = time.perf_counter() - wall0
        return SimResult(self.config, self.records, self.log, metrics, wall, now, layer_us, peak_us, stopped)

    # -- request flow ----------------------------------------------------------------------------------------

    def _submit(self, live: _Live, sid: str, now: float, first: bool) -> None:
        """Send (a continuation of) a request to prefill; it joins the scheduler when its KV has landed."""
        req = self._reqs[live.index]
        first_token = self.prefill.submit(replace(req, rid=sid, input_len=live.prompt_len), now)
        if first:
            rec = self.records[live.index]
            rec.first_token_s = first_token
            if live.max_new_tokens == 1:  # prefill produced the only token: nothing to decode
                rec.finish_s, rec.status = first_token, FINISHED
                return
        transfer = self.profile.kv_transfer_time(live.prompt_len) if self.config.kv_transfer else 0.0
        self._pending[sid] = live
        self._seq += 1
        heapq.heappush(self._ready, (first_token + transfer, self._seq, sid))

    def _enqueue(self, sid: str) -> None:
        live = self._pending.pop(sid)
        rec = self.records[live.index]
        try:
            self.sched.add_request(sid, live.prompt_len, live.max_new_tokens)
        except SchedulerError:
            rec.status = REJECTED  # can never be placed under this policy and cluster
            self._missed += 1
            return
        self._live[sid] = live
        self._waiting[sid] = live.prompt_len + 1

    def _end_segment(self, sid: str, k: int) -> _Live:
        """Close the request's current stint in the batch (iterations admitted_at .. k-1)."""
        live = self._live.pop(sid)
        rec = self.records[live.index]
        if live.admitted_at >= 0:
            rec.decode_time_s += self._cum_dt[k] - self._cum_dt[live.admitted_at]
            rec.ideal_decode_time_s += self._cum_ideal[k] - self._cum_ideal[live.admitted_at]
            rec.decode_iterations += k - live.admitted_at
        self._multi_rows -= self._multi.pop(sid, 0)
        return live

    # -- one iteration ---------------------------------------------------------------------------------------

    def _iteration(self, now: float) -> float:
        plan = self.sched.step()
        k = len(self._cum_dt) - 1  # this iteration's index
        for sid in plan.finished:
            if sid in self._self_finished:
                self._self_finished.discard(sid)
                continue
            live = self._end_segment(sid, k)
            rec = self.records[live.index]
            rec.finish_s, rec.status = now, FINISHED
            self._missed += not rec.meets(self.config.slo)
        rejected = set(plan.rejected)
        for sid in plan.preempted:
            if sid in rejected:  # preempted, then grown past what the policy can ever re-admit: ends just below
                self.records[self._live[sid].index].preemptions += 1
                continue
            self._preempt(sid, k, now)
        for sid in plan.rejected:
            live = self._end_segment(sid, k)
            self.records[live.index].status = REJECTED
            self._missed += 1
            self._waiting.pop(sid, None)
        for adm in plan.admitted:
            live = self._live[adm.rid]
            live.admitted_at = k
            self._waiting.pop(adm.rid, None)
            split = self.sched.request_state(adm.rid).kv_split
            rec = self.records[live.index]
            rec.max_cp = max(rec.max_cp, len(split))
            if len(split) > 1:
                self._multi[adm.rid] = len(split)
                self._multi_rows += len(split)

        loads = self.sched.loads()
        kv = np.array([x.kv_tokens for x in loads], dtype=float)  # [I]
        batch = np.array([x.moe_batch for x in loads], dtype=float)  # [I]
        shards = np.array([x.shards for x in loads], dtype=float)  # [I]
        free_pages = np.array([x.free_pages for x in loads], dtype=float)  # [I]
        running = int(batch.sum())
        if running == 0:
            self._append_cum(0.0, 0.0)
            return 0.0
        routes = self._routes(plan, int(shards.sum()), running)
        cost = self.profile.iteration_cost(kv, shards, batch, routes, self.node_of)
        ideal = self.profile.ideal_iteration_time(float(kv.sum()), float(batch.sum()), len(batch))
        dt = ideal if self.config.charge_ideal else cost.total_s
        self._append_cum(dt, ideal)
        if now <= self._horizon:  # the loaded window, as in the run's balance summary
            for key, value in cost.layer.items():
                self._layer_sum[key] = self._layer_sum.get(key, 0.0) + value
                self._layer_peak[key] = np.maximum(self._layer_peak.get(key, 0.0), value)
            self._layer_iterations += 1
        n_queries = routes.total if routes is not None else 0
        self.log.append(
            t=now,
            dt=dt,
            ideal_dt=ideal,
            running=running,
            waiting=self.sched.num_waiting,
            kv_imbalance=imbalance(kv),
            batch_imbalance=imbalance(batch),
            hol_blocked=float(self._hol_blocked(free_pages)),
            cp_queries=n_queries,
            cp_requests=len(self._multi),
            cp_bytes=n_queries * self.cp_bytes_per_query,
            **{f"slowest_{p}": v for p, v in cost.slowest_layer.items()},
        )
        return dt

    def _append_cum(self, dt: float, ideal: float) -> None:
        self._cum_dt.append(self._cum_dt[-1] + dt)
        self._cum_ideal.append(self._cum_ideal[-1] + ideal)

    def _preempt(self, sid: str, k: int, now: float) -> None:
        live = self._end_segment(sid, k)
        rec = self.records[live.index]
        rec.preemptions += 1
        done = self.sched.request_state(sid).decode_steps
        self.sched.finish(sid)
        self._self_finished.add(sid)
        self._waiting.pop(sid, None)
        cont = _Live(live.index, live.prompt_len + done, live.max_new_tokens - done)
        self._submit(cont, f"{rec.rid}@{rec.preemptions}", now, first=False)

    def _routes(self, plan: Any, total_shards: int, running: int) -> RouteCounts | None:
        """Routed queries of this iteration, one per (running request, shard not on its MoE instance).

        Multi-shard requests are tracked from admission with their shard counts; a binding that grew (its MoE
        instance ran out of pages) shows up as a shard-count mismatch and is re-read from the lowered tables.
        """
        if total_shards == running:  # every request has one shard: no CP this iteration
            self._multi.clear()
            self._multi_rows = 0
            return None
        grew = running - len(self._multi) + self._multi_rows != total_shards
        if not grew and len(self._multi) <= FEW_MULTI_SHARD:
            pairs = []
            for sid in self._multi:
                st = self.sched.request_state(sid)  # the MoE instance moves with nanocp's rebalancing
                pairs.extend((st.moe_instance, i) for i in st.kv_split if i != st.moe_instance)
            return RouteCounts.from_pairs(pairs, self.spec.num_instances)
        tables = [RoutingTables.parse(t) for t in plan.tables]
        if grew:
            self._recount_multi(plan, tables)
        src = np.concatenate([t.q_recv[:, 0] for t in tables]).astype(np.int64)  # [Q] sender (MoE instance)
        dst = np.repeat(np.arange(len(tables)), [len(t.q_recv) for t in tables])  # [Q] receiver (shard)
        return RouteCounts(src, dst, self.spec.num_instances)

    def _recount_multi(self, plan: Any, tables: list[RoutingTables]) -> None:
        """Shard count of every request from the lowered tables; refresh the multi-shard set and max CP."""
        batch_index = np.concatenate([t.shards[:, 0] for t in tables])  # [S] one entry per (request, shard)
        counts = np.bincount(batch_index, minlength=len(plan.batch_handles))  # [B]
        multi = np.nonzero(counts > 1)[0]
        names, old = plan.batch, self._multi
        self._multi = {names[b]: n for b, n in zip(multi.tolist(), counts[multi].tolist())}
        self._multi_rows = int(counts[multi].sum())
        for sid, n in self._multi.items():
            if old.get(sid, 1) < n:  # shard counts only grow while a request runs
                rec = self.records[self._live[sid].index]
                rec.max_cp = max(rec.max_cp, n)

    def _hol_blocked(self, free_pages: np.ndarray) -> bool:
        """The queue's head still waits although some node's free pages would hold its whole context."""
        if not self._waiting:
            return False
        need = -(-next(iter(self._waiting.values())) // self.spec.page_size)
        per_node = np.bincount(self.node_of, weights=free_pages, minlength=self.spec.num_nodes)
        return bool((per_node >= need).any())


def iteration_cost_of(sched: GlobalScheduler, profile: LatencyProfile, plan: Any) -> IterationCost:
    """The latency profile's cost of `plan`, the scheduler's latest iteration (e.g. a micro-benchmark's state)."""
    loads = sched.loads()
    pairs = [(moe, i) for moe, split in plan.bindings.values() for i in split if i != moe]
    spec = sched.spec
    return profile.iteration_cost(
        [x.kv_tokens for x in loads],
        [x.shards for x in loads],
        [x.moe_batch for x in loads],
        RouteCounts.from_pairs(pairs, spec.num_instances) if pairs else None,
        np.arange(spec.num_instances) // spec.instances_per_node,
    )


def simulate(
    requests: Sequence[Request], config: SimConfig | None = None, prefill_tier: PrefillTier | None = None
) -> SimResult:
    """Run one workload through a fresh simulator."""
    return ClusterSimulator(config, prefill_tier).run(requests)


def capacity_search(
    workload_at: Callable[[float], Sequence[Request]],
    config: SimConfig,
    lo: float,
    hi: float,
    rel_tol: float = 0.05,
    max_runs: int = 16,
    prefill_tier_factory: Callable[[], PrefillTier] | None = None,
) -> CapacityResult:
    """Largest request rate whose run has >= config.slo.attainment of requests meeting the SLO (bisection).

    `workload_at(rate)` builds the workload for a rate; use one seed so that rates differ only by time scaling.
    """

    def attainment(rate: float) -> float:
        tier = prefill_tier_factory() if prefill_tier_factory else None
        return simulate(workload_at(rate), replace(config, progress=False), tier).metrics.slo_attainment

    return bisect_capacity(attainment, lo, hi, config.slo.attainment, rel_tol, max_runs)
