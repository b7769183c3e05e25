"""Plain-Python reference of the control-plane core: request state, page table use, policies, growth.

This is the readable statement of the algorithm. The C++ core (csrc/scheduler.cpp) implements exactly the same
decisions, and tests drive both with random workloads and require them to agree step for step. Requests are
integer handles here; `GlobalScheduler` maps string ids onto them.

One call of `step(num_steps=k)` is one decode iteration (k decode steps with multi-step execution):
  1. finish requests that have done all their decode iterations (pages freed);
  2. the policy rebalances MoE bindings of running requests (nanocp only);
  3. every running request reserves KV for its window w = max(1, min(k, decode steps it has left)) tokens on its
     MoE instance (growth; may move the binding or preempt);
  4. waiting requests are placed in queue order, with a full window if it fits, else a window of one; a request
     that does not fit waits, later ones may still go;
  5. every request in the batch counts its window's decode steps.

Every shard holds a slot of its instance's block-table store from creation until its request ends; lowering lists
only the frames added since the last table lowered for each instance (see lowering.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cp_buckets import CPBucketTable
from .lowering import EMPTY_STORE, ShardInput, lower_reference, pack_tables
from .page_table import GlobalPageTable
from .spec import ClusterSpec, SchedulerError
from .waterfill import waterfill

WAITING, RUNNING, FINISHED = 0, 1, 2
POLICIES = ("nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp", "medha", "csps")
CSPS_DEFAULT_PARTITION = 65536  # CSPS's sequence-partition length without TP (its paper, Sec. 4.2)
MAX_NUM_STEPS = 2**31 - 1  # num_steps travels in the int32 routing-table header


@dataclass
class Shard:
    instance: int
    slot: int = -1  # row of the instance's block-table store (handed out at the end of the step creating it)
    tokens: int = 0
    pages: list[int] = field(default_factory=list)  # logical page ids in token order
    emitted: int = 0  # pages already listed in a table lowered for this instance


@dataclass
class SlotAllocator:
    """Block-table store slots of one instance: the most recently freed slot first, else the lowest never used.

    Slots are handed out at the end of a step, after its releases, so slot numbers stay below the largest number
    of shards the instance held at the end of a step (its routing tables' shard rows)."""

    free: list[int] = field(default_factory=list)  # freed slots, the next to reuse at the back
    high: int = 0  # slots 0..high-1 have been handed out at least once

    def alloc(self) -> int:
        if self.free:
            return self.free.pop()
        self.high += 1
        return self.high - 1

    def release(self, slot: int) -> None:
        self.free.append(slot)


@dataclass
class Request:
    handle: int
    prompt_len: int
    max_new_tokens: int
    decode_steps: int = 0  # decode iterations done (the first output token comes from prefill)
    status: int = WAITING
    admit_seq: int = -1  # order of (re-)admission; the largest is "most recently admitted"
    moe: int = -1
    window: int = 1  # decode steps this iteration (KV reserved for them on the MoE instance)
    shards: list[Shard] = field(default_factory=list)  # KV binding, in binding order

    @property
    def context_len(self) -> int:
        return sum(s.tokens for s in self.shards)

    def shard_on(self, instance: int) -> Shard | None:
        for s in self.shards:
            if s.instance == instance:
                return s
        return None


def parse_policy(policy: str) -> tuple[str, int]:
    """'uniform-cp:4' -> ('uniform-cp', 4); 'medha:N' -> N tokens per KV group; 'csps[:S]' -> partition length S."""
    name, _, arg = policy.partition(":")
    if name not in POLICIES:
        raise SchedulerError(
            f"unknown policy {policy!r}; choose one of nanocp, least-batch, least-cache, round-robin, uniform-cp:K, "
            "medha:N, csps[:S]"
        )
    if name in ("uniform-cp", "medha") or (name == "csps" and arg):
        if not arg.isdigit() or int(arg) < 1:
            example = {"uniform-cp": "uniform-cp:4", "medha": "medha:65536", "csps": "csps:65536"}[name]
            raise SchedulerError(f"policy {policy!r} needs a positive integer argument, e.g. {example}")
        return name, int(arg)
    if arg:
        raise SchedulerError(f"policy {name!r} takes no argument, got {policy!r}")
    return name, CSPS_DEFAULT_PARTITION if name == "csps" else 0


class ReferenceCore:
    def __init__(
        self,
        spec: ClusterSpec,
        policy: str = "nanocp",
        cp_buckets: CPBucketTable | None = None,
        max_batch_per_instance: int = 0,
    ) -> None:
        self.spec = spec
        self.policy, self.policy_arg = parse_policy(policy)
        if self.policy == "uniform-cp" and spec.instances_per_node % self.policy_arg != 0:
            raise SchedulerError(
                f"uniform-cp:{self.policy_arg} needs a group size dividing instances_per_node "
                f"({spec.instances_per_node})"
            )
        room = spec.frames_per_instance * spec.page_size - 1
        if self.policy == "medha" and self.policy_arg > room:
            raise SchedulerError(
                f"medha:{self.policy_arg}: a KV group must fit one instance ({room} tokens plus the new one)"
            )
        if max_batch_per_instance < 0:
            raise SchedulerError(f"max_batch_per_instance must be >= 0 (0 = unbounded), got {max_batch_per_instance}")
        self.cp_buckets = cp_buckets or CPBucketTable.load()
        self.max_batch = max_batch_per_instance
        n = spec.num_instances
        self.pages = GlobalPageTable(spec)
        self.kv_tokens = [0] * n
        self.moe_batch = [0] * n
        self.num_shards = [0] * n
        self.slots = [SlotAllocator() for _ in range(n)]
        self.lowered_seq = [EMPTY_STORE] * n  # per instance: iteration of the last table lowered for it
        self._unslotted: list[tuple[Request, Shard]] = []  # shards created in this step, in creation order
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []  # handles in queue order
        self.running: list[int] = []  # handles in batch order (admission order)
        self.iteration = -1  # index of the last planned iteration
        self.num_steps = 1  # decode steps the last plan covers (multi-step execution)
        self.rr_cursor = 0
        self._admit_counter = 0
        self._finished_pending: list[int] = []
        self.last_admitted: list[tuple[int, int, bool]] = []  # (handle, context_len, recompute)
        self.last_finished: list[int] = []
        self.last_preempted: list[int] = []
        self.last_rejected: list[int] = []  # preempted requests that grew past what the policy can ever re-admit

    # ---------------------------------------------------------------- requests in and out

    def max_context(self) -> int:
        """Largest context a request can ever be admitted with under this policy (on an empty cluster)."""
        room = self.spec.frames_per_instance * self.spec.page_size - 1  # one slot kept for the new token
        if self.policy in ("nanocp", "csps"):
            return self.spec.instances_per_node * room
        if self.policy == "uniform-cp":
            return self.policy_arg * room
        if self.policy == "medha":
            return self.spec.num_instances * self.policy_arg - 1
        return room

    def add_request(self, handle: int, prompt_len: int, max_new_tokens: int) -> None:
        if handle in self.requests:
            raise SchedulerError(f"request {handle} already exists")
        if prompt_len < 1 or max_new_tokens < 1:
            raise SchedulerError(f"request {handle}: prompt_len and max_new_tokens must be >= 1")
        longest = prompt_len + max_new_tokens - 1
        cluster = self.spec.num_instances * self.spec.frames_per_instance * self.spec.page_size
        if longest > cluster:
            raise SchedulerError(f"request {handle} needs {longest} tokens of KV, the whole cluster holds {cluster}")
        if prompt_len > self.max_context():
            raise SchedulerError(
                f"request {handle}: prompt of {prompt_len} tokens can never be admitted under policy "
                f"{self.policy} (at most {self.max_context()})"
            )
        self.requests[handle] = Request(handle, prompt_len, max_new_tokens)
        self.waiting.append(handle)

    def finish(self, handle: int) -> None:
        req = self.requests.get(handle)
        if req is None:
            raise SchedulerError(f"unknown request {handle}")
        if req.status == RUNNING:
            self._release(req)
            self.running.remove(handle)
        else:
            self.waiting.remove(handle)
        del self.requests[handle]
        self._finished_pending.append(handle)

    # ---------------------------------------------------------------- one iteration

    def step(self, num_steps: int = 1) -> None:
        """Plan one iteration that the data plane may run for up to `num_steps` decode steps (multi-step): each
        request reserves KV for min(num_steps, decode iterations it has left) tokens up front (its window)."""
        if not 1 <= num_steps <= MAX_NUM_STEPS:
            raise SchedulerError(f"num_steps must be between 1 and {MAX_NUM_STEPS}, got {num_steps}")
        self.num_steps = num_steps
        self.iteration += 1
        self.last_admitted, self.last_preempted, self.last_rejected = [], [], []
        self._finish_completed()
        self.last_finished, self._finished_pending = self._finished_pending, []
        if self.policy == "nanocp":
            self._rebalance_moe()
        for handle in list(self.running):
            req = self.requests[handle]
            if req.status == RUNNING:
                self._grow(req, self._window(req))
        self._admit_waiting()
        self._assign_slots()
        for handle in self.running:
            self.requests[handle].decode_steps += self.requests[handle].window

    def _finish_completed(self) -> None:
        done = [h for h in self.running if self.requests[h].decode_steps >= self.requests[h].max_new_tokens - 1]
        # Requests that need no decode iteration at all (max_new_tokens == 1) finish from the queue.
        done_waiting = [h for h in self.waiting if self.requests[h].max_new_tokens == 1]
        for handle in done + done_waiting:
            self.finish(handle)

    # ---------------------------------------------------------------- NanoCP Alg. 1 (1): MoE rebalancing

    def _rebalance_moe(self) -> None:
        # Fewest options first (ascending KV-binding size), ties in batch order.
        order = sorted(self.running, key=lambda h: len(self.requests[h].shards))
        for handle in order:
            req = self.requests[handle]
            if len(req.shards) < 2:
                continue
            self.moe_batch[req.moe] -= 1
            best = req.moe
            for shard in req.shards:
                i = shard.instance
                if (self.moe_batch[i], i != req.moe, i) < (self.moe_batch[best], best != req.moe, best):
                    best = i
            req.moe = best
            self.moe_batch[best] += 1

    # ---------------------------------------------------------------- growth by one token

    def _window(self, req: Request) -> int:
        """Tokens a request decodes in this iteration: num_steps, or fewer when it has fewer left."""
        return max(1, min(self.num_steps, req.max_new_tokens - 1 - req.decode_steps))

    def _has_room(self, req: Request, instance: int, n: int) -> bool:
        """Can `instance` take n more tokens of this request (the free tail of its shard there plus free pages)?"""
        shard = req.shard_on(instance)
        page = self.spec.page_size
        tail_free = (-shard.tokens) % page if shard is not None else 0
        return tail_free + self.pages.free_frames(instance) * page >= n

    def _batch_open(self, instance: int) -> bool:
        """Can one more request's MoE binding move to `instance` (max_batch_per_instance, 0 = unbounded)?"""
        return not self.max_batch or self.moe_batch[instance] < self.max_batch

    def _least_kv(self, candidates) -> int:
        best = -1
        for i in candidates:
            if best < 0 or (self.kv_tokens[i], i) < (self.kv_tokens[best], best):
                best = i
        return best

    def _growth_target(self, req: Request, n: int) -> int:
        """Where the n new tokens go: the MoE instance, else a binding member, else the node, else anywhere.

        Medha: once the tail shard would pass N tokens, the request gains a new instance (not yet in its binding)."""
        if self.policy == "medha" and req.shard_on(req.moe).tokens + n > self.policy_arg:
            members = {s.instance for s in req.shards}
            node = self.spec.node_instances(self.spec.node_of(req.moe))
            for tier in (node, range(self.spec.num_instances)):
                fresh = [i for i in tier if i not in members and self._has_room(req, i, n) and self._batch_open(i)]
                target = self._least_kv(fresh)
                if target >= 0:
                    return target
            return -1
        if self._has_room(req, req.moe, n):
            return req.moe
        tiers = (
            [s.instance for s in req.shards],
            list(self.spec.node_instances(self.spec.node_of(req.moe))),
            list(range(self.spec.num_instances)),
        )
        for tier in tiers:
            target = self._least_kv([i for i in tier if self._has_room(req, i, n) and self._batch_open(i)])
            if target >= 0:
                return target
        return -1

    def _grow(self, req: Request, n: int) -> None:
        while True:
            target = self._growth_target(req, n)
            if target >= 0:
                break
            victim = max(self.running, key=lambda h: self.requests[h].admit_seq)
            self._preempt(self.requests[victim])
            if victim == req.handle:
                return
        if target != req.moe:
            self.moe_batch[req.moe] -= 1
            self.moe_batch[target] += 1
            req.moe = target
        shard = req.shard_on(target) or self._new_shard(req, target)
        self._add_tokens(shard, n)
        req.window = n

    def _new_shard(self, req: Request, instance: int) -> Shard:
        shard = Shard(instance)
        req.shards.append(shard)
        self.num_shards[instance] += 1
        self._unslotted.append((req, shard))
        return shard

    def _assign_slots(self) -> None:
        """Slots for the shards this step created and kept (a request preempted in a step is not re-admitted in it)."""
        for req, shard in self._unslotted:
            if req.status == RUNNING:
                shard.slot = self.slots[shard.instance].alloc()
        self._unslotted = []

    def _add_tokens(self, shard: Shard, n: int) -> None:
        page = self.spec.page_size
        need = -(-(shard.tokens + n) // page) - (-(-shard.tokens // page))
        shard.pages.extend(self.pages.alloc(shard.instance, need))
        shard.tokens += n
        self.kv_tokens[shard.instance] += n

    def _release(self, req: Request) -> None:
        for shard in req.shards:
            self.pages.free(shard.pages)
            if shard.slot >= 0:
                self.slots[shard.instance].release(shard.slot)
            self.kv_tokens[shard.instance] -= shard.tokens
            self.num_shards[shard.instance] -= 1
        self.moe_batch[req.moe] -= 1
        req.shards, req.moe = [], -1

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = WAITING
        self.running.remove(req.handle)
        self.waiting.insert(0, req.handle)
        self.last_preempted.append(req.handle)

    # ---------------------------------------------------------------- admission

    def _admit_waiting(self) -> None:
        preempted_now = set(self.last_preempted)
        still_waiting = []
        for handle in self.waiting:
            req = self.requests[handle]
            context = req.prompt_len + req.decode_steps
            if context > self.max_context():
                del self.requests[handle]
                self.last_rejected.append(handle)
                continue
            window = self._window(req)
            placement = None
            if handle not in preempted_now:
                # A full window first; a window of one always fits an empty cluster (max_context), so never stall.
                placement = self._place(context, window) or (window > 1 and self._place(context, 1)) or None
            if placement is None:
                still_waiting.append(handle)
            else:
                self._commit(req, *placement)
        self.waiting = still_waiting

    def _can_allocate(self, moe: int, split: dict[int, int]) -> bool:
        if not self._batch_open(moe):
            return False
        page = self.spec.page_size
        return all(-(-n // page) <= self.pages.free_frames(i) for i, n in split.items())

    def _place(self, context: int, window: int) -> tuple[int, dict[int, int], int] | None:
        """Policy decision for a request with `context` tokens: (moe instance, {instance: tokens}, window) or None.

        The split includes the iteration's `window` new tokens on the MoE instance.
        """
        if self.policy == "nanocp":
            placed = self._place_nanocp(context, window)
        elif self.policy == "uniform-cp":
            placed = self._place_uniform(context, window)
        elif self.policy == "medha":
            placed = self._place_medha(context, window)
        elif self.policy == "csps":
            placed = self._place_csps(context, window)
        else:
            placed = self._place_single(context, window)
        return None if placed is None else (*placed, window)

    def _place_single(self, context: int, window: int) -> tuple[int, dict[int, int]] | None:
        """CP = 1 baselines: least-batch, least-cache, round-robin."""
        n = self.spec.num_instances
        if self.policy == "least-batch":
            # vLLM's DP balancing looks at the batch only; SGLang-style least-cache at KV only.
            target = min(range(n), key=lambda i: (self.moe_batch[i], i))
        elif self.policy == "least-cache":
            target = min(range(n), key=lambda i: (self.kv_tokens[i], i))
        else:  # round-robin
            target = self.rr_cursor
        split = {target: context + window}
        if not self._can_allocate(target, split):
            return None
        if self.policy == "round-robin":
            self.rr_cursor = (self.rr_cursor + 1) % n
        return target, split

    def _node_owned(self, node: int) -> int:
        return sum(self.moe_batch[i] for i in self.spec.node_instances(node))

    def _place_nanocp(self, context: int, window: int) -> tuple[int, dict[int, int]] | None:
        # The bucket's degree, raised to the least degree whose even split fits an instance (else it never fits).
        room = self.spec.frames_per_instance * self.spec.page_size - 1
        cp = min(max(self.cp_buckets.lookup(context), -(-context // room)), self.spec.instances_per_node)
        nodes = sorted(range(self.spec.num_nodes), key=lambda d: (self._node_owned(d), d))
        # The node with the fewest owned requests first; if it cannot hold the request, the next one.
        for node in nodes:
            members = list(self.spec.node_instances(node))
            moe = min(members, key=lambda i: (self.moe_batch[i], self.kv_tokens[i], i))
            others = sorted((i for i in members if i != moe), key=lambda i: (self.kv_tokens[i], i))[: cp - 1]
            participants = [moe, *others]
            tokens = waterfill([self.kv_tokens[i] for i in participants], context)
            split = {i: t for i, t in zip(participants, tokens) if t > 0 or i == moe}
            split[moe] += window
            if self._can_allocate(moe, split):
                return moe, split
        return None

    def _place_uniform(self, context: int, window: int) -> tuple[int, dict[int, int]] | None:
        k = self.policy_arg
        groups = range(self.spec.num_instances // k)

        def group_key(g: int) -> tuple[int, int, int]:
            members = range(g * k, (g + 1) * k)
            return (sum(self.moe_batch[i] for i in members), sum(self.kv_tokens[i] for i in members), g)

        group = min(groups, key=group_key)
        members = list(range(group * k, (group + 1) * k))
        moe = min(members, key=lambda i: (self.moe_batch[i], self.kv_tokens[i], i))
        base, extra = divmod(context, k)
        split = {i: base + (1 if j < extra else 0) for j, i in enumerate(members)}
        split[moe] += window
        split = {i: t for i, t in split.items() if t > 0}
        if not self._can_allocate(moe, split):
            return None
        return moe, split

    def _place_medha(self, context: int, window: int) -> tuple[int, dict[int, int]] | None:
        """Medha's KV parallelism: groups of N tokens on the least-loaded instances; every group but the last is
        full; the last one takes the rest, the new token and the MoE binding."""
        n_groups = context // self.policy_arg + 1
        if n_groups > self.spec.num_instances:
            return None
        members = sorted(range(self.spec.num_instances), key=lambda i: (self.kv_tokens[i], i))[:n_groups]
        split = {i: self.policy_arg for i in members[:-1]}
        moe = members[-1]
        split[moe] = context - self.policy_arg * (n_groups - 1) + window
        return (moe, split) if self._can_allocate(moe, split) else None

    def _place_csps(self, context: int, window: int) -> tuple[int, dict[int, int]] | None:
        """CSPS's SP decode: a request longer than the partition length S is split into ceil(L/S) near-equal
        contiguous partitions on the least-loaded instances of the node with the least KV, next to short requests;
        the last partition holds the MoE binding and the new tokens. Short requests (up to S tokens and what one
        instance holds) go whole to the instance with the fewest running requests."""
        room = self.spec.frames_per_instance * self.spec.page_size - 1
        if context <= min(self.policy_arg, room):
            target = min(range(self.spec.num_instances), key=lambda i: (self.moe_batch[i], self.kv_tokens[i], i))
            split = {target: context + window}
            return (target, split) if self._can_allocate(target, split) else None
        parts = min(max(-(-context // self.policy_arg), -(-context // room)), self.spec.instances_per_node)
        node = min(
            range(self.spec.num_nodes),
            key=lambda d: (sum(self.kv_tokens[i] for i in self.spec.node_instances(d)), d),
        )
        members = sorted(self.spec.node_instances(node), key=lambda i: (self.kv_tokens[i], i))[:parts]
        base, extra = divmod(context, parts)
        split = {i: base + (1 if j < extra else 0) for j, i in enumerate(members)}
        moe = members[-1]
        split[moe] += window
        return (moe, split) if self._can_allocate(moe, split) else None

    def _commit(self, req: Request, moe: int, split: dict[int, int], window: int) -> None:
        recompute = req.decode_steps > 0
        order = [moe] + [i for i in split if i != moe]
        for i in order:
            self._add_tokens(self._new_shard(req, i), split[i])
        req.moe = moe
        self.moe_batch[moe] += 1
        req.status = RUNNING
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.running.append(req.handle)
        req.window = window
        self.last_admitted.append((req.handle, req.context_len - window, recompute))

    # ---------------------------------------------------------------- views used by tests and the facade

    def batch_handles(self) -> list[int]:
        return list(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def loads(self) -> tuple[list[int], list[int], list[int], list[int]]:
        free = [self.pages.free_frames(i) for i in range(self.spec.num_instances)]
        return list(self.kv_tokens), list(self.moe_batch), list(self.num_shards), free

    def request_info(self, handle: int) -> tuple[int, int, int, int, int]:
        """(prompt_len, max_new_tokens, decode_steps, status, moe_instance)"""
        req = self.requests[handle]
        return req.prompt_len, req.max_new_tokens, req.decode_steps, req.status, req.moe

    def lower_all(self, full: bool = False) -> list[np.ndarray]:
        """Every instance's routing table of the current iteration: incremental block tables (the frames added
        since the last table lowered for the instance), or full snapshots. Either marks the frames as listed."""
        return self._lower(range(self.spec.num_instances), full)

    def lower_packed(self, full: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """lower_all's tables back to back in one int32 array, with their int64 offsets [n + 1]."""
        return pack_tables(self.lower_all(full))

    def lower(self, instance: int, full: bool = False) -> np.ndarray:
        """One instance's routing table (only its frames are marked as listed)."""
        if not 0 <= instance < self.spec.num_instances:
            raise IndexError(f"instance {instance} out of range [0, {self.spec.num_instances})")
        return self._lower([instance], full)[instance]

    def _lower(self, instances, full: bool) -> list[np.ndarray]:
        page_frame = self.pages.page_frame
        batch = []
        for handle in self.running:
            req = self.requests[handle]
            shards = [
                ShardInput(s.instance, s.tokens, s.slot, [page_frame[p] for p in s.pages], s.emitted)
                for s in req.shards
            ]
            batch.append((req.moe, req.context_len, req.window, shards))
        tables = lower_reference(self.spec.num_instances, self.iteration, self.num_steps, batch, self.lowered_seq, full)
        chosen = set(instances)
        for handle in self.running:
            for s in self.requests[handle].shards:
                if s.instance in chosen:
                    s.emitted = len(s.pages)
        for i in chosen:
            self.lowered_seq[i] = self.iteration
        return tables

    def binding(self, handle: int) -> tuple[int, list[tuple[int, int]]]:
        req = self.requests[handle]
        return req.moe, [(s.instance, s.tokens) for s in req.shards]

    def shard_pages(self, handle: int) -> list[tuple[int, int, list[int]]]:
        """(instance, tokens, frames in token order) per shard of a running request."""
        req = self.requests[handle]
        return [(s.instance, s.tokens, [self.pages.page_frame[p] for p in s.pages]) for s in req.shards]

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken (used by tests)."""
        n = self.spec.num_instances
        kv, batch, shards, used = [0] * n, [0] * n, [0] * n, [0] * n
        seen_pages: set[int] = set()
        page = self.spec.page_size
        slots_used: list[list[int]] = [[] for _ in range(n)]
        for handle in self.running:
            req = self.requests[handle]
            assert req.status == RUNNING
            assert req.shard_on(req.moe) is not None, "MoE instance must hold a shard"
            batch[req.moe] += 1
            for s in req.shards:
                assert s.tokens > 0 and len(s.pages) == -(-s.tokens // page)
                assert 0 <= s.emitted <= len(s.pages)
                slots_used[s.instance].append(s.slot)
                kv[s.instance] += s.tokens
                shards[s.instance] += 1
                for p in s.pages:
                    assert p not in seen_pages, f"page {p} owned twice"
                    seen_pages.add(p)
                    assert self.pages.page_instance[p] == s.instance
                    used[s.instance] += 1
        assert kv == self.kv_tokens and batch == self.moe_batch and shards == self.num_shards
        for i in range(n):
            assert used[i] + self.pages.free_frames(i) == self.spec.frames_per_instance
            alloc = self.slots[i]
            assert sorted(slots_used[i] + alloc.free) == list(range(alloc.high)), f"slots of instance {i}"
        assert self.pages.used_pages() == len(seen_pages)
        assert set(self.waiting) | set(self.running) == set(self.requests)
        assert not set(self.waiting) & set(self.running)
