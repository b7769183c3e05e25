"""Queue policies of the prefill scheduler: when each request's chunks run and on which instances, in estimated
(Eq. 1) time. Both the CDSP tier and the prefill simulator drive this one class.

- "fcfs" (Tetris): a request is planned by the CDSP planner the moment it arrives, against every instance's queue
  time (when it frees up under the plans already committed), and its whole chunk plan is committed.
- "lars" (Medha): requests wait in a queue ordered by Length-Aware Relative Slack,
  rho = (deadline - now - remaining work) / total work, and run one chunk at a time (chunk-level preemption): when
  instances are free, the request with the least relative slack gets a group of free instances (Tetris Algorithm
  2 over the free pool, extending the instances that already hold its KV) for one chunk of at most `quantum_s`;
  then it goes back into the queue, where a more urgent request may overtake it. When the most urgent request
  waits for KV-holding instances that are partly busy, it reserves the free ones (backfilling uses the rest),
  else a stream of short requests could keep a wide group from ever being free at once. Work is the idle-pool
  best case of Eq. 1 (`CdspPlanner.best_latency`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .planner import CdspPlanner, CoreCdspPlanner, PlannerError

QUEUE_POLICIES = ("fcfs", "lars")
_EPS = 1e-12


class QueuePolicyError(ValueError):
    """Bad queue-policy configuration or job."""


@dataclass
class PrefillJob:
    """A request in the prefill queue; times are seconds on the scheduler's clock."""

    rid: str
    length: int
    arrival: float
    deadline: float = math.inf  # when the first token is due (LARS)
    context: int = 0  # tokens already dispatched
    instances: tuple[int, ...] = ()  # instances holding its KV (the last chunk's group)
    chunks: int = 0
    running_until: float | None = None
    finish: float | None = None
    total_work: float = 0.0
    remaining_work: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


@dataclass(frozen=True)
class ChunkDispatch:
    """One committed chunk: `tokens` tokens after `context` of `rid` on `instances`, from `start` to `end`."""

    rid: str
    index: int
    context: int
    tokens: int
    instances: tuple[int, ...]
    attention: str
    start: float
    end: float
    last: bool


class PrefillScheduler:
    """A prefill queue over one pool of instances, with the FCFS (Tetris) or LARS (Medha) policy."""

    def __init__(
        self,
        planner: CdspPlanner | CoreCdspPlanner,
        policy: str = "fcfs",
        quantum_s: float = 1.0,
        min_chunk_tokens: int | None = None,
    ) -> None:
        if policy not in QUEUE_POLICIES:
            raise QueuePolicyError(f"queue policy must be one of {QUEUE_POLICIES}, got {policy!r}")
        if not (quantum_s > 0 and math.isfinite(quantum_s)):
            raise QueuePolicyError(f"quantum_s must be a positive number, got {quantum_s!r}")
        self.policy = policy
        self.quantum_s = quantum_s
        self.min_chunk_tokens = planner.config.min_chunk_tokens if min_chunk_tokens is None else min_chunk_tokens
        if self.min_chunk_tokens < 1:
            raise QueuePolicyError(f"min_chunk_tokens must be >= 1, got {self.min_chunk_tokens}")
        self._reference: dict[int, CdspPlanner] = {}
        self.use_planner(planner)
        self.busy_until = [0.0] * planner.config.num_instances
        self.jobs: dict[str, PrefillJob] = {}
        self.waiting: list[PrefillJob] = []
        self.running: list[PrefillJob] = []
        self._out: list[ChunkDispatch] = []

    def use_planner(self, planner: CdspPlanner | CoreCdspPlanner) -> None:
        """Plan with `planner` from now on (e.g. another improvement rate); the pool shape must not change."""
        if hasattr(self, "planner") and planner.config.num_instances != self.planner.config.num_instances:
            raise QueuePolicyError("a new planner must plan the same pool")
        self.planner = planner
        # LARS needs Algorithm 2 and Eq. 1 pieces, which only the Python planner exposes (cheap: no recursion).
        key = id(planner)
        if key not in self._reference:
            python = planner if isinstance(planner, CdspPlanner) else CdspPlanner(planner.models, planner.config)
            self._reference[key] = python
        self.reference = self._reference[key]

    # ------------------------------------------------------------------ queue

    def submit(self, job: PrefillJob, now: float) -> None:
        """A request arrives (job.arrival <= now)."""
        if job.rid in self.jobs:
            raise QueuePolicyError(f"request {job.rid!r} is already queued")
        if not isinstance(job.length, int) or job.length < 1:
            raise QueuePolicyError(f"request {job.rid!r}: length must be a positive int, got {job.length!r}")
        self.jobs[job.rid] = job
        job.total_work = self.reference.best_latency(0, job.length)
        job.remaining_work = job.total_work
        if self.policy == "fcfs":
            self._plan_whole(job, now)
        else:
            self.waiting.append(job)

    def poll(self, now: float) -> list[ChunkDispatch]:
        """Advance to `now`: finish chunks that ended, start new ones (LARS); returns the chunks committed since
        the last poll (FCFS commits whole plans at submit, with future start times)."""
        if self.policy == "lars":
            self._complete(now)
            self._dispatch(now)
        out, self._out = self._out, []
        return out

    def next_wakeup(self) -> float | None:
        """When the scheduler next has something to do on its own (a running chunk ends), or None."""
        return min((job.running_until for job in self.running), default=None)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def queue_times(self, now: float) -> list[float]:
        return [max(0.0, t - now) for t in self.busy_until]

    # ------------------------------------------------------------------ FCFS

    def _plan_whole(self, job: PrefillJob, now: float) -> None:
        plan = self.planner.plan(job.length, self.queue_times(now))
        for k, chunk in enumerate(plan.chunks):
            self._out.append(
                ChunkDispatch(
                    job.rid,
                    k,
                    chunk.context,
                    chunk.tokens,
                    chunk.instances,
                    chunk.attention,
                    now + chunk.start,
                    now + chunk.end,
                    k == len(plan.chunks) - 1,
                )
            )
        for instance, queue in plan.queue_updates.items():
            self.busy_until[instance] = now + queue
        job.context, job.chunks, job.instances = job.length, len(plan.chunks), plan.instances
        job.finish, job.remaining_work = now + plan.ttft, 0.0

    # ------------------------------------------------------------------ LARS

    def relative_slack(self, job: PrefillJob, now: float) -> float:
        """Medha's LARS key: slack per unit of total work (the smaller, the more urgent)."""
        return (job.deadline - now - job.remaining_work) / job.total_work

    def _complete(self, now: float) -> None:
        still = []
        for job in self.running:
            if job.running_until <= now + _EPS:
                end, job.running_until = job.running_until, None
                if job.context == job.length:
                    job.finish = end
                else:
                    self.waiting.append(job)
            else:
                still.append(job)
        self.running = still

    def _dispatch(self, now: float) -> None:
        free = {i for i, t in enumerate(self.busy_until) if t <= now + _EPS}
        if not free or not self.waiting:
            return
        order = sorted(self.waiting, key=lambda j: (self.relative_slack(j, now), j.arrival, j.rid))
        for rank, job in enumerate(order):
            if not free:
                break
            if not set(job.instances) <= free:
                if rank == 0:
                    # The most urgent request waits for its KV holders: keep its free ones for it, so that less
                    # urgent requests cannot keep its group from ever being free at once (no starvation).
                    free -= set(job.instances)
                continue
            try:
                group, _, _, _ = self.reference.single_chunk_group(
                    {i: 0.0 for i in free}, job.instances, job.length - job.context, job.context
                )
            except PlannerError:
                continue
            self._start_chunk(job, tuple(group), now)
            free -= set(group)

    def _start_chunk(self, job: PrefillJob, group: tuple[int, ...], now: float) -> None:
        remaining, sp = job.length - job.context, len(group)
        tokens = self.reference.solve_chunk_len(sp, job.context, self.quantum_s, remaining)
        tokens = min(remaining, max(tokens, self.min_chunk_tokens))
        if remaining - tokens < self.min_chunk_tokens:
            tokens = remaining  # no tail too short to be worth a chunk of its own
        seconds, attention = self.reference.prefill_latency(sp, job.context, tokens)
        end = now + seconds
        last = tokens == remaining
        self._out.append(ChunkDispatch(job.rid, job.chunks, job.context, tokens, group, attention, now, end, last))
        for i in group:
            self.busy_until[i] = end
        job.context += tokens
        job.chunks += 1
        job.instances = group
        job.remaining_work = self.reference.best_latency(job.context, job.length - job.context) if not last else 0.0
        job.running_until = end
        self.waiting.remove(job)
        self.running.append(job)


def run_to_completion(
    scheduler: PrefillScheduler,
    jobs: list[PrefillJob],
    before_submit: Callable[[PrefillScheduler, PrefillJob], None] | None = None,
) -> list[ChunkDispatch]:
    """Submit jobs at their arrival times and advance the scheduler until every one is done; the dispatches in
    commit order (each request's chunks in order). `before_submit` runs at each arrival (e.g. to switch the
    planner to the improvement rate an arrival-rate monitor picks)."""
    pending = sorted(jobs, key=lambda j: j.arrival)
    out, i = [], 0
    while i < len(pending) or not scheduler.idle:
        wake = scheduler.next_wakeup()
        now = min(pending[i].arrival if i < len(pending) else math.inf, math.inf if wake is None else wake)
        if math.isinf(now):
            raise QueuePolicyError(f"{len(scheduler.waiting)} requests wait but nothing can run or finish")
        while i < len(pending) and pending[i].arrival <= now:
            if before_submit is not None:
                before_submit(scheduler, pending[i])
            scheduler.submit(pending[i], now)
            i += 1
        out.extend(scheduler.poll(now))
    return out
