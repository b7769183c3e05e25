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
modes with equal latency the first model given wins. Both implementations skip pairs that provably cannot beat the
best plan (a lower bound of Eq. 1, see `_cannot_win`); the C++ core also explores the pairs best-first by that bound
and breaks TTFT ties by the order above, so it returns exactly the same plan.

All times are seconds from the moment of planning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanocp.prefill.latency_model import PrefillLatencyModel, largest_len_within

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
        sub_pool = {i: pool[i] for i in group}
        for k, s_cur in enumerate(cdsp_sizes):
            current = self._get_group(sub_pool, initial, s_cur)
            if current is None:
                continue
            queue_cur = max(sub_pool[i] for i in current)
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
                if self.prune and self._cannot_win(next_sizes, rest, next_context, next_t0, sub_pool, end_rel, best):
                    continue
                chunk = Chunk(length, context, tuple(current), t0 + queue_cur, t0 + end_rel, attention)
                # Eq. 2: re-base the queue times on the end of this chunk.
                next_pool = {i: max(0.0, t - end_rel) for i, t in sub_pool.items()}
                result = self._schedule(rest, prefix + [chunk], next_context, current, next_sizes, next_pool, next_t0)
                if best.ttft > result.ttft:
                    best = result
        return best

    def _cannot_win(
        self,
        sizes: list[int],
        tokens: int,
        context: int,
        t0: float,
        sub_pool: dict[int, float],
        shift: float,
        best: _Best,
    ) -> bool:
        """Branch-and-bound test that never changes the result: True if no plan of the remaining `tokens`
        (starting at t0, pool = `sub_pool` re-based by `shift`) can end before `best`.

        If the last chunk of such a plan runs on s_f instances, every chunk uses between sizes[0] and s_f
        instances, so the work takes at least the lower envelope of Eq. 1 over those sizes (a*, b*, c* = minima,
        m* = min(d*, c*/2): superadditive, so chunking cannot beat it); and the last chunk cannot start before
        the s_f-th shortest re-based queue time. The plan ends no earlier than the smaller over s_f of the
        larger of the two.
        """
        queues = sorted(max(0.0, t - shift) for t in sub_pool.values())
        lower = math.inf
        for f, s_last in enumerate(sizes):
            a, b, c, m = self._envelope(sizes[: f + 1])
            work = a + b * tokens + c * context * tokens + m * tokens * tokens
            last_start = queues[s_last - 1] + min(k.coeffs[s_last].a for k in self.models if s_last in k.coeffs)
            lower = min(lower, max(work, last_start))
        return t0 + lower * (1.0 - 1e-9) > best.ttft * (1.0 + 1e-12)

    def _envelope(self, sizes: list[int]) -> tuple[float, float, float, float]:
        coeffs = [m.coeffs[s] for s in sizes for m in self.models if s in m.coeffs]
        c = min(k.c for k in coeffs)
        return min(k.a for k in coeffs), min(k.b for k in coeffs), c, min(min(k.d for k in coeffs), c / 2.0)

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
