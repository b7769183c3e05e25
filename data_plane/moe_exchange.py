"""Packed MoE dispatch/combine over a fabric: the eager decode path's exchange (one put per peer and direction).

comm.moe_dispatch.LowLatencyDispatcher keeps DeepEP's static layout (one slab block per (expert, source), one put
per (token block, expert)), which the graph path needs. Here each rank sends every peer one contiguous block per
direction, its (token, expert) pairs sorted by (expert, token):
- dispatch: rows of x into the peer's `x` buffer at [rank * cap, rank * cap + n), and a meta block at
  [rank * (cap + 1), ...) in the peer's `meta` buffer: the count n, then the local expert of each row;
- combine: the expert outputs of the rows a source sent, in the same order, into the source's `y` buffer at
  [rank * cap, ...); the source gathers each (token, slot) result and sums them with the gate weights (fp32).
cap = max_tokens * min(top_k, local experts) bounds the pairs one rank sends one peer. Every rank signals every
rank in both directions (also with nothing to send), so a combine waits for all ranks: a rank's next dispatch can
only start once every peer has consumed what it received (the buffers are reused every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanocp.comm.fabric import DEFAULT_TIMEOUT_S, Fabric


@dataclass
class PackedPending:
    """A dispatch whose tokens are sent: what the sender needs to combine the results."""

    seq: int
    tokens: int
    top_k: int
    result_rows: torch.Tensor  # int64 [T * k]: row of each (token, slot) result in the `y` buffer (0 when none)
    valid: torch.Tensor | None  # bool [T, k] when some slot chose no expert, else None


@dataclass
class PackedReceived:
    """What this rank received in one dispatch, source-major (source 0's rows first)."""

    seq: int
    rows: np.ndarray  # int64 [N]: row of each received token in the `x` buffer
    local_expert: np.ndarray  # int64 [N]
    source_counts: list[int]  # [ranks]


class PackedDispatcher:
    """Construct on every rank in the same order (buffer registration is collective)."""

    name = "packed"

    def __init__(
        self,
        fabric: Fabric,
        num_experts: int,
        hidden: int,
        max_tokens_per_rank: int,
        top_k: int,
        dtype: torch.dtype,
        name: str = "moe",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        ranks = fabric.world_size
        if num_experts < 1 or num_experts % ranks:
            raise ValueError(f"num_experts {num_experts} must be a positive multiple of the {ranks} ranks")
        if hidden < 1 or max_tokens_per_rank < 1 or top_k < 1:
            raise ValueError(
                f"hidden ({hidden}), max_tokens_per_rank ({max_tokens_per_rank}) and top_k ({top_k}) must be >= 1"
            )
        self.fabric = fabric
        self.num_experts = num_experts
        self.local_experts = num_experts // ranks
        self.hidden = hidden
        self.max_tokens = max_tokens_per_rank
        self.top_k = top_k
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.cap = max_tokens_per_rank * min(top_k, self.local_experts)
        self._names = {k: f"{name}.{k}" for k in ("meta", "x", "y")}
        fabric.register(self._names["meta"], (ranks * (self.cap + 1),), torch.int32, timeout_s)
        fabric.register(self._names["x"], (ranks * self.cap, hidden), dtype, timeout_s)
        fabric.register(self._names["y"], (ranks * self.cap, hidden), dtype, timeout_s)
        self.dispatch_flag = fabric.reserve_flags(ranks)
        self.combine_flag = fabric.reserve_flags(ranks)
        self._seq = 0

    @property
    def recv_x(self) -> torch.Tensor:
        """[ranks * cap, hidden]: the dispatch receive buffer (`PackedReceived.rows` index it)."""
        return self.fabric.buffer(self._names["x"])

    # ---- dispatch -----------------------------------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor) -> PackedPending:
        """x [T, hidden], topk_idx int64 [T, k] (-1 = no expert) -> the pending dispatch; every rank is signalled."""
        idx = self._check_inputs(x, topk_idx)  # host copy [T, k]
        self._seq += 1
        fabric, rank, ranks, lx, cap = (
            self.fabric,
            self.fabric.rank,
            self.fabric.world_size,
            self.local_experts,
            self.cap,
        )
        t, k = idx.shape
        flat = idx.reshape(-1)
        n = int((flat >= 0).sum())
        order = np.argsort(np.where(flat < 0, self.num_experts, flat), kind="stable")[:n]  # by (expert, token)
        expert = flat[order]
        dst = expert // lx
        per_dst = np.bincount(dst, minlength=ranks)
        starts = np.cumsum(per_dst) - per_dst
        meta = np.empty(n + ranks, dtype=np.int32)  # per peer: count, then the local expert of each row
        meta[np.arange(n) + dst + 1] = expert - dst * lx
        meta[starts + np.arange(ranks)] = per_dst
        meta_t = torch.from_numpy(meta)
        rows = x.index_select(0, torch.from_numpy(order // k)) if n else x[:0]
        for d in range(ranks):
            a, count = int(starts[d]), int(per_dst[d])
            fabric.put(d, self._names["meta"], rank * (cap + 1), meta_t[a + d : a + d + 1 + count])
            if count:
                fabric.put(d, self._names["x"], rank * cap, rows[a : a + count])
        for d in range(ranks):
            fabric.signal(d, self.dispatch_flag + rank, self._seq)
        result_rows = np.zeros(t * k, dtype=np.int64)
        result_rows[order] = dst * cap + np.arange(n) - starts[dst]
        valid = None if n == t * k else torch.from_numpy(idx >= 0)
        return PackedPending(self._seq, t, k, torch.from_numpy(result_rows), valid)

    def wait_flags(self, pending: PackedPending) -> list[tuple[int, int]]:
        """(flag, value) pairs that must hold before dispatch_finish: every rank has sent its tokens."""
        return [(self.dispatch_flag + src, pending.seq) for src in range(self.fabric.world_size)]

    def dispatch_finish(self, pending: PackedPending) -> PackedReceived:
        """Read what every source sent (call after the dispatch flags hold)."""
        cap = self.cap
        meta = self.fabric.buffer(self._names["meta"]).cpu().numpy()
        counts = [int(c) for c in meta[:: cap + 1]]
        if any(not 0 <= c <= cap for c in counts):
            raise ValueError(f"corrupt dispatch meta: counts {counts} outside [0, {cap}]")
        rows = np.concatenate([np.arange(s * cap, s * cap + c) for s, c in enumerate(counts)])
        local = np.concatenate([meta[s * (cap + 1) + 1 : s * (cap + 1) + 1 + c] for s, c in enumerate(counts)])
        if len(local) and (local.min() < 0 or local.max() >= self.local_experts):
            raise ValueError(f"corrupt dispatch meta: local experts outside [0, {self.local_experts})")
        return PackedReceived(pending.seq, rows.astype(np.int64), local.astype(np.int64), counts)

    # ---- combine ------------------------------------------------------------------------------------------
    def combine_send(self, y: torch.Tensor, received: PackedReceived) -> None:
        """y [N, hidden]: expert outputs of the received rows, in their order -> back to their sources."""
        if tuple(y.shape) != (len(received.rows), self.hidden):
            raise ValueError(f"y must be [{len(received.rows)}, {self.hidden}], got {tuple(y.shape)}")
        fabric, rank, cap = self.fabric, self.fabric.rank, self.cap
        offset = 0
        for src, count in enumerate(received.source_counts):
            if count:
                fabric.put(src, self._names["y"], rank * cap, y[offset : offset + count])
            offset += count
        for dst in range(fabric.world_size):
            fabric.signal(dst, self.combine_flag + rank, received.seq)

    def combine_wait_flags(self, pending: PackedPending) -> list[tuple[int, int]]:
        """(flag, value) pairs that must hold before combine_finish: every rank has sent its outputs."""
        return [(self.combine_flag + src, pending.seq) for src in range(self.fabric.world_size)]

    def combine_finish(self, pending: PackedPending, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out [T, hidden] = sum over the top-k slots of weight * expert output, accumulated in fp32."""
        if tuple(topk_weights.shape) != (pending.tokens, pending.top_k):
            raise ValueError(
                f"topk_weights must be [{pending.tokens}, {pending.top_k}], got {tuple(topk_weights.shape)}"
            )
        if pending.tokens == 0:
            return torch.zeros(0, self.hidden, dtype=dtype)
        results = self.fabric.buffer(self._names["y"]).index_select(0, pending.result_rows)
        results = results.view(pending.tokens, pending.top_k, self.hidden).float()  # [T, k, hidden]
        weights = topk_weights.float()
        if pending.valid is not None:  # slots without an expert read row 0: weight 0, value 0
            weights = weights.masked_fill(~pending.valid, 0.0)
            results = results.masked_fill(~pending.valid[..., None], 0.0)
        return (results * weights[..., None]).sum(dim=1).to(dtype)

    # ---- checks -------------------------------------------------------------------------------------------
    def _check_inputs(self, x: torch.Tensor, topk_idx: torch.Tensor) -> np.ndarray:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {tuple(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens_per_rank={self.max_tokens}")
        if x.dtype != self.dtype:
            raise TypeError(f"x dtype {x.dtype} != dispatcher dtype {self.dtype}")
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"topk_idx must be int64 [{x.shape[0]}, k], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
        if topk_idx.shape[1] > self.top_k:
            raise ValueError(f"topk_idx has {topk_idx.shape[1]} slots, the dispatcher was sized for {self.top_k}")
        idx = topk_idx.cpu().numpy()
        if idx.size and (idx.min() < -1 or idx.max() >= self.num_experts):
            raise ValueError(f"topk_idx values must lie in [-1, {self.num_experts})")
        chosen = np.sort(idx, axis=1)
        if ((chosen[:, 1:] == chosen[:, :-1]) & (chosen[:, 1:] >= 0)).any():
            raise ValueError("a token chooses the same expert twice in topk_idx")
        return idx
