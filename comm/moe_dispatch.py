"""Reference MoE dispatch/combine with DeepEP's low-latency layout, over any fabric.

Rank r owns experts [r * E/N, (r+1) * E/N). `dispatch` sends every (token, top-k slot) to the rank owning
the chosen expert; tokens from rank s land in rows [s * max_tokens, (s+1) * max_tokens) of each local
expert's slab of `recv_x` [local_experts, ranks * max_tokens, hidden], in ascending token order. `combine`
sends the expert outputs back and returns, per token, the sum over its top-k slots (in slot order, fp32
accumulation) of weight * expert output: the same bits whatever the number of ranks.

Buffers are static (graph friendly). `recv_x` is valid until this rank calls `combine`; the next dispatch
on a peer can only start after that, because every combine waits for every rank's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanocp.comm.fabric import DEFAULT_TIMEOUT_S, Fabric


@dataclass
class DispatchHandle:
    """What combine needs to route outputs back, plus the receive-side layout."""

    seq: int
    topk_idx: torch.Tensor  # int64 [T, k], -1 = none
    slot: torch.Tensor  # int64 [T, k]: row of (t, k) in its expert's block from this rank, -1 = none
    recv_layout: torch.Tensor  # int32 [ranks, local_experts]: rows received from each source rank
    recv_src_token: torch.Tensor  # int32 [local_experts, ranks * max_tokens]: source token per row, -1 = empty


@dataclass
class PendingDispatch:
    """A dispatch whose tokens are sent but whose receive side is not read yet."""

    seq: int
    topk_idx: torch.Tensor  # int64 [T, k]
    slot: torch.Tensor  # int64 [T, k]
    flag_base: int


def check_dispatch_inputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    hidden: int,
    max_tokens: int,
    dtype: torch.dtype,
    num_experts: int,
    top_k: int | None = None,
) -> np.ndarray:
    """Validate a dispatch's x [T, hidden] and topk_idx int64 [T, k] (-1 = no expert, no expert twice per token,
    k <= top_k when given); returns topk_idx as a numpy array."""
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [T, {hidden}], got {tuple(x.shape)}")
    if x.shape[0] > max_tokens:
        raise ValueError(f"{x.shape[0]} tokens exceed max_tokens_per_rank={max_tokens}")
    if x.dtype != dtype:
        raise TypeError(f"x dtype {x.dtype} != dispatcher dtype {dtype}")
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx must be int64 [{x.shape[0]}, k], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if top_k is not None and topk_idx.shape[1] > top_k:
        raise ValueError(f"topk_idx has {topk_idx.shape[1]} slots, the dispatcher was sized for {top_k}")
    idx = topk_idx.cpu().numpy()
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        raise ValueError(f"topk_idx values must lie in [-1, {num_experts})")
    chosen = np.sort(idx, axis=1)
    if ((chosen[:, 1:] == chosen[:, :-1]) & (chosen[:, 1:] >= 0)).any():
        raise ValueError("a token chooses the same expert twice in topk_idx")
    return idx


class LowLatencyDispatcher:
    """Static-buffer dispatch/combine for one fabric (construct on every rank in the same order)."""

    def __init__(
        self,
        fabric: Fabric,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "moe",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        ranks = fabric.world_size
        if num_experts < 1 or num_experts % ranks:
            raise ValueError(f"num_experts {num_experts} must be a positive multiple of the {ranks} ranks")
        if hidden < 1 or max_tokens_per_rank < 1:
            raise ValueError(f"hidden ({hidden}) and max_tokens_per_rank ({max_tokens_per_rank}) must be >= 1")
        self.fabric = fabric
        self.num_experts = num_experts
        self.local_experts = num_experts // ranks
        self.hidden = hidden
        self.max_tokens = max_tokens_per_rank
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._names = {k: f"{name}.{k}" for k in ("x", "src", "count", "combine")}
        slab_rows = self.local_experts * ranks * max_tokens_per_rank
        # rows (expert l, source s, slot j) at l * ranks * max + s * max + j
        fabric.register(self._names["x"], (slab_rows, hidden), dtype, timeout_s)
        fabric.register(self._names["src"], (slab_rows,), torch.int32, timeout_s)
        # row s: how many tokens source s sent to each local expert
        fabric.register(self._names["count"], (ranks, self.local_experts), torch.int32, timeout_s)
        # rows (global expert e, slot j) at e * max + j: expert outputs for this rank's tokens
        fabric.register(self._names["combine"], (num_experts * max_tokens_per_rank, hidden), dtype, timeout_s)
        self.dispatch_flag = fabric.reserve_flags(ranks)
        self.combine_flag = fabric.reserve_flags(ranks)
        self._seq = 0

    @property
    def recv_x(self) -> torch.Tensor:
        """[local_experts, ranks * max_tokens, hidden] view of the dispatch receive buffer."""
        return self.fabric.buffer(self._names["x"]).view(self.local_experts, -1, self.hidden)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """x [T, hidden], topk_idx int64 [T, k] -> (recv_x, recv_count int32 [local_experts], handle)."""
        pending = self.dispatch_send(x, topk_idx)
        self._wait_all(pending)
        return self.dispatch_finish(pending)

    def combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: DispatchHandle
    ) -> torch.Tensor:
        """y [local_experts, ranks * max, hidden] expert outputs -> out [T, hidden] = sum_k w_k * y_k."""
        self.combine_send(y, topk_idx, topk_weights, handle)
        self._wait_all(handle)
        return self.combine_finish(handle, topk_weights, y.dtype)

    # ---- split phases: send, then wait (blocking or polled via wait_flags), then finish -----------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor) -> PendingDispatch:
        """Put this rank's tokens into the owners' slabs and signal every rank."""
        check_dispatch_inputs(x, topk_idx, self.hidden, self.max_tokens, self.dtype, self.num_experts)
        self._seq += 1
        fabric, rank, ranks, lx = self.fabric, self.fabric.rank, self.fabric.world_size, self.local_experts
        expert, token, slot, counts, starts = self._layout(topk_idx.cpu())  # host bookkeeping
        for dst in range(ranks):
            fabric.put(dst, self._names["count"], rank, counts[dst * lx : (dst + 1) * lx].to(torch.int32)[None])
        for e in torch.nonzero(counts).flatten().tolist():
            dst, local = divmod(e, lx)
            tokens = token[starts[e] : starts[e] + counts[e]]  # ascending source token ids
            row = (local * ranks + rank) * self.max_tokens
            fabric.put(dst, self._names["x"], row, x.index_select(0, tokens.to(x.device)))
            fabric.put(dst, self._names["src"], row, tokens.to(torch.int32))
        for dst in range(ranks):
            fabric.signal(dst, self.dispatch_flag + rank, self._seq)
        return PendingDispatch(self._seq, topk_idx.clone(), slot, self.dispatch_flag)

    def wait_flags(self, pending: PendingDispatch | DispatchHandle) -> list[tuple[int, int]]:
        """(flag, value) pairs that must hold before dispatch_finish / combine_finish: every rank has sent."""
        base = pending.flag_base if isinstance(pending, PendingDispatch) else self.combine_flag
        return [(base + src, pending.seq) for src in range(self.fabric.world_size)]

    def dispatch_finish(self, pending: PendingDispatch) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        layout = self.fabric.buffer(self._names["count"]).clone()  # [ranks, local_experts]
        handle = DispatchHandle(pending.seq, pending.topk_idx, pending.slot, layout, self._received_sources(layout))
        return self.recv_x, layout.sum(0, dtype=torch.int32), handle

    def combine_send(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: DispatchHandle
    ) -> None:
        """Send the expert outputs y [local_experts, ranks * max, hidden] back to the ranks that own the tokens."""
        fabric, rank, ranks, mt = self.fabric, self.fabric.rank, self.fabric.world_size, self.max_tokens
        if tuple(y.shape) != (self.local_experts, ranks * mt, self.hidden):
            raise ValueError(f"y must be [{self.local_experts}, {ranks * mt}, {self.hidden}], got {tuple(y.shape)}")
        if not torch.equal(topk_idx, handle.topk_idx):
            raise ValueError("topk_idx differs from the one this handle was dispatched with")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_idx {tuple(topk_idx.shape)}")
        for local, src in torch.nonzero(handle.recv_layout.T).tolist():
            n = int(handle.recv_layout[src, local])
            row = (rank * self.local_experts + local) * mt
            fabric.put(src, self._names["combine"], row, y[local, src * mt : src * mt + n])
        for dst in range(ranks):
            fabric.signal(dst, self.combine_flag + rank, handle.seq)

    def combine_finish(self, handle: DispatchHandle, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out [T, hidden] = sum over top-k slots (in slot order) of weight * expert output."""
        return self._reduce(self.fabric.buffer(self._names["combine"]), handle, topk_weights, dtype)

    def _wait_all(self, pending: PendingDispatch | DispatchHandle) -> None:
        for flag, value in self.wait_flags(pending):
            self.fabric.wait(flag, value, self.timeout_s)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _layout(self, topk_idx: torch.Tensor):
        """Sort the valid (token, slot) pairs by (expert, token). Returns the sorted experts and tokens,
        slot [T, k] (position of each pair inside its expert block, -1 = none), counts [E], starts [E]."""
        num_tokens, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        valid = torch.nonzero(flat >= 0).flatten()  # flat positions t * k + slot
        expert, token = flat[valid], valid // max(k, 1)
        order = torch.argsort(expert * max(num_tokens, 1) + token, stable=True)
        expert, token, valid = expert[order], token[order], valid[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.full((num_tokens * k,), -1, dtype=torch.int64)
        slot[valid] = torch.arange(expert.numel()) - starts[expert]
        return expert, token, slot.view(num_tokens, k), counts, starts

    def _received_sources(self, layout: torch.Tensor) -> torch.Tensor:
        ranks, mt = self.fabric.world_size, self.max_tokens
        src = self.fabric.buffer(self._names["src"]).view(self.local_experts, ranks, mt)
        filled = (
            torch.arange(mt, device=src.device) < layout.T.to(src.device)[:, :, None]
        )  # [local_experts, ranks, max]
        return torch.where(filled, src, torch.full_like(src, -1)).reshape(self.local_experts, ranks * mt)

    def _reduce(
        self, outputs: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """out[t] = sum over slots k in order of w[t, k] * outputs[e(t, k), slot(t, k)] in fp32."""
        topk_idx, slot = handle.topk_idx, handle.slot.to(handle.topk_idx.device)
        out = torch.zeros(topk_idx.shape[0], self.hidden, dtype=torch.float32, device=outputs.device)
        for k in range(topk_idx.shape[1]):
            valid = topk_idx[:, k] >= 0
            if not bool(valid.any()):
                continue
            rows = topk_idx[valid, k] * self.max_tokens + slot[valid, k]
            out[valid] += weights[valid, k, None].float() * outputs.index_select(0, rows).float()
        return out.to(dtype)
