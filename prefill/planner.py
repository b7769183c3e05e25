"""CDSP prefill planner: Tetris Algorithms 1-3 (plain Python reference) and the C++ core behind the same API.

Given a prompt of `length` tokens and the queue time of every prefill instance (seconds until it is free), the
planner splits the prompt into chunks, each on an SP group that contains every instance of the previous chunks, and
returns the chunk plan with its estimated TTFT and the queue times to commit.

Policies:
- "cdsp": Algorithm 1 (single-chunk plan, then recursive exploration of (s_current, s_next) SP pairs with chunk
  lengths solved from the queue-time budget, Algorithm 3). `chunking=False` stops after the single-chunk plan
  (Algorithm 2 only), the paper's ablation.
- "fixed": the cluster is cut into fixed SP groups of `fixed_sp` consecutive instances; a request goes whole to the
  group that frees up first.
- "elastic": request-level elastic SP, greedy largest (LoongServe-like): one chunk on the `s` globally least-queued
  instances, `s` minimising the request's TTFT with no improvement threshold, ties going to the larger `s`.

Deterministic tie-breaking everywhere: instances order by (queue time, index); nodes by (queue value, node index);
SP sizes ascend and a larger size replaces the current choice only when strictly better by the improvement rate;
SP pairs run (s_current ascending, then s_next ascending) and a chunked plan replaces the best one only when its TTFT
is strictly smaller (so the result is the earliest plan, in that order, with the smallest TTFT); among attention
modes with equal latency the first model given wins.

Pruning never changes a plan: both implementations skip the chunked plans of a level, and single pairs, whose TTFT
provably cannot beat the best plan found (`_lower_bound`: the groups a chain of GetGroup calls can build are ready no
earlier than `_ready_times`, and the work before the last chunk must fit in the instance-seconds of the groups ready by
then). The C++ core also explores the pairs best-first by that bound (or by the child's own single-chunk TTFT, which
it computes in the parent), skips a pair whose child has the same chunk and single-chunk group as an earlier pair's
(that child's plans are a subset), answers repeated sub-problems from a memo and breaks TTFT ties by the order above,
so it returns exactly the same plan.

All times are seconds from the moment of planning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanocp.prefill.latency_model import LatencyCoeffs, PrefillLatencyModel, largest_len_within

POLICIES = ("cdsp", "fixed", "elastic")


class PlannerError(ValueError):
    """Bad planner configuration or planning input."""


@dataclass(frozen=True)
class PlannerConfig:
    """Prefill pool shape and planner knobs."""

    num_nodes: int
    instances_per_node: int
    max_sp: int
    improvement_rate: float = 0.3
    chunking: bool = True
    min_chunk_tokens: int = 1024  # a chunk shorter than max(this, 2 * s_current) is illegal
    policy: str = "cdsp"
    fixed_sp: int = 0  # group size of the "fixed" policy

    def __post_init__(self) -> None:
        for name in ("num_nodes", "instances_per_node", "max_sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlannerError(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.improvement_rate, (int, float)) and 0.0 <= self.improvement_rate < 1.0):
            raise PlannerError(f"improvement_rate must be in [0, 1), got {self.improvement_rate!r}")
        if not isinstance(self.min_chunk_tokens, int) or self.min_chunk_tokens < 1:
            raise PlannerError(f"min_chunk_tokens must be a positive int, got {self.min_chunk_tokens!r}")
        if self.policy not in POLICIES:
            raise PlannerError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "fixed" and not (1 <= self.fixed_sp <= self.num_instances):
            raise PlannerError(f"fixed policy needs 1 <= fixed_sp <= {self.num_instances}, got {self.fixed_sp}")

    @property
    def num_instances(self) -> int:
        return self.num_nodes * self.instances_per_node


@dataclass(frozen=True)
class Chunk:
    """One chunk of a plan: `tokens` new tokens after `context` computed ones, on `instances` (ascending)."""

    tokens: int
    context: int
    instances: tuple[int, ...]
    start: float
    end: float
    attention: str

    @property
    def sp(self) -> int:
        return len(self.instances)


@dataclass
class ChunkPlan:
    """A request's prefill plan: its chunks in execution order, the estimated TTFT and the queue times to commit."""

    chunks: list[Chunk]
    ttft: float
    queue_updates: dict[int, float] = field(default_factory=dict)  # instance -> new queue time (s from now)

    @property
    def sp_sizes(self) -> list[int]:
        return [c.sp for c in self.chunks]

    @property
    def instances(self) -> tuple[int, ...]:
        return self.chunks[-1].instances


def apply_queue_updates(queue_times: Sequence[float], plan: ChunkPlan) -> list[float]:
    """Queue times after committing `plan`."""
    updated = list(queue_times)
    for instance, busy_until in plan.queue_updates.items():
        updated[instance] = busy_until
    return updated


def advance_queue_times(queue_times: Sequence[float], elapsed: float) -> list[float]:
    """Queue times `elapsed` seconds later: Eq. 2, T_i <- max(0, T_i - elapsed)."""
    return [max(0.0, t - elapsed) for t in queue_times]


def sp_candidates(models: Sequence[PrefillLatencyModel], config: PlannerConfig) -> list[int]:
    """Powers of two up to min(max_sp, #instances) for which at least one latency model has coefficients."""
    available = {sp for m in models for sp in m.sp_sizes}
    limit = min(config.max_sp, config.num_instances)
    sizes, s = [], 1
    while s <= limit:
        if s in available:
            sizes.append(s)
        s *= 2
    return sizes


def _as_models(models: PrefillLatencyModel | Sequence[PrefillLatencyModel]) -> list[PrefillLatencyModel]:
    models = [models] if isinstance(models, PrefillLatencyModel) else list(models)
    if not models or not all(isinstance(m, PrefillLatencyModel) for m in models):
        raise PlannerError("models must be a PrefillLatencyModel or a non-empty sequence of them")
    return models


@dataclass
class _Best:
    """Running optimum of one recursion level."""

    ttft: float
    chunks: list[Chunk]


class CdspPlanner:
    """Plain Python reference of the CDSP planner (Tetris Algorithms 1-3) and the baseline policies."""

    def __init__(
        self,
        models: PrefillLatencyModel | Sequence[PrefillLatencyModel],
        config: PlannerConfig,
        prune: bool = True,
    ) -> None:
        self.models = _as_models(models)
        self.config = config
        self.prune = prune
        self._works: dict[tuple[int, ...], list[tuple[float, float, float, float]]] = {}
        self.sizes = sp_candidates(self.models, config)
        if not self.sizes:
            raise PlannerError("no SP size is both a power of two <= max_sp and present in the latency models")
        if config.policy == "fixed" and not any(config.fixed_sp in m.coeffs for m in self.models):
            raise PlannerError(f"no latency model has SP size {config.fixed_sp}")

    # --- latency model, best attention mode per chunk ---------------------------------------------------------
    def _prefill(self, sp: int, context: int, tokens: int) -> tuple[float, str]:
        best: tuple[float, str] | None = None
        for model in self.models:
            if sp in model.coeffs:
                t = model.coeffs[sp](context, tokens)
                if best is None or t < best[0]:
                    best = (t, model.attention)
        assert best is not None  # sizes are filtered by sp_candidates
        return best

    def _solve(self, sp: int, context: int, budget: float, limit: int) -> int:
        return max(largest_len_within(m.coeffs[sp], context, budget, limit) for m in self.models if sp in m.coeffs)

    # --- GetGroup ---------------------------------------------------------------------------------------------
    def _node(self, instance: int) -> int:
        return instance // self.config.instances_per_node

    def _get_group(self, pool: dict[int, float], initial: Sequence[int], size: int) -> list[int] | None:
        """Extend `initial` to `size` instances of `pool`: first inside the nodes it already uses, then whole
        nodes / the best single node by queue time. None if the pool is too small."""
        need = size - len(initial)
        if need < 0 or need > len(pool) - len(initial):
            return None
        chosen = set(initial)
        used_nodes = {self._node(i) for i in initial}
        if need > 0 and used_nodes:
            free_in_used = sorted((pool[i], i) for i in pool if self._node(i) in used_nodes and i not in chosen)
            taken = free_in_used[:need]
            chosen.update(i for _, i in taken)
            need -= len(taken)
        nodes: dict[int, list[tuple[float, int]]] = {}
        for i, t in pool.items():
            if self._node(i) not in used_nodes:
                nodes.setdefault(self._node(i), []).append((t, i))
        for members in nodes.values():
            members.sort()
        while need > 0:
            fitting = [n for n, members in nodes.items() if len(members) >= need]
            if fitting:
                # one node holds the rest: the node whose need-th shortest queue is smallest
                node = min(fitting, key=lambda n: (nodes[n][need - 1][0], n))
                chosen.update(i for _, i in nodes[node][:need])
                need = 0
            else:
                # the rest spans nodes: take the whole node that frees up first
                node = min(nodes, key=lambda n: (nodes[n][-1][0], n))
                members = nodes.pop(node)
                chosen.update(i for _, i in members)
                need -= len(members)
        return sorted(chosen)

    # --- Algorithm 2 ------------------------------------------------------------------------------------------
    def _single_chunk(
        self, pool: dict[int, float], initial: Sequence[int], sizes: Sequence[int], tokens: int, context: int
    ) -> tuple[list[int], float, float, str]:
        """Best (group, queue, prefill, attention) for all `tokens` in one chunk, growing SP only when TTFT
        improves by more than the improvement rate."""
        rate = self.config.improvement_rate
        opt_ttft, opt = math.inf, None
        for s in sizes:
            group = self._get_group(pool, initial, s)
            if group is None:
                continue
            queue = max(pool[i] for i in group)
            prefill, attention = self._prefill(s, context, tokens)
            ttft = queue + prefill
            if ttft < opt_ttft * (1.0 - rate):
                opt_ttft, opt = ttft, (group, queue, prefill, attention)
        if opt is None:
            raise PlannerError(f"no SP size in {list(sizes)} fits the pool of {len(pool)} instances")
        return opt

    # --- Algorithms 1 and 3 -----------------------------------------------------------------------------------
    def _schedule(
        self,
        tokens: int,
        prefix: list[Chunk],
        context: int,
        initial: list[int],
        sizes: list[int],
        pool: dict[int, float],
        t0: float,
    ) -> _Best:
        """Algorithm 1 on the remaining `tokens`; `pool` holds queue times relative to absolute time t0."""
        group, queue, prefill, attention = self._single_chunk(pool, initial, sizes, tokens, context)
        end_rel = queue + prefill
        last = Chunk(tokens, context, tuple(group), t0 + queue, t0 + end_rel, attention)
        best = _Best(t0 + end_rel, prefix + [last])
        if not self.config.chunking:
            return best
        cdsp_sizes = [s for s in sizes if s <= len(group)]
        if len(cdsp_sizes) < 2:
            return best
        if self.prune:  # no chunked plan of this level can beat the single-chunk plan
            ready = self._ready_times(pool, initial, cdsp_sizes)
            if _beyond(t0 + self._lower_bound(cdsp_sizes, tokens, context, ready, 0.0), best.ttft):
                return best
        sub_pool = {i: pool[i] for i in group}
        for k, s_cur in enumerate(cdsp_sizes):
            current = self._get_group(sub_pool, initial, s_cur)
            if current is None:
                continue
            queue_cur = max(sub_pool[i] for i in current)
            ready = self._ready_times(sub_pool, current, cdsp_sizes[k + 1 :]) if self.prune else {}
            for s_next in cdsp_sizes[k + 1 :]:
                nxt = self._get_group(sub_pool, current, s_next)
                if nxt is None:
                    continue
                # Algorithm 3: the chunk may run until the larger group frees up.
                budget = max(sub_pool[i] for i in nxt) - queue_cur
                length = self._solve(s_cur, context, budget, tokens)
                if length >= tokens or length < max(self.config.min_chunk_tokens, 2 * s_cur):
                    continue  # illegal: no chunk, too short, or the whole remainder (= a single-chunk plan)
                prefill, attention = self._prefill(s_cur, context, length)
                end_rel = queue_cur + prefill
                next_sizes = [s for s in cdsp_sizes if s >= s_next]
                rest, next_context, next_t0 = tokens - length, context + length, t0 + end_rel
                if self.prune and _beyond(
                    next_t0 + self._lower_bound(next_sizes, rest, next_context, ready, end_rel), best.ttft
                ):
                    continue
                chunk = Chunk(length, context, tuple(current), t0 + queue_cur, t0 + end_rel, attention)
                # Eq. 2: re-base the queue times on the end of this chunk.
                next_pool = {i: max(0.0, t - end_rel) for i, t in sub_pool.items()}
                result = self._schedule(rest, prefix + [chunk], next_context, current, next_sizes, next_pool, next_t0)
                if best.ttft > result.ttft:
                    best = result
        return best

    # --- pruning bound (never changes a plan) ------------------------------------------------------------------
    def _ready_times(self, pool: dict[int, float], initial: Sequence[int], sizes: Sequence[int]) -> dict[int, float]:
        """Per size: a lower bound of the longest queue of any group of that size that a chain of GetGroup calls can
        grow from `initial` inside `pool`.

        Such a group either stays inside the initial group's nodes (then it holds the shortest free queues there) or
        holds all of those nodes plus, from the other nodes, some of their shortest queues. GetGroup adds a node
        partly only when the remaining need is smaller than a node, and fills it before taking new ones; so if the
        other nodes have one size k and every size s with s - own >= k has s - own a multiple of k, they come whole
        beyond one partial node.
        """
        per_node = self.config.instances_per_node
        chosen = set(initial)
        own_nodes = {i // per_node for i in initial}
        init_queue = max((pool[i] for i in initial), default=-math.inf)
        free = sorted(t for i, t in pool.items() if i // per_node in own_nodes and i not in chosen)
        own = len(chosen) + len(free)
        own_max = max([init_queue] + free[-1:])
        nodes: dict[int, list[float]] = {}
        for i, t in pool.items():
            if i // per_node not in own_nodes:
                nodes.setdefault(i // per_node, []).append(t)
        members = [sorted(queues) for queues in nodes.values()]
        k = len(members[0]) if members else 0
        whole = k > 0 and all(len(m) == k for m in members)
        whole = whole and all((s - own) % k == 0 for s in sizes if s - own >= k)
        longest = sorted(m[-1] for m in members)
        others = sorted(t for m in members for t in m)
        ready = {}
        for s in sizes:
            if s <= len(chosen):
                ready[s] = init_queue
            elif s <= own:
                ready[s] = max(init_queue, free[s - len(chosen) - 1])
            elif s - own > len(others):
                ready[s] = math.inf  # no group of this size exists
            elif whole and s - own < k:  # part of one more node
                ready[s] = max(own_max, min(m[s - own - 1] for m in members))
            elif whole:
                ready[s] = max(own_max, longest[(s - own) // k - 1])
            else:
                ready[s] = max(own_max, others[s - own - 1])
        return ready

    def _lower_bound(self, sizes: list[int], tokens: int, context: int, ready: dict[int, float], shift: float) -> float:
        """Lower bound of the TTFT, relative to the origin re-based by `shift` (Eq. 2), of any plan of the remaining
        `tokens` whose chunks use SP sizes from `sizes`, each group of size s ready no earlier than ready[s].

        For a plan whose last chunk has s_f instances: all its work runs after the first chunk's group is ready, at
        no less than the envelope of Eq. 1 over the sizes used (superadditive, so chunking cannot beat it); and the
        last chunk starts once its group is ready, after the earlier (smaller) chunks did at most the work that fits
        in the instance-seconds of the groups ready by then, or later by the extra work over the largest earlier
        size. The bound is the smallest over s_f.
        """
        r = {s: max(0.0, ready[s] - shift) for s in sizes}
        lower = math.inf
        for f in reversed(range(len(sizes))):  # large last chunks usually give the bound
            s_f = sizes[f]
            a, b, c, m = self._envelope(sizes[: f + 1])
            work = r[sizes[0]] + a + b * tokens + c * context * tokens + m * tokens * tokens
            if work >= lower or r[s_f] + min(k.coeffs[s_f].a for k in self.models if s_f in k.coeffs) >= lower:
                continue
            if f == 0:
                tail = r[s_f] + self._last_chunk_min(s_f, context, tokens, 0.0, 0.0)
            else:
                cap, earliest = 0.0, math.inf  # instance-seconds of sizes < s_f before r[s_f]
                for j in reversed(range(f)):
                    earliest = min(earliest, r[sizes[j]])
                    cap += (sizes[j] - (sizes[j - 1] if j > 0 else 0)) * max(0.0, r[s_f] - earliest)
                works = self._work_envelopes(tuple(sizes[:f]))
                done = 0.0  # most tokens the earlier chunks can finish by r[s_f]
                for wa, wb, wc, wm in works:
                    if cap > wa:
                        p = wb + wc * context
                        root = p + math.sqrt(p * p + 4.0 * wm * (cap - wa))
                        done = max(done, min(tokens, 2.0 * (cap - wa) / root) if root > 0 else tokens)
                tail = r[s_f] + self._last_chunk_min(s_f, context, tokens, 0.0, done)
                if done < tokens:
                    for wa, wb, wc, wm in works:
                        extra = ((wa - cap) / sizes[f - 1], (wb + wc * context) / sizes[f - 1], wm / sizes[f - 1])
                        tail = min(tail, r[s_f] + self._last_chunk_min(s_f, context, tokens, done, tokens, extra))
            lower = min(lower, max(work, tail))
        return lower

    def _last_chunk_min(
        self, sp: int, context: int, tokens: int, x0: float, x1: float, extra: tuple[float, float, float] = (0, 0, 0)
    ) -> float:
        """min over X in [x0, x1] of T_sp(context + X, tokens - X) + e0 + e1 X + e2 X^2 (a quadratic in X)."""
        return min(_shifted_min(m.coeffs[sp], context, tokens, x0, x1, extra) for m in self.models if sp in m.coeffs)

    def _envelope(self, sizes: list[int]) -> tuple[float, float, float, float]:
        coeffs = [m.coeffs[s] for s in sizes for m in self.models if s in m.coeffs]
        c = min(k.c for k in coeffs)
        return min(k.a for k in coeffs), min(k.b for k in coeffs), c, min(min(k.d for k in coeffs), c / 2.0)

    def _work_envelopes(self, sizes: tuple[int, ...]) -> list[tuple[float, float, float, float]]:
        """Instance-seconds (s * latency) of chunks on `sizes`, one envelope per set of attention modes a plan may
        use: a = the largest per-chunk overhead s * a_s among the set (each mode used runs at least one chunk),
        b, c, m = minima over the set, m <= c / 2."""
        if sizes not in self._works:
            per_mode = []
            for model in self.models:
                ks = [(s, model.coeffs[s]) for s in sizes if s in model.coeffs]
                if ks:
                    per_mode.append(tuple(min(s * getattr(k, name) for s, k in ks) for name in "abcd"))
            if len(per_mode) > 4:  # too many mode sets: one envelope with the smallest overhead
                sets = [per_mode]
            else:
                sets = [[w for j, w in enumerate(per_mode) if mask >> j & 1] for mask in range(1, 1 << len(per_mode))]
            works = []
            for ws in sets:
                overhead = min(w[0] for w in ws) if len(per_mode) > 4 else max(w[0] for w in ws)
                c = min(w[2] for w in ws)
                works.append((overhead, min(w[1] for w in ws), c, min(min(w[3] for w in ws), c / 2.0)))
            self._works[sizes] = works
        return self._works[sizes]

    # --- public pieces for chunk-at-a-time schedulers (queue_policy.py) ----------------------------------------
    def prefill_latency(self, sp: int, context: int, tokens: int) -> tuple[float, str]:
        """Eq. 1 latency of a chunk on `sp` instances with the fastest attention mode, and that mode."""
        if sp not in self.sizes:
            raise PlannerError(f"SP size {sp} is not a candidate (candidates: {self.sizes})")
        return self._prefill(sp, context, tokens)

    def best_latency(self, context: int, tokens: int) -> float:
        """The smallest Eq. 1 latency of a chunk over all candidate SP sizes (an idle pool's best case)."""
        return min(self._prefill(s, context, tokens)[0] for s in self.sizes)

    def solve_chunk_len(self, sp: int, context: int, budget: float, limit: int) -> int:
        """Largest chunk (<= limit) whose Eq. 1 latency on `sp` instances fits `budget`; 0 if none."""
        if sp not in self.sizes:
            raise PlannerError(f"SP size {sp} is not a candidate (candidates: {self.sizes})")
        return self._solve(sp, context, budget, limit)

    def single_chunk_group(
        self, pool: dict[int, float], initial: Sequence[int], tokens: int, context: int
    ) -> tuple[list[int], float, float, str]:
        """Algorithm 2 over `pool` (instance -> queue time, s): the group for all `tokens` after `context`,
        extending `initial`, with its queue time, prefill latency and attention mode (PlannerError if none fits)."""
        return self._single_chunk(pool, list(initial), self.sizes, tokens, context)

    # --- baselines --------------------------------------------------------------------------------------------
    def _fixed(self, length: int, queue: Sequence[float]) -> _Best:
        k = self.config.fixed_sp
        options = []
        for g in range(len(queue) // k):
            group = list(range(g * k, (g + 1) * k))
            options.append((max(queue[i] for i in group), g, group))
        group_queue, _, group = min(options)
        prefill, attention = self._prefill(k, 0, length)
        end = group_queue + prefill
        return _Best(end, [Chunk(length, 0, tuple(group), group_queue, end, attention)])

    def _elastic(self, length: int, queue: Sequence[float]) -> _Best:
        order = sorted(range(len(queue)), key=lambda i: (queue[i], i))
        best: _Best | None = None
        for s in self.sizes:
            group = sorted(order[:s])
            group_queue = max(queue[i] for i in group)
            prefill, attention = self._prefill(s, 0, length)
            end = group_queue + prefill
            if best is None or end <= best.ttft:
                best = _Best(end, [Chunk(length, 0, tuple(group), group_queue, end, attention)])
        assert best is not None
        return best

    # --- entry point ------------------------------------------------------------------------------------------
    def plan(self, length: int, queue_times: Sequence[float]) -> ChunkPlan:
        """Plan the prefill of a `length`-token prompt given every instance's queue time (seconds from now)."""
        queue = _check_inputs(self.config, length, queue_times)
        if self.config.policy == "fixed":
            best = self._fixed(length, queue)
        elif self.config.policy == "elastic":
            best = self._elastic(length, queue)
        else:
            pool = dict(enumerate(queue))
            best = self._schedule(length, [], 0, [], self.sizes, pool, 0.0)
        updates = {i: best.ttft for i in best.chunks[-1].instances}
        return ChunkPlan(best.chunks, best.ttft, updates)


def _shifted_min(
    k: LatencyCoeffs, context: int, tokens: int, x0: float, x1: float, extra: tuple[float, float, float]
) -> float:
    """min over X in [x0, x1] of k(context + X, tokens - X) + e0 + e1 X + e2 X^2: endpoints, or the vertex."""
    e0, e1, e2 = extra

    def value(x: float) -> float:
        return k(context + x, tokens - x) + e0 + e1 * x + e2 * x * x

    q2 = k.d - k.c + e2
    q1 = -k.b + k.c * (tokens - context) - 2.0 * k.d * tokens + e1
    best = min(value(x0), value(x1))
    if q2 > 0 and x0 < -q1 / (2.0 * q2) < x1:
        best = min(best, value(-q1 / (2.0 * q2)))
    return best


def _beyond(lower: float, best: float) -> bool:
    """A plan whose TTFT is at least `lower` (up to a rounding margin) cannot beat `best`."""
    return lower * (1.0 - 1e-9) > best * (1.0 + 1e-12)


def _check_inputs(config: PlannerConfig, length: int, queue_times: Sequence[float]) -> list[float]:
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise PlannerError(f"length must be a positive int, got {length!r}")
    queue = [float(t) for t in queue_times]
    if len(queue) != config.num_instances:
        raise PlannerError(f"expected {config.num_instances} queue times, got {len(queue)}")
    if not all(math.isfinite(t) and t >= 0.0 for t in queue):
        raise PlannerError("queue times must be finite and >= 0")
    return queue


class CoreCdspPlanner:
    """The C++ planner (nanocp.control_plane._core.CdspPlanner) behind the CdspPlanner API: same plans, faster."""

    def __init__(self, models: PrefillLatencyModel | Sequence[PrefillLatencyModel], config: PlannerConfig) -> None:
        from nanocp.control_plane import _core

        self.models = _as_models(models)
        self.config = config
        self.sizes = sp_candidates(self.models, config)
        if not self.sizes:
            raise PlannerError("no SP size is both a power of two <= max_sp and present in the latency models")
        if config.policy == "fixed" and not any(config.fixed_sp in m.coeffs for m in self.models):
            raise PlannerError(f"no latency model has SP size {config.fixed_sp}")
        self.core = _core.CdspPlanner(
            [m.attention for m in self.models],
            [[(sp, k.a, k.b, k.c, k.d) for sp, k in m.coeffs.items()] for m in self.models],
            config.num_nodes,
            config.instances_per_node,
            config.max_sp,
            float(config.improvement_rate),
            config.chunking,
            config.min_chunk_tokens,
            config.policy,
            config.fixed_sp,
        )

    def plan(self, length: int, queue_times: Sequence[float]) -> ChunkPlan:
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise PlannerError(f"length must be a positive int, got {length!r}")
        try:  # the core checks the queue times (count, finite, >= 0)
            ttft, raw = self.core.plan(length, queue_times)
        except (ValueError, TypeError) as exc:
            raise PlannerError(f"bad queue times: {exc}") from exc
        chunks = [
            Chunk(tokens, context, tuple(instances), start, end, self.models[mode].attention)
            for tokens, context, instances, start, end, mode in raw
        ]
        return ChunkPlan(chunks, ttft, {i: ttft for i in chunks[-1].instances})
