"""Shard attention on CPU: the fused C++ kernel reading the pages in place (fp32), else torch's fused
flash-attention kernel over the gathered pages; one call per layer, LSE included.

MLA decode attention is multi-query: the H query heads of a shard share one latent KV head. The kernel sees each
shard as a batch element with one head and H query rows: q [S, 1, H, Dqk], k = v = the shard's gathered pages
[S, 1, N, Dqk] (the kernel wants v as wide as k; the first v_dim output values are the latent output). The page
gather index and the length mask depend only on the block tables and the shard lengths, which every layer of a
sub-step shares: `plan` builds them once, `run` is the per-layer call. The contract is
models.mla_paged_attention_with_lse's: an empty shard gives o = 0 and lse = -inf (the kernel's lse there is 0,
fixed here).

For fp32 the C++ kernel (data_plane/cpu_kernels.py, `mla_paged_attention`) reads each shard's rows from its pages
directly: no gather, no mask, and at the tiny model's widths (80 values per row) it costs a fraction of the flash
kernel's per-call setup. The gather and the mask are then never built (the plan makes them on first use).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from nanocp.data_plane import cpu_kernels


def fused_attention_unavailable_reason() -> str | None:
    """Why the fused CPU kernel cannot be used (None when it can)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return f"torch {torch.__version__} has no aten._scaled_dot_product_flash_attention_for_cpu"
    return None


@dataclass
class CpuAttentionPlan:
    """What every layer of one sub-step shares: the block tables and shard lengths, and (built on first use, for
    the flash kernel) which pages to gather and which of their slots are valid."""

    block_table: torch.Tensor  # int [S, B]
    lens: np.ndarray  # int64 [S]
    page_size: int
    dtype: torch.dtype
    shards: int = field(init=False)
    width: int = field(init=False)  # N = B * page_size

    def __post_init__(self) -> None:
        self.shards = self.block_table.shape[0]
        self.width = self.block_table.shape[1] * self.page_size

    @cached_property
    def page_index(self) -> torch.Tensor:
        """int64 [S * B]: the block tables, row-major."""
        return self.block_table.reshape(-1).long()

    @cached_property
    def mask(self) -> torch.Tensor:
        """[S, 1, 1, N] additive: 0 on a shard's tokens, -inf past its length."""
        mask = np.where(np.arange(self.width)[None, :] < self.lens[:, None], 0.0, -np.inf).astype(np.float32)
        return torch.from_numpy(mask).to(self.dtype).view(self.shards, 1, 1, self.width)

    @cached_property
    def empty(self) -> torch.Tensor | None:
        """bool [S]: shards without tokens (None when there are none)."""
        empty = self.lens == 0
        return torch.from_numpy(empty) if empty.any() else None


class CpuPagedAttention:
    """Callable with the signature of models.mla_paged_attention_with_lse, plus the split `plan` / `run`."""

    name = "cpu-flash"

    def plan(
        self, block_table: torch.Tensor, lens: torch.Tensor, page_size: int, dtype: torch.dtype
    ) -> CpuAttentionPlan:
        """block_table int [S, B], lens int [S] -> the plan of one sub-step."""
        shards, blocks = block_table.shape
        width = blocks * page_size
        lens_np = lens.cpu().numpy().astype(np.int64)
        if len(lens_np) and (lens_np.min() < 0 or lens_np.max() > width):
            raise ValueError(f"shard lengths must lie in [0, {width}] (block tables of {blocks} pages)")
        return CpuAttentionPlan(block_table=block_table, lens=lens_np, page_size=page_size, dtype=dtype)

    def run(
        self, plan: CpuAttentionPlan, q_latent: torch.Tensor, kv_pages: torch.Tensor, scale: float, v_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_latent [S, H, Dqk], kv_pages [P, page_size, Dqk] -> o [S, H, v_dim], lse [S, H] fp32 (natural log)."""
        shards, heads = q_latent.shape[0], q_latent.shape[1]
        if shards != plan.shards:
            raise ValueError(f"the plan is for {plan.shards} shards, got {shards} queries")
        if shards == 0:
            return q_latent.new_zeros(0, heads, v_dim), q_latent.new_zeros(0, heads, dtype=torch.float32)
        if cpu_kernels.usable(q_latent) and cpu_kernels.usable(kv_pages) and plan.block_table.dtype == torch.int32:
            return cpu_kernels.mla_paged_attention(q_latent, kv_pages, plan.block_table, plan.lens, scale, v_dim)
        kv = kv_pages.index_select(0, plan.page_index).view(shards, 1, plan.width, kv_pages.shape[-1])
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_latent.unsqueeze(1), kv, kv, 0.0, False, attn_mask=plan.mask, scale=scale
        )[:2]  # [S, 1, H, Dqk], [S, 1, H]
        lse = lse[:, 0].float()
        if plan.empty is not None:
            lse = lse.masked_fill(plan.empty[:, None], float("-inf"))
        return o[:, 0, :, :v_dim], lse

    def __call__(
        self,
        q_latent: torch.Tensor,
        kv_pages: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        v_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan(block_table, lens, kv_pages.shape[1], q_latent.dtype)
        return self.run(plan, q_latent, kv_pages, scale, v_dim)
