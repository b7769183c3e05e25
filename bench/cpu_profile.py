"""Profile the real CPU decode cluster and fit the `cpu-tiny` latency profile (bench/profiles/cpu-tiny.json).

The sweep runs `nanocp.LLM(model="tiny", decode_instances=4, backend=..., timing=True)` over batch sizes, prompt
(KV) lengths and CP degrees forced with `CPBucketTable.single(cp)`. Each decode iteration leaves one
`PhaseRecord` per (instance, layer, phase) (data_plane/timing.py: compute only, the waits at exchanges are outside
the phases); iterations that admitted requests (their wall time includes prefill) are left out. Records map onto
the profile's phases, per instance and layer:

    attention     <- attention                 [kv_tokens, shard_rows]
    dense         <- projection                 [moe_batch]  (query/KV projections, KV write)
    merge         <- merge                      [res_recv, moe_batch]  (LSE merge + W_UV + o_proj)
    dense_mlp     <- dense                      [moe_batch]  (dense layers)
    moe_dispatch  <- dispatch                   [moe_batch]  (gate + send)
    expert        <- experts                    [mean moe_batch over instances]
    moe_combine   <- combine (both halves)      [moe_batch]  (send + weighted sum + shared expert)
    iteration     <- sampling                   [moe_batch]
    links         <- q_route, res_route         [bytes = max(q_recv, res_recv) x row bytes]  (send side)
    shared_expert = 0 (it runs inside combine here)

Backends. `inline` (the engine's default) runs every instance in one thread, taking turns at each exchange: phase
times are each instance's own work, and the instances share one core, so the profile says `shared_cores: 1`
(iteration >= the sum of all instances' work; latency_profile.py). With `threads`, the instances' threads contend
for the GIL and the cores: each phase time also holds the others' work (per-instance phase sums come out at 2-3x
the step time on 2 cores), so `shared_cores` is fitted to the measured step times instead (an effective value, not a
core count). The driver's serial work per iteration (scheduler step, lowering, hand-off, appending tokens) is the
profile's `host` phase, fitted to the measured step time minus the instance-side model.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from nanocp.control_plane import RoutingTables

from .latency_profile import (
    LINKS,
    PHASE_FEATURES,
    PROFILES_DIR,
    SCHEMA,
    LatencyProfile,
    ModelShape,
    RouteCounts,
    fit_linear_cost,
    fit_profile_from_timing_log,
)
from .machine import machine_info

PROFILE_NAME = "cpu-tiny"
RUN_ITERATION_OFFSET = 1_000_000
SPIKE_RATIO = 2.0  # a record this many times its first fit (plus SPIKE_FLOOR_S) is a contention spike
SPIKE_FLOOR_S = 50e-6
THREADS_CORE_CANDIDATES = tuple(float(x) for x in np.round(np.geomspace(0.5, 16.0, 36), 3))


class ProfilingError(RuntimeError):
    """The sweep produced too little data to fit, or was configured with impossible values."""


# ---------------------------------------------------------------------------------------------------------------
# Measuring iterations
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class StepSample:
    """One `engine.step()`: its wall time and the plan's per-instance state when it was made."""

    iteration: int
    wall_s: float
    admitted: int  # requests admitted (and prefilled) inside this step
    kv_tokens: list[int]  # [I]
    shards: list[int]  # [I]
    batch: list[int]  # [I] MoE batch
    route_src: list[int] = field(default_factory=list)  # [Q] MoE instance of each routed query
    route_dst: list[int] = field(default_factory=list)  # [Q] instance holding the remote shard

    @property
    def running(self) -> int:
        return sum(self.batch)

    def routes(self) -> RouteCounts | None:
        if not self.route_src:
            return None
        n = len(self.batch)
        return RouteCounts(np.asarray(self.route_src, np.int64), np.asarray(self.route_dst, np.int64), n)

    def predict(self, profile: LatencyProfile, instances_per_node: int) -> float:
        """The profile's iteration time for this step's state."""
        node_of = np.arange(len(self.batch)) // instances_per_node
        return profile.iteration_cost(self.kv_tokens, self.shards, self.batch, self.routes(), node_of).total_s


class StepRecorder:
    """Times `engine.step()` and captures the scheduler's plan state at the moment the plan is made (before the
    step's finishes free pages), by wrapping `step` on the engine's scheduler object (re-wrapped if the engine
    replaces its scheduler, as it does when it recovers from a failed iteration).

    A step in which the engine recovered from a failed iteration raises: its time measures a failure, not decode.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._state: dict[str, Any] | None = None
        self._wrapped: Any = None

    def _wrap(self) -> None:
        sched = self.engine.scheduler
        inner = sched.step

        def step_and_capture(*args, **kwargs):
            plan = inner(*args, **kwargs)
            self._state = _plan_state(sched, plan)
            return plan

        sched.step = step_and_capture
        self._wrapped = sched

    def step(self) -> StepSample:
        if self.engine.scheduler is not self._wrapped:
            self._wrap()
        self._state = None
        recoveries = len(getattr(self.engine, "recoveries", ()))
        t0 = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - t0
        if self._state is None:
            raise ProfilingError("engine.step() did not call its scheduler's step()")
        if len(getattr(self.engine, "recoveries", ())) != recoveries:
            raise ProfilingError(f"a decode iteration failed and the engine recovered: {self.engine.recoveries[-1]}")
        return StepSample(wall_s=wall, **self._state)


def _plan_state(sched: Any, plan: Any) -> dict[str, Any]:
    loads = sched.loads()
    src, dst = [], []
    if plan.batch_handles.size:
        for instance, table in enumerate(plan.tables):
            q_recv = RoutingTables.parse(table).q_recv  # [n, 2]: source instance, consuming shard
            src += q_recv[:, 0].tolist()
            dst += [instance] * len(q_recv)
    return {
        "iteration": plan.iteration,
        "admitted": len(plan.admitted),
        "kv_tokens": [x.kv_tokens for x in loads],
        "shards": [x.shards for x in loads],
        "batch": [x.moe_batch for x in loads],
        "route_src": src,
        "route_dst": dst,
    }


# ---------------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SweepConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 12, 32)  # batch 1 pins down the per-iteration constants
    kv_lens: tuple[int, ...] = (32, 256, 1024)  # prefill is O(batch x len^2) on the driver: keep lengths modest
    cp_degrees: tuple[int, ...] = (1, 2, 4)
    iterations: int = 5  # timed decode iterations per sweep point
    decode_instances: int = 4
    backend: str = "inline"
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.batch_sizes, default=0) < 1 or min(self.kv_lens, default=0) < 1 or self.iterations < 1:
            raise ProfilingError("batch sizes, KV lengths and iterations must be >= 1 and non-empty")
        bad = [cp for cp in self.cp_degrees if not 1 <= cp <= self.decode_instances]
        if bad or not self.cp_degrees:
            raise ProfilingError(f"CP degrees must be in [1, {self.decode_instances}], got {self.cp_degrees}")

    def kv_capacity_tokens(self) -> int:
        """Per instance: the largest sweep point on one instance, plus growth, in whole pages."""
        need = max(self.batch_sizes) * (max(self.kv_lens) + self.iterations + 2)
        return -(-need // self.page_size) * self.page_size


def tiny_model_shape(model: str = "tiny") -> ModelShape:
    """The profile's model section for a checkpoint's config (float32 KV and activations on CPU)."""
    from nanocp.models import load_config

    c = load_config(model)
    return ModelShape(
        num_layers=c.num_hidden_layers,
        num_dense_layers=min(c.first_k_dense_replace, c.num_hidden_layers),
        num_heads=c.num_attention_heads,
        kv_lora_rank=c.kv_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        kv_bytes_per_element=4,
        act_bytes_per_element=4,
        num_experts=c.n_routed_experts,
        top_k=c.num_experts_per_tok,
    )


def run_sweep(cfg: SweepConfig, log=print) -> tuple[list[StepSample], list[Any]]:
    """Timed steps (admission-free) and their PhaseRecords over the whole sweep."""
    from nanocp import LLM
    from nanocp.control_plane import CPBucketTable

    rng = np.random.default_rng(cfg.seed)
    samples, records = [], []
    for run, cp in enumerate(cfg.cp_degrees):
        llm = LLM(
            "tiny",
            decode_instances=cfg.decode_instances,
            backend=cfg.backend,
            timing=True,
            cp_buckets=CPBucketTable.single(cp),
            kv_capacity_tokens=cfg.kv_capacity_tokens(),
            page_size=cfg.page_size,
            max_batch_per_instance=max(cfg.batch_sizes),
            overlap=False,  # each timed step runs its own plan's iteration
        )
        try:
            recorder = StepRecorder(llm.engine)
            for batch in cfg.batch_sizes:
                for kv_len in cfg.kv_lens:
                    point = _sweep_point(llm.engine, recorder, cfg, rng, cp, batch, kv_len)
                    offset = run * RUN_ITERATION_OFFSET  # iteration ids restart with every LLM
                    samples += [replace(s, iteration=s.iteration + offset) for s in point[0]]
                    records += [replace(r, iteration=r.iteration + offset) for r in point[1]]
                    log(f"cp {cp} batch {batch} kv {kv_len}: {np.median([s.wall_s for s in point[0]]) * 1e3:.1f} ms")
        finally:
            llm.close()
    return samples, records


def _sweep_point(engine, recorder: StepRecorder, cfg: SweepConfig, rng, cp: int, batch: int, kv_len: int):
    from nanocp import SamplingParams

    params = SamplingParams(max_tokens=cfg.iterations + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"cp{cp}-b{batch}-kv{kv_len}-{i}", rng.integers(0, 256, kv_len).tolist(), params)
    samples = []
    while engine.has_unfinished():
        s = recorder.step()
        if s.admitted == 0 and s.running > 0:
            samples.append(s)
    for rid in [r for r in engine.requests if engine.requests[r].finish_reason is not None]:
        engine.release(rid)
    keep = {s.iteration for s in samples}
    records = [r for r in engine.timing_records() if r.iteration in keep]
    return samples, records


# ---------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------


def profile_records(records: Iterable[Any], shape: ModelShape) -> list[dict[str, Any]]:
    """PhaseRecords -> records for `fit_profile_from_timing_log` (mapping in the module docstring)."""
    cells: dict[tuple[int, int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ctx: dict[tuple[int, int, int], Any] = {}
    for r in records:
        key = (r.iteration, r.instance, r.layer)
        cells[key][r.phase] += r.seconds
        ctx[key] = r
    batches: dict[int, dict[int, int]] = defaultdict(dict)
    for (it, inst, _), c in ctx.items():
        batches[it][inst] = c.moe_batch
    mean_batch = {it: float(np.mean(list(b.values()))) for it, b in batches.items()}
    out: list[dict[str, Any]] = []
    for key, ph in cells.items():
        c, it = ctx[key], key[0]
        if key[2] < 0:
            out.append({"phase": "iteration", "batch": c.moe_batch, "seconds": ph["sampling"]})
            continue
        out.append({"phase": "attention", "kv_tokens": c.kv_tokens, "shards": c.shard_rows, "seconds": ph["attention"]})
        out.append({"phase": "dense", "batch": c.moe_batch, "seconds": ph["projection"]})
        out.append({"phase": "merge", "partials": c.res_recv, "batch": c.moe_batch, "seconds": ph["merge"]})
        if "dense" in ph:
            out.append({"phase": "dense_mlp", "batch": c.moe_batch, "seconds": ph["dense"]})
        if "dispatch" in ph:
            out.append({"phase": "moe_dispatch", "batch": c.moe_batch, "seconds": ph["dispatch"]})
            out.append({"phase": "expert", "batch": mean_batch[it], "seconds": ph["experts"]})
            out.append({"phase": "moe_combine", "batch": c.moe_batch, "seconds": ph["combine"]})
        n = max(c.q_recv, c.res_recv)  # rows the instance moves per round (full duplex: the larger side)
        if n:
            for link in LINKS:  # one in-process fabric: both link entries come from the same records
                out.append({"phase": "cp_comm", "link": link, "bytes": n * shape.q_bytes, "seconds": ph["q_route"]})
                out.append({"phase": "cp_comm", "link": link, "bytes": n * shape.res_bytes, "seconds": ph["res_route"]})
    return out


def host_copy_GBps(nbytes: int = 1 << 26, repeats: int = 5) -> float:
    """This host's memory copy bandwidth (best of `repeats` copies of `nbytes`), in GB/s."""
    src = np.random.default_rng().random(nbytes // 8)  # fresh data: no page is shared or zero
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def zero_base(shape: ModelShape, instances_per_node: int) -> dict[str, Any]:
    """A profile with every phase 0 (the fit replaces what it measures; shared_expert stays 0).

    Its links move rows at the host's copy bandwidth: the CPU fabric is a memory copy, and a sweep whose route
    times do not grow with bytes (rows this small are latency-bound) keeps that bandwidth and fits only a latency.
    """
    phases = {p: {"const": 0.0} for p in PHASE_FEATURES}
    link = {"GBps": host_copy_GBps(), "latency_us": 0.0}
    return {
        "schema": SCHEMA,
        "name": PROFILE_NAME,
        "time_unit": "s",
        "model": asdict(shape),
        "cluster": {"instances_per_node": instances_per_node, "links": {k: dict(link) for k in LINKS}},
        "phases": phases,
    }


def fit_cpu_profile(
    samples: Sequence[StepSample], records: Sequence[Any], shape: ModelShape, instances_per_node: int, backend: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fitted profile dict and fit statistics (errors on the sweep's own steps).

    Other processes on the machine only ever make a phase slower (the process is descheduled), so the fit is
    trimmed on one side: records more than SPIKE_RATIO x their first fit are dropped and the phases refitted; the
    host phase is fitted the same way on the step times.
    """
    if len(samples) < 4:
        raise ProfilingError(f"need at least 4 timed iterations to fit, got {len(samples)}")
    recs = profile_records(records, shape)
    base = zero_base(shape, instances_per_node)
    first = fit_profile_from_timing_log(recs, base, PROFILE_NAME)
    kept = _drop_spikes(recs, LatencyProfile.from_dict(first), instances_per_node)
    profile = fit_profile_from_timing_log(kept, base, PROFILE_NAME)
    candidates = (1.0,) if backend == "inline" else THREADS_CORE_CANDIDATES
    fits = [_calibrate(profile, samples, cores, instances_per_node) for cores in candidates]
    profile, ape, steps_kept = min(fits, key=lambda f: float(np.median(f[1])))
    stats = {
        "records": len(records),
        "fit_records": len(recs),
        "fit_records_dropped_as_spikes": len(recs) - len(kept),
        "iterations": len(samples),
        "iterations_dropped_as_spikes_in_host_fit": len(samples) - steps_kept,
        "shared_cores": profile["cluster"]["shared_cores"],
        "sweep_median_ape": float(np.median(ape)),
        "sweep_p90_ape": float(np.percentile(ape, 90)),
    }
    return profile, stats


def _record_prediction(model: LatencyProfile, rec: dict[str, Any], num_instances: int) -> float:
    if rec["phase"] == "cp_comm":
        return float(model.links[rec["link"]].time(rec["bytes"]))
    cost = model.phase(rec["phase"], num_instances)
    return float(cost(**{f: rec[f] for f in PHASE_FEATURES[rec["phase"]]}))


def _drop_spikes(recs: list[dict[str, Any]], model: LatencyProfile, num_instances: int) -> list[dict[str, Any]]:
    limit = [SPIKE_RATIO * _record_prediction(model, r, num_instances) + SPIKE_FLOOR_S for r in recs]
    return [r for r, lim in zip(recs, limit) if r["seconds"] <= lim]


def _calibrate(
    fitted: dict[str, Any], samples: Sequence[StepSample], cores: float, instances_per_node: int
) -> tuple[dict[str, Any], np.ndarray, int]:
    """Set shared_cores, fit the host phase to the step times' residual (trimmed like the phases); return the
    profile, its errors on every sample and how many samples the host fit kept."""
    profile = json.loads(json.dumps(fitted))
    profile["cluster"]["shared_cores"] = cores
    profile["phases"].pop("host", None)
    model = LatencyProfile.from_dict(profile)
    work = np.array([s.predict(model, instances_per_node) for s in samples])  # [S] instance side
    wall = np.array([s.wall_s for s in samples])  # [S]
    running = [s.running for s in samples]
    keep = np.ones(len(samples), dtype=bool)
    for _ in range(2):  # fit, drop the spikes, refit
        residual = [{"batch": running[k], "seconds": wall[k] - work[k]} for k in np.nonzero(keep)[0]]
        host = fit_linear_cost(residual, ("batch",))
        pred = work + host["const"] + host["batch"] * np.asarray(running)
        keep = wall <= SPIKE_RATIO * pred + SPIKE_FLOOR_S
    profile["phases"]["host"] = host
    final = LatencyProfile.from_dict(profile)
    ape = np.array([abs(s.predict(final, instances_per_node) - s.wall_s) / s.wall_s for s in samples])
    return profile, ape, int(keep.sum())


# ---------------------------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------------------------


def profile_decode(
    cfg: SweepConfig | None = None, command: str = "", timing_log: Path | None = None, log=print
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the sweep and fit; returns (profile dict with provenance, statistics)."""
    cfg = cfg or SweepConfig()
    t0 = time.perf_counter()
    before = machine_info()
    samples, records = run_sweep(cfg, log)
    if timing_log is not None:
        with open(timing_log, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(asdict(r)) + "\n")
    shape = tiny_model_shape()
    profile, stats = fit_cpu_profile(samples, records, shape, cfg.decode_instances, cfg.backend)
    stats["wall_s"] = time.perf_counter() - t0
    after = machine_info()
    profile["description"] = (
        f"Tiny DeepSeek-V3 (3 layers: 1 dense + 2 MoE, 16 experts) on {cfg.decode_instances} DP-EP decode instances"
        f" of the CPU data plane, {cfg.backend} backend, float32; measured by `nanocp profile decode`. Phase times"
        " include the contention of instances sharing this machine's cores; they describe this machine only."
    )
    profile["provenance"] = profile.get("provenance", {}) | {
        "machine": before | {"load_average_after": after["load_average"]},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or "nanocp profile decode",
        "sweep": asdict(cfg),
        "mapping": "PhaseRecord phases -> profile phases: see bench/cpu_profile.py (module docstring)",
        "phases.shared_expert": "0: the CPU data plane runs the shared expert inside its combine phase",
        "links": "one in-process fabric: nvlink and rdma are fitted from the same q_route/res_route send times",
        "phases.host": "least-squares fit of (step wall time - instance-side model) on the cluster's running "
        "requests: the driver's scheduler step, lowering and hand-off to the instances",
        "cluster.shared_cores": "1 for the inline backend (one thread runs every instance); fitted to the step "
        "times for the threads backend (an effective value that absorbs GIL contention)",
        "fit": stats,
    }
    return profile, stats


def write_profile(profile: dict[str, Any], path: Path | None = None) -> Path:
    path = Path(path) if path else PROFILES_DIR / f"{PROFILE_NAME}.json"
    LatencyProfile.from_dict(profile)  # it must load
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path
