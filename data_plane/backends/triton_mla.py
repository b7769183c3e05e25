"""Triton paged MLA decode attention: the contract of models.mla_paged_attention_with_lse on any CUDA GPU where
Triton runs, for GPUs without FlashMLA (not built, not SM90, pages other than 64 tokens, fp32).

Split-KV flash decoding. Each program takes BLOCK_H query heads of one shard and one contiguous range of its KV
tokens (a split), walks the range BLOCK_N tokens at a time through the block table (online softmax: running max m,
sum l, unnormalised accumulator acc) and writes (acc, m, l) for its split. The host side then forms each split's
partial (o = acc / l, lse = m + log l) and merges the splits with models.merge_attention_partials: torch's accurate
log, no host synchronisation (the split plan depends only on the static shapes, so the call can be captured in a
CUDA graph). The latent row is read as its first v_dim values (the value, dot products with q's first v_dim) and the
rest (the rope part). fp32 inputs use IEEE fp32 dot products (no TF32); bf16/fp16 inputs multiply in their dtype with
fp32 accumulation, the probabilities rounded to it for the value product, as flash attention does. Under
TRITON_INTERPRET=1 the same kernel runs on CPU tensors (how CI checks it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nanocp.models import merge_attention_partials

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@functools.cache
def _multiprocessors(device_index: int) -> int:
    """The GPU's multiprocessor count (read once: the attention is called every layer of every iteration)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def triton_mla_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton MLA kernel cannot serve `device` (None when it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA (the Triton kernel runs on CPU only under TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


@triton.jit
def _mla_decode_split_kernel(
    q,  # [S, H, dqk]
    kv,  # [P, page_size, dqk]
    block_table,  # int [S, max_blocks]
    lens,  # int [S]
    acc_out,  # fp32 [S, H, splits, dv]
    m_out,  # fp32 [S, H, splits]
    l_out,  # fp32 [S, H, splits]
    scale,
    heads,
    dqk,
    dv,
    page_size,
    max_blocks,
    split_len,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    hb, split, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cv, cr = tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_DR)
    hmask, vmask, rmask = h < heads, cv < dv, cr < dqk - dv
    q_rows = q + (s.to(tl.int64) * heads + h) * dqk  # [BLOCK_H] row pointers
    qv = tl.load(q_rows[:, None] + cv[None, :], mask=hmask[:, None] & vmask[None, :], other=0.0)
    qr = tl.load(q_rows[:, None] + dv + cr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    start = split * split_len
    end = tl.minimum(start + split_len, tl.load(lens + s).to(tl.int32))
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        page = tl.load(block_table + s.to(tl.int64) * max_blocks + t // page_size, mask=tmask, other=0)
        rows = kv + (page.to(tl.int64) * page_size + t % page_size) * dqk  # [BLOCK_N] row pointers
        k_v = tl.load(rows[:, None] + cv[None, :], mask=tmask[:, None] & vmask[None, :], other=0.0)
        k_r = tl.load(rows[:, None] + dv + cr[None, :], mask=tmask[:, None] & rmask[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot does not do bf16 arithmetic: the same products, exact in fp32
            qv, qr, k_v, k_r = qv.to(tl.float32), qr.to(tl.float32), k_v.to(tl.float32), k_r.to(tl.float32)
        if IEEE:
            scores = tl.dot(qv, tl.trans(k_v), input_precision="ieee")
            scores += tl.dot(qr, tl.trans(k_r), input_precision="ieee")
        else:
            scores = tl.dot(qv, tl.trans(k_v)) + tl.dot(qr, tl.trans(k_r))
        scores = tl.where(tmask[None, :], scores * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_v, input_precision="ieee")
        elif UPCAST:  # p rounded to the inputs' dtype, as the compiled kernel does
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype.element_ty).to(tl.float32), k_v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_v.dtype), k_v)
        m_i = m_new
    out = (s.to(tl.int64) * heads + h) * splits + split  # [BLOCK_H] rows of [S * H * splits]
    tl.store(m_out + out, m_i, mask=hmask)
    tl.store(l_out + out, l_i, mask=hmask)
    tl.store(acc_out + out[:, None] * dv + cv[None, :], acc, mask=hmask[:, None] & vmask[None, :])


class TritonMLAAttention:
    """Callable with the signature of models.mla_paged_attention_with_lse. `programs`: how many programs to aim
    for when choosing the number of splits (default: 2 per multiprocessor on CUDA, 8 elsewhere)."""

    name = "triton-mla"
    BLOCK_H = 16

    def __init__(self, programs: int | None = None) -> None:
        if programs is not None and programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
        self.programs = programs

    def _target(self, device: torch.device) -> int:
        if self.programs is not None:
            return self.programs
        if device.type != "cuda":
            return 8
        return 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())

    @staticmethod
    def block_n(dtype: torch.dtype) -> int:
        return 16 if dtype == torch.float32 else 32  # fp32 tiles are twice the bytes

    def split_plan(
        self, shards: int, heads: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[int, int]:
        """(splits, tokens per split) for `shards` rows of `heads` heads over at most `max_len` KV tokens each: enough
        splits to give every multiprocessor work, each a multiple of BLOCK_N tokens."""
        block_n = self.block_n(dtype)
        tiles = max(triton.cdiv(max_len, block_n), 1)
        busy = max(shards, 1) * triton.cdiv(heads, self.BLOCK_H)
        splits = min(max(triton.cdiv(self._target(device), busy), 1), tiles)
        split_len = triton.cdiv(tiles, splits) * block_n
        return triton.cdiv(max(max_len, 1), split_len), split_len

    def __call__(
        self,
        q_latent: torch.Tensor,  # [S, H, dqk]
        kv_pages: torch.Tensor,  # [P, page_size, dqk]
        block_table: torch.Tensor,  # int [S, max_blocks]
        lens: torch.Tensor,  # int [S]
        scale: float,
        v_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> o [S, H, v_dim] (q's dtype), lse [S, H] fp32, natural log, -inf (o = 0) for an empty shard."""
        shards, heads, dqk = q_latent.shape
        if kv_pages.shape[-1] != dqk or not 0 < v_dim <= dqk:
            raise ValueError(f"latent width {dqk}: kv rows of {kv_pages.shape[-1]} and v_dim {v_dim} do not fit it")
        if kv_pages.dtype != q_latent.dtype:
            raise ValueError(f"q is {q_latent.dtype} but the KV cache is {kv_pages.dtype}")
        page_size, max_blocks = kv_pages.shape[1], block_table.shape[1]
        device = q_latent.device
        if not shards or not max_blocks:  # no KV anywhere: every shard is empty
            o = torch.zeros(shards, heads, v_dim, dtype=q_latent.dtype, device=device)
            return o, torch.full((shards, heads), float("-inf"), dtype=torch.float32, device=device)
        splits, split_len = self.split_plan(shards, heads, max_blocks * page_size, q_latent.dtype, device)
        # every (shard, head, split) entry is written by the kernel (an empty split: m = -inf, l = 0, acc = 0)
        acc = torch.empty(shards, heads, splits, v_dim, dtype=torch.float32, device=device)
        m = torch.empty(shards, heads, splits, dtype=torch.float32, device=device)
        total = torch.empty(shards, heads, splits, dtype=torch.float32, device=device)
        grid = (triton.cdiv(heads, self.BLOCK_H), splits, shards)
        _mla_decode_split_kernel[grid](
            q_latent.contiguous(),
            kv_pages.contiguous(),
            block_table.contiguous(),
            lens.to(device).contiguous(),
            acc,
            m,
            total,
            float(scale),
            heads,
            dqk,
            v_dim,
            page_size,
            max_blocks,
            split_len,
            BLOCK_H=self.BLOCK_H,
            BLOCK_N=self.block_n(q_latent.dtype),
            BLOCK_DV=max(triton.next_power_of_2(v_dim), MIN_DOT),
            BLOCK_DR=max(triton.next_power_of_2(max(dqk - v_dim, 1)), MIN_DOT),
            IEEE=q_latent.dtype == torch.float32,
            UPCAST=q_latent.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        )
        nonempty = total > 0
        safe = torch.where(nonempty, total, torch.ones_like(total))
        o_parts = acc / safe[..., None]  # [S, H, splits, dv]
        lse_parts = torch.where(nonempty, m + torch.log(safe), torch.full_like(m, float("-inf")))
        o, lse = merge_attention_partials(o_parts.permute(2, 0, 1, 3), lse_parts.permute(2, 0, 1))
        return o.to(q_latent.dtype), lse


__all__ = ["TritonMLAAttention", "triton_mla_unavailable_reason"]
