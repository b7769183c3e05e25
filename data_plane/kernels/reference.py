"""Torch reference of the routing kernels: packing/unpacking of routed queries and partial results, the LSE merge.

These are the plain statements the Triton kernels (triton_routing.py) are tested against, and what the graph path
runs on CPU. Index conventions: int64 row indices; in `merge_routed` a part index < S names row idx of the local
partials (o, lse), an index >= S names row idx - S of the received results, -1 names no part.
"""

from __future__ import annotations

import torch

from nanocp.models import merge_attention_partials


class TorchRoutingKernels:
    name = "torch"

    @staticmethod
    def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack: out[i] = src[index[i]]; src [N, ...], index [n] -> out [n, ...]."""
        return torch.index_select(src, 0, index, out=out) if out is not None else src.index_select(0, index)

    @staticmethod
    def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Unpack: dst[index[i]] = src[i] in place; dst [N, ...], index [n], src [n, ...]. Duplicate indices leave
        one of the written rows (unspecified which: use them only for scratch rows)."""
        return dst.index_copy_(0, index, src.to(dst.dtype))

    @staticmethod
    def gather_two(
        a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Unpack routed queries: out[i] = a[index[i]] if index[i] < len(a) else b[index[i] - len(a)]."""
        rows = torch.cat([a, b.to(a.dtype)]).index_select(0, index)
        return rows if out is None else out.copy_(rows)

    @staticmethod
    def pack_partials(
        o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pack partial results for Res-routing: o [S, H, Dv], lse [S, H] -> out [n, H, Dv + 1] fp32 whose row i is
        o[index[i]] with lse[index[i]] appended per head."""
        rows = torch.cat([o.float(), lse.float()[..., None]], dim=-1).index_select(0, index)
        return rows if out is None else out.copy_(rows)

    @staticmethod
    def merge_routed(
        o: torch.Tensor,
        lse: torch.Tensor,
        res: torch.Tensor,
        index: torch.Tensor,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpack received partials and LSE-merge: o [S, H, Dv] local partials, lse [S, H], res [R, H, Dv + 1] fp32
        received rows (o | lse), index [N, K] -> o_merged [N, H, Dv] (o's dtype), lse [N, H] fp32. Received o rows
        are cast to o's dtype before merging, as the eager decode path does."""
        dv = o.shape[-1]
        pad_o = o.new_zeros(1, *o.shape[1:])
        pad_lse = lse.new_full((1, lse.shape[1]), float("-inf"))
        parts_o = torch.cat([o, res[..., :dv].to(o.dtype), pad_o])  # [S + R + 1, H, Dv]
        parts_lse = torch.cat([lse.float(), res[..., dv], pad_lse.float()])  # [S + R + 1, H]
        idx = torch.where(index < 0, parts_o.shape[0] - 1, index).T  # [K, N]: -1 -> the empty part
        merged, merged_lse = merge_attention_partials(parts_o[idx], parts_lse[idx])
        if out is not None:
            merged = out.copy_(merged)
        if out_lse is not None:
            merged_lse = out_lse.copy_(merged_lse)
        return merged, merged_lse
