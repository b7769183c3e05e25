"""One DeepSeek-V3 decode layer timed phase by phase on one device, fitted into a measured latency profile.

    python -m nanocp.bench.gpu_layer --device cuda|cpu [--tiny] [--budget-s S] [--base PROFILE] --out DIR

Random weights at the model's real dimensions (bf16 on CUDA; fp32 on CPU by default), one layer, one DP-EP
instance. Each phase of `bench/latency_profile.py` that one device can run is timed over a grid of batch sizes and
context lengths, with the project's own code where it exists:

- dense (feature batch): decode_layers.project (input RMSNorm, fused q_a|kv_a GEMM, q/kv norms, q_b, W_UK per
  head, RoPE), add_attention_output (W_UV per head, o_proj, residual), ffn_input (post-attention RMSNorm);
- attention (kv_tokens, shards): models.mla_paged_attention_with_lse over [P, page, 576] latent pages (FlashMLA
  where flash_mla imports), rows of whole requests and CP shards of one request;
- merge (partials, batch): the routing kernels' merge_routed (Triton on CUDA) of one local + K-1 received partials
  per row, as the MoE instance merges them (and models.merge_attention_partials at a few points);
- shared_expert (batch): decode_layers.moe_gate (sigmoid, group-limited top-k) + the shared expert's SwiGLU;
- expert (batch, per EP size): the instance's 256/EP routed experts over mean_batch x top_k received rows:
  torch._grouped_mm, one GEMM pair per expert, or decode_layers.slab_experts (bmm over the static slab);
- dense_mlp (batch): the dense layers' SwiGLU MLP;
- iteration (batch): final RMSNorm + lm_head + argmax.

Timing: CUDA events (median over repetitions after warm-up; a point under `Grid.graph_max_s` is also captured in a
CUDA graph and its replay timed, which is how the data plane runs decode on CUDA); time.perf_counter on CPU.
The budget is wall-clock: a first pass measures a few spread points of every phase (enough to fit each), a second
the rest of the grid; once the budget is spent the remaining points are skipped and listed. A phase or point that
fails (out of memory, an unsupported kernel) is recorded with its error and the run goes on.

`fit_profile` turns the timings into a `nanocp-latency-profile/1` profile: the measured phases are least-squares
fits (coefficients >= 0); links, MoE dispatch/combine, prefill and KV transfer, which one GPU cannot measure, come
from a base profile (h200-deepseek-v3 by default). `compare_profiles` puts it next to the published-figure profile.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanocp.data_plane import cpu_kernels
from nanocp.data_plane.decode_layers import (
    DecodeWeights,
    GroupedExperts,
    Linear,
    RopeTable,
    add_attention_output,
    add_mlp,
    ffn_input,
    moe_gate,
    norm,
    project,
    slab_experts,
    swiglu,
)
from nanocp.data_plane.kernels import select_routing_kernels
from nanocp.models import (
    ModelConfig,
    RotaryEmbedding,
    YarnScaling,
    build_weights,
    hf_tensor_shapes,
    merge_attention_partials,
    mla_paged_attention_with_lse,
)

from .latency_profile import PHASE_FEATURES, TIME_UNITS, LatencyProfile, ProfileError, fit_linear_cost

SCHEMA = "nanocp-gpu-layer/1"
PHASE_ORDER = ("dense", "attention", "expert", "shared_expert", "merge", "dense_mlp", "iteration")
DEFAULT_BASE = "h200-deepseek-v3"
WEIGHT_STD = 0.02


# ---------------------------------------------------------------------------------------------------------------
# Dimensions and grid
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerDims:
    """One DeepSeek-V3 layer's dimensions (defaults: the real model) and the instance's main EP size."""

    hidden: int = 7168
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    num_experts: int = 256
    top_k: int = 8
    n_group: int = 8
    topk_group: int = 4
    moe_intermediate: int = 2048
    n_shared: int = 1
    dense_intermediate: int = 18432
    vocab: int = 129280
    page_size: int = 64
    ep_size: int = 32  # the EP group the main expert grid assumes (256 / 32 = 8 local experts)
    name: str = "deepseek-v3"

    @classmethod
    def tiny(cls) -> LayerDims:
        """Small enough for a CPU dry run in seconds; the widths keep DeepSeek-V3's non-absorbed MLA path."""
        return cls(
            hidden=64,
            heads=4,
            q_lora=64,
            kv_lora=32,
            qk_nope=8,
            qk_rope=16,
            v_head=8,
            num_experts=16,
            top_k=2,
            n_group=4,
            topk_group=2,
            moe_intermediate=32,
            n_shared=1,
            dense_intermediate=128,
            vocab=512,
            page_size=16,
            ep_size=4,
            name="tiny",
        )

    def config(self) -> ModelConfig:
        """A one-layer ModelConfig with these widths (DeepSeek-V3's YaRN rope and gate rule)."""
        return ModelConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.dense_intermediate,
            moe_intermediate_size=self.moe_intermediate,
            num_hidden_layers=1,
            num_attention_heads=self.heads,
            q_lora_rank=self.q_lora,
            kv_lora_rank=self.kv_lora,
            qk_nope_head_dim=self.qk_nope,
            qk_rope_head_dim=self.qk_rope,
            v_head_dim=self.v_head,
            n_routed_experts=self.num_experts,
            n_shared_experts=self.n_shared,
            num_experts_per_tok=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=0,
            rope_scaling=YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0),
            max_position_embeddings=163840,
            eos_token_ids=(min(1, self.vocab - 1),),
            dtype="bfloat16",
            name=f"{self.name}-one-layer",
        )

    def local_experts(self, ep: int) -> int:
        return self.num_experts // ep


@dataclass(frozen=True)
class Grid:
    """The points each phase is timed at, and how long each point is repeated."""

    batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256)  # dense, shared_expert, expert (main EP), dense_mlp, iteration
    attention_rows: tuple[int, ...] = (1, 8, 32, 64, 128, 256)  # (request, shard) rows on the instance
    context_lens: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072)  # tokens per row
    shard_splits: tuple[tuple[int, int], ...] = ((131072, 2), (131072, 4), (131072, 8), (32768, 4))  # (len, S)
    max_kv_tokens: int = 4 << 20  # attention points with rows x len above this are left out (memory)
    merge_parts: tuple[int, ...] = (1, 2, 3, 4, 8)  # K partials per row: the local one + K - 1 received
    merge_batches: tuple[int, ...] = (1, 8, 64, 256)
    ep_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    ep_batches: tuple[int, ...] = (1, 64, 256)  # batches timed at EP sizes other than dims.ep_size
    warmup: int = 2
    min_reps: int = 3
    max_reps: int = 20
    target_point_s: float = 0.05  # repetitions per point ~ this much time (within min_reps..max_reps)
    cuda_graphs: bool = True
    graph_max_s: float = 2e-3  # points faster than this (eager) are also timed as CUDA graph replays
    graph_calls: int = 10  # calls captured back to back in one graph

    @classmethod
    def tiny(cls) -> Grid:
        return cls(
            batches=(1, 4, 16),
            attention_rows=(1, 4, 8),
            context_lens=(64, 256),
            shard_splits=((256, 2), (256, 4)),
            max_kv_tokens=2048,
            merge_parts=(1, 2, 4),
            merge_batches=(1, 4),
            ep_sizes=(2, 4, 8, 16),
            ep_batches=(1, 16),
            warmup=1,
            min_reps=2,
            max_reps=3,
            target_point_s=0.002,
        )


def _spread(values: Sequence[Any], k: int) -> list[Any]:
    """Up to k elements of values, evenly spread, first and last included."""
    if len(values) <= k:
        return list(values)
    idx = sorted({round(i * (len(values) - 1) / (k - 1)) for i in range(k)})
    return [values[i] for i in idx]


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _repeat(fn: Callable[[], Any], reps: int, device: torch.device) -> list[float]:
    """Seconds of each of `reps` calls: CUDA events on CUDA, perf_counter elsewhere."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) * 1e-3 for start, end in events]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _time_graph(fn: Callable[[], Any], reps: int, device: torch.device, calls: int) -> float:
    """Median seconds of one call of fn as a CUDA graph: `calls` calls captured back to back in one graph (after a
    warm-up on a side stream), each replay timed and divided by `calls`, so one replay launch is spread over them
    (the data plane chains a layer's phases in one graph)."""
    _free(device)  # eager blocks are not reused by the graph's private pool
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                out = fn()
        graph.replay()
        times = _repeat(graph.replay, reps, device)
        del out
    finally:
        del graph
        _free(device)
    return statistics.median(times) / calls


def _measure(fn: Callable[[], Any], device: torch.device, grid: Grid) -> dict[str, Any]:
    """Time fn: warm-up, a probe call to size the repetitions, then the median of those; on CUDA a fast point is
    also timed as a graph replay. `seconds` is the graph replay's time where there is one, else eager."""
    for _ in range(max(1, grid.warmup)):
        fn()
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    probe = time.perf_counter() - t
    reps = int(min(grid.max_reps, max(grid.min_reps, math.ceil(grid.target_point_s / max(probe, 1e-7)))))
    times = _repeat(fn, reps, device)
    out: dict[str, Any] = {"eager_s": statistics.median(times), "min_s": min(times), "reps": reps}
    if device.type == "cuda" and grid.cuda_graphs and out["eager_s"] <= grid.graph_max_s:
        try:
            out["graph_s"] = _time_graph(fn, reps, device, grid.graph_calls)
            out["graph_calls"] = grid.graph_calls
        except Exception as e:  # a capture-unsafe op: eager time only
            out["graph_error"] = _one_line(e)
    out["seconds"] = out.get("graph_s", out["eager_s"])
    out["mode"] = "cuda_graph" if "graph_s" in out else "eager"
    return out


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _free(device: torch.device) -> None:
    """Return cached memory to the device (never raises: it also runs after a failed point)."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception:
            pass


def _random(shape: Sequence[int], device: torch.device, dtype: torch.dtype, std: float = WEIGHT_STD) -> torch.Tensor:
    return torch.randn(tuple(shape), device=device, dtype=dtype).mul_(std)


def _seeded(shape: Sequence[int], seed: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values from a generator on the device itself (inputs are made where they are used)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)


def _path(t: torch.Tensor) -> str:
    """Which branch of the eager decode math a tensor takes: the fused CPU kernels or torch."""
    return "cpu_kernels" if cpu_kernels.usable(t) else "torch"


# ---------------------------------------------------------------------------------------------------------------
# Inputs shared with the tests
# ---------------------------------------------------------------------------------------------------------------


class _DeviceRandomSource:
    """A models.TensorSource of random weights made on the device (std WEIGHT_STD, norms 1): a real-size layer in
    a moment, where the seeded CPU source (models.RandomTensorSource) would take minutes."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.shapes = hf_tensor_shapes(config, expert_ids=set())
        self.device, self.dtype = device, dtype

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name)

    def read(self, name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(self.shapes[name], device=self.device, dtype=self.dtype)
        return _random(self.shapes[name], self.device, self.dtype)

    def read_index(self, name: str, index: int) -> torch.Tensor:
        return self.read(name)[index]


def build_layer(
    dims: LayerDims, device: torch.device | str, dtype: torch.dtype, *, mlp: bool = False
) -> tuple[ModelConfig, Any, RotaryEmbedding]:
    """Random weights of one layer without routed experts, prepared as a decode instance prepares them
    (models.build_weights, then DecodeWeights.build): a dense layer (its MLP) with `mlp`, else a MoE layer (gate and
    shared expert). -> (config, DecodeLayerWeights, rope)."""
    c, device = dims.config(), torch.device(device)
    if mlp:
        c = dataclasses.replace(c, first_k_dense_replace=1)
    model = build_weights(c, _DeviceRandomSource(c, device, dtype), expert_ids=set(), dtype=dtype, device=device)
    return c, DecodeWeights.build(model).layers[0], model.rope


@dataclass
class AttentionCase:
    """Inputs of one attention point: rows = requests x shards_per_request rows of row_tokens tokens each; the
    rows of one request share its query (CP shards of one request). Row r owns pages [r * n, (r + 1) * n)."""

    q: torch.Tensor  # [rows, H, kv_lora + rope]
    kv_pages: torch.Tensor  # [P, page, kv_lora + rope]
    block_table: torch.Tensor  # int32 [rows, n]
    lens: torch.Tensor  # int32 [rows]
    scale: float
    v_dim: int

    def run(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> o [rows, H, v_dim], lse [rows, H] fp32."""
        return fn(self.q, self.kv_pages, self.block_table, self.lens, self.scale, self.v_dim)


def make_kv_pool(dims: LayerDims, pages: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Random latent KV pages [pages, page, kv_lora + rope] (values of a normed latent: unit scale)."""
    return torch.randn(pages, dims.page_size, dims.kv_lora + dims.qk_rope, device=device, dtype=dtype)


def attention_case(
    dims: LayerDims,
    kv_pool: torch.Tensor,
    requests: int,
    shards_per_request: int,
    row_tokens: int,
    seed: int = 0,
) -> AttentionCase:
    """An attention point over `kv_pool` (which must hold rows x ceil(row_tokens / page) pages)."""
    rows, n = requests * shards_per_request, -(-row_tokens // dims.page_size)
    if rows * n > kv_pool.shape[0]:
        raise ValueError(f"{rows} rows of {n} pages need {rows * n} pages, the pool has {kv_pool.shape[0]}")
    device, dtype = kv_pool.device, kv_pool.dtype
    q = _seeded((requests, dims.heads, dims.kv_lora + dims.qk_rope), seed, device, dtype)  # [requests, H, Dqk]
    q = q.repeat_interleave(shards_per_request, dim=0)  # [rows, H, Dqk]
    table = torch.arange(rows * n, dtype=torch.int32, device=device).view(rows, n)
    lens = torch.full((rows,), row_tokens, dtype=torch.int32, device=device)
    return AttentionCase(q, kv_pool, table, lens, dims.config().softmax_scale, dims.kv_lora)


def attention_implementations(dims: LayerDims, device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """Shard attention implementations that can run here: the torch reference, the Triton split-KV kernel on a CUDA
    device, and FlashMLA where it imports."""
    impls: dict[str, Any] = {"reference": mla_paged_attention_with_lse}
    from nanocp.data_plane.backends.flashmla import FlashMLAAttention, flashmla_unavailable_reason
    from nanocp.data_plane.kernels import triton_unavailable_reason

    if triton_unavailable_reason(torch.device(device)) is None:
        from nanocp.data_plane.backends.triton_mla import TritonMLAAttention

        impls["triton-mla"] = TritonMLAAttention()
    dims_ok = dims.kv_lora + dims.qk_rope == 576 and dims.kv_lora == 512
    if dims_ok and flashmla_unavailable_reason(device, dims.page_size, dtype) is None:
        impls["flashmla"] = FlashMLAAttention()
    return impls


def merge_inputs(
    dims: LayerDims, batch: int, parts: int, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the MoE instance merges: each of `batch` rows has its local partial and parts - 1 received ones.
    -> o [batch, H, kv_lora], lse [batch, H] fp32, res [batch * (parts - 1), H, kv_lora + 1] fp32 (received o |
    lse), index int64 [batch, parts] (local row b, then received rows batch + b * (parts - 1) + j)."""
    heads, dv = dims.heads, dims.kv_lora
    o = _seeded((batch, heads, dv), seed, device, dtype)
    lse = _seeded((batch, heads), seed + 1, device, torch.float32)
    res = _seeded((batch * (parts - 1), heads, dv + 1), seed + 2, device, torch.float32)
    received = batch + torch.arange(batch * (parts - 1), dtype=torch.int64).view(batch, parts - 1)
    index = torch.cat([torch.arange(batch, dtype=torch.int64)[:, None], received], dim=1).to(device)
    return o, lse, res, index


def stacked_partials(
    o: torch.Tensor, lse: torch.Tensor, res: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_inputs as K stacked partials for models.merge_attention_partials -> os [K, B, H, Dv], lses [K, B, H]."""
    dv = o.shape[-1]
    all_o = torch.cat([o, res[..., :dv].to(o.dtype)])  # [B + R, H, Dv]
    all_lse = torch.cat([lse, res[..., dv]])  # [B + R, H]
    return all_o[index.T], all_lse[index.T]


@dataclass
class ExpertCase:
    """One instance's routed experts over `rows` received tokens, split as evenly as routing allows."""

    x: torch.Tensor  # [R, D] received tokens, sorted by local expert
    counts: list[int]  # [E] rows per local expert (sum R)
    offs: torch.Tensor  # int32 [E] cumulative counts (torch._grouped_mm)
    recv_x: torch.Tensor  # [E, width, D] the static receive slab (rows past counts[e] are zero)
    slab_out: torch.Tensor  # [E, width, D]
    gate_up: torch.Tensor  # [E, D, 2I]
    down: torch.Tensor  # [E, I, D]
    grouped: GroupedExperts

    @classmethod
    def make(cls, gate_up: torch.Tensor, down: torch.Tensor, counts: Sequence[int], seed: int = 0) -> ExpertCase:
        e, d = gate_up.shape[0], gate_up.shape[1]
        device, dtype = gate_up.device, gate_up.dtype
        x = _seeded((int(sum(counts)), d), seed, device, dtype)
        width = max(1, max(counts))
        recv_x = torch.zeros(e, width, d, device=device, dtype=dtype)
        start = 0
        for i, n in enumerate(counts):
            recv_x[i, :n] = x[start : start + n]
            start += n
        offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
        grouped = GroupedExperts(gate_up, down)
        return cls(x, list(counts), offs, recv_x, torch.empty_like(recv_x), gate_up, down, grouped)

    def loop(self) -> torch.Tensor:
        """One GEMM pair per expert with rows (the data plane's segment path) -> [R, D]."""
        y, start = torch.empty_like(self.x), 0
        for e, n in enumerate(self.counts):
            if n:
                part = slice(start, start + n)
                torch.mm(swiglu(self.x[part] @ self.gate_up[e]), self.down[e], out=y[part])
                start += n
        return y

    def grouped_mm(self) -> torch.Tensor:
        """Two torch._grouped_mm calls over the sorted rows -> [R, D]."""
        h = torch._grouped_mm(self.x, self.gate_up, offs=self.offs)  # [R, 2I]
        return torch._grouped_mm(swiglu(h), self.down, offs=self.offs)

    def slab(self) -> torch.Tensor:
        """decode_layers.slab_experts: every expert over its whole slab (two bmm's) -> [E, width, D]."""
        slab_experts(self.grouped, self.recv_x, self.slab_out)
        return self.slab_out

    def slab_rows(self) -> torch.Tensor:
        """The slab output's used rows, in the sorted order of x -> [R, D]."""
        return torch.cat([self.slab_out[e, :n] for e, n in enumerate(self.counts) if n])


def balanced_counts(rows: int, experts: int) -> list[int]:
    """rows split over experts as evenly as possible (the first rows % experts get one more)."""
    return [rows // experts + (1 if e < rows % experts else 0) for e in range(experts)]


def verify_experts(case: ExpertCase) -> dict[str, str | None]:
    """Each expert implementation against the per-expert loop: None where it runs and agrees (within bf16/fp32
    tolerance, relative to the largest output), else why not."""
    ref = case.loop().float()
    tol = 1e-4 if case.x.dtype == torch.float32 else 3e-2
    scale = float(ref.abs().max()) or 1.0
    result: dict[str, str | None] = {"loop": None}
    checks = {"grouped_mm": case.grouped_mm, "slab_bmm": lambda: (case.slab(), case.slab_rows())[1]}
    for name, fn in checks.items():
        if name == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            result[name] = f"torch {torch.__version__} has no torch._grouped_mm"
            continue
        try:
            err = float((fn().float() - ref).abs().max()) / scale
        except Exception as e:
            result[name] = _one_line(e)
            continue
        result[name] = None if err <= tol else f"differs from the per-expert loop: max error {err:.2e} > {tol:g}"
    return result


# ---------------------------------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------------------------------


class _Bench(ABC):
    """One phase: its grid points in priority order, the weights it needs, and the timed call per implementation."""

    name = ""
    code = ""

    def __init__(self, dims: LayerDims, grid: Grid, device: torch.device, dtype: torch.dtype) -> None:
        self.dims, self.grid, self.device, self.dtype = dims, grid, device, dtype
        self.notes: dict[str, Any] = {}

    @abstractmethod
    def points(self) -> list[dict[str, Any]]:
        """Grid points (features + labels) with `core` (measured in the first pass), core ones first."""

    @abstractmethod
    def build(self) -> None:
        """Make the weights / pools the timed calls read."""

    @abstractmethod
    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        """The timed call of each implementation at `point`."""

    def free(self) -> None:
        """Drop what build() made (weights, pools), keeping the configuration and the notes."""
        for key in [k for k in vars(self) if k not in ("dims", "grid", "device", "dtype", "notes")]:
            delattr(self, key)

    def choose(self, points: list[dict[str, Any]]) -> str | None:
        """The implementation the profile is fitted on: the one measured at the most points (ties: the first)."""
        counts: dict[str, int] = {}
        for p in points:
            for impl, r in p.get("by_impl", {}).items():
                counts[impl] = counts.get(impl, 0) + int("seconds" in r)
        best = max(counts, key=lambda k: counts[k]) if counts else None
        return best if best is not None and counts[best] else None

    def _batch_points(self, batches: Sequence[int]) -> list[dict[str, Any]]:
        core = set(_spread(batches, 3))
        pts = [{"batch": b, "core": b in core} for b in batches]
        return sorted(pts, key=lambda p: not p["core"])


class _DenseBench(_Bench):
    name = "dense"
    code = (
        "data_plane.decode_layers.project (input RMSNorm, fused q_a|kv_a GEMM, q/kv norms, q_b, W_UK per head, "
        "RoPE) + add_attention_output (W_UV per head, o_proj, residual) + ffn_input (post-attention RMSNorm)"
    )

    def points(self) -> list[dict[str, Any]]:
        return self._batch_points(self.grid.batches)

    def build(self) -> None:
        self.c, self.w, self.rope = build_layer(self.dims, self.device, self.dtype)
        self.notes["absorbed_query"] = self.w.attn.w_uk is None
        self.notes["absorbed_output"] = self.w.attn.w_uv is None

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        b, c, w, dev = point["batch"], self.c, self.w, self.device
        h = torch.randn(b, c.hidden_size, device=dev, dtype=self.dtype)
        o_latent = torch.randn(b, c.num_attention_heads, c.kv_lora_rank, device=dev, dtype=self.dtype)
        positions = torch.randint(0, c.max_position_embeddings, (b,), device=dev)
        rope = RopeTable.at(self.rope, positions)  # per sub-step, shared by every layer: not timed

        def dense() -> tuple[torch.Tensor, ...]:
            q_latent, kv_new = project(w, c, h, rope)
            return q_latent, kv_new, ffn_input(w, c, add_attention_output(w, h, o_latent))

        return {f"decode_layers/{_path(h)}": dense}


class _AttentionBench(_Bench):
    name = "attention"
    code = (
        "models.mla_paged_attention_with_lse (torch reference), the Triton split-KV kernel on CUDA "
        "(data_plane/backends/triton_mla.py), FlashMLA where flash_mla imports"
    )

    def points(self) -> list[dict[str, Any]]:
        g = self.grid
        core_rows, core_lens = set(_spread(g.attention_rows, 3)), set(_spread(g.context_lens, 3))
        pts = []
        for length in g.context_lens:
            for rows in g.attention_rows:
                if rows * length <= g.max_kv_tokens:
                    core = rows in core_rows and length in core_lens
                    pts.append({"requests": rows, "shards_per_request": 1, "row_tokens": length, "core": core})
        for i, (length, shards) in enumerate(g.shard_splits):
            if length <= g.max_kv_tokens:
                pts.append({"requests": 1, "shards_per_request": shards, "row_tokens": -(-length // shards)})
                pts[-1]["core"] = i == 0
        for p in pts:
            p["shards"] = p["requests"] * p["shards_per_request"]
            p["kv_tokens"] = p["shards"] * p["row_tokens"]
        return sorted(pts, key=lambda p: (not p["core"], p["kv_tokens"]))

    def build(self) -> None:
        ps = self.dims.page_size
        pages = max((p["shards"] * -(-p["row_tokens"] // ps) for p in self.points()), default=1)
        self.pool = make_kv_pool(self.dims, pages, self.device, self.dtype)
        self.impls = attention_implementations(self.dims, self.device, self.dtype)
        self.notes["implementations"] = sorted(self.impls)
        self.notes["kv_pool_pages"] = pages

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        case = attention_case(self.dims, self.pool, point["requests"], point["shards_per_request"], point["row_tokens"])
        impls = self.impls
        if len(impls) > 1 and not point["core"]:  # the slow reference only at the first pass's points
            impls = {k: v for k, v in impls.items() if k != "reference"}
        return {name: (lambda fn=fn: case.run(fn)) for name, fn in impls.items()}

    def choose(self, points: list[dict[str, Any]]) -> str | None:
        measured = {i for p in points for i, r in p.get("by_impl", {}).items() if "seconds" in r}
        return next((i for i in ("flashmla", "triton-mla", "reference") if i in measured), None)


class _MergeBench(_Bench):
    name = "merge"
    code = (
        "routing kernels' merge_routed (Triton on CUDA, torch elsewhere) of one local + K-1 received partials per "
        "row, as the MoE instance merges them; models.merge_attention_partials of K stacked partials at the first "
        "pass's points"
    )

    def points(self) -> list[dict[str, Any]]:
        g = self.grid
        core_k, core_b = set(_spread(g.merge_parts, 3)), set(_spread(g.merge_batches, 2))
        pts = [
            {"batch": b, "parts": k, "partials": b * (k - 1), "core": k in core_k and b in core_b}
            for k in g.merge_parts
            for b in g.merge_batches
        ]
        return sorted(pts, key=lambda p: not p["core"])

    def build(self) -> None:
        self.kernels = select_routing_kernels(self.device)

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        b, k = point["batch"], point["parts"]
        o, lse, res, index = merge_inputs(self.dims, b, k, self.device, self.dtype)
        fns: dict[str, Callable[[], Any]] = {
            f"merge_routed/{self.kernels.name}": lambda: self.kernels.merge_routed(o, lse, res, index)
        }
        if point["core"]:
            parts_o, parts_lse = stacked_partials(o, lse, res, index)
            fns["merge_attention_partials"] = lambda: merge_attention_partials(parts_o, parts_lse)
        return fns

    def choose(self, points: list[dict[str, Any]]) -> str | None:
        name = f"merge_routed/{select_routing_kernels(self.device).name}"  # what the instance runs
        ran = any("seconds" in p.get("by_impl", {}).get(name, {}) for p in points)
        return name if ran else super().choose(points)


class _SharedExpertBench(_Bench):
    name = "shared_expert"
    code = "data_plane.decode_layers.moe_gate (fp32 gate GEMM, sigmoid, group-limited top-k) + add_mlp(shared)"

    def points(self) -> list[dict[str, Any]]:
        return self._batch_points(self.grid.batches)

    def build(self) -> None:
        self.c, self.w, _ = build_layer(self.dims, self.device, self.dtype)

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        b, c, w = point["batch"], self.c, self.w
        h = torch.randn(b, c.hidden_size, device=self.device, dtype=self.dtype)
        x = torch.randn(b, c.hidden_size, device=self.device, dtype=self.dtype)
        return {f"decode_layers/{_path(x)}": lambda: (moe_gate(w, c, x), add_mlp(w.shared, x, h))}


class _DenseMlpBench(_Bench):
    name = "dense_mlp"
    code = "data_plane.decode_layers.add_mlp (fused gate|up GEMM, SiLU x up, down GEMM, residual)"

    def points(self) -> list[dict[str, Any]]:
        return self._batch_points(self.grid.batches)

    def build(self) -> None:
        self.c, self.w, _ = build_layer(self.dims, self.device, self.dtype, mlp=True)

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        b, c, w = point["batch"], self.c, self.w
        h = torch.randn(b, c.hidden_size, device=self.device, dtype=self.dtype)
        x = torch.randn(b, c.hidden_size, device=self.device, dtype=self.dtype)
        return {f"decode_layers/{_path(x)}": lambda: add_mlp(w.mlp, x, h)}


class _IterationBench(_Bench):
    name = "iteration"
    code = "data_plane.decode_layers.norm (final RMSNorm) + lm_head Linear + argmax (greedy sampling)"

    def points(self) -> list[dict[str, Any]]:
        return self._batch_points(self.grid.batches)

    def build(self) -> None:
        d = self.dims
        self.lm_head = Linear.of(_random((d.hidden, d.vocab), self.device, self.dtype))  # [D, V]
        self.norm_w = torch.ones(d.hidden, device=self.device, dtype=self.dtype)
        self.eps = d.config().rms_norm_eps

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        h = torch.randn(point["batch"], self.dims.hidden, device=self.device, dtype=self.dtype)
        return {f"decode_layers/{_path(h)}": lambda: self.lm_head(norm(h, self.norm_w, self.eps)).argmax(dim=-1)}


class _ExpertBench(_Bench):
    name = "expert"
    code = (
        "the instance's 256/EP routed experts (SwiGLU, stacked [E, D, 2I] / [E, I, D]) over mean_batch x top_k "
        "received rows split evenly: torch._grouped_mm, one GEMM pair per expert (loop), or "
        "decode_layers.slab_experts (bmm over the padded static slab)"
    )

    def _ep_sizes(self) -> list[int]:
        d = self.dims
        return [ep for ep in self.grid.ep_sizes if ep <= d.num_experts and d.num_experts % ep == 0]

    def points(self) -> list[dict[str, Any]]:
        d, g = self.dims, self.grid
        pts = []
        for ep in [d.ep_size] + [e for e in self._ep_sizes() if e != d.ep_size]:
            batches = g.batches if ep == d.ep_size else g.ep_batches
            core = set(_spread(batches, 3 if ep == d.ep_size else 2))
            for b in batches:
                pts.append({"ep": ep, "local_experts": d.local_experts(ep), "batch": b, "rows": b * d.top_k})
                pts[-1]["core"] = b in core
        return sorted(pts, key=lambda p: not p["core"])

    def build(self) -> None:
        d = self.dims
        most = max(d.local_experts(ep) for ep in self._ep_sizes() + [d.ep_size])
        self.gate_up = _random((most, d.hidden, 2 * d.moe_intermediate), self.device, self.dtype)
        self.down = _random((most, d.moe_intermediate, d.hidden), self.device, self.dtype)
        e = d.local_experts(d.ep_size)
        counts = balanced_counts(3 * e, e)
        counts[0], counts[-1] = counts[0] + counts[-1], 0  # uneven, one expert idle
        verified = verify_experts(ExpertCase.make(self.gate_up[:e], self.down[:e], counts))
        self.notes["verification"] = {k: v or "ok" for k, v in verified.items()}
        self.impls = [k for k, v in verified.items() if v is None]
        if "grouped_mm" not in self.impls:
            self.notes["grouped_mm_fallback"] = f"torch._grouped_mm not used ({verified['grouped_mm']})"

    def functions(self, point: dict[str, Any]) -> dict[str, Callable[[], Any]]:
        e = point["local_experts"]
        case = ExpertCase.make(self.gate_up[:e], self.down[:e], balanced_counts(point["rows"], e))
        fns = {"grouped_mm": case.grouped_mm, "loop": case.loop, "slab_bmm": case.slab}
        return {k: fns[k] for k in self.impls}

    def choose(self, points: list[dict[str, Any]]) -> str | None:
        """The fastest implementation over the points where every candidate ran."""
        impls = {i for p in points for i in p.get("by_impl", {})}
        full = [p for p in points if all("seconds" in p.get("by_impl", {}).get(i, {}) for i in impls)]
        if not impls:
            return None
        if not full:
            return super().choose(points)
        return min(sorted(impls), key=lambda i: sum(p["by_impl"][i]["seconds"] for p in full))


BENCHES: dict[str, type[_Bench]] = {
    b.name: b
    for b in (
        _DenseBench,
        _AttentionBench,
        _ExpertBench,
        _SharedExpertBench,
        _MergeBench,
        _DenseMlpBench,
        _IterationBench,
    )
}


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


def point_label(phase: str, point: dict[str, Any]) -> str:
    if phase == "attention":
        s = point["shards_per_request"]
        split = f" ({point['requests']} req x {s} shards)" if s > 1 else ""
        return f"rows={point['shards']} x {point['row_tokens']} tok{split}"
    if phase == "merge":
        return f"batch={point['batch']} K={point['parts']}"
    if phase == "expert":
        return f"EP={point['ep']} ({point['local_experts']} experts) batch={point['batch']}"
    return f"batch={point['batch']}"


def environment(device: str | torch.device) -> dict[str, Any]:
    """GPU, driver, CUDA, torch and Triton versions (what a measured profile is labelled with)."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        env["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        env["triton"] = None
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            total_memory_bytes=int(props.total_memory),
            sm_count=props.multi_processor_count,
        )
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def _run_point(
    bench: _Bench, point: dict[str, Any], device: torch.device, grid: Grid
) -> tuple[dict[str, Any], list[str]]:
    """Time every implementation of one point -> (point record, errors). Memory is returned to the device after a
    failure only once the exception (whose traceback holds the point's tensors) is gone."""
    record = dict(point)
    record["by_impl"], errors = {}, []
    label = point_label(bench.name, point)
    try:
        fns = bench.functions(point)
    except Exception as e:
        record["error"] = _one_line(e)
        fns = {}
    if "error" in record:
        _free(device)
        return record, [f"{label}: {record['error']}"]
    for impl, fn in fns.items():
        try:
            record["by_impl"][impl] = _measure(fn, device, grid)
        except Exception as e:  # out of memory, an unsupported kernel: recorded, the run goes on
            record["by_impl"][impl] = {"error": _one_line(e)}
            errors.append(f"{label} {impl}: {_one_line(e)}")
        if "error" in record["by_impl"][impl]:
            _free(device)
    del fns
    return record, errors


def time_layer_phases(
    device: str,
    dims: LayerDims,
    grid: Grid,
    budget_s: float,
    dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
    phases: Sequence[str] = PHASE_ORDER,
) -> dict[str, Any]:
    """Time every phase of one decode layer over `grid` within `budget_s` wall-clock seconds.

    Returns {"schema", "device", "dtype", "dims", "grid", "environment", "budget_s", "elapsed_s", "skipped_points",
    "phases": {phase: {"features", "code", "implementation", "points", "skipped", "errors", "error", "notes",
    "elapsed_s"}}}. A point is its features and labels (batch; kv_tokens, shards, requests, shards_per_request,
    row_tokens; partials, parts; ep, local_experts, rows) plus `by_impl` {implementation: {seconds, eager_s,
    graph_s?, mode, reps} or {error}} and `seconds`, the chosen implementation's time (None where it did not run).
    """
    t0 = time.perf_counter()
    dev = torch.device(device)
    say = progress or (lambda msg: None)
    torch.manual_seed(0)
    unknown = set(phases) - set(BENCHES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)} (known: {', '.join(PHASE_ORDER)})")
    benches = {name: BENCHES[name](dims, grid, dev, dtype) for name in PHASE_ORDER if name in phases}
    plans = {name: b.points() for name, b in benches.items()}
    out_phases: dict[str, dict[str, Any]] = {
        name: {
            "features": list(PHASE_FEATURES[name]),
            "code": b.code,
            "points": [],
            "skipped": [],
            "errors": [],
            "error": None,
            "elapsed_s": 0.0,
        }
        for name, b in benches.items()
    }
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "dims": asdict(dims),
        "grid": asdict(grid),
        "environment": environment(dev),
        "budget_s": budget_s,
    }

    def spent() -> bool:
        return time.perf_counter() - t0 >= budget_s

    with torch.no_grad():
        for first_pass in (True, False):
            for name, bench in benches.items():
                rec = out_phases[name]
                todo = [p for p in plans[name] if p["core"] == first_pass]
                if not todo or rec["error"]:
                    rec["skipped"].extend([{**p, "reason": "phase error"} for p in todo] if rec["error"] else [])
                    continue
                if spent():
                    rec["skipped"].extend({**p, "reason": "budget"} for p in todo)
                    continue
                t_phase = time.perf_counter()
                try:
                    bench.build()
                except Exception as e:
                    rec["error"] = f"building the weights: {_one_line(e)}"
                if rec["error"]:
                    rec["skipped"].extend({**p, "reason": "phase error"} for p in todo)
                    bench.free()
                    _free(dev)
                    say(f"{name}: {rec['error']}")
                    continue
                for i, point in enumerate(todo):
                    if spent():
                        rec["skipped"].extend({**p, "reason": "budget"} for p in todo[i:])
                        break
                    record, errors = _run_point(bench, point, dev, grid)
                    rec["points"].append(record)
                    rec["errors"].extend(errors)
                bench.free()
                _free(dev)
                rec["elapsed_s"] += time.perf_counter() - t_phase
                n_pass, n_points, now = 1 if first_pass else 2, len(rec["points"]), time.perf_counter() - t0
                say(f"{name}: pass {n_pass}, {n_points} points, {now:.1f} s")

    for name, bench in benches.items():
        rec = out_phases[name]
        rec["notes"] = bench.notes
        rec["implementation"] = bench.choose(rec["points"])
        for p in rec["points"]:
            p["seconds"] = p["by_impl"].get(rec["implementation"], {}).get("seconds")
        rec["skipped"] = [{k: v for k, v in p.items() if k != "core"} for p in rec["skipped"]]
        rec["elapsed_s"] = round(rec["elapsed_s"], 3)
    skipped = sum(len(r["skipped"]) for r in out_phases.values())
    over_budget = sum(p["reason"] == "budget" for r in out_phases.values() for p in r["skipped"])
    result["phases"] = out_phases
    result["skipped_points"] = skipped
    result["elapsed_s"] = round(time.perf_counter() - t0, 3)
    if over_budget:
        result["note"] = f"budget of {budget_s:g} s spent: {over_budget} grid points skipped (listed per phase)"
    return result


# ---------------------------------------------------------------------------------------------------------------
# Fitting a profile
# ---------------------------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; a name without a model number is slugified whole."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.upper())
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def device_slug(timings: dict[str, Any], gpu_name: str | None = None) -> str:
    """The file-name stem of a run: the GPU's slug, or cpu / cpu-dryrun (tiny dimensions) on a CPU."""
    if gpu_name:
        return gpu_slug(gpu_name)
    env = timings.get("environment", {})
    if env.get("gpu"):
        return gpu_slug(env["gpu"])
    return "cpu-dryrun" if timings.get("dims", {}).get("name") == "tiny" else "cpu"


def phase_records(timings: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    """The measured points of a phase as fit records (features + seconds), failed and skipped ones left out."""
    rec = timings.get("phases", {}).get(phase) or {}
    return [p for p in rec.get("points", []) if p.get("seconds") is not None and p["seconds"] > 0]


def _fit(records: list[dict[str, Any]], features: Sequence[str]) -> tuple[dict[str, float], float]:
    """-> (coefficients in seconds, relative RMS residual)."""
    coefs = fit_linear_cost(records, features)
    pred = np.array([coefs["const"] + sum(coefs[f] * float(r[f]) for f in features) for r in records])
    y = np.array([float(r["seconds"]) for r in records])
    return coefs, float(np.sqrt(np.mean(((pred - y) / y) ** 2)))


def _grid_text(records: list[dict[str, Any]], keys: Sequence[str]) -> str:
    return ", ".join(sorted({"/".join(str(r[k]) for k in keys) for r in records}, key=lambda s: [len(s), s]))


def fit_profile(
    timings: dict[str, Any],
    base_profile_name: str = DEFAULT_BASE,
    gpu_name: str | None = None,
    hbm_bytes: float | None = None,
) -> dict[str, Any]:
    """A `nanocp-latency-profile/1` dict: the base profile with every measured phase replaced by its fit.

    timings: what `time_layer_phases` returns (only `phases[p]["points"]` with features + `seconds`, and
    optionally `environment`, `dims`, `phases[p]["implementation"/"code"/"error"]` are read).
    A phase with too few measured points keeps the base's coefficients (provenance says why). The expert phase
    is fitted per EP size (`by_ep`, every EP size with >= 2 points). hbm_bytes (default: the measured GPU's total
    memory; the base's on a CPU) sets memory.hbm_bytes. Coefficients are in the base's time unit.
    """
    base = LatencyProfile.load(base_profile_name)
    out = copy.deepcopy(base.raw)
    unit = out.get("time_unit", "s")
    scale = TIME_UNITS[unit]
    env = timings.get("environment", {})
    gpu = gpu_name or env.get("gpu")
    slug = device_slug(timings, gpu_name)
    label = gpu or f"CPU ({env.get('cpu') or platform.machine()})"
    dims = timings.get("dims", {})
    dry_run = dims.get("name") == "tiny"

    def to_unit(coefs: dict[str, float]) -> dict[str, float]:
        return {k: v / scale for k, v in coefs.items()}

    provenance = {
        k: v
        for k, v in out.get("provenance", {}).items()
        if not any(k == f"phases.{p}" or k.startswith(f"phases.{p}.") for p in PHASE_ORDER)
    }
    fits: dict[str, Any] = {}
    phases = dict(out["phases"])
    for phase in PHASE_ORDER:
        rec = timings.get("phases", {}).get(phase) or {}
        records = phase_records(timings, phase)
        impl, features = rec.get("implementation"), PHASE_FEATURES[phase]
        what = f"{rec.get('code', phase)}; implementation {impl}"
        modes = sorted({p["by_impl"][impl].get("mode", "?") for p in records if impl in p.get("by_impl", {})})
        timing = f"timing {'/'.join(modes) or 'given'}, median of repetitions"
        try:
            if phase == "expert":
                by_ep: dict[str, dict[str, float]] = {}
                residuals = {}
                for ep in sorted({int(r["ep"]) for r in records}):
                    at_ep = [r for r in records if int(r["ep"]) == ep]
                    if len(at_ep) >= len(features) + 1:
                        coefs, residuals[str(ep)] = _fit(at_ep, features)
                        by_ep[str(ep)] = to_unit(coefs)
                if not by_ep:
                    raise ProfileError(f"no EP size has {len(features) + 1} measured points")
                phases[phase] = {"by_ep": by_ep}
                fits[phase] = {"implementation": impl, "points": len(records), "rel_rms_residual": residuals}
                grid = _grid_text(records, ("ep", "batch"))
                provenance[f"phases.{phase}"] = (
                    f"measured on {label}: {what}; {timing}; fitted per EP size over (EP/batch) {grid}; EP sizes "
                    f"between the measured ones are interpolated in log2(EP) by the loader"
                )
            else:
                coefs, resid = _fit(records, features)
                phases[phase] = to_unit(coefs)
                fits[phase] = {"implementation": impl, "points": len(records), "rel_rms_residual": resid}
                keys = {"attention": ("shards", "row_tokens"), "merge": ("batch", "parts")}.get(phase, ("batch",))
                provenance[f"phases.{phase}"] = (
                    f"measured on {label}: {what}; {timing}; least-squares fit (coefficients >= 0) over "
                    f"({'/'.join(keys)}) {_grid_text(records, keys)}"
                )
        except ProfileError as e:
            reason = rec.get("error") or str(e)
            fits[phase] = {"implementation": impl, "points": len(records), "error": reason}
            provenance[f"phases.{phase}"] = f"not measured ({reason}): coefficients copied from {base.name}"
    if "merge" in fits and "error" not in fits["merge"]:
        provenance["phases.merge"] += (
            f"; const and batch are the merge kernel's own per-layer cost (the graph path runs it every layer; "
            f"{base.name} sets them to 0), the per-partial coefficient is the CP cost"
        )
    copied = [p for p in PHASE_FEATURES if p in phases and p not in PHASE_ORDER]
    provenance["not_measured"] = (
        f"one GPU cannot measure the links (nvlink, rdma), {', '.join(copied)}, prefill and kv_transfer: copied "
        f"from {base.name} ({base.kind}); weights are random bf16 (the base assumes fp8 experts/projections via "
        "DeepGEMM, not installed here), so weight-bound phases read twice the bytes of an fp8 deployment"
    )
    memory = dict(out.get("memory", {}))
    total = hbm_bytes if hbm_bytes is not None else env.get("total_memory_bytes")
    if total:
        memory["hbm_bytes"] = float(total)
        provenance["memory"] = (
            f"hbm_bytes = {label}'s total memory ({float(total) / 1e9:.1f} GB); usable fraction, weights and "
            f"reserve as in {base.name}: " + str(base.raw.get("provenance", {}).get("memory", ""))
        )
    desc = (
        f"DeepSeek-V3 decode, one layer measured per phase on {label} with random weights "
        f"({timings.get('dtype', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda')}); "
        f"phases one GPU cannot measure are copied from {base.name}."
    )
    if dry_run:
        desc = f"CPU dry run at tiny dimensions (not a model of DeepSeek-V3 timing). {desc}"
    out.update(
        name=f"{slug}-deepseek-v3",
        kind="measured",
        description=desc,
        time_unit=unit,
        phases=phases,
        memory=memory,
        provenance=provenance,
        measurement={
            "base_profile": base.name,
            "device": label,
            "environment": env,
            "dims": dims,
            "fits": fits,
            "skipped_points": timings.get("skipped_points", 0),
        },
    )
    LatencyProfile.from_dict(out)  # must load
    return out


# ---------------------------------------------------------------------------------------------------------------
# Comparison and report
# ---------------------------------------------------------------------------------------------------------------

COMPARE_EP = 32


def _compare_points() -> list[tuple[str, str, dict[str, float]]]:
    pts: list[tuple[str, str, dict[str, float]]] = [
        ("attention", "64 requests x 4K ctx", {"kv_tokens": 64 * 4096, "shards": 64}),
        ("attention", "1 request x 128K ctx", {"kv_tokens": 131072, "shards": 1}),
        ("attention", "1 x 128K in 8 shards", {"kv_tokens": 131072, "shards": 8}),
        ("merge", "batch 64, 1 remote partial each", {"partials": 64, "batch": 64}),
        ("merge", "batch 1, 7 remote partials", {"partials": 7, "batch": 1}),
    ]
    for phase in ("dense", "shared_expert", "expert", "dense_mlp", "moe_dispatch", "moe_combine", "iteration"):
        pts += [(phase, f"batch {b}", {"batch": b}) for b in (1, 64, 256)]
    return pts


def compare_profiles(
    measured: dict[str, Any], published_name: str = DEFAULT_BASE, num_instances: int = COMPARE_EP
) -> list[dict[str, Any]]:
    """Phase by phase, the per-layer time each profile gives at representative points (EP size num_instances),
    plus one whole iteration: rows {phase, point, measured_us, published_us, ratio (measured / published),
    source ("measured" or "copied")}."""
    mine, pub = LatencyProfile.from_dict(measured), LatencyProfile.load(published_name)
    fits = measured.get("measurement", {}).get("fits", {})
    rows = []
    for phase, label, feats in _compare_points():
        a = float(mine.phase(phase, num_instances)(**feats))
        b = float(pub.phase(phase, num_instances)(**feats))
        source = "measured" if phase in fits and "error" not in fits[phase] else "copied"
        rows.append(
            {
                "phase": phase,
                "point": label + (f" (EP {num_instances})" if phase == "expert" else ""),
                "measured_us": a * 1e6,
                "published_us": b * 1e6,
                "ratio": a / b if b > 0 else math.inf,
                "source": source,
            }
        )
    n, b, ctx = num_instances, 64, 4096
    args = ([b * ctx] * n, [b] * n, [b] * n)
    a_it, b_it = mine.iteration_cost(*args).total_s, pub.iteration_cost(*args).total_s
    rows.append(
        {
            "phase": "total",
            "point": f"one iteration, {n} instances x batch {b} x {ctx // 1024}K ctx, no CP",
            "measured_us": a_it * 1e6,
            "published_us": b_it * 1e6,
            "ratio": a_it / b_it,
            "source": "both",
        }
    )
    return rows


def _us(s: float | None) -> str:
    if s is None:
        return "-"
    us = s * 1e6
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def markdown_report(timings: dict[str, Any], profile: dict[str, Any] | None, comparison: list[dict[str, Any]]) -> str:
    """The per-phase table (implementation, points, fit), every point's times and the comparison, as markdown."""
    env = timings.get("environment", {})
    label = env.get("gpu") or f"CPU ({env.get('cpu')})"
    lines = [
        f"# One DeepSeek-V3 decode layer per phase on {label}",
        "",
        f"dims `{timings.get('dims', {}).get('name')}`, {timings.get('dtype')}, torch {env.get('torch')}, CUDA "
        f"{env.get('cuda')}, driver {env.get('driver')}, triton {env.get('triton')}; {timings.get('elapsed_s')} s "
        f"of a {timings.get('budget_s')} s budget; {timings.get('skipped_points', 0)} grid points skipped.",
        "",
    ]
    if timings.get("note"):
        lines += [timings["note"], ""]
    fits = (profile or {}).get("measurement", {}).get("fits", {})
    unit = (profile or {}).get("time_unit", "s")
    lines += [
        f"| phase | implementation | points (measured / skipped / failed) | fitted coefficients ({unit}) | rel. RMS "
        "residual |",
        "|---|---|---|---|---|",
    ]
    for phase, rec in timings.get("phases", {}).items():
        n_ok = len(phase_records(timings, phase))
        failed = len(rec.get("points", [])) - n_ok
        coefs = (profile or {}).get("phases", {}).get(phase, {})
        fit = fits.get(phase, {})
        if "by_ep" in coefs:
            coef_text = "; ".join(
                f"EP{ep}: " + ", ".join(f"{k} {v:.4g}" for k, v in c.items()) for ep, c in coefs["by_ep"].items()
            )
        else:
            coef_text = ", ".join(f"{k} {v:.4g}" for k, v in coefs.items())
        if "error" in fit:
            coef_text = f"copied ({fit['error']})"
        resid = fit.get("rel_rms_residual")
        resid_text = (
            "-"
            if resid is None
            else (", ".join(f"EP{k} {v:.1%}" for k, v in resid.items()) if isinstance(resid, dict) else f"{resid:.1%}")
        )
        impl = rec.get("implementation") or "-"
        err = f" (error: {rec['error']})" if rec.get("error") else ""
        lines.append(
            f"| {phase} | {impl}{err} | {n_ok} / {len(rec.get('skipped', []))} / {failed} | {coef_text} | "
            f"{resid_text} |"
        )
    lines += ["", "## Points (median us per call; `g` = CUDA graph replay)", ""]
    for phase, rec in timings.get("phases", {}).items():
        for p in rec.get("points", []):
            parts = []
            for impl, r in p.get("by_impl", {}).items():
                if "seconds" in r:
                    parts.append(f"{impl} {_us(r['seconds'])}{' g' if r.get('mode') == 'cuda_graph' else ''}")
                else:
                    parts.append(f"{impl} error: {r.get('error')}")
            if p.get("error"):
                parts.append(f"error: {p['error']}")
            lines.append(f"- {phase} {point_label(phase, p)}: {'; '.join(parts)}")
        for note_key, note in (rec.get("notes") or {}).items():
            lines.append(f"- {phase} note {note_key}: {note}")
    if comparison:
        lines += [
            "",
            f"## Compared with {(profile or {}).get('measurement', {}).get('base_profile', DEFAULT_BASE)} "
            f"(per layer, EP {COMPARE_EP})",
            "",
            "| phase | point | measured us | published us | measured / published | source |",
            "|---|---|---|---|---|---|",
        ]
        for r in comparison:
            lines.append(
                f"| {r['phase']} | {r['point']} | {r['measured_us']:.1f} | {r['published_us']:.1f} | "
                f"{r['ratio']:.2f} | {r['source']} |"
            )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise _ArgError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m nanocp.bench.gpu_layer", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny dimensions and grid (a CPU dry run in seconds)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 150 on CUDA, 60 on CPU)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="auto: bf16 on CUDA")
    ap.add_argument("--base", default=DEFAULT_BASE, help="profile the unmeasured parts come from / compared with")
    ap.add_argument("--out", default=".", help="output directory (default: the current directory)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit code (0 also when a phase failed: the failure is in the JSON)."""
    try:
        args = _parser().parse_args(None if argv is None else list(argv))
        if args.budget_s is not None and not args.budget_s >= 0:
            raise _ArgError(f"--budget-s must be >= 0, got {args.budget_s}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise _ArgError("--device cuda: no CUDA device is available")
        try:
            LatencyProfile.load(args.base)
        except ProfileError as e:
            raise _ArgError(f"--base: {e}") from None
    except _ArgError as e:
        print(f"gpu_layer: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    device = args.device
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.float32
    )
    dims, grid = (LayerDims.tiny(), Grid.tiny()) if args.tiny else (LayerDims(), Grid())
    budget = args.budget_s if args.budget_s is not None else (150.0 if device == "cuda" else 60.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"gpu_layer: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"{device} {str(dtype).removeprefix('torch.')} dims={dims.name} budget {budget:g} s")
    timings = time_layer_phases(device, dims, grid, budget, dtype, progress=log)
    slug = device_slug(timings)
    code, profile, comparison = 0, None, []
    try:
        profile = fit_profile(timings, args.base)
        comparison = compare_profiles(profile, args.base)
    except Exception as e:  # a bug, not a measurement failure: recorded, files still written
        timings["profile_error"] = _one_line(e)
        code = 1
    raw_path = out_dir / f"gpu_layer_{slug}.json"
    raw_path.write_text(json.dumps({**timings, "comparison": comparison}, indent=1, default=str) + "\n")
    written = [raw_path]
    if profile is not None:
        prof_path = out_dir / f"{profile['name']}.json"
        prof_path.write_text(json.dumps(profile, indent=1) + "\n")
        written.append(prof_path)
    md_path = out_dir / f"gpu_layer_{slug}.md"
    md_path.write_text(markdown_report(timings, profile, comparison))
    written.append(md_path)
    for name, rec in timings["phases"].items():
        status = rec["error"] or (f"{len(rec['errors'])} errors" if rec["errors"] else "ok")
        log(f"{name}: {rec['implementation']}, {len(phase_records(timings, name))} points, {status}")
    log(f"{timings['elapsed_s']:.1f} s; wrote {', '.join(str(p) for p in written)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
