"""Triton kernels for the routing data path: row gather/scatter (packing), two-source gather (unpacking routed
queries), partial-result packing (o | lse) and the LSE merge of local and received partials.

Same signatures and semantics as `reference.TorchRoutingKernels`. They run on CUDA tensors, and on CPU tensors
under TRITON_INTERPRET=1 (how CI checks them). Every tensor is used through contiguous row-major views; int64
indices keep the address arithmetic 64-bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 256  # elements per program along a row


@triton.jit
def _gather_rows_kernel(src, index, out, row_numel, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    src_row = tl.load(index + row)
    vals = tl.load(src + src_row * row_numel + offs, mask=mask)
    tl.store(out + row.to(tl.int64) * row_numel + offs, vals, mask=mask)


@triton.jit
def _scatter_rows_kernel(dst, index, src, row_numel, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    dst_row = tl.load(index + row)
    vals = tl.load(src + row.to(tl.int64) * row_numel + offs, mask=mask)
    tl.store(dst + dst_row * row_numel + offs, vals.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _gather_two_kernel(a, b, index, out, rows_a, row_numel, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    i = tl.zeros([BLOCK], dtype=tl.int64) + tl.load(index + row)  # as a block: masks combine elementwise
    from_a = i < rows_a
    va = tl.load(a + i * row_numel + offs, mask=mask & from_a)
    vb = tl.load(b + (i - rows_a) * row_numel + offs, mask=mask & (i >= rows_a))
    vals = tl.where(from_a, va, vb.to(va.dtype))
    tl.store(out + row.to(tl.int64) * row_numel + offs, vals, mask=mask)


@triton.jit
def _pack_partials_kernel(o, lse, index, out, heads, dv, BLOCK: tl.constexpr):
    row, h, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dv
    s = tl.load(index + row)
    vals = tl.load(o + (s * heads + h) * dv + offs, mask=mask).to(tl.float32)
    dst = out + (row.to(tl.int64) * heads + h) * (dv + 1)
    tl.store(dst + offs, vals, mask=mask)
    tl.store(dst + dv, tl.load(lse + s * heads + h).to(tl.float32), mask=blk == 0)


@triton.jit
def _part_lse(lse, res, idx, h, heads, dv, n_local):
    """LSE of part idx for head h (-inf when idx < 0): local row idx, or received row idx - n_local."""
    valid = idx >= 0
    local = idx < n_local
    l_loc = tl.load(lse + idx * heads + h, mask=valid & local, other=float("-inf"))
    l_rem = tl.load(res + ((idx - n_local) * heads + h) * (dv + 1) + dv, mask=valid & (idx >= n_local), other=0.0)
    return tl.where(valid, tl.where(local, l_loc, l_rem), float("-inf"))


@triton.jit
def _merge_routed_kernel(o, lse, res, index, out, out_lse, heads, dv, n_local, k_parts, BLOCK: tl.constexpr):
    n, h, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dv
    parts = index + n.to(tl.int64) * k_parts
    top = float("-inf")
    for k in range(k_parts):
        top = tl.maximum(top, _part_lse(lse, res, tl.load(parts + k), h, heads, dv, n_local))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = 0.0
    for k in range(k_parts):
        total += tl.exp(_part_lse(lse, res, tl.load(parts + k), h, heads, dv, n_local) - shift)
    merged_lse = shift + tl.log(total)  # all parts empty: log(0) = -inf
    base = tl.where(merged_lse == float("-inf"), 0.0, merged_lse)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(k_parts):
        idx = tl.load(parts + k)
        w = tl.exp(_part_lse(lse, res, idx, h, heads, dv, n_local) - base)
        idx = tl.zeros([BLOCK], dtype=tl.int64) + idx  # as a block: masks combine elementwise
        local = (idx >= 0) & (idx < n_local)
        remote = idx >= n_local
        v_loc = tl.load(o + (idx * heads + h) * dv + offs, mask=mask & local, other=0.0).to(tl.float32)
        v_rem = tl.load(res + ((idx - n_local) * heads + h) * (dv + 1) + offs, mask=mask & remote, other=0.0)
        v_rem = v_rem.to(out.dtype.element_ty).to(tl.float32)  # received rows take the local dtype first
        acc += w * tl.where(local, v_loc, v_rem)
    row = n.to(tl.int64) * heads + h
    tl.store(out + row * dv + offs, acc.to(out.dtype.element_ty), mask=mask)
    tl.store(out_lse + row, merged_lse, mask=blk == 0)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t as contiguous rows, and the elements per row."""
    return t.contiguous(), math.prod(t.shape[1:])


def _check_index(index: torch.Tensor, what: str) -> torch.Tensor:
    if index.dtype != torch.int64:
        raise TypeError(f"{what}: index must be int64, got {index.dtype}")
    return index.contiguous()


class TritonRoutingKernels:
    name = "triton"

    @staticmethod
    def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        src, row = _rows(src)
        index = _check_index(index, "gather_rows")
        out = src.new_empty(index.shape[0], *src.shape[1:]) if out is None else out
        if index.numel() and row:
            _gather_rows_kernel[(index.shape[0], triton.cdiv(row, BLOCK))](src, index, out, row, BLOCK=BLOCK)
        return out

    @staticmethod
    def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if not dst.is_contiguous():
            raise ValueError("scatter_rows writes in place: dst must be contiguous")
        src, row = _rows(src)
        index = _check_index(index, "scatter_rows")
        if index.numel() and row:
            _scatter_rows_kernel[(index.shape[0], triton.cdiv(row, BLOCK))](dst, index, src, row, BLOCK=BLOCK)
        return dst

    @staticmethod
    def gather_two(
        a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        a, row = _rows(a)
        b = b.contiguous() if b.shape[0] else a  # an empty second source is never read
        index = _check_index(index, "gather_two")
        out = a.new_empty(index.shape[0], *a.shape[1:]) if out is None else out
        if index.numel() and row:
            grid = (index.shape[0], triton.cdiv(row, BLOCK))
            _gather_two_kernel[grid](a, b, index, out, a.shape[0], row, BLOCK=BLOCK)
        return out

    @staticmethod
    def pack_partials(
        o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        o, lse = o.contiguous(), lse.contiguous()
        index = _check_index(index, "pack_partials")
        n, heads, dv = index.shape[0], o.shape[1], o.shape[2]
        out = o.new_empty(n, heads, dv + 1, dtype=torch.float32) if out is None else out
        if n and heads:
            _pack_partials_kernel[(n, heads, triton.cdiv(dv, BLOCK))](o, lse, index, out, heads, dv, BLOCK=BLOCK)
        return out

    @staticmethod
    def merge_routed(
        o: torch.Tensor,
        lse: torch.Tensor,
        res: torch.Tensor,
        index: torch.Tensor,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = o.contiguous(), lse.contiguous()
        res = res.contiguous() if res.shape[0] else o.new_zeros(1, o.shape[1], o.shape[2] + 1, dtype=torch.float32)
        index = _check_index(index, "merge_routed")
        n, k = index.shape
        heads, dv = o.shape[1], o.shape[2]
        out = o.new_empty(n, heads, dv) if out is None else out
        out_lse = o.new_empty(n, heads, dtype=torch.float32) if out_lse is None else out_lse
        if n and heads:
            grid = (n, heads, triton.cdiv(dv, BLOCK))
            _merge_routed_kernel[grid](o, lse, res, index, out, out_lse, heads, dv, o.shape[0], k, BLOCK=BLOCK)
        return out, out_lse
