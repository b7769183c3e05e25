"""GlobalScheduler: the control plane's public API over the C++ core (or its Python reference).

    sched = GlobalScheduler(ClusterSpec(4, 8, kv_capacity_tokens=1_000_000, page_size=64), policy="nanocp")
    sched.add_request("r1", prompt_len=512_000, max_new_tokens=800)
    plan = sched.step()              # plan.bindings["r1"] -> (moe_instance, {instance: n_tokens, ...})
    sched.finish("r1"); sched.loads()

Both backends expose the same integer-handle core interface; this module maps request ids onto handles and wraps
each iteration's result in an `IterationPlan`. A plan is a view of the core's state at its iteration: its lazy
parts (batch, bindings, lowering) raise once the scheduler has stepped past it. `step(num_steps=k)` plans k decode
steps per request (multi-step). Lowering is stateful: `plan.tables` lists only block-table entries added since the
previous tables (lowered once per plan and cached); `plan.full_tables()` gives full snapshots of the same iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .cp_buckets import CPBucketTable
from .lowering import ExecShape, RoutingTables, moe_section, split_tables
from .reference import MAX_NUM_STEPS, RUNNING, ReferenceCore, parse_policy
from .spec import ClusterSpec, SchedulerError

BACKENDS = ("cpp", "python")


@dataclass(frozen=True)
class InstanceLoad:
    kv_tokens: int
    moe_batch: int
    shards: int
    free_pages: int


@dataclass(frozen=True)
class Admission:
    rid: str
    context_len: int  # tokens whose KV must be prefilled (or recomputed) before this iteration's decode
    recompute: bool  # re-admission after a preemption


@dataclass(frozen=True)
class RequestState:
    prompt_len: int
    max_new_tokens: int
    decode_steps: int
    running: bool
    moe_instance: int
    kv_split: dict[int, int]


class StalePlanError(RuntimeError):
    """A plan's lazy view was read after the scheduler moved on to a later iteration."""


def make_core(spec: ClusterSpec, policy: str, cp_buckets: CPBucketTable, max_batch: int, backend: str):
    if backend == "python":
        return ReferenceCore(spec, policy, cp_buckets, max_batch)
    if backend != "cpp":
        raise SchedulerError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    from . import _core

    name, arg = parse_policy(policy)
    if name == "uniform-cp" and spec.instances_per_node % arg != 0:
        raise SchedulerError(f"uniform-cp:{arg} needs a group size dividing instances_per_node")
    return _core.SchedulerCore(
        spec.num_nodes,
        spec.instances_per_node,
        spec.kv_capacity_tokens,
        spec.page_size,
        policy,
        list(cp_buckets.max_lens),
        list(cp_buckets.cps),
        max_batch,
    )


class IterationPlan:
    """One decode iteration's decisions (see docs/architecture.md, "IterationPlan")."""

    def __init__(self, sched: GlobalScheduler) -> None:
        core = sched.core
        self._sched = sched
        self.iteration: int = core.iteration
        names = sched._names
        self.admitted = [Admission(names[h], c, bool(r)) for h, c, r in core.last_admitted]
        self.finished = [names[h] for h in core.last_finished]
        self.preempted = [names[h] for h in core.last_preempted]
        self.rejected = [names[h] for h in core.last_rejected]
        self._full_tables: list[np.ndarray] | None = None

    def _live_core(self):
        if self._sched.core.iteration != self.iteration:
            raise StalePlanError(f"plan of iteration {self.iteration} read after a later step()")
        return self._sched.core

    @cached_property
    def batch_handles(self) -> np.ndarray:
        return np.asarray(self._live_core().batch_handles(), dtype=np.int64)

    @cached_property
    def batch(self) -> list[str]:
        names = self._sched._names
        return [names[h] for h in self.batch_handles.tolist()]

    @cached_property
    def bindings(self) -> dict[str, tuple[int, dict[int, int]]]:
        core, names = self._live_core(), self._sched._names
        out = {}
        for h in self.batch_handles:
            moe, shards = core.binding(int(h))
            out[names[int(h)]] = (moe, dict(shards))
        return out

    @cached_property
    def tables(self) -> list[np.ndarray]:
        """Per instance, the lowered int32 routing table (layout in lowering.py) with incremental block tables:
        each lists the frames added since the previous table lowered for its instance."""
        return split_tables(*self._live_core().lower_packed())

    def full_tables(self) -> list[np.ndarray]:
        """Per instance, the same routing table as `tables` with a full block-table snapshot (for a fresh or
        restarted instance, or one whose store missed a table). `tables` is lowered first, so the incremental
        tables keep building on the previous iteration's."""
        if self._full_tables is None:
            self.tables  # noqa: B018 - lowered first (cached): it advances the incremental state
            self._full_tables = split_tables(*self._live_core().lower_packed(True))
        return self._full_tables

    def moe(self, instance: int) -> np.ndarray:
        """The instance's MoE rows [n_moe, 4] (layout in lowering.py): those of `routing(instance).moe`, read alone."""
        return moe_section(self.tables[instance])

    def routing(self, instance: int) -> RoutingTables:
        return RoutingTables.parse(self.tables[instance])

    def shape(self, instance: int) -> ExecShape:
        return self.routing(instance).shape

    @cached_property
    def cp_remote_shards(self) -> int:
        """(request, remote shard) pairs: queries routed to another instance this iteration."""
        return sum(len(self.routing(i).q_recv) for i in range(len(self.tables)))


class GlobalScheduler:
    def __init__(
        self,
        spec: ClusterSpec,
        policy: str = "nanocp",
        *,
        cp_buckets: CPBucketTable | None = None,
        max_batch_per_instance: int = 0,
        backend: str = "cpp",
    ) -> None:
        if not isinstance(spec, ClusterSpec):
            raise SchedulerError(f"spec must be a ClusterSpec, got {type(spec).__name__}")
        self.spec = spec
        self.policy = policy
        self.backend = backend
        self.cp_buckets = cp_buckets or CPBucketTable.load()
        self.core = make_core(spec, policy, self.cp_buckets, max_batch_per_instance, backend)
        self._handles: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_handle = 0
        self._reported: set[int] = set()  # handles whose end was reported in the last plan: forget them next step

    # -------------------------------------------------------------- requests

    def add_request(self, rid: str, prompt_len: int, max_new_tokens: int) -> None:
        if not isinstance(rid, str) or not rid:
            raise SchedulerError(f"request id must be a non-empty str, got {rid!r}")
        if rid in self._handles:
            raise SchedulerError(f"duplicate request id {rid!r}")
        for name, value in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise SchedulerError(f"request {rid!r}: {name} must be an int, got {value!r}")
        handle = self._next_handle
        try:
            self.core.add_request(handle, int(prompt_len), int(max_new_tokens))
        except ValueError as e:
            raise SchedulerError(str(e).replace(f"request {handle}", f"request {rid!r}")) from None
        self._next_handle += 1
        self._handles[rid] = handle
        self._names[handle] = rid

    def finish(self, rid: str) -> None:
        """End a request now (EOS, stop string, cancel): its pages are freed; it is listed in the next plan."""
        handle = self._live_handle(rid)
        self.core.finish(handle)
        del self._handles[rid]  # the id is free again; the next plan still reports it as finished

    def step(self, num_steps: int = 1) -> IterationPlan:
        """Plan the next iteration. With num_steps = k > 1 the plan covers up to k decode steps per request
        (multi-step execution): KV for them is reserved up front; see IterationPlan / the lowering's `window`."""
        if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool):
            raise SchedulerError(f"num_steps must be an int, got {num_steps!r}")
        if not 1 <= num_steps <= MAX_NUM_STEPS:
            raise SchedulerError(f"num_steps must be between 1 and {MAX_NUM_STEPS}, got {num_steps}")
        for handle in self._reported:
            rid = self._names.pop(handle)
            if self._handles.get(rid) == handle:
                del self._handles[rid]
        self.core.step(int(num_steps))
        plan = IterationPlan(self)
        self._reported = set(self.core.last_finished) | set(self.core.last_rejected)
        return plan

    # -------------------------------------------------------------- state

    def __contains__(self, rid: str) -> bool:
        """Is `rid` waiting or running (not yet finished)?"""
        handle = self._handles.get(rid)
        return handle is not None and handle not in self._reported

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting()

    @property
    def num_running(self) -> int:
        return len(self.core.batch_handles())

    def loads(self) -> list[InstanceLoad]:
        return [InstanceLoad(*row) for row in zip(*self.core.loads())]

    def _live_handle(self, rid: str) -> int:
        if rid not in self:
            raise SchedulerError(f"unknown or finished request id {rid!r}")
        return self._handles[rid]

    def request_state(self, rid: str) -> RequestState:
        handle = self._live_handle(rid)
        prompt_len, max_new, steps, status, moe = self.core.request_info(handle)
        split = dict(self.core.binding(handle)[1]) if status == RUNNING else {}
        return RequestState(prompt_len, max_new, steps, status == RUNNING, moe, split)

    def shard_pages(self, rid: str) -> list[tuple[int, int, list[int]]]:
        """(instance, n_tokens, frames) per shard of a running request, in binding order."""
        return self.core.shard_pages(self._live_handle(rid))

    def check_invariants(self) -> None:
        self.core.check_invariants()
