"""Load-aware improvement rate for the CDSP planner (Tetris Sec. 5.1).

Offline: for each arrival rate, simulate the prefill tier (Poisson arrivals, prompt lengths drawn from a given
sample, every request planned on arrival by the CDSP planner against the instances' queue times) under every
candidate improvement rate and keep the rate with the lowest mean TTFT -> an `ImprovementRateTable`.

Online: `ArrivalRateMonitor` measures the arrival rate over a sliding window and, every `update_interval_s`
(30 s in the paper), switches to the table's improvement rate for the closest recorded arrival rate.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nanocp.prefill.latency_model import PrefillLatencyModel, load_profile, profile_path
from nanocp.prefill.planner import CdspPlanner, CoreCdspPlanner, PlannerConfig

DEFAULT_RATES = tuple(round(0.05 * k, 2) for k in range(1, 16))  # 0.05 .. 0.75, as in the paper
TABLE_FORMAT = "nanocp.improvement_rate_table/1"


class ImprovementRateError(ValueError):
    """Bad search input or table."""


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """`count` arrival times (s) of a Poisson process with `rate` requests per second, starting after 0."""
    if rate <= 0 or count < 0:
        raise ImprovementRateError(f"need rate > 0 and count >= 0, got {rate}, {count}")
    times, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def simulate_prefill(
    planner: CdspPlanner | CoreCdspPlanner, arrivals: Sequence[float], lengths: Sequence[int]
) -> list[float]:
    """TTFT of every request when each one is planned at its arrival (FCFS) and its plan is committed.

    Event-driven: one event per arrival. A committed plan never changes, so completions need no events of
    their own: each instance's busy-until time says when it frees up.
    """
    if len(arrivals) != len(lengths):
        raise ImprovementRateError("arrivals and lengths must have the same length")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ImprovementRateError("arrivals must be sorted")
    busy_until = [0.0] * planner.config.num_instances  # absolute time each instance frees up
    ttfts = []
    for now, length in zip(arrivals, lengths):
        plan = planner.plan(int(length), [max(0.0, t - now) for t in busy_until])
        for instance, queue in plan.queue_updates.items():
            busy_until[instance] = now + queue
        ttfts.append(plan.ttft)
    return ttfts


@dataclass(frozen=True)
class RateSearchResult:
    """Mean TTFT of every candidate improvement rate at one arrival rate, and the best one."""

    arrival_rate: float
    best_rate: float
    mean_ttft: dict[float, float]


@dataclass
class ImprovementRateTable:
    """(arrival rate [req/s], best improvement rate) pairs, sorted by arrival rate."""

    entries: list[tuple[float, float]]
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.entries:
            raise ImprovementRateError("an improvement-rate table needs at least one entry")
        for arrival, rate in self.entries:
            if arrival < 0 or not 0.0 <= rate < 1.0:
                raise ImprovementRateError(f"bad table entry ({arrival}, {rate})")
        self.entries = sorted((float(a), float(r)) for a, r in self.entries)

    def lookup(self, arrival_rate: float) -> float:
        """Improvement rate of the closest recorded arrival rate (the lower one on a tie)."""
        return min(self.entries, key=lambda e: (abs(e[0] - arrival_rate), e[0]))[1]

    def save(self, path: str | Path) -> None:
        data = {"format": TABLE_FORMAT, "entries": self.entries, "provenance": self.provenance}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ImprovementRateTable:
        data = json.loads(Path(path).read_text())
        if data.get("format") != TABLE_FORMAT:
            raise ImprovementRateError(f"{path}: expected format {TABLE_FORMAT!r}")
        return cls([tuple(e) for e in data["entries"]], data.get("provenance", {}))


def search_improvement_rates(
    models: Sequence[PrefillLatencyModel],
    config: PlannerConfig,
    arrival_rates: Sequence[float],
    length_sample: Sequence[int],
    rates: Sequence[float] = DEFAULT_RATES,
    num_requests: int = 400,
    seed: int = 0,
    use_core: bool = True,
) -> list[RateSearchResult]:
    """Best improvement rate per arrival rate by simulation (common random numbers across rates)."""
    if not length_sample or min(length_sample) < 1:
        raise ImprovementRateError("length_sample must hold positive prompt lengths")
    if not rates or not all(0.0 <= r < 1.0 for r in rates):
        raise ImprovementRateError("improvement rates must be in [0, 1)")
    planner_type = CoreCdspPlanner if use_core else CdspPlanner
    results = []
    for k, arrival_rate in enumerate(arrival_rates):
        rng = random.Random(seed * 1_000_003 + k)
        arrivals = poisson_arrivals(arrival_rate, num_requests, rng)
        lengths = [rng.choice(length_sample) for _ in range(num_requests)]
        mean_ttft = {}
        for rate in rates:
            planner = planner_type(models, PlannerConfig(**{**vars(config), "improvement_rate": rate}))
            ttfts = simulate_prefill(planner, arrivals, lengths)
            mean_ttft[rate] = sum(ttfts) / len(ttfts)
        best = min(rates, key=lambda r: (mean_ttft[r], r))
        results.append(RateSearchResult(arrival_rate, best, mean_ttft))
    return results


def build_table(results: Sequence[RateSearchResult], provenance: dict | None = None) -> ImprovementRateTable:
    provenance = dict(provenance or {})
    provenance["mean_ttft_s"] = {str(r.arrival_rate): {str(k): v for k, v in r.mean_ttft.items()} for r in results}
    return ImprovementRateTable([(r.arrival_rate, r.best_rate) for r in results], provenance)


class ArrivalRateMonitor:
    """Sliding-window arrival rate -> improvement rate, refreshed every `update_interval_s` (time injectable)."""

    def __init__(
        self,
        table: ImprovementRateTable,
        window_s: float = 30.0,
        update_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or update_interval_s <= 0:
            raise ImprovementRateError("window_s and update_interval_s must be > 0")
        self.table = table
        self.window_s = window_s
        self.update_interval_s = update_interval_s
        self.clock = clock
        self._arrivals: deque[float] = deque()
        self._last_update: float | None = None
        self._rate = table.entries[0][1]

    def record_arrival(self, t: float | None = None) -> None:
        t = self.clock() if t is None else t
        if self._arrivals and t < self._arrivals[-1]:
            raise ImprovementRateError("arrivals must be recorded in time order")
        self._arrivals.append(t)

    def arrival_rate(self, now: float | None = None) -> float:
        """Arrivals per second over the window (now - window_s, now]."""
        now = self.clock() if now is None else now
        while self._arrivals and self._arrivals[0] <= now - self.window_s:
            self._arrivals.popleft()
        return sum(1 for t in self._arrivals if t <= now) / self.window_s

    def improvement_rate(self, now: float | None = None) -> float:
        """The improvement rate in force; re-chosen from the table once every update interval."""
        now = self.clock() if now is None else now
        if self._last_update is None or now - self._last_update >= self.update_interval_s:
            self._rate = self.table.lookup(self.arrival_rate(now))
            self._last_update = now
        return self._rate


def _trace_lengths(path: Path) -> list[int]:
    if path.suffix == ".jsonl":
        return [int(json.loads(line)["input_length"]) for line in path.read_text().splitlines() if line.strip()]
    rows = path.read_text().splitlines()
    column = rows[0].split(",").index("ContextTokens")
    return [int(row.split(",")[column]) for row in rows[1:] if row.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Offline improvement-rate search for the CDSP planner")
    parser.add_argument("--profile", default="a100-llama3-8b")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--max-sp", type=int, default=16)
    parser.add_argument("--trace", type=Path, required=True, help="jsonl (input_length) or csv (ContextTokens)")
    parser.add_argument("--arrival-rates", type=float, nargs="+", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    models = load_profile(profile_path(args.profile))
    config = PlannerConfig(num_nodes=args.nodes, instances_per_node=args.per_node, max_sp=args.max_sp)
    lengths = _trace_lengths(args.trace)
    results = search_improvement_rates(
        models, config, args.arrival_rates, lengths, num_requests=args.requests, seed=args.seed
    )
    provenance = {
        "kind": "simulation with the Eq. 1 latency profile (model output, not a measurement)",
        "profile": args.profile,
        "pool": {"nodes": args.nodes, "instances_per_node": args.per_node, "max_sp": args.max_sp},
        "lengths": f"drawn with replacement from {args.trace.name} ({len(lengths)} prompts)",
        "requests_per_point": args.requests,
        "seed": args.seed,
        "candidate_rates": list(DEFAULT_RATES),
    }
    build_table(results, provenance).save(args.out)
    for r in results:
        print(f"{r.arrival_rate:6.2f} req/s -> improvement rate {r.best_rate:.2f}")


if __name__ == "__main__":
    main()
