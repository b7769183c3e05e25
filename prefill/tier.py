"""The CDSP prefill tier: plans admitted requests with the CDSP planner, computes their chunks with sequence
parallelism on its prefill instances, streams each chunk's KV into the decode pages the decode scheduler chose, and
returns every request's last-token logits. The Engine calls it in place of its simple prefill:

    tier = CdspPrefillTier(engine.prefill_model, TierConfig(num_nodes=1, instances_per_node=4))
    requests = [PrefillRequest(rid, context_tokens, KVDestination.from_shard_pages(shard_pages, moe_instance),
                               recompute) for each admission]
    logits = tier.prefill(requests, engine.cluster)   # rid -> [vocab] logits of the last context token

A call is synchronous: when it returns, every request's KV is in its pages. Within the call, the queue policy
(FCFS or LARS) orders the chunks in estimated (Eq. 1) time, starting from an idle pool, and the chunks run in that
order; the hand-off copies chunk k's KV on worker threads while chunk k+1 computes.

Failures: when a prefill instance dies (`PrefillInstanceFailure` from the executor), the call finishes the copies in
flight, keeps every request whose KV has fully landed, and re-plans all the others from their first token on the
surviving instances (the planner now plans that smaller pool); the dead instance is left out of every later call.
An instance that stops answering is declared dead after `heartbeat_timeout_s` and handled the same way.
With no instance left the call raises `TierError`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from nanocp.models import DeepseekV3Weights

from .handoff import HandoffError, KVDestination, TransferEngine, TransferRecord, as_sink
from .latency_model import PrefillLatencyModel, load_profile, profile_path
from .planner import CdspPlanner, PlannerConfig
from .queue_policy import QUEUE_POLICIES, ChunkDispatch, PrefillJob, PrefillScheduler, run_to_completion
from .sp_exec import ChunkResult, ChunkSpec, PrefillInstanceFailure, SpPrefillExecutor, zigzag_segments


class TierError(ValueError):
    """Bad tier configuration or prefill request."""


@dataclass(frozen=True)
class TierConfig:
    """Prefill pool shape, planner and queue knobs, and the hand-off's receive backends."""

    num_nodes: int = 1
    instances_per_node: int = 4
    max_sp: int | None = None  # default: every instance
    profile: str = "cpu-tiny"  # shipped profile name or path of the Eq. 1 latency models the planner uses
    improvement_rate: float = 0.3
    chunking: bool = True
    min_chunk_tokens: int = 64
    queue_policy: str = "fcfs"  # "fcfs" (Tetris) | "lars" (Medha)
    lars_quantum_s: float = 0.05  # longest chunk LARS dispatches before a request may be preempted
    ttft_slo_scale: float = 10.0  # LARS deadline: arrival + scale * the request's idle-pool prefill latency
    max_request_tokens: int | None = None  # default: the model's max_position_embeddings
    transfer_backends: int | None = None  # receive backends per decode instance; None: one per prefill instance
    transfer_workers: int = 2
    timeout_s: float = 60.0
    heartbeat_timeout_s: float = 3.0  # an instance that stops answering this long is declared dead

    @property
    def num_instances(self) -> int:
        return self.num_nodes * self.instances_per_node


@dataclass(frozen=True)
class PrefillRequest:
    """An admitted request: its context tokens, where its KV goes, and whether it is a recompute."""

    rid: str
    tokens: Sequence[int]
    destination: KVDestination
    recompute: bool = False
    waited_s: float = 0.0  # how long it already waited before this call (LARS slack)


@dataclass(frozen=True)
class PrefillFailure:
    """A prefill instance the tier lost, and the requests it re-planned on the survivors because of it."""

    instance: int
    replanned: tuple[str, ...]
    survivors: tuple[int, ...]
    error: str


@dataclass
class TierStats:
    """What the last `prefill` call did (instance ids in `schedule` are the executor's)."""

    schedule: list[ChunkDispatch] = field(default_factory=list)
    chunk_seconds: list[float] = field(default_factory=list)  # wall time of each chunk, in schedule order
    transfers: list[TransferRecord] = field(default_factory=list)
    failures: list[PrefillFailure] = field(default_factory=list)


def load_models(profile: str) -> list[PrefillLatencyModel]:
    path = Path(profile)
    return load_profile(path if path.suffix == ".json" else profile_path(profile))


class CdspPrefillTier:
    """Prefill instances (full model weights each) behind the CDSP planner and the KV hand-off."""

    def __init__(
        self,
        model: DeepseekV3Weights,
        config: TierConfig | None = None,
        models: Sequence[PrefillLatencyModel] | None = None,
    ) -> None:
        config = config or TierConfig()
        if config.queue_policy not in QUEUE_POLICIES:
            raise TierError(f"queue_policy must be one of {QUEUE_POLICIES}, got {config.queue_policy!r}")
        self.config = config
        self.model = model
        self.models = list(models) if models is not None else load_models(config.profile)
        self.members = list(range(config.num_instances))  # planner instance index -> executor instance
        self.planner = CdspPlanner(self.models, self._planner_config(self.members))
        self.max_request_tokens = config.max_request_tokens or model.config.max_position_embeddings
        self.executor = SpPrefillExecutor(
            model, config.num_instances, self.max_request_tokens, heartbeat_timeout_s=config.heartbeat_timeout_s
        )
        self.stats = TierStats()
        self.failures: list[PrefillFailure] = []  # every instance lost so far

    def _planner_config(self, members: list[int]) -> PlannerConfig:
        """The pool the planner sees: the live instances, nodes kept when every node lost the same number
        (else the survivors are planned as one node)."""
        c = self.config
        per_node = Counter(i // c.instances_per_node for i in members)
        sizes = set(per_node.values())
        num_nodes, instances_per_node = (len(per_node), sizes.pop()) if len(sizes) == 1 else (1, len(members))
        return PlannerConfig(
            num_nodes=num_nodes,
            instances_per_node=instances_per_node,
            max_sp=min(c.max_sp or c.num_instances, len(members)),
            improvement_rate=c.improvement_rate,
            chunking=c.chunking,
            min_chunk_tokens=c.min_chunk_tokens,
        )

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> CdspPrefillTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the call

    @torch.no_grad()
    def prefill(self, requests: Sequence[PrefillRequest], sink) -> dict[str, torch.Tensor]:
        """Prefill `requests`, write their KV through `sink` (a `KVSink` or a decode cluster with `pools`), and
        return rid -> logits [vocab] of each request's last context token (for recomputes too)."""
        requests = list(requests)
        self._check(requests)
        if not requests:
            return {}
        sink = as_sink(sink)
        stats = TierStats()
        logits: dict[str, torch.Tensor] = {}
        todo = requests
        while todo:
            landed, failure = self._attempt(todo, sink, stats)
            logits.update(landed)
            todo = [r for r in todo if r.rid not in landed]
            if failure is not None:
                self._lose(failure, [r.rid for r in todo], stats)
        self.stats = stats
        return logits

    def _attempt(
        self, requests: list[PrefillRequest], sink, stats: TierStats
    ) -> tuple[dict[str, torch.Tensor], PrefillInstanceFailure | None]:
        """Plan and run `requests` on the live instances: (logits of the requests whose KV landed, the instance
        failure that stopped the attempt or None)."""
        by_rid = {r.rid: r for r in requests}
        schedule = self._schedule(requests)
        stats.schedule.extend(schedule)
        pieces = {d: self._pieces(d, by_rid[d.rid].destination) for d in schedule}
        receivers = 1 + max(s.instance for r in requests for s in r.destination.shards)
        transfers = TransferEngine(
            sink, receivers, self.config.num_instances, self.config.transfer_backends, self.config.transfer_workers
        )
        logits: dict[str, torch.Tensor] = {}
        failure = None
        try:
            for rid, counts in _expected_pieces(pieces).items():
                transfers.expect(rid, counts)
            for r in requests:
                self.executor.start(r.rid, r.tokens)
            try:
                for d in schedule:
                    for sender, receiver in pieces[d]:
                        transfers.handshake(d.rid, d.index, sender, receiver)  # before the compute: overlaps it
                    result = self._run(d, stats)
                    self._stream(transfers, d, result, by_rid[d.rid].destination)
                    if d.last:
                        logits[d.rid] = result.logits
                        self.executor.finish(d.rid)
            except PrefillInstanceFailure as e:
                failure = e
            if failure is None:
                transfers.wait(list(by_rid), self.config.timeout_s)
        finally:
            for r in requests:
                self.executor.finish(r.rid)
            transfers.close()  # every copy already started has finished
        stats.transfers.extend(transfers.log)
        if failure is not None:
            logits = {rid: v for rid, v in logits.items() if _landed(transfers, rid)}
        return logits, failure

    def _lose(self, failure: PrefillInstanceFailure, replanned: list[str], stats: TierStats) -> None:
        """Plan on the surviving instances from now on."""
        survivors = self.executor.alive()
        record = PrefillFailure(failure.instance, tuple(replanned), tuple(survivors), str(failure))
        self.failures.append(record)
        stats.failures.append(record)
        if not survivors:
            raise TierError(f"every prefill instance is gone; {len(replanned)} requests cannot be prefilled") from (
                failure
            )
        self.members = survivors
        self.planner = CdspPlanner(self.models, self._planner_config(survivors))

    def _check(self, requests: list[PrefillRequest]) -> None:
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise TierError(f"duplicate request ids in one prefill call: {rids}")
        for r in requests:
            n = len(r.tokens)
            if n < 1:
                raise TierError(f"request {r.rid!r}: empty context")
            if n > self.max_request_tokens:
                raise TierError(f"request {r.rid!r}: {n} tokens exceed the tier's limit {self.max_request_tokens}")
            if r.destination.total_tokens != n:
                raise TierError(
                    f"request {r.rid!r}: its KV destination holds {r.destination.total_tokens} tokens, "
                    f"the context has {n}"
                )

    def _schedule(self, requests: list[PrefillRequest]) -> list[ChunkDispatch]:
        """Every chunk of every request in execution order (estimated start time, then commit order)."""
        c = self.config
        scheduler = PrefillScheduler(self.planner, c.queue_policy, c.lars_quantum_s, c.min_chunk_tokens)
        jobs = []
        for r in requests:
            arrival = -float(r.waited_s)
            work = self.planner.best_latency(0, len(r.tokens))
            jobs.append(PrefillJob(r.rid, len(r.tokens), arrival, arrival + c.ttft_slo_scale * work))
        committed = run_to_completion(scheduler, jobs)
        order = sorted(range(len(committed)), key=lambda k: (committed[k].start, k))
        members = self.members
        return [replace(committed[k], instances=tuple(members[i] for i in committed[k].instances)) for k in order]

    def _run(self, d: ChunkDispatch, stats: TierStats) -> ChunkResult:
        began = time.perf_counter()
        result = self.executor.run_chunk(d.rid, ChunkSpec(d.tokens, d.instances, d.attention))
        stats.chunk_seconds.append(time.perf_counter() - began)
        return result

    @staticmethod
    def _pieces(d: ChunkDispatch, destination: KVDestination) -> list[tuple[int, int]]:
        """(sender, receiver) pairs of a chunk: which decode instances each member's rows land on."""
        pairs = []
        for member, segments in zip(d.instances, zigzag_segments(d.tokens, len(d.instances))):
            receivers = []
            for a, b in segments:
                for w in destination.writes(d.context + a, b - a):
                    if w.instance not in receivers:
                        receivers.append(w.instance)
            pairs.extend((member, receiver) for receiver in receivers)
        return pairs

    @staticmethod
    def _stream(transfers: TransferEngine, d: ChunkDispatch, result: ChunkResult, destination: KVDestination) -> None:
        data: dict[tuple[int, int], list] = {}
        for run in result.runs:
            for w in destination.writes(run.start, run.tokens):
                data.setdefault((run.instance, w.instance), []).append(
                    (w.frames, w.start_slot, run.kv[:, w.row_lo : w.row_hi])
                )
        for (sender, receiver), writes in data.items():
            transfers.ready(d.rid, d.index, sender, receiver, writes)


def _landed(transfers: TransferEngine, rid: str) -> bool:
    """After `transfers.close()`: did every piece of `rid` land? (Nothing is in flight any more, so no wait.)"""
    try:
        transfers.wait([rid], timeout_s=0.0)
    except HandoffError:
        return False
    return True


def _expected_pieces(pieces: dict[ChunkDispatch, list[tuple[int, int]]]) -> dict[str, dict[int, int]]:
    counts: dict[str, dict[int, int]] = {}
    for d, pairs in pieces.items():
        per_receiver = counts.setdefault(d.rid, {})
        for _, receiver in pairs:
            per_receiver[receiver] = per_receiver.get(receiver, 0) + 1
    return counts
