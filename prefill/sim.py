"""Prefill-only discrete-event simulation of the prefill tier (Tetris Sec. 6's profiler, extended to queue policies
and baselines): Poisson arrivals, prompt lengths from a length distribution, each request scheduled by a
`PrefillScheduler` (FCFS or LARS) over a planner (CDSP, fixed SP, elastic SP) with Eq. 1 latency models. The event
loop is `queue_policy.run_to_completion`: arrivals and chunk completions are the only events.

All TTFTs are model outputs of the latency profiles, not measurements.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from .improvement_rate import ArrivalRateMonitor, ImprovementRateTable
from .planner import CdspPlanner, CoreCdspPlanner, PlannerConfig
from .queue_policy import PrefillJob, PrefillScheduler, run_to_completion


@dataclass(frozen=True)
class LengthShape:
    """A prompt-length distribution: lo + (hi - lo) * Beta(alpha, beta) with beta set by the mean."""

    name: str
    lo: int
    hi: int
    mean: float
    alpha: float = 1.5

    def __post_init__(self) -> None:
        if not (0 < self.lo < self.mean < self.hi) or self.alpha <= 0:
            raise ValueError(f"length shape {self.name!r} needs 0 < lo < mean < hi and alpha > 0")

    @property
    def beta(self) -> float:
        m = (self.mean - self.lo) / (self.hi - self.lo)
        return self.alpha * (1.0 - m) / m

    def sample(self, n: int, rng: random.Random) -> list[int]:
        span = self.hi - self.lo
        return [
            min(self.hi, max(self.lo, round(self.lo + span * rng.betavariate(self.alpha, self.beta)))) for _ in range(n)
        ]


# Stand-ins for Tetris' production traces (not public): ranges and means as the paper states them (Sec. 7.1).
TETRIS_SHAPES = {
    "short": LengthShape("short", 4_000, 95_000, 23_600),
    "medium": LengthShape("medium", 8_000, 142_000, 32_800),
    "long": LengthShape("long", 16_000, 190_000, 50_100),
}


@dataclass(frozen=True)
class Workload:
    """Arrival gaps at 1 req/s and prompt lengths; `at(rate)` scales the gaps (the paper scales timestamps too)."""

    unit_gaps: tuple[float, ...]
    lengths: tuple[int, ...]

    @classmethod
    def draw(cls, shape: LengthShape, n: int, seed: int) -> Workload:
        rng = random.Random(seed)
        gaps = tuple(rng.expovariate(1.0) for _ in range(n))
        return cls(gaps, tuple(shape.sample(n, rng)))

    def at(self, rate: float) -> list[float]:
        if rate <= 0:
            raise ValueError(f"arrival rate must be > 0, got {rate}")
        times, t = [], 0.0
        for gap in self.unit_gaps:
            t += gap / rate
            times.append(t)
        return times


@dataclass(frozen=True)
class Arm:
    """One system of the comparison: planner policy, chunking, queue policy, improvement-rate handling."""

    name: str
    planner_policy: str = "cdsp"  # "cdsp" | "fixed" | "elastic"
    fixed_sp: int = 0
    chunking: bool = True
    queue: str = "fcfs"  # "fcfs" | "lars"
    dynamic_rate: bool = True  # improvement rate from the table via the arrival-rate monitor


@dataclass
class SimResult:
    ttft: list[float]
    ideal: list[float]  # idle-pool best-case TTFT of each request (the SLO's unit)
    chunks: int

    def percentile(self, q: float) -> float:
        values = sorted(self.ttft)
        k = min(len(values) - 1, max(0, math.ceil(q / 100.0 * len(values)) - 1))
        return values[k]

    def attainment(self, slo_scale: float) -> float:
        return sum(t <= slo_scale * i for t, i in zip(self.ttft, self.ideal)) / len(self.ttft)


class PlannerSet:
    """The planners of one arm, one per candidate improvement rate (C++ core where the arm allows)."""

    def __init__(self, models, config: PlannerConfig, arm: Arm, rates: Sequence[float]) -> None:
        base = dict(vars(config), policy=arm.planner_policy, fixed_sp=arm.fixed_sp, chunking=arm.chunking)
        self.by_rate = {r: CoreCdspPlanner(models, PlannerConfig(**{**base, "improvement_rate": r})) for r in rates}
        self.rates = list(rates)

    def planner(self, rate: float) -> CdspPlanner | CoreCdspPlanner:
        return self.by_rate[min(self.rates, key=lambda r: abs(r - rate))]


def simulate(
    planners: PlannerSet,
    arm: Arm,
    arrivals: Sequence[float],
    lengths: Sequence[int],
    slo_scale: float,
    table: ImprovementRateTable | None = None,
    fixed_rate: float = 0.3,
    quantum_s: float = 1.0,
) -> SimResult:
    """TTFT of every request under `arm`. With `arm.dynamic_rate` and a table, the improvement rate follows an
    `ArrivalRateMonitor` (30 s window and update interval, as in Tetris); otherwise `fixed_rate`."""
    first = planners.planner(fixed_rate if table is None or not arm.dynamic_rate else table.entries[0][1])
    scheduler = PrefillScheduler(first, arm.queue, quantum_s=quantum_s)
    reference = scheduler.reference
    jobs, ideals = [], []
    for k, (a, n) in enumerate(zip(arrivals, lengths)):
        ideals.append(reference.best_latency(0, int(n)))
        jobs.append(PrefillJob(str(k), int(n), float(a), float(a) + slo_scale * ideals[-1]))
    hook = None
    if arm.dynamic_rate and table is not None:
        monitor = ArrivalRateMonitor(table, clock=lambda: 0.0)

        def hook(sched: PrefillScheduler, job: PrefillJob) -> None:
            monitor.record_arrival(job.arrival)
            sched.use_planner(planners.planner(monitor.improvement_rate(job.arrival)))

    dispatches = run_to_completion(scheduler, jobs, hook)
    return SimResult([j.ttft for j in jobs], ideals, len(dispatches))
