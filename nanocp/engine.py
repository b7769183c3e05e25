"""The engine: one global scheduler driving a decode cluster, plus the prefill that feeds it.

Each `step()` is one decode iteration: the scheduler plans (admissions, bindings, growth, preemptions) and lowers
the plan into per-instance routing tables; admitted requests are prefilled and their KV is written straight into
the pages of their KV binding; every instance runs the iteration; sampled tokens are appended and stop conditions
checked. With `num_steps = k > 1` (multi-step execution) an iteration decodes up to k tokens per request: the
scheduler reserves their KV up front, the instances run k sub-steps, and each request's tokens are appended in
order up to its first stop condition (the rest of its window is discarded). `nanocp.LLM` (offline) and the HTTP
server both drive this class.
"""

from __future__ import annotations

import itertools
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from nanocp.control_plane import Admission, ClusterSpec, CPBucketTable, GlobalScheduler, IterationPlan
from nanocp.data_plane.cluster import ClusterConfig, InstanceFailure, make_cluster
from nanocp.data_plane.decode_layers import DecodeWeights
from nanocp.data_plane.instance import KEPT_TOKEN, Handoff, InstanceLimits
from nanocp.data_plane.packed_prefill import PrefillOutput, prefill_packed
from nanocp.data_plane.row_messages import RowBatch, SampledRows
from nanocp.data_plane.sampling import SamplingParams, sample_tokens
from nanocp.data_plane.timing import PhaseRecord
from nanocp.driver_policy import batch_policy
from nanocp.models import load_config, load_model, load_tokenizer
from nanocp.prefill.handoff import KVDestination
from nanocp.prefill.tier import CdspPrefillTier, PrefillRequest, TierConfig
from nanocp.stop_strings import stop_string_end


@dataclass
class EngineConfig:
    model: str = "tiny"
    decode_instances: int = 4
    instances_per_node: int | None = None  # default: every instance on one node
    policy: str = "nanocp"
    backend: str = "inline"  # "inline" (one thread, cooperative) | "threads" | "processes"
    kv_capacity_tokens: int = 16384  # per instance
    page_size: int = 16
    max_batch_per_instance: int = 64
    cp_buckets: CPBucketTable | None = None
    scheduler_backend: str = "cpp"
    dtype: torch.dtype = torch.float32
    timeout_s: float = 30.0
    timing: bool = False
    metadata_timeout_s: float = 2.0  # processes backend: wait for a routing table before asking for a resend
    # processes backend: an instance whose heartbeat stops this long (stopped, wedged) is killed and handled as dead
    heartbeat_timeout_s: float = 3.0
    use_graphs: bool = False  # AOT graph engine (buckets over the execution shape, one static pool)
    num_steps: int = 1  # decode steps per iteration (multi-step execution: one plan, k sub-steps on the instances)
    # Overlapped iterations (processes backend): plan and send iteration t + 1 while the instances run t; each
    # instance feeds a continuing request the token it sampled itself (handed over when the request moves). A plan
    # that admits a request waits for the iteration in flight only when a page it got may still be touched by it.
    overlap: bool = True
    # With overlap: an admitting plan overlaps too when no page it got may still be touched by the iteration in
    # flight; otherwise its prefill is computed while that iteration runs and written after it. False: every
    # admitting plan waits for the iteration in flight before its prefill.
    overlap_admissions: bool = True
    # CDSP prefill tier (Tetris): 0 = the driver prefills admitted prompts itself (packed, one device); N > 0 = N
    # prefill instances compute prompts with chunkwise dynamic SP and hand the KV straight to the decode pages.
    prefill_instances: int = 0
    prefill_queue_policy: str = "fcfs"  # "fcfs" (Tetris queue-time estimates) | "lars" (Medha relative slack)
    cluster_options: dict = field(default_factory=dict)  # backend-specific (e.g. Ray placement)
    # Intra-op threads for torch in this process (None: leave torch's setting). Decode work here is many small
    # ops; OpenMP fan-out on them costs more than it gives, badly so when other processes share the cores.
    torch_threads: int | None = 1
    # While it drives instances in other processes (processes / Ray backends), the driver thread runs as
    # SCHED_BATCH (Linux): an instance's answer then does not make it preempt another instance mid-iteration
    # (nanocp/driver_policy.py). LLM.generate switches it for the call only; `nanocp serve` for its engine thread.
    driver_sched_batch: bool = True
    # Where the decode instances run ("cpu", "cuda", "cuda:<i>"; a GPU with the inline or threads backend, every
    # instance of the cluster sharing it). The driver's own prefill stays on the CPU and its KV is copied into the
    # instances' pools.
    device: str = "cpu"
    # A progress bar (stderr) while the driver reads a checkpoint's weights (not for "tiny").
    load_progress: bool = True

    def cluster_spec(self) -> ClusterSpec:
        if not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {self.num_steps!r}")
        per_node = self.instances_per_node or self.decode_instances
        if self.decode_instances < 1 or self.decode_instances % per_node:
            raise ValueError(
                f"decode_instances ({self.decode_instances}) must be a positive multiple of instances_per_node "
                f"({per_node})"
            )
        return ClusterSpec(self.decode_instances // per_node, per_node, self.kv_capacity_tokens, self.page_size)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    metrics: RequestMetrics
    logits: list[torch.Tensor] | None = None  # per output token, [vocab], when requested
    error: str | None = None


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    keep_logits: bool
    metrics: RequestMetrics
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    stop_text_end: int | None = None  # text is cut here when a stop string matched
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: its stop_token_ids, and EOS unless ignore_eos
    resume: bool = False  # re-admitted after a cluster failure: its prefill must not sample a new first token
    key: int = -1  # stable integer key (the instances keep its last token under it)


@dataclass
class _MoeRows:
    """Where an iteration's requests sample their tokens: per instance, its MoE rows in its routing table's order,
    and per request, its row's instance and window."""

    rids: list[list[str]]  # per instance: the request of each of its MoE rows
    batch_indices: list[list[int]]  # per instance: the batch index of each of its MoE rows
    windows: list[list[int]]  # per instance: decode steps each of its MoE rows runs
    moe_instance: dict[str, int]  # request -> its MoE instance
    window: dict[str, int]  # request -> decode steps it runs (tokens it adds unless it stops)

    @classmethod
    def none(cls, num_instances: int) -> _MoeRows:
        """No rows (an empty batch)."""
        return cls(
            [[] for _ in range(num_instances)],
            [[] for _ in range(num_instances)],
            [[] for _ in range(num_instances)],
            {},
            {},
        )


@dataclass
class _InFlight:
    """An iteration sent to the cluster whose tokens are not appended yet."""

    batch: list[str]  # batch index -> request id
    rows: _MoeRows
    launch: object | None  # the cluster's handle while running; None once `outputs` are here
    outputs: SampledRows | None = None


def undecodable(error: Exception) -> str:
    return f"the output tokens cannot be decoded by the tokenizer ({type(error).__name__}: {error})"


@dataclass(frozen=True)
class Recovery:
    """A decode-cluster failure the engine survived."""

    iteration: int
    dead_instances: tuple[int, ...]
    survivors: int
    error: str


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self.model_config = load_config(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.prefill_model = load_model(config.model, dtype=config.dtype, progress=config.load_progress)
        # The driver's own prefill runs the eager decode path's prepared weights, every routed expert local.
        self.prefill_weights = DecodeWeights.build(self.prefill_model, range(self.model_config.n_routed_experts))
        self.prefill_tier = None
        if config.prefill_instances:
            tier = TierConfig(
                instances_per_node=config.prefill_instances,
                queue_policy=config.prefill_queue_policy,
                max_request_tokens=config.kv_capacity_tokens,
                timeout_s=config.timeout_s,
                heartbeat_timeout_s=config.heartbeat_timeout_s,
            )
            self.prefill_tier = CdspPrefillTier(self.prefill_model, tier)
        self.recoveries: list[Recovery] = []
        self._build_cluster(config.cluster_spec())
        self.requests: dict[str, _Request] = {}
        self._done: list[RequestOutput] = []
        self.last_updated: list[str] = []  # requests that received tokens in the last step (for streaming)
        self.iterations = 0
        self._keys = itertools.count()
        self._inflight: _InFlight | None = None
        self.overlapped_iterations = 0  # iterations sent while the previous one was still running
        self.admissions_in_flight = 0  # admitting plans made while an iteration was in flight
        self.overlapped_admissions = 0  # ... of which sent before that iteration returned
        self.early_prefills = 0  # ... of the others: prefill computed before that iteration returned
        # (instance, frame) pages of requests of the iteration in flight that freed them (or will, at the next plan)
        self._released_pages: dict[str, frozenset[tuple[int, int]]] = {}

    def _build_cluster(self, spec: ClusterSpec, previous=None) -> None:
        """A scheduler and a decode cluster of spec.num_instances instances (the experts split over them). After a
        failure, `previous` (the failed cluster) is rebuilt in its surviving processes when it can be (`rebuild`),
        which costs far less than starting new ones; otherwise it is closed."""
        config = self.config
        self.spec = spec
        self.scheduler = GlobalScheduler(
            spec,
            config.policy,
            cp_buckets=config.cp_buckets,
            max_batch_per_instance=config.max_batch_per_instance,
            backend=config.scheduler_backend,
        )
        n = spec.num_instances
        limits = InstanceLimits(
            max_moe_batch=config.max_batch_per_instance,
            max_q_recv=config.max_batch_per_instance * n,
            max_res_recv=config.max_batch_per_instance * n,
        )
        cluster_cfg = ClusterConfig(
            config.model,
            n,
            limits,
            spec.frames_per_instance,
            spec.page_size,
            config.dtype,
            config.timeout_s,
            config.timing,
            metadata_timeout_s=config.metadata_timeout_s,
            use_graphs=config.use_graphs,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            device=config.device,
        )
        if previous is not None and hasattr(previous, "rebuild"):
            self.cluster = previous.rebuild(cluster_cfg)
        else:
            if previous is not None:
                previous.close()
            self.cluster = make_cluster(config.backend, cluster_cfg, **config.cluster_options)
        self.overlaps = config.overlap and getattr(self.cluster, "overlaps", False)
        self._inflight = None

    # ------------------------------------------------------------------ failures

    def _recover(self, error: InstanceFailure) -> None:
        """An iteration failed: shrink the EP group to the surviving instances (experts re-sharded over them),
        and re-prefill every unfinished request on the new cluster from its prompt and the tokens it has
        generated; a request the smaller cluster can never hold ends with an explicit error."""
        recent = [r for r in self.recoveries if r.iteration >= self.iterations - 3]
        if len(recent) >= 3:
            raise RuntimeError(f"decode cluster keeps failing ({len(recent)} recoveries in 3 iterations)") from error
        dead = self.cluster.dead_instances()
        survivors = self.spec.num_instances - len(dead)
        if survivors < 1:
            raise RuntimeError("every decode instance is gone") from error
        self.recoveries.append(Recovery(self.iterations, tuple(dead), survivors, str(error)))
        per_node = self.spec.instances_per_node
        if survivors % per_node:
            per_node = survivors  # the survivors form one node
        spec = ClusterSpec(survivors // per_node, per_node, self.spec.kv_capacity_tokens, self.spec.page_size)
        self._build_cluster(spec, previous=self.cluster)
        for req in self.requests.values():
            if req.finish_reason is not None:
                continue
            # A request that has output tokens resumes: its context is the prompt plus all but the last output
            # token (whose KV the next iteration writes), and it needs one decode iteration per missing token.
            context = len(req.prompt) + max(0, len(req.output) - 1)
            new_tokens = req.params.max_tokens - max(0, len(req.output) - 1)
            try:
                self.scheduler.add_request(req.rid, context, new_tokens)
            except ValueError as e:
                self._end(req, "error", f"the cluster can no longer hold this request after a failure: {e}")
                continue
            req.resume = bool(req.output)

    # ------------------------------------------------------------------ requests

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, keep_logits: bool = False) -> None:
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if not prompt_ids:
            raise ValueError(f"request {rid!r}: empty prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        longest = len(prompt_ids) + params.max_tokens
        if longest > self.model_config.max_position_embeddings:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context of {self.model_config.max_position_embeddings} tokens"
            )
        self.scheduler.add_request(rid, len(prompt_ids), params.max_tokens)
        seed = params.seed if params.seed is not None else hash(rid) & 0x7FFFFFFF
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        self.requests[rid] = _Request(
            rid,
            list(prompt_ids),
            params,
            seed,
            keep_logits,
            RequestMetrics(arrival_time=time.monotonic()),
            stop_ids=frozenset((*params.stop_token_ids, *eos)),
            key=next(self._keys),
        )

    def abort(self, rid: str) -> None:
        """Cancel a request: its pages are freed now; it ends with finish_reason "abort"."""
        req = self.requests.get(rid)
        if req is None or req.finish_reason is not None:
            return
        if rid in self.scheduler:
            self._finish_in_scheduler(rid)
        self._end(req, "abort")

    def has_unfinished(self) -> bool:
        return any(r.finish_reason is None for r in self.requests.values())

    def driving(self) -> AbstractContextManager[bool]:
        """Context for the thread that calls `step`: SCHED_BATCH inside it when the instances run in other
        processes and `driver_sched_batch` is on (nanocp/driver_policy.py); yields whether it switched."""
        elsewhere = getattr(self.cluster, "instances_in_other_processes", False)
        return batch_policy(self.config.driver_sched_batch and elsewhere)

    # ------------------------------------------------------------------ one iteration

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """One decode iteration (num_steps decode steps); returns the requests that ended in it. With overlapped
        iterations the tokens appended are those of the iteration sent in the previous step, collected after this
        step's iteration is sent."""
        plan = self.scheduler.step(self.config.num_steps)
        self.iterations += 1
        self.last_updated = []
        # lowered now: a request that ends in its prefill is still in this batch (an empty batch lowers nothing)
        rows = self._moe_rows(plan) if plan.batch else _MoeRows.none(self.spec.num_instances)
        overlapped = self._inflight is not None and self._can_overlap(plan, rows)
        if plan.admitted and self._inflight is not None:
            self.admissions_in_flight += 1
            self.overlapped_admissions += overlapped
        computed = None
        if self._inflight is not None and not overlapped and self._can_prefill_early(plan):
            computed = self._prefill_packed(plan.admitted)  # while the iteration in flight runs; written after it
            self.early_prefills += 1
        if self._inflight is not None and not overlapped and not self._collect():
            return self._take_done()  # the cluster failed and was rebuilt: the next step plans anew
        if not overlapped:
            self._apply_plan_ends(plan)
        if plan.admitted:
            self._prefill(plan.admitted, computed)
        launched = None
        if plan.batch:
            try:
                launched = self._launch(plan, rows)
            except InstanceFailure as e:
                self._inflight = None
                self._recover(e)
                return self._take_done()
        if self._inflight is not None and not self._collect():  # the previous iteration's, while this one runs
            return self._take_done()
        if overlapped:
            self._apply_plan_ends(plan)  # now that the requests it ends have their last tokens
        self._inflight = launched
        if launched is not None and (launched.launch is None or not self.has_unfinished()):
            self._collect()  # no overlap, or nothing left to overlap with
        return self._take_done()

    def _apply_plan_ends(self, plan: IterationPlan) -> None:
        """The requests the plan finished, rejected or preempted."""
        self._first_token_only([rid for rid in plan.finished if self._needs_first_token(rid)])
        for rid in plan.finished:
            self._on_scheduler_finished(rid)
        for rid in plan.rejected:
            self._end(self.requests[rid], "error", "the cluster can no longer hold this request")
        for rid in plan.preempted:
            self.requests[rid].metrics.preemptions += 1

    def _take_done(self) -> list[RequestOutput]:
        done, self._done = self._done, []
        return done

    def _moe_rows(self, plan: IterationPlan) -> _MoeRows:
        moe = [plan.moe(instance) for instance in range(self.spec.num_instances)]
        batch_indices, windows = [m[:, 0].tolist() for m in moe], [m[:, 3].tolist() for m in moe]
        batch = plan.batch
        rids = [[batch[b] for b in indices] for indices in batch_indices]
        moe_instance = {rid: instance for instance, instance_rids in enumerate(rids) for rid in instance_rids}
        window = {rid: w for instance_rids, ws in zip(rids, windows) for rid, w in zip(instance_rids, ws)}
        return _MoeRows(rids, batch_indices, windows, moe_instance, window)

    def _can_overlap(self, plan: IterationPlan, rows: _MoeRows) -> bool:
        """Whether `plan` may be sent before the iteration in flight returns. Decode growth is always safe, as each
        instance runs its iterations in order; an admission only when its prefill writes no page the iteration in
        flight may still touch (`_admission_is_safe`). A continuing request that moves to another MoE instance gets
        its kept token handed over (`_launch`)."""
        if not plan.batch:
            return False
        return not plan.admitted or (self._guards_admissions and self._admission_is_safe(plan))

    @property
    def _guards_admissions(self) -> bool:
        """Admitting plans may overlap the iteration in flight (then freed pages are recorded for the check)."""
        return self.overlaps and self.config.overlap_admissions

    def _admits_in_flight(self, plan: IterationPlan) -> bool:
        """Whether the plan admits a request of the iteration in flight (a recompute whose context lacks that
        iteration's tokens)."""
        return not set(self._inflight.batch).isdisjoint(adm.rid for adm in plan.admitted)

    def _admission_is_safe(self, plan: IterationPlan) -> bool:
        """Whether the plan's prefills may write their KV while the iteration in flight runs. That iteration reads
        and writes the pages of its batch; a request of it that has freed its pages since (it ended, was aborted
        or preempted) may have passed them to an admitted request (frees are reused first). Safe when no admitted
        request is in flight itself and no page an admitted request got is one of those: each such request's pages
        were recorded when it freed them (`_finish_in_scheduler`) or, for a length end the scheduler applies at
        this plan, when its last iteration was sent (`_record_last_pages`); a preemption's pages are not known, so
        it waits."""
        if self._admits_in_flight(plan):
            return False
        freed: set[tuple[int, int]] = set()
        for rid in set(self._inflight.batch).difference(plan.batch):
            if rid in self.scheduler and self.scheduler.request_state(rid).running:
                continue  # not batched this time but still holds its pages
            pages = self._released_pages.get(rid)
            if pages is None:
                return False
            freed |= pages
        return all(self._pages_of(adm.rid).isdisjoint(freed) for adm in plan.admitted)

    def _can_prefill_early(self, plan: IterationPlan) -> bool:
        """Whether an admitting plan that waits for the iteration in flight may compute its prefill before that
        iteration returns (and write the KV after): the driver's packed prefill (the CDSP tier writes as it
        computes), and no admitted request in flight (its context would lack that iteration's tokens)."""
        if not plan.admitted or not self._guards_admissions or self.prefill_tier is not None:
            return False
        return not self._admits_in_flight(plan)

    def _pages_of(self, rid: str) -> frozenset[tuple[int, int]]:
        """(instance, frame) of every page of a running request."""
        return frozenset((instance, f) for instance, _, frames in self.scheduler.shard_pages(rid) for f in frames)

    def _finish_in_scheduler(self, rid: str) -> None:
        """End a live request in the scheduler (its pages are freed now); with overlapped iterations, its pages are
        recorded first, for `_admission_is_safe`."""
        if self._guards_admissions and self.scheduler.request_state(rid).running:
            self._released_pages[rid] = self._pages_of(rid)
        self.scheduler.finish(rid)

    def _launch(self, plan: IterationPlan, moe_rows: _MoeRows) -> _InFlight:
        """The plan's routing tables and each MoE row's input to the cluster. A request whose tokens are still in
        flight gets KEPT_TOKEN: its MoE instance feeds it the token it sampled last, or, when the request moved,
        the instance that sampled it hands it over first (`Handoff`)."""
        batch, n = plan.batch, self.spec.num_instances
        pending = self._inflight.rows if self._inflight is not None else _MoeRows.none(n)
        handoffs: list[list[Handoff]] = [[] for _ in range(n)]
        rows = [self._row_batch(moe_rows, instance, pending, handoffs) for instance in range(n)]
        keep = any(self.requests[rid].keep_logits for rid in batch)
        inflight = _InFlight(list(batch), moe_rows, None)
        if self._guards_admissions:
            self._record_last_pages(batch, moe_rows, rows)
        if not getattr(self.cluster, "incremental_tables", False):  # a cluster that tracks no store state
            inflight.outputs = self.cluster.run_iteration(plan.full_tables(), rows, keep)
        elif self.overlaps:
            inflight.launch = self.cluster.launch(plan.tables, rows, keep, plan.full_tables, handoffs)
            self.overlapped_iterations += self._inflight is not None
        else:
            inflight.outputs = self.cluster.run_iteration(plan.tables, rows, keep, full_tables=plan.full_tables)
        return inflight

    def _row_batch(
        self, moe_rows: _MoeRows, instance: int, pending: _MoeRows, handoffs: list[list[Handoff]]
    ) -> RowBatch:
        """The inputs of the instance's MoE rows. A request with `pending` tokens (in flight) is fed KEPT_TOKEN; one
        that moved here gets its token handed over by the instance that sampled it, into the next row of this
        instance's handoff buffer (a Handoff appended to that instance's `handoffs`)."""
        rids = moe_rows.rids[instance]
        reqs = [self.requests[rid] for rid in rids]
        in_flight = [pending.window.get(rid, 0) for rid in rids]  # tokens each request has in flight
        moved: dict[int, tuple[int, int]] = {}  # row -> (instance that kept its token, row of the handoff buffer)
        moved_rows = [row for row, rid in enumerate(rids) if pending.moe_instance.get(rid, instance) != instance]
        for buffer_row, row in enumerate(moved_rows):
            before = pending.moe_instance[rids[row]]
            moved[row] = (before, buffer_row)
            handoffs[before].append(Handoff(reqs[row].key, instance, buffer_row))
        return RowBatch(
            moe_rows.batch_indices[instance],
            [KEPT_TOKEN if w else req.output[-1] for req, w in zip(reqs, in_flight)],
            [len(req.output) + w for req, w in zip(reqs, in_flight)],
            [req.seed for req in reqs],
            [req.key for req in reqs],
            [req.params for req in reqs],
            moved,
        )

    def _record_last_pages(self, batch: list[str], moe_rows: _MoeRows, rows: list[RowBatch]) -> None:
        """Keep the freed-page records of this batch's requests only (no other can touch a page while it runs), and
        record the pages of each request this iteration brings to max_tokens: the scheduler frees them at the next
        plan, while the iteration may still run."""
        if self._released_pages:
            in_batch = set(batch)
            self._released_pages = {rid: p for rid, p in self._released_pages.items() if rid in in_batch}
        ending = [
            rid
            for rids, windows, instance_rows in zip(moe_rows.rids, moe_rows.windows, rows)
            for rid, window, output_index in zip(rids, windows, instance_rows.output_indices)
            if output_index + window + 1 >= self.requests[rid].params.max_tokens
        ]
        for rid in ending:
            if rid in self.scheduler:
                self._released_pages[rid] = self._pages_of(rid)  # anew each time: this plan may have grown it

    def _collect(self) -> bool:
        """Append the tokens of the iteration in flight. False when the cluster failed: it is rebuilt (anything
        else in flight is dropped) and the requests resume from the tokens they have."""
        inflight, self._inflight = self._inflight, None
        if inflight.launch is not None:
            try:
                inflight.outputs = self.cluster.collect(inflight.launch)
            except InstanceFailure as e:
                self._recover(e)
                return False
        now = time.monotonic()
        for batch_index, token, logits in inflight.outputs.in_order():
            req = self.requests.get(inflight.batch[batch_index])
            if req is not None and req.finish_reason is None:  # tokens after a stop are dropped
                self._append(req, token, logits, now)
        return True

    def _context(self, adm: Admission) -> list[int]:
        """The tokens an admission prefills: the prompt, then any output a recompute rebuilds."""
        req = self.requests[adm.rid]
        return (req.prompt + req.output)[: adm.context_len]

    def _prefill_packed(self, admitted: list[Admission]) -> list[PrefillOutput]:
        """The driver's packed prefill of the admitted contexts: per request its KV and logits, nothing written."""
        contexts = [torch.tensor(self._context(a), dtype=torch.int64) for a in admitted]
        return prefill_packed(self.prefill_weights, contexts)

    def _prefill(self, admitted: list[Admission], computed: list[PrefillOutput] | None = None) -> None:
        """Compute the admitted contexts' KV (unless `computed` by `_prefill_packed` already) and write it into each
        request's shards, in the pages the scheduler chose (the MoE shard's last `window` slots stay for the tokens
        this iteration decodes); sample the first output token unless the request already has its next input token
        (recompute after preemption or a failure). With prefill instances configured, the CDSP tier computes the
        prompts with chunkwise dynamic SP and hands the KV straight to the decode pages; otherwise the driver
        prefills all prompts packed."""
        destinations = {}
        for adm in admitted:
            moe = self.scheduler.request_state(adm.rid).moe_instance
            shards = self.scheduler.shard_pages(adm.rid)
            window = sum(n_tokens for _, n_tokens, _ in shards) - adm.context_len  # slots reserved for decoding
            destinations[adm.rid] = KVDestination.from_shard_pages(shards, moe, window)
        if self.prefill_tier is not None:
            requests = [PrefillRequest(a.rid, self._context(a), destinations[a.rid], a.recompute) for a in admitted]
            last_logits = self.prefill_tier.prefill(requests, self.cluster)  # the KV is in the pages on return
        else:
            outs = computed if computed is not None else self._prefill_packed(admitted)
            last_logits = {}
            for adm, out in zip(admitted, outs):
                for w in destinations[adm.rid].writes(0, adm.context_len):
                    self.cluster.write_kv(w.instance, list(w.frames), w.start_slot, out.kv[:, w.row_lo : w.row_hi])
                last_logits[adm.rid] = out.logits[-1]
        fresh = []  # requests whose first output token this prefill samples
        for adm in admitted:
            req = self.requests[adm.rid]
            if adm.recompute or req.resume:  # KV rebuilt for a request that already has its next input token
                req.resume = False
            else:
                fresh.append(req)
        if not fresh:
            return
        self._append_first_tokens(fresh, torch.stack([last_logits[req.rid] for req in fresh]))

    def _append_first_tokens(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample each request's first output token from its prompt's last logits [n, vocab]."""
        tokens = sample_tokens(logits, [r.params for r in reqs], [0] * len(reqs), [r.seed for r in reqs])
        now = time.monotonic()
        for req, token, row in zip(reqs, tokens, logits):
            self._append(req, token, row.clone() if req.keep_logits else None, now)

    def _append(self, req: _Request, token: int, logits: torch.Tensor | None, now: float) -> None:
        metrics = req.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        req.output.append(token)
        self.last_updated.append(req.rid)
        if logits is not None:
            req.logits.append(logits)
        reason = self._stop_reason(req, token)
        if reason is not None:
            if req.rid in self.scheduler:
                self._finish_in_scheduler(req.rid)  # pages back now, not at the next iteration
            self._end(req, reason, req.error)

    def _stop_reason(self, req: _Request, token: int) -> str | None:
        p = req.params
        if token in req.stop_ids:
            return "stop"
        if p.stop:
            try:
                end = stop_string_end(self.tokenizer, req.output, p.stop)
            except Exception as e:  # tokenizer code (any type): its failure ends this request, never the batch
                req.error = undecodable(e)
                return "error"
            if end is not None:
                req.stop_text_end = end
                return "stop"
        if len(req.output) >= p.max_tokens:
            return "length"
        return None

    def _needs_first_token(self, rid: str) -> bool:
        req = self.requests.get(rid)
        return req is not None and req.finish_reason is None and not req.output

    def _first_token_only(self, rids: list[str]) -> None:
        """Requests the scheduler ended before they needed the decode cluster (max_tokens == 1): one packed prefill
        of all their prompts samples their only token; their KV is not kept."""
        if not rids:
            return
        reqs = [self.requests[rid] for rid in rids]
        outs = prefill_packed(self.prefill_weights, [torch.tensor(r.prompt, dtype=torch.int64) for r in reqs])
        self._append_first_tokens(reqs, torch.cat([out.logits for out in outs]))

    def _on_scheduler_finished(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is None:
            self._end(req, "length")

    def _end(self, req: _Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.monotonic()
        self._done.append(self.output_of(req.rid))

    # ------------------------------------------------------------------ views

    def output_of(self, rid: str) -> RequestOutput:
        """The request as it stands. Its text is the decoded output (an id without a token, from a padded
        vocabulary, adds no text and keeps its place in token_ids); an output the tokenizer cannot decode makes a
        finished request's finish_reason "error", with the reason, and no other request is touched."""
        req = self.requests[rid]
        ids = list(req.output)
        if req.finish_reason == "stop" and ids and ids[-1] in self.tokenizer.eos_token_ids:
            ids = ids[:-1]  # the EOS token is not part of the text
        reason, error = req.finish_reason, req.error
        try:
            text = self.tokenizer.decode(ids)
        except Exception as e:  # tokenizer code (any type): its failure is this request's only
            text, error = "", undecodable(e)
            reason = "error" if reason is not None else None
        if req.stop_text_end is not None:
            text = text[: req.stop_text_end]
        return RequestOutput(
            rid,
            req.prompt,
            list(req.output),
            text,
            req.finish_reason is not None,
            reason,
            req.metrics,
            list(req.logits) if req.keep_logits else None,
            error,
        )

    def release(self, rid: str) -> None:
        """Forget a finished request (the server calls this once the client has its answer)."""
        req = self.requests.get(rid)
        if req is not None and req.finish_reason is not None:
            del self.requests[rid]

    def timing_records(self) -> list[PhaseRecord]:
        return self.cluster.timing_records()

    def close(self) -> None:
        self.cluster.close()
        if self.prefill_tier is not None:
            self.prefill_tier.close()
