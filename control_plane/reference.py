"""Plain-Python reference of the control-plane core: request state, page table use, policies, growth.

This is the readable statement of the algorithm. The C++ core (csrc/scheduler.cpp) implements exactly the same
decisions, and tests drive both with random workloads and require them to agree step for step. Requests are
integer handles here; `GlobalScheduler` maps string ids onto them.

One call of `step()` is one decode iteration:
  1. finish requests that have done all their decode iterations (pages freed);
  2. the policy rebalances MoE bindings of running requests (nanocp only);
  3. every running request gains one token of KV on its MoE instance (growth; may move the binding or preempt);
  4. waiting requests are placed in queue order; a request that does not fit waits, later ones may still go;
  5. every request in the batch counts one decode iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .cp_buckets import CPBucketTable
from .lowering import lower_reference
from .page_table import GlobalPageTable
from .spec import ClusterSpec, SchedulerError
from .waterfill import waterfill

WAITING, RUNNING, FINISHED = 0, 1, 2
POLICIES = ("nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp", "medha", "csps")
CSPS_DEFAULT_PARTITION = 65536  # CSPS's sequence-partition length without TP (its paper, Sec. 4.2)


@dataclass
class Shard:
    instance: int
    tokens: int = 0
    pages: list[int] = field(default_factory=list)  # logical page ids in token order


@dataclass
class Request:
    handle: int
    prompt_len: int
    max_new_tokens: int
    decode_steps: int = 0  # decode iterations done (the first output token comes from prefill)
    status: int = WAITING
    admit_seq: int = -1  # order of (re-)admission; the largest is "most recently admitted"
    moe: int = -1
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
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []  # handles in queue order
        self.running: list[int] = []  # handles in batch order (admission order)
        self.iteration = -1  # index of the last planned iteration
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

    def step(self) -> None:
        self.iteration += 1
        self.last_admitted, self.last_preempted, self.last_rejected = [], [], []
        self._finish_completed()
        self.last_finished, self._finished_pending = self._finished_pending, []
        if self.policy == "nanocp":
            self._rebalance_moe()
        for handle in list(self.running):
            req = self.requests[handle]
            if req.status == RUNNING:
                self._grow(req)
        self._admit_waiting()
        for handle in self.running:
            self.requests[handle].decode_steps += 1

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

    def _has_room(self, req: Request, instance: int) -> bool:
        shard = req.shard_on(instance)
        if shard is not None and shard.tokens % self.spec.page_size != 0:
            return True
        return self.pages.free_frames(instance) > 0

    def _batch_open(self, instance: int) -> bool:
        """Can one more request's MoE binding move to `instance` (max_batch_per_instance, 0 = unbounded)?"""
        return not self.max_batch or self.moe_batch[instance] < self.max_batch

    def _least_kv(self, candidates) -> int:
        best = -1
        for i in candidates:
            if best < 0 or (self.kv_tokens[i], i) < (self.kv_tokens[best], best):
                best = i
        return best

    def _growth_target(self, req: Request) -> int:
        """Where the new token goes: the MoE instance, else a binding member, else the node, else anywhere.

        Medha: once the tail shard holds N tokens, the request gains a new instance (not yet in its binding)."""
        if self.policy == "medha" and req.shard_on(req.moe).tokens >= self.policy_arg:
            members = {s.instance for s in req.shards}
            node = self.spec.node_instances(self.spec.node_of(req.moe))
            for tier in (node, range(self.spec.num_instances)):
                fresh = [i for i in tier if i not in members and self.pages.free_frames(i) > 0 and self._batch_open(i)]
                target = self._least_kv(fresh)
                if target >= 0:
                    return target
            return -1
        if self._has_room(req, req.moe):
            return req.moe
        tiers = (
            [s.instance for s in req.shards],
            list(self.spec.node_instances(self.spec.node_of(req.moe))),
            list(range(self.spec.num_instances)),
        )
        for tier in tiers:
            target = self._least_kv([i for i in tier if self._has_room(req, i) and self._batch_open(i)])
            if target >= 0:
                return target
        return -1

    def _grow(self, req: Request) -> None:
        while True:
            target = self._growth_target(req)
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
        shard = req.shard_on(target)
        if shard is None:
            shard = Shard(target)
            req.shards.append(shard)
            self.num_shards[target] += 1
        self._add_tokens(shard, 1)

    def _add_tokens(self, shard: Shard, n: int) -> None:
        page = self.spec.page_size
        need = -(-(shard.tokens + n) // page) - (-(-shard.tokens // page))
        shard.pages.extend(self.pages.alloc(shard.instance, need))
        shard.tokens += n
        self.kv_tokens[shard.instance] += n

    def _release(self, req: Request) -> None:
        for shard in req.shards:
            self.pages.free(shard.pages)
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
            if req.prompt_len + req.decode_steps > self.max_context():
                del self.requests[handle]
                self.last_rejected.append(handle)
                continue
            placement = None if handle in preempted_now else self._place(req.prompt_len + req.decode_steps)
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

    def _place(self, context: int) -> tuple[int, dict[int, int]] | None:
        """Policy decision for a request with `context` tokens: (moe instance, {instance: tokens}) or None.

        The split includes the iteration's new token on the MoE instance.
        """
        if self.policy == "nanocp":
            return self._place_nanocp(context)
        if self.policy == "uniform-cp":
            return self._place_uniform(context)
        if self.policy == "medha":
            return self._place_medha(context)
        if self.policy == "csps":
            return self._place_csps(context)
        n = self.spec.num_instances
        if self.policy == "least-batch":
            # vLLM's DP balancing looks at the batch only; SGLang-style least-cache at KV only.
            target = min(range(n), key=lambda i: (self.moe_batch[i], i))
        elif self.policy == "least-cache":
            target = min(range(n), key=lambda i: (self.kv_tokens[i], i))
        else:  # round-robin
            target = self.rr_cursor
        split = {target: context + 1}
        if not self._can_allocate(target, split):
            return None
        if self.policy == "round-robin":
            self.rr_cursor = (self.rr_cursor + 1) % n
        return target, split

    def _node_owned(self, node: int) -> int:
        return sum(self.moe_batch[i] for i in self.spec.node_instances(node))

    def _place_nanocp(self, context: int) -> tuple[int, dict[int, int]] | None:
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
            split[moe] += 1
            if self._can_allocate(moe, split):
                return moe, split
        return None

    def _place_uniform(self, context: int) -> tuple[int, dict[int, int]] | None:
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
        split[moe] += 1
        split = {i: t for i, t in split.items() if t > 0}
        if not self._can_allocate(moe, split):
            return None
        return moe, split

    def _place_medha(self, context: int) -> tuple[int, dict[int, int]] | None:
        """Medha's KV parallelism: groups of N tokens on the least-loaded instances; every group but the last is
        full; the last one takes the rest, the new token and the MoE binding."""
        n_groups = context // self.policy_arg + 1
        if n_groups > self.spec.num_instances:
            return None
        members = sorted(range(self.spec.num_instances), key=lambda i: (self.kv_tokens[i], i))[:n_groups]
        split = {i: self.policy_arg for i in members[:-1]}
        moe = members[-1]
        split[moe] = context - self.policy_arg * (n_groups - 1) + 1
        return (moe, split) if self._can_allocate(moe, split) else None

    def _place_csps(self, context: int) -> tuple[int, dict[int, int]] | None:
        """CSPS's SP decode: a request longer than the partition length S is split into ceil(L/S) near-equal
        contiguous partitions on the least-loaded instances of the node with the least KV, next to short requests;
        the last partition holds the MoE binding and the new tokens. Short requests go whole to the instance with
        the fewest running requests."""
        if context <= self.policy_arg:
            target = min(range(self.spec.num_instances), key=lambda i: (self.moe_batch[i], self.kv_tokens[i], i))
            split = {target: context + 1}
            return (target, split) if self._can_allocate(target, split) else None
        room = self.spec.frames_per_instance * self.spec.page_size - 1
        parts = min(max(-(-context // self.policy_arg), -(-context // room)), self.spec.instances_per_node)
        node = min(
            range(self.spec.num_nodes),
            key=lambda d: (sum(self.kv_tokens[i] for i in self.spec.node_instances(d)), d),
        )
        members = sorted(self.spec.node_instances(node), key=lambda i: (self.kv_tokens[i], i))[:parts]
        base, extra = divmod(context, parts)
        split = {i: base + (1 if j < extra else 0) for j, i in enumerate(members)}
        moe = members[-1]
        split[moe] += 1
        return (moe, split) if self._can_allocate(moe, split) else None

    def _commit(self, req: Request, moe: int, split: dict[int, int]) -> None:
        recompute = req.decode_steps > 0
        order = [moe] + [i for i in split if i != moe]
        for i in order:
            shard = Shard(i)
            req.shards.append(shard)
            self.num_shards[i] += 1
            self._add_tokens(shard, split[i])
        req.moe = moe
        self.moe_batch[moe] += 1
        req.status = RUNNING
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.running.append(req.handle)
        self.last_admitted.append((req.handle, req.context_len - 1, recompute))

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

    def lower_all(self) -> list[np.ndarray]:
        batch = []
        for handle in self.running:
            req = self.requests[handle]
            frames = [(i, t, f) for i, t, f in self.shard_pages(handle)]
            batch.append((req.moe, req.context_len, frames))
        return lower_reference(self.spec.num_instances, self.iteration, batch)

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
        for handle in self.running:
            req = self.requests[handle]
            assert req.status == RUNNING
            assert req.shard_on(req.moe) is not None, "MoE instance must hold a shard"
            batch[req.moe] += 1
            for s in req.shards:
                assert s.tokens > 0 and len(s.pages) == -(-s.tokens // page)
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
        assert self.pages.used_pages() == len(seen_pages)
        assert set(self.waiting) | set(self.running) == set(self.requests)
        assert not set(self.waiting) & set(self.running)
