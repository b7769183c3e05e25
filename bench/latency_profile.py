"""Latency profiles: per-layer, per-instance cost of a DP-EP decode iteration, from a data file.

A profile is a JSON file (bench/profiles/<name>.json) holding linear coefficients per phase, link bandwidths and
latencies, a memory budget and a prefill cost model, each with its provenance. The same code reads a profile
derived from published GPU numbers (h200-deepseek-v3, h800-deepseek-v3) or one fitted from the CPU data plane's
timing log (`fit_profile_from_timing_log`).

Phases and the feature each coefficient multiplies (time per layer unless noted; `const` is always present):

| phase | features | feature meaning |
|---|---|---|
| attention | kv_tokens, shards | KV tokens on the instance; (request, shard) rows on it |
| merge | partials, batch | remote partials merged at the MoE instance (CP cost); local MoE batch (output side) |
| dense | batch | local MoE batch (attention-side projections, norms, RoPE) - every layer |
| shared_expert | batch | local MoE batch (gate + shared expert) - MoE layers |
| dense_mlp | batch | local MoE batch (dense FFN) - dense layers |
| expert | batch | mean MoE batch over instances (each receives mean x top_k rows) - MoE layers |
| moe_dispatch, moe_combine | batch | max MoE batch over instances (lock-step all-to-all) - MoE layers |
| iteration | batch | local MoE batch; once per iteration (lm_head, sampling) |
| host (optional) | batch | running requests of the cluster; once per iteration, serial (driver: scheduling, lowering) |

The merge's const and batch terms apply to every instance and layer (0 in the GPU profiles, whose output projection
is in `dense`; the CPU data plane's merge phase also runs W_UV and o_proj).

Coefficients are >= 0. A phase is either a coefficient dict or {"by_ep": {"<EP size>": coefficients}}; between
tabulated EP sizes each coefficient is interpolated linearly in log2(EP), outside the table the nearest entry is used.

CP communication per layer and instance: a Q round then a Res round. In each round an instance sends and receives
over NVLink (peers in its node) and RDMA (other nodes) at once; a link costs latency + bytes / bandwidth, with
bytes = max(sent, received) as the link is full duplex; a round lasts as long as its slower link.

One iteration (the all-to-all is a barrier, so every instance waits for the slowest):
    pre_i   = attention_i + cp_i + merge_i + dense_i + shared_expert_i             (MoE layer, before dispatch)
    dlayer_i = attention_i + cp_i + merge_i + dense_i + dense_mlp_i                (dense layer)
    a2a     = dispatch(max batch) + expert(mean batch) + combine(max batch)
    T = max_i(n_dense * dlayer_i + pre_i) + (n_moe - 1) * max_i(pre_i) + n_moe * a2a + max_i(iteration_i) + host
(cp_i here includes the per-partial part of the merge; its const and batch parts count as "other".) The ideal bound
charges the same formulas with every instance at the mean KV and mean batch, one shard row per request and no CP
traffic.

Shared processors (optional `cluster.shared_cores` = P, for local CPU clusters whose instances take turns on a few
cores): the iteration cannot be shorter than every instance's work spread over P cores,
    T = max(T_lockstep, sum_i work_i / P) + host
    work_i = n_dense * dlayer_i + n_moe * (pre_i + dispatch(b_i) + expert(mean batch) + combine(b_i)) + iteration_i
Without it (the GPU profiles) every instance has its own hardware.

Breakdown of one MoE layer on instance i (`IterationCost.layer`): attention_i, cp_i, other_i = pre_i - attention_i
- cp_i + expert, and moe_a2a_i = dispatch + combine + (max_j pre_j - pre_i): an instance that finishes its
attention early waits inside the all-to-all, as a profiler sees it. The four parts add up to the same layer time on
every instance; the slowest instance waits 0.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
SCHEMA = "nanocp-latency-profile/1"
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}

PHASE_FEATURES: dict[str, tuple[str, ...]] = {
    "attention": ("kv_tokens", "shards"),
    "merge": ("partials", "batch"),
    "dense": ("batch",),
    "shared_expert": ("batch",),
    "dense_mlp": ("batch",),
    "expert": ("batch",),
    "moe_dispatch": ("batch",),
    "moe_combine": ("batch",),
    "iteration": ("batch",),
    "host": ("batch",),
}
OPTIONAL_PHASES = frozenset({"host"})  # absent = zero
LINKS = ("nvlink", "rdma")
BREAKDOWN = ("attention", "moe_a2a", "cp_comm", "other")


class ProfileError(ValueError):
    """A latency profile is missing, malformed, or asked something it cannot answer."""


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearCost:
    """t = const + sum_f coefs[f] * x_f, in seconds."""

    const: float
    coefs: Mapping[str, float]

    def __call__(self, **features: Any) -> Any:
        t = self.const
        for name, x in features.items():
            t = t + self.coefs.get(name, 0.0) * x
        return t


@dataclass(frozen=True)
class PhaseModel:
    """A phase's cost, either one LinearCost or a table keyed by EP size (number of instances)."""

    name: str
    by_ep: Mapping[int, LinearCost]

    def at(self, num_instances: int) -> LinearCost:
        if len(self.by_ep) == 1:
            return next(iter(self.by_ep.values()))
        sizes = sorted(self.by_ep)
        if num_instances <= sizes[0]:
            return self.by_ep[sizes[0]]
        if num_instances >= sizes[-1]:
            return self.by_ep[sizes[-1]]
        if num_instances in self.by_ep:
            return self.by_ep[num_instances]
        hi = next(s for s in sizes if s > num_instances)
        lo = sizes[sizes.index(hi) - 1]
        w = (math.log2(num_instances) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        a, b = self.by_ep[lo], self.by_ep[hi]
        keys = set(a.coefs) | set(b.coefs)
        coefs = {k: (1 - w) * a.coefs.get(k, 0.0) + w * b.coefs.get(k, 0.0) for k in keys}
        return LinearCost((1 - w) * a.const + w * b.const, coefs)


@dataclass(frozen=True)
class Link:
    bandwidth_Bps: float
    latency_s: float

    def time(self, nbytes: np.ndarray) -> np.ndarray:
        """Latency + bytes / bandwidth where bytes > 0, else 0."""
        nbytes = np.asarray(nbytes, dtype=float)
        return np.where(nbytes > 0, self.latency_s + nbytes / self.bandwidth_Bps, 0.0)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_dense_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_bytes_per_element: int
    act_bytes_per_element: int
    num_experts: int
    top_k: int

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def q_bytes(self) -> int:
        """One routed query in latent form: heads x (kv_lora + rope) values."""
        return self.num_heads * (self.kv_lora_rank + self.qk_rope_head_dim) * self.act_bytes_per_element

    @property
    def res_bytes(self) -> int:
        """One routed partial result: heads x (o of kv_lora values + one fp32 lse)."""
        return self.num_heads * (self.kv_lora_rank * self.act_bytes_per_element + 4)

    @property
    def kv_bytes_per_token(self) -> int:
        """Latent KV bytes of one token over all layers."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes_per_element


@dataclass(frozen=True)
class PrefillCost:
    """Prefill FLOPs over a rate: linear per token plus causal attention per (query, key) pair."""

    linear_flops_per_token: float
    flops_per_token_pair: float
    flops_per_s: float

    def __call__(self, input_len: int) -> float:
        if input_len < 0:
            raise ProfileError(f"prefill length must be >= 0, got {input_len}")
        pairs = input_len * (input_len + 1) / 2
        return (self.linear_flops_per_token * input_len + self.flops_per_token_pair * pairs) / self.flops_per_s


# ---------------------------------------------------------------------------------------------------------------
# Iteration cost
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class IterationCost:
    """One decode iteration: its time and the per-phase split, per instance and for the slowest one.

    per_instance[phase] is [num_instances] seconds over the whole iteration; the four phases of an instance sum to
    total_s (its waiting for the lock-step barrier is counted in moe_a2a, as a profiler sees it).
    slowest_layer[phase] is one MoE layer of the slowest instance (the one with the largest pre-dispatch time),
    in seconds, with moe_a2a the pure dispatch + combine time.
    layer[phase] is one MoE layer (a dense layer in a model without MoE layers) of every instance, [num_instances]
    seconds; moe_a2a includes the instance's wait for the slowest one (module docstring).
    """

    total_s: float
    per_instance: dict[str, np.ndarray]
    slowest: int
    slowest_layer: dict[str, float]
    layer: dict[str, np.ndarray] = field(default_factory=dict)

    def slowest_breakdown(self) -> dict[str, float]:
        return {p: float(self.per_instance[p][self.slowest]) for p in BREAKDOWN}


@dataclass(frozen=True)
class RouteCounts:
    """Routed queries per layer, one entry per (request, remote shard): MoE instance src[k] -> shard dst[k]."""

    src: np.ndarray  # [Q] int64, MoE instance of the query
    dst: np.ndarray  # [Q] int64, instance holding the remote shard (!= src)
    num_instances: int

    @staticmethod
    def from_pairs(pairs: Iterable[tuple[int, int]], num_instances: int) -> RouteCounts:
        arr = np.array([(m, s) for m, s in pairs if m != s], dtype=np.int64).reshape(-1, 2)  # [Q, 2]
        return RouteCounts(arr[:, 0], arr[:, 1], num_instances)

    @staticmethod
    def from_matrix(count: np.ndarray) -> RouteCounts:
        """count[m, s] = queries from m to s; the diagonal (local shards) is ignored."""
        c = np.array(count, dtype=np.int64)
        np.fill_diagonal(c, 0)
        src, dst = np.nonzero(c)
        reps = c[src, dst]
        return RouteCounts(np.repeat(src, reps), np.repeat(dst, reps), len(c))

    @property
    def total(self) -> int:
        return len(self.src)

    @property
    def count(self) -> np.ndarray:
        """[I, I] queries from m to s."""
        c = np.zeros((self.num_instances, self.num_instances), dtype=np.int64)
        np.add.at(c, (self.src, self.dst), 1)
        return c


@dataclass(frozen=True)
class _Coefs:
    """Every phase's coefficients at one EP size, as plain floats (seconds)."""

    attn: float
    attn_kv: float
    attn_rows: float
    merge: float  # every layer and instance (output side of the merge)
    merge_partial: float
    merge_b: float
    dense: float
    dense_b: float
    shared: float
    shared_b: float
    mlp: float
    mlp_b: float
    expert: float
    expert_b: float
    a2a: float  # dispatch + combine
    a2a_b: float
    it: float
    it_b: float
    host: float
    host_b: float


@dataclass
class LatencyProfile:
    name: str
    kind: str
    model: ModelShape
    instances_per_node: int
    links: dict[str, Link]
    phases: dict[str, PhaseModel]
    memory: dict[str, float]
    prefill: PrefillCost | None
    kv_transfer_link: str = "rdma"
    kv_transfer_links: int = 1
    shared_cores: float | None = None  # instances share this many processors (CPU clusters); None: dedicated
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    _phase_cache: dict[tuple[str, int], LinearCost] = field(default_factory=dict, repr=False, compare=False)
    _coef_cache: dict[int, _Coefs] = field(default_factory=dict, repr=False, compare=False)

    # -- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, name_or_path: str | os.PathLike) -> LatencyProfile:
        """A profile by name (bench/profiles/<name>.json) or by path."""
        path = Path(name_or_path)
        if not path.is_file():
            path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise ProfileError(f"latency profile {name_or_path!r} not found (known: {', '.join(known)})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyProfile:
        if data.get("schema") != SCHEMA:
            raise ProfileError(f"profile schema must be {SCHEMA!r}, got {data.get('schema')!r}")
        unit = data.get("time_unit", "s")
        if unit not in TIME_UNITS:
            raise ProfileError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {unit!r}")
        scale = TIME_UNITS[unit]
        try:
            model = ModelShape(**{k: v for k, v in data["model"].items() if k != "name"})
        except (KeyError, TypeError) as e:
            raise ProfileError(f"bad or missing model section: {e}") from None
        phases = {name: _parse_phase(name, spec, scale) for name, spec in data.get("phases", {}).items()}
        missing = set(PHASE_FEATURES) - set(phases) - OPTIONAL_PHASES
        if missing:
            raise ProfileError(f"profile {data.get('name')!r} lacks phases {sorted(missing)}")
        cluster = data.get("cluster", {})
        links = {}
        for name in LINKS:
            spec = cluster.get("links", {}).get(name)
            if spec is None:
                raise ProfileError(f"profile lacks link {name!r}")
            links[name] = Link(spec["GBps"] * 1e9, spec["latency_us"] * 1e-6)
        pre = data.get("prefill")
        transfer = data.get("kv_transfer", {})
        return cls(
            name=data.get("name", "unnamed"),
            kind=data.get("kind", "unknown"),
            model=model,
            instances_per_node=int(cluster.get("instances_per_node", 8)),
            links=links,
            phases=phases,
            memory=dict(data.get("memory", {})),
            prefill=PrefillCost(**pre) if pre else None,
            kv_transfer_link=transfer.get("link", "rdma"),
            kv_transfer_links=int(transfer.get("links", 1)),
            shared_cores=_shared_cores(cluster.get("shared_cores")),
            raw=dict(data),
        )

    # -- per-phase functions (per layer, seconds; arrays broadcast) ------------------------------------------

    def phase(self, name: str, num_instances: int) -> LinearCost:
        key = (name, num_instances)
        cost = self._phase_cache.get(key)
        if cost is None:
            model = self.phases.get(name)
            cost = model.at(num_instances) if model is not None else LinearCost(0.0, {})
            self._phase_cache[key] = cost
        return cost

    def attention_time(self, kv_tokens: Any, shards: Any, num_instances: int = 1) -> Any:
        """Partial attention over the instance's shards: fixed + per (request, shard) row + per KV token."""
        return self.phase("attention", num_instances)(kv_tokens=kv_tokens, shards=shards)

    def cp_comm_time(self, routes: RouteCounts, node_of: np.ndarray) -> np.ndarray:
        """Per instance [I]: Q round + Res round over NVLink (same node) and RDMA (other nodes)."""
        n = routes.num_instances
        same = node_of[routes.src] == node_of[routes.dst]  # [Q]
        # Full duplex: a link's time follows the larger of what the instance sends and receives on it. Results
        # flow back one per query, so the Res round sees the same max(sent, received) counts as the Q round.
        n_nvl = np.maximum(
            np.bincount(routes.src[same], minlength=n), np.bincount(routes.dst[same], minlength=n)
        )  # [I]
        n_rdma = np.maximum(
            np.bincount(routes.src[~same], minlength=n), np.bincount(routes.dst[~same], minlength=n)
        )  # [I]
        nvl, rdma = self.links["nvlink"], self.links["rdma"]
        q_round = np.maximum(nvl.time(self.model.q_bytes * n_nvl), rdma.time(self.model.q_bytes * n_rdma))
        res_round = np.maximum(nvl.time(self.model.res_bytes * n_nvl), rdma.time(self.model.res_bytes * n_rdma))
        return q_round + res_round

    def merge_time(self, partials: Any, batch: Any = 0, num_instances: int = 1) -> Any:
        return self.phase("merge", num_instances)(partials=partials, batch=batch)

    def moe_a2a_time(self, max_batch: float, num_instances: int) -> tuple[float, float]:
        """(dispatch, combine) per MoE layer, driven by the largest batch (lock-step)."""
        return (
            float(self.phase("moe_dispatch", num_instances)(batch=max_batch)),
            float(self.phase("moe_combine", num_instances)(batch=max_batch)),
        )

    def kv_transfer_time(self, tokens: int, link: str | None = None, num_links: int | None = None) -> float:
        """Moving a request's KV (all layers) from prefill to decode over `num_links` parallel links."""
        if tokens < 0:
            raise ProfileError(f"token count must be >= 0, got {tokens}")
        name = link or self.kv_transfer_link
        if name not in self.links:
            raise ProfileError(f"unknown link {name!r} (known: {sorted(self.links)})")
        n = num_links or self.kv_transfer_links
        nbytes = tokens * self.model.kv_bytes_per_token
        return float(self.links[name].time(nbytes / n)) if tokens else 0.0

    def kv_capacity_tokens(self, num_instances: int) -> int:
        """KV tokens per instance left after weights (experts split over EP) and reserves."""
        m = self.memory
        needed = ("hbm_bytes", "usable_fraction", "weights_replicated_bytes", "weights_expert_bytes")
        if any(k not in m for k in needed):
            raise ProfileError(f"profile {self.name!r} has no memory budget; pass kv_capacity_tokens explicitly")
        free = (
            m["hbm_bytes"] * m["usable_fraction"]
            - m["weights_replicated_bytes"]
            - m["weights_expert_bytes"] / num_instances
            - m.get("reserve_bytes", 0.0)
        )
        if free <= 0:
            raise ProfileError(f"{num_instances} instances of {self.name!r} leave no memory for KV")
        return int(free // self.model.kv_bytes_per_token)

    def prefill_time(self, input_len: int) -> float:
        if self.prefill is None:
            raise ProfileError(f"profile {self.name!r} has no prefill model")
        return self.prefill(input_len)

    # -- one iteration ---------------------------------------------------------------------------------------

    def _coefs(self, num_instances: int) -> _Coefs:
        c = self._coef_cache.get(num_instances)
        if c is None:
            p = lambda name: self.phase(name, num_instances)  # noqa: E731
            batch = lambda name: p(name).coefs.get("batch", 0.0)  # noqa: E731
            att, disp, comb = p("attention"), p("moe_dispatch"), p("moe_combine")
            c = self._coef_cache[num_instances] = _Coefs(
                attn=att.const,
                attn_kv=att.coefs.get("kv_tokens", 0.0),
                attn_rows=att.coefs.get("shards", 0.0),
                merge=p("merge").const,
                merge_partial=p("merge").coefs.get("partials", 0.0),
                merge_b=batch("merge"),
                dense=p("dense").const,
                dense_b=batch("dense"),
                shared=p("shared_expert").const,
                shared_b=batch("shared_expert"),
                mlp=p("dense_mlp").const,
                mlp_b=batch("dense_mlp"),
                expert=p("expert").const,
                expert_b=batch("expert"),
                a2a=disp.const + comb.const,
                a2a_b=batch("moe_dispatch") + batch("moe_combine"),
                it=p("iteration").const,
                it_b=batch("iteration"),
                host=p("host").const,
                host_b=batch("host"),
            )
        return c

    def iteration_cost(
        self,
        kv_tokens: Sequence[float],
        shards: Sequence[float],
        batch: Sequence[float],
        routes: RouteCounts | None = None,
        node_of: Sequence[int] | None = None,
        num_instances: int | None = None,
    ) -> IterationCost:
        """Cost of one iteration given per-instance KV tokens, shard rows and MoE batch ([I] each).

        num_instances (the EP size the phase tables are read at) defaults to the arrays' length; the ideal bound
        passes one representative instance of a larger cluster.
        """
        kv = np.asarray(kv_tokens, dtype=float)
        rows = np.asarray(shards, dtype=float)
        b = np.asarray(batch, dtype=float)
        if len(b) == 0 or not len(kv) == len(rows) == len(b):
            raise ProfileError(f"need equal non-empty per-instance arrays, got {len(kv)}, {len(rows)}, {len(b)}")
        c = self._coefs(num_instances or len(b))
        attn = c.attn + c.attn_kv * kv + c.attn_rows * rows  # [I] per layer
        cp = 0.0
        if routes is not None and routes.total:
            nodes = np.arange(len(b)) // self.instances_per_node if node_of is None else np.asarray(node_of)
            partials = np.bincount(routes.src, minlength=len(b))  # remote partials merged at each MoE instance
            cp = self.cp_comm_time(routes, nodes) + c.merge_partial * partials
        cp = np.broadcast_to(cp, b.shape)
        n_moe, n_dense = self.model.num_moe_layers, self.model.num_dense_layers
        b_max, b_mean = float(b.max()), float(b.mean())
        a2a = c.a2a + c.a2a_b * b_max  # dispatch + combine, lock-step on the largest batch
        expert = c.expert + c.expert_b * b_mean  # every instance receives mean batch x top-k rows
        local = c.dense + c.dense_b * b + c.merge + c.merge_b * b  # [I]
        pre = attn + cp + local + (c.shared + c.shared_b * b)  # [I] MoE layer up to dispatch
        dlayer = attn + cp + local + (c.mlp + c.mlp_b * b)  # [I] dense layer
        iter_local = c.it + c.it_b * b  # [I]
        if n_moe > 0:
            first = n_dense * dlayer + pre if n_dense else pre
            total = float(first.max()) + (n_moe - 1) * float(pre.max()) + n_moe * (a2a + expert)
        else:
            total = float((n_dense * dlayer).max())
        total += float(iter_local.max())
        if self.shared_cores is not None:
            moe_own = c.a2a + c.a2a_b * b + expert  # [I] all-to-all work at the instance's own batch
            work = n_dense * dlayer + n_moe * (pre + moe_own) + iter_local  # [I]
            total = max(total, float(work.sum()) / self.shared_cores)
        host = c.host + c.host_b * float(b.sum())  # the driver's serial part of the iteration
        total += host

        n_layers = n_moe + n_dense
        other = n_dense * (dlayer - attn - cp) + n_moe * (pre - attn - cp + expert) + iter_local + host
        per_instance = {"attention": n_layers * attn, "cp_comm": n_layers * cp, "other": other}
        per_instance["moe_a2a"] = total - per_instance["attention"] - per_instance["cp_comm"] - other
        body = pre if n_moe > 0 else dlayer  # [I] one layer up to the all-to-all
        slowest = int(np.argmax(body))
        layer = {
            "attention": attn.copy(),
            "cp_comm": np.array(cp, dtype=float),
            "moe_a2a": (a2a + body.max() - body) if n_moe > 0 else np.zeros_like(body),
            "other": body - attn - cp + (expert if n_moe > 0 else 0.0),
        }
        slowest_layer = {k: float(v[slowest]) for k, v in layer.items()}
        return IterationCost(total, per_instance, slowest, slowest_layer, layer)

    def ideal_iteration_time(self, total_kv_tokens: float, total_batch: float, num_instances: int) -> float:
        """The same work perfectly balanced (mean KV, mean batch, one shard per request) with no CP traffic."""
        c = self._coefs(num_instances)
        kv, b = total_kv_tokens / num_instances, total_batch / num_instances
        attn = c.attn + c.attn_kv * kv + c.attn_rows * b
        local = attn + c.dense + c.dense_b * b + c.merge + c.merge_b * b
        pre = local + c.shared + c.shared_b * b
        dlayer = local + c.mlp + c.mlp_b * b
        n_moe, n_dense = self.model.num_moe_layers, self.model.num_dense_layers
        moe = c.a2a + c.a2a_b * b + c.expert + c.expert_b * b
        body = n_dense * dlayer + n_moe * (pre + moe) if n_moe > 0 else n_dense * dlayer
        per_instance = body + c.it + c.it_b * b
        if self.shared_cores is not None:
            per_instance = max(per_instance, num_instances * per_instance / self.shared_cores)
        return per_instance + c.host + c.host_b * total_batch


def _shared_cores(value: Any) -> float | None:
    if value is None:
        return None
    try:
        cores = float(value)
    except (TypeError, ValueError):
        raise ProfileError(f"cluster.shared_cores must be a number, got {value!r}") from None
    if not cores > 0:
        raise ProfileError(f"cluster.shared_cores must be > 0, got {value!r}")
    return cores


def _parse_phase(name: str, spec: Mapping[str, Any], scale: float) -> PhaseModel:
    if name not in PHASE_FEATURES:
        raise ProfileError(f"unknown phase {name!r} (known: {sorted(PHASE_FEATURES)})")
    table = spec["by_ep"] if "by_ep" in spec else {"0": spec}
    by_ep = {}
    for ep, coefs in table.items():
        unknown = set(coefs) - {"const", *PHASE_FEATURES[name]}
        if unknown:
            raise ProfileError(f"phase {name!r} has unknown coefficients {sorted(unknown)}")
        if any(float(v) < 0 for v in coefs.values()):
            raise ProfileError(f"phase {name!r} has a negative coefficient: {dict(coefs)}")
        by_ep[int(ep)] = LinearCost(
            float(coefs.get("const", 0.0)) * scale,
            {f: float(coefs[f]) * scale for f in PHASE_FEATURES[name] if f in coefs},
        )
    return PhaseModel(name, by_ep)


# ---------------------------------------------------------------------------------------------------------------
# Fitting a profile from measured per-phase timings
# ---------------------------------------------------------------------------------------------------------------


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x c - y|| subject to c >= 0, exactly, by trying every support (phases have <= 3 columns)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
    for k in range(1, x.shape[1] + 1):
        for support in itertools.combinations(range(x.shape[1]), k):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            err = float(np.sum((x[:, cols] @ sol - y) ** 2))
            if err < best_err - 1e-18:
                best, best_err = np.zeros(x.shape[1]), err
                best[cols] = sol
    return best


def fit_linear_cost(records: Sequence[Mapping[str, Any]], features: Sequence[str]) -> dict[str, float]:
    """Least-squares `const` and per-feature coefficients (all >= 0) from records with those keys + seconds."""
    if len(records) < len(features) + 1:
        raise ProfileError(f"need at least {len(features) + 1} records to fit {list(features)}, got {len(records)}")
    try:
        x = np.array([[1.0] + [float(r[f]) for f in features] for r in records])  # [N, 1 + F]
        y = np.array([float(r["seconds"]) for r in records])  # [N]
    except KeyError as e:
        raise ProfileError(f"timing record lacks {e}") from None
    coef = nonnegative_lstsq(x, y)
    return {"const": float(coef[0])} | {f: float(c) for f, c in zip(features, coef[1:])}


def _fit_link(recs: Sequence[Mapping[str, Any]], link_name: str, base: LatencyProfile | None) -> dict[str, float]:
    """GBps and latency_us of one link from its cp_comm records.

    When the transfer times do not grow with bytes (latency-bound sizes, or noise larger than the bandwidth term),
    the bandwidth cannot be resolved: it is taken from the base profile and only the latency is fitted.
    """
    fit = fit_linear_cost(recs, ("bytes",))
    if fit["bytes"] > 0:
        return {"GBps": 1.0 / fit["bytes"] / 1e9, "latency_us": fit["const"] * 1e6}
    if base is None:
        raise ProfileError(
            f"cp_comm records over {link_name} do not grow with bytes and no base profile gives its bandwidth"
        )
    bandwidth = base.links[link_name].bandwidth_Bps
    residual = [float(r["seconds"]) - float(r["bytes"]) / bandwidth for r in recs]
    return {"GBps": bandwidth / 1e9, "latency_us": max(0.0, float(np.mean(residual))) * 1e6}


def fit_profile_from_timing_log(
    records: Iterable[Mapping[str, Any]],
    base: LatencyProfile | Mapping[str, Any] | None = None,
    name: str = "cpu-tiny",
    *,
    model: Mapping[str, int] | None = None,
    instances_per_node: int = 1,
) -> dict[str, Any]:
    """Fit every phase's coefficients from per-phase timing records; returns a profile dict (time_unit "s").

    A record is a dict with `phase` (a name of PHASE_FEATURES, or `cp_comm`), `seconds`, and that phase's
    features (kv_tokens, shards, batch, partials; for cp_comm: `bytes` and `link` nvlink|rdma). Phases or links
    without records keep the coefficients of `base` (a profile or profile dict, which also gives the model shape,
    memory and prefill sections; a link whose records do not resolve a bandwidth keeps the base's). Without a base,
    `model` (ModelShape fields) is required and the records must cover every phase and both links.
    """
    by_phase: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        by_phase.setdefault(str(r.get("phase")), []).append(r)
    unknown = set(by_phase) - set(PHASE_FEATURES) - {"cp_comm"}
    if unknown:
        raise ProfileError(f"timing records name unknown phases {sorted(unknown)}")
    if base is None:
        if model is None:
            raise ProfileError("fitting without a base profile needs the model shape (model=...)")
        base_dict: dict[str, Any] = {"schema": SCHEMA, "model": dict(model)}
        base_dict["cluster"] = {"instances_per_node": instances_per_node}
        base_profile = None
    else:
        base_dict = dict(base.raw if isinstance(base, LatencyProfile) else base)
        base_profile = LatencyProfile.from_dict(base_dict)

    phases: dict[str, Any] = {}
    for phase, feats in PHASE_FEATURES.items():
        if phase in by_phase:
            phases[phase] = fit_linear_cost(by_phase[phase], feats)
        elif phase in OPTIONAL_PHASES and (base_profile is None or phase not in base_profile.phases):
            continue
        elif base_profile is None:
            raise ProfileError(f"no timing records for phase {phase!r} and no base profile to take it from")
        else:  # keep the base's coefficients, converted to seconds
            table = {str(ep): {"const": c.const} | dict(c.coefs) for ep, c in base_profile.phases[phase].by_ep.items()}
            phases[phase] = next(iter(table.values())) if len(table) == 1 else {"by_ep": table}
    links = {}
    for link_name in LINKS:
        recs = [r for r in by_phase.get("cp_comm", []) if r.get("link", "nvlink") == link_name]
        if recs:
            links[link_name] = _fit_link(recs, link_name, base_profile)
        elif base_profile is None:
            raise ProfileError(f"no cp_comm records over {link_name} and no base profile to take the link from")
        else:
            link = base_profile.links[link_name]
            links[link_name] = {"GBps": link.bandwidth_Bps / 1e9, "latency_us": link.latency_s * 1e6}

    out = dict(base_dict)
    out.update(
        name=name,
        kind="measured",
        time_unit="s",
        phases=phases,
        cluster=dict(base_dict.get("cluster", {})) | {"links": links},
        provenance={
            "phases": f"least-squares fit (coefficients >= 0) of {sum(map(len, by_phase.values()))} "
            "timing records from the CPU data plane; unfitted phases copied from the base profile"
        },
    )
    LatencyProfile.from_dict(out)  # the result must load
    return out
