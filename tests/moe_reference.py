"""Plain references shared by the MoE exchange tests (the static-slab dispatcher and the packed one)."""

from __future__ import annotations

import dataclasses

import tolerances as tol
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# The random exchanges both dispatcher tests draw: ranks, experts per rank, top-k, tokens per rank, drop rate, seed.
exchange_cases = given(
    world=st.sampled_from([1, 2, 4]),
    experts_per_rank=st.integers(1, 3),
    k=st.integers(1, 4),
    max_tokens=st.integers(1, 6),
    drop=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
exchange_settings = settings(max_examples=20, deadline=None)


def expert_fn(x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A row-wise expert whose result does not depend on the batch: f_e(x) = x * (e + 1) - e / 8."""
    e = experts.to(torch.float32)
    return (x.float() * (e + 1)[..., None] - (e / 8)[..., None]).to(x.dtype)


def random_topk(tokens: int, k: int, experts: int, gen: torch.Generator, drop: float) -> torch.Tensor:
    """[tokens, k] distinct experts per token, each slot dropped (-1) with probability `drop`."""
    rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
    idx = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)
    idx[torch.rand(tokens, k, generator=gen) < drop] = -1
    return idx.to(torch.int64)


def random_routing(
    tokens: list[int], hidden: int, k: int, experts: int, gen: torch.Generator, drop: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per rank with tokens[r] tokens: x [t, hidden], topk_idx [t, k] (random_topk), gate weights [t, k]."""
    xs = [torch.randn(t, hidden, generator=gen) for t in tokens]
    idxs = [random_topk(t, k, experts, gen, drop) for t in tokens]
    ws = [torch.rand(t, k, generator=gen) for t in tokens]
    return xs, idxs, ws


def reference_combine(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over slots k (in slot order, fp32) of w_k * f_e(x), computed locally."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        out[valid] += w[valid, k, None].float() * expert_fn(x[valid], idx[valid, k]).float()
    return out.to(x.dtype)


def combine_bound(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, base: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 error bound of one evaluation of reference_combine (+ base) in any order (tests/tolerances.py): a
    sum of k products (and the base) errs by at most gamma(k (+ 1)) times the sum of the terms' magnitudes. Two
    evaluations (the packed exchange, the reference) differ by at most twice this."""
    terms = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        terms[valid] += (w[valid, k, None].double() * expert_fn(x[valid], idx[valid, k]).double()).abs()
    if base is None:
        return tol.gamma(idx.shape[1]) * terms
    return tol.gamma(idx.shape[1] + 1) * (terms + base.double().abs())


def gate_config(base, experts: int, n_group: int, topk_group: int, top_k: int, normalize: bool, scale: float):
    """`base` (a ModelConfig) with another MoE gate: experts, grouping, top-k, normalisation, scaling."""
    return dataclasses.replace(
        base,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        norm_topk_prob=normalize,
        routed_scaling_factor=scale,
    )
