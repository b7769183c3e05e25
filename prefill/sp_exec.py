"""SP prefill execution of CDSP chunk plans on a group of prefill instances (Tetris Sec. 4.1).

`SpPrefillExecutor` owns N `PrefillInstance`s on one in-process fabric and runs chunks with a cooperative
single-thread driver (like data_plane.cluster.InlineCluster): each member's part of a chunk is a generator that
yields at every exchange; the driver resumes whichever member's wait is satisfied, and a round in which nobody can
move raises (never hangs). For every chunk the executor computes, from its bookkeeping of who holds how many rows:

- the zigzag split of the chunk: 2s segments, member j computes segments j and 2s-1-j (even causal work);
- the cache-balancing moves: the history (all earlier chunks' rows) is spread evenly over the chunk's group,
  surplus holders sending the tail of their rows to members with a deficit (fewest rows moved; holders outside the
  group, never produced by the CDSP planner, hand over everything);
- each member's block sizes for the ring / all-gather layout.

Failures: an instance that dies (`kill_instance`, fault injection standing for a lost process) raises
`PrefillInstanceFailure` at its next resumption, so the chunk in progress fails at once instead of its peers waiting
on the fabric; the dead instance stays out of every later chunk. One that stops answering without dying
(`stop_instance`: a stopped process, a wedged kernel) is no longer resumed; once it has been silent for
`heartbeat_timeout_s` it is declared dead the same way.

Timing (optional): a `CriticalPathClock` measures every resumption of every member (thread CPU time) and carries the
sender's clock across each signal, which gives the chunk's latency as if every member ran on its own core (the
profile of `nanocp profile prefill`); fabric copies are counted in the sender's compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanocp.comm.fabric import InProcessFabric
from nanocp.models import DeepseekV3Weights

from .instance import (
    ATTENTION_MODES,
    BalanceRecv,
    BalanceSend,
    ChunkOutput,
    ChunkWork,
    PrefillExecError,
    PrefillInstance,
    Wait,
)


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a plan: `tokens` new tokens on `instances` with the given attention mode."""

    tokens: int
    instances: tuple[int, ...]
    attention: str = "ring"


@dataclass(frozen=True)
class KVRun:
    """Contiguous new rows of one chunk on one instance: positions [start, start + n), kv [L, n, Dkv]."""

    instance: int
    start: int
    kv: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[1])


@dataclass
class ChunkResult:
    rid: str
    index: int  # chunk number within the request
    context: int
    tokens: int
    runs: list[KVRun]  # the chunk's new KV by owner, in position order per owner
    logits: torch.Tensor | None  # [vocab] of the request's last token, on its last chunk only
    latency_s: float | None = None  # critical-path latency when timing is on


def zigzag_segments(tokens: int, size: int) -> list[list[tuple[int, int]]]:
    """Per member of an SP group of `size`: its [start, end) token ranges (chunk-relative, ascending, non-empty)
    under the zigzag split into 2 * size segments (sizes differ by at most 1, longer ones first)."""
    if tokens < 0 or size < 1:
        raise ValueError(f"need tokens >= 0 and size >= 1, got {tokens}, {size}")
    n_seg = 2 * size
    bounds = [0]
    for i in range(n_seg):
        bounds.append(bounds[-1] + tokens // n_seg + (1 if i < tokens % n_seg else 0))
    ranges = []
    for j in range(size):
        own = [(bounds[j], bounds[j + 1]), (bounds[n_seg - 1 - j], bounds[n_seg - j])]
        ranges.append([r for r in own if r[1] > r[0]])
    return ranges


@dataclass(frozen=True)
class BalancePlan:
    """Targets and moves of one cache-balancing step: moves are (src, dst, count) in execution order."""

    targets: dict[int, int]
    moves: tuple[tuple[int, int, int], ...]


def balance_plan(holdings: dict[int, int], group: Sequence[int]) -> BalancePlan:
    """Spread the history evenly over `group`: every member ends with floor or ceil of total / size rows, the
    ceil going to the members that hold the most already (then lowest index), so the fewest rows move."""
    total, size = sum(holdings.values()), len(group)
    by_load = sorted(group, key=lambda i: (-holdings.get(i, 0), i))
    targets = {i: total // size + (1 if k < total % size else 0) for k, i in enumerate(by_load)}
    surplus = [(i, n - targets.get(i, 0)) for i, n in sorted(holdings.items()) if n > targets.get(i, 0)]
    deficit = [(i, targets[i] - holdings.get(i, 0)) for i in sorted(group) if targets[i] > holdings.get(i, 0)]
    moves, si, di = [], 0, 0
    while si < len(surplus) and di < len(deficit):
        (src, have), (dst, need) = surplus[si], deficit[di]
        count = min(have, need)
        moves.append((src, dst, count))
        surplus[si], deficit[di] = (src, have - count), (dst, need - count)
        si += surplus[si][1] == 0
        di += deficit[di][1] == 0
    return BalancePlan(targets, tuple(moves))


class PrefillInstanceFailure(PrefillExecError):
    """A prefill instance died while a chunk needed it: the rows it held for requests in prefill are lost."""

    def __init__(self, instance: int, detail: str = "") -> None:
        super().__init__(f"prefill instance {instance} is dead{': ' + detail if detail else ''}")
        self.instance = instance


class CriticalPathClock:
    """Per-instance logical clocks: compute segments are measured; a wait ends no earlier than the signals it
    waited for (carrying the sender's clock at signal time).

    The default timer is the driver thread's CPU time: with one intra-op thread it counts exactly the compute of
    the resumed instance and nothing of the time the thread spends descheduled on a shared machine."""

    def __init__(self, world: int, timer: Callable[[], float] = time.thread_time) -> None:
        self.timer = timer
        self.clock = [0.0] * world
        self._segment_start = [0.0] * world
        self._stamps: dict[tuple[int, int], float] = {}

    def reset(self) -> None:
        self.clock = [0.0] * len(self.clock)
        self._stamps.clear()

    def begin(self, rank: int, wait: Wait | None) -> None:
        if wait is not None:
            seen = [self._stamps.get((rank, flag), 0.0) for flag, _ in wait.flags]
            self.clock[rank] = max([self.clock[rank], *seen])
        self._segment_start[rank] = self.timer()

    def end(self, rank: int) -> None:
        self.clock[rank] += self.timer() - self._segment_start[rank]

    def on_signal(self, src: int, dst: int, flag: int) -> None:
        self._stamps[(dst, flag)] = self.clock[src] + self.timer() - self._segment_start[src]


def drive(
    steps: dict[int, object],
    instances: Sequence[PrefillInstance],
    clock: CriticalPathClock | None,
    check_alive: Callable[[int], None] | None = None,
    responsive: Callable[[int], bool] | None = None,
) -> dict:
    """Run generators (rank -> generator) cooperatively to completion; returns rank -> returned value.
    `check_alive(rank)` runs before every resumption and raises if that instance is gone; `responsive(rank)` False
    skips a rank that stopped answering (it raises once the rank is declared dead), so a round in which nobody
    moved while such a rank is waited for polls again instead of reporting a deadlock."""
    waits: dict[int, Wait | None] = {r: None for r in steps}
    results = {}
    while waits:
        moved = False
        for r in list(waits):
            wait, fabric = waits[r], instances[r].fabric
            if wait is not None and any(fabric.read_flag(f) < v for f, v in wait.flags):
                continue
            if check_alive is not None:
                check_alive(r)
            if responsive is not None and not responsive(r):
                continue
            if clock is not None:
                clock.begin(r, wait)
            try:
                waits[r] = steps[r].send(None)
            except StopIteration as done:
                results[r] = done.value
                del waits[r]
            finally:
                if clock is not None:
                    clock.end(r)
            moved = True
        if not moved:
            if responsive is not None and not all(responsive(r) for r in waits):
                time.sleep(1e-3)  # a stopped instance: wait for it to be declared dead
                continue
            raise PrefillExecError(f"chunk deadlocked: instances {sorted(waits)} wait forever")
    return results


@dataclass
class _RequestState:
    tokens: torch.Tensor  # int64 [T]
    context: int = 0
    chunks: int = 0
    holdings: dict[int, int] | None = None  # instance -> rows held


class SpPrefillExecutor:
    """N prefill instances (full weights each) on one in-process fabric, running CDSP chunks."""

    def __init__(
        self,
        model: DeepseekV3Weights,
        num_instances: int,
        max_request_tokens: int,
        timing: bool = False,
        heartbeat_timeout_s: float = 3.0,
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.model = model
        self.num_instances = num_instances
        self.max_request_tokens = max_request_tokens
        fabrics = InProcessFabric.create(num_instances, num_flags=4 * num_instances)
        # Buffer registration is collective (it ends in a barrier): build the instances on threads once.
        with ThreadPoolExecutor(num_instances) as pool:
            futures = [
                pool.submit(PrefillInstance, r, model, fabrics[r], max_request_tokens) for r in range(num_instances)
            ]
            self.instances = [f.result() for f in futures]
        self.clock = CriticalPathClock(num_instances) if timing else None
        for inst in self.instances:
            inst.signal_hook = self.clock.on_signal if self.clock else None
        self.requests: dict[str, _RequestState] = {}
        self._seq = 0
        self.dead: set[int] = set()
        self._doomed: dict[int, int] = {}  # rank -> resumptions it still runs before it dies (fault injection)
        self._stopping: dict[int, int] = {}  # rank -> resumptions it still runs before it stops answering
        self._stopped: dict[int, float] = {}  # rank -> when it stopped answering (its last heartbeat)

    def close(self) -> None:
        for inst in self.instances:
            inst.fabric.close()
        self.requests.clear()

    # ------------------------------------------------------------------ failures

    def kill_instance(self, rank: int, after_resumes: int = 0) -> None:
        """Fault injection: instance `rank` dies after `after_resumes` more resumptions (0: at its next one),
        which may be in the middle of a chunk. Its rows are lost and it takes no part in any later chunk."""
        if not 0 <= rank < self.num_instances:
            raise ValueError(f"instance {rank} outside [0, {self.num_instances})")
        if after_resumes < 0:
            raise ValueError(f"after_resumes must be >= 0, got {after_resumes}")
        self._doomed[rank] = after_resumes

    def stop_instance(self, rank: int, after_resumes: int = 0) -> None:
        """Fault injection: instance `rank` stops answering after `after_resumes` more resumptions (a stopped
        process, a wedged kernel): it is never resumed again, and once silent for heartbeat_timeout_s it is
        declared dead (its rows lost), which fails the chunk that waits for it."""
        if not 0 <= rank < self.num_instances:
            raise ValueError(f"instance {rank} outside [0, {self.num_instances})")
        if after_resumes < 0:
            raise ValueError(f"after_resumes must be >= 0, got {after_resumes}")
        self._stopping[rank] = after_resumes

    def alive(self) -> list[int]:
        """Instances that have not died, ascending."""
        return [r for r in range(self.num_instances) if r not in self.dead]

    def _check_alive(self, rank: int) -> None:
        left = self._doomed.get(rank)
        if left is not None:
            if left == 0:
                del self._doomed[rank]
                self.dead.add(rank)
                self.instances[rank].store.clear()  # what a lost process held is gone
            else:
                self._doomed[rank] = left - 1
        left = self._stopping.get(rank)
        if left is not None:
            if left == 0:
                del self._stopping[rank]
                self._stopped[rank] = time.monotonic()
            else:
                self._stopping[rank] = left - 1
        if rank in self.dead:
            raise PrefillInstanceFailure(rank)

    def _responsive(self, rank: int) -> bool:
        """False while `rank` is stopped; raises PrefillInstanceFailure once it has been silent for the heartbeat
        timeout (it is dead from then on)."""
        since = self._stopped.get(rank)
        if since is None:
            return True
        if time.monotonic() - since < self.heartbeat_timeout_s:
            return False
        del self._stopped[rank]
        self.dead.add(rank)
        self.instances[rank].store.clear()  # a process killed for its silence loses what it held
        raise PrefillInstanceFailure(rank, f"no heartbeat for {self.heartbeat_timeout_s:g} s")

    # ------------------------------------------------------------------ requests

    def start(self, rid: str, tokens: torch.Tensor | Sequence[int]) -> None:
        """Register a request's prompt (positions 0..T-1); its chunks follow with `run_chunk`."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in prefill")
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"request {rid!r}: tokens must be a non-empty 1-d sequence")
        if tokens.numel() > self.max_request_tokens:
            raise ValueError(
                f"request {rid!r}: {tokens.numel()} tokens exceed the executor's capacity {self.max_request_tokens}"
            )
        vocab = self.model.config.vocab_size
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"request {rid!r}: token ids outside the vocabulary [0, {vocab})")
        self.requests[rid] = _RequestState(tokens, holdings={})

    def finish(self, rid: str) -> None:
        """Drop a request's rows on every instance."""
        self.requests.pop(rid, None)
        for inst in self.instances:
            inst.drop(rid)

    def holdings(self, rid: str) -> dict[int, int]:
        return dict(self._state(rid).holdings)

    def _state(self, rid: str) -> _RequestState:
        if rid not in self.requests:
            raise KeyError(f"request {rid!r} is not in prefill")
        return self.requests[rid]

    # ------------------------------------------------------------------ one chunk

    def _check_chunk(self, rid: str, state: _RequestState, spec: ChunkSpec) -> tuple[int, ...]:
        group = tuple(int(i) for i in spec.instances)
        if not group or len(set(group)) != len(group):
            raise ValueError(f"request {rid!r}: a chunk needs distinct instances, got {spec.instances}")
        if min(group) < 0 or max(group) >= self.num_instances:
            raise ValueError(f"request {rid!r}: instances {group} outside [0, {self.num_instances})")
        if spec.attention not in ATTENTION_MODES:
            raise ValueError(f"unknown attention mode {spec.attention!r}; choose one of {ATTENTION_MODES}")
        remaining = int(state.tokens.numel()) - state.context
        if not 1 <= spec.tokens <= remaining:
            raise ValueError(f"request {rid!r}: chunk of {spec.tokens} tokens, {remaining} left to prefill")
        return group

    def run_chunk(self, rid: str, spec: ChunkSpec) -> ChunkResult:
        """Compute the next `spec.tokens` tokens of `rid` on `spec.instances` (any order: the ring follows it)."""
        state = self._state(rid)
        group = self._check_chunk(rid, state, spec)
        size, start = len(group), state.context
        segments = zigzag_segments(spec.tokens, size)
        query_counts = tuple(sum(b - a for a, b in segs) for segs in segments)
        plan = balance_plan(state.holdings, group)
        block_sizes = tuple(plan.targets[i] + query_counts[k] for k, i in enumerate(group))
        self._seq += 1
        last = start + spec.tokens == state.tokens.numel()
        owner_of_last = next(k for k, segs in enumerate(segments) if segs and segs[-1][1] == spec.tokens)
        logits_rank = group[owner_of_last] if last else -1
        works = {
            r: self._work(rid, state, spec, group, segments, block_sizes, query_counts, plan, r, r == logits_rank)
            for r in sorted(set(group) | set(state.holdings))
        }
        if self.clock is not None:
            self.clock.reset()
        dead = sorted(self.dead.intersection(works))
        if dead:
            raise PrefillInstanceFailure(dead[0], f"request {rid!r} needs it for chunk {state.chunks}")
        outputs: dict[int, ChunkOutput] = drive(
            {r: self.instances[r].chunk(w) for r, w in works.items()},
            self.instances,
            self.clock,
            self._check_alive,
            self._responsive,
        )
        state.context += spec.tokens
        state.holdings = {i: plan.targets[i] + query_counts[k] for k, i in enumerate(group)}
        state.chunks += 1
        runs = []
        for k, r in enumerate(group):
            out = outputs[r]
            offset = 0
            for a, b in segments[k]:
                runs.append(KVRun(r, start + a, out.new_kv[:, offset : offset + b - a]))
                offset += b - a
        latency = max(self.clock.clock) if self.clock is not None else None
        logits = outputs[logits_rank].logits if last else None
        return ChunkResult(rid, state.chunks - 1, start, spec.tokens, runs, logits, latency)

    def _work(
        self,
        rid: str,
        state: _RequestState,
        spec: ChunkSpec,
        group: tuple[int, ...],
        segments: list[list[tuple[int, int]]],
        block_sizes: tuple[int, ...],
        query_counts: tuple[int, ...],
        plan: BalancePlan,
        rank: int,
        want_logits: bool,
    ) -> ChunkWork:
        held = state.holdings.get(rank, 0)
        keep = min(held, plan.targets.get(rank, 0))
        sends, recvs, cursor = [], [], keep
        incoming = {}
        for src, dst, count in plan.moves:
            incoming[dst] = incoming.get(dst, 0)
            if src == rank:
                sends.append(BalanceSend(dst, cursor, count, incoming[dst]))
                cursor += count
            if dst == rank:
                recvs.append(BalanceRecv(src, count, incoming[dst]))
            incoming[dst] += count
        if rank in group:
            k = group.index(rank)
            local = [torch.arange(state.context + a, state.context + b) for a, b in segments[k]]
            positions = torch.cat(local) if local else torch.empty(0, dtype=torch.int64)
        else:
            positions = torch.empty(0, dtype=torch.int64)
        return ChunkWork(
            rid=rid,
            seq=self._seq,
            attention=spec.attention,
            group=group,
            positions=positions,
            tokens=state.tokens[positions],
            block_sizes=block_sizes,
            query_counts=query_counts,
            keep=keep,
            sends=tuple(sends),
            recvs=tuple(recvs),
            want_logits=want_logits,
        )

    # ------------------------------------------------------------------ whole plans and inspection

    def gather_kv(self, rid: str) -> torch.Tensor:
        """The request's KV so far in position order, [L, context, Dkv], from wherever the rows live."""
        state = self._state(rid)
        c = self.model.config
        out = self.model.embed_tokens.new_full((c.num_hidden_layers, state.context, c.kv_cache_dim), float("nan"))
        seen = torch.zeros(state.context, dtype=torch.int64)
        for inst in self.instances:
            held = inst.holdings(rid)
            if held is None or held.rows == 0:
                continue
            out[:, held.positions] = held.kv
            seen.index_add_(0, held.positions, torch.ones_like(held.positions))
        if not bool((seen == 1).all()):
            raise PrefillExecError(f"request {rid!r}: positions held {seen.tolist()} times, expected once each")
        return out

    def run_plan(
        self, rid: str, tokens: Sequence[int] | torch.Tensor, chunks: Sequence[ChunkSpec]
    ) -> list[ChunkResult]:
        """Start a request, run all its chunks, keep its rows (call `finish` to drop them)."""
        self.start(rid, tokens)
        total = sum(c.tokens for c in chunks)
        if total != self.requests[rid].tokens.numel():
            self.finish(rid)
            raise ValueError(f"request {rid!r}: chunks cover {total} tokens, the prompt has {len(tokens)}")
        return [self.run_chunk(rid, spec) for spec in chunks]
