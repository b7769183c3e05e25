"""Packed MoE dispatch/combine over a fabric: the eager decode path's exchange (one put per peer and direction).

comm.moe_dispatch.LowLatencyDispatcher keeps DeepEP's static layout (one slab block per (expert, source), one put
per (token block, expert)), which the graph path needs. Here each rank sends every peer one contiguous block per
direction, its (token, expert) pairs sorted by (expert, token):
- dispatch: into the peer's `x` buffer at rows [rank * (cap + 1), ...): a header row, then one row per pair. A row
  is [hidden values | tag], the tag (4 bytes, an int32 view of the row's tail; int64 for 8-byte dtypes) holding the
  pair's local expert, the header's tag the number of pairs;
- combine: the expert outputs of the pairs a source sent, in the same order, into the source's `y` buffer at
  [rank * cap, ...); the source gathers each (token, slot) result and sums them with the gate weights (fp32).
cap = max_tokens * min(top_k, local experts) bounds the pairs one rank sends one peer. Every rank signals every
other rank in both directions (also with nothing to send), so a combine waits for all ranks: a rank's next
dispatch can only start once every peer has consumed what it received (the buffers are reused every layer). A
rank's block for itself is a plain copy into its own buffer (no put, no flag).

Where every rank's buffers are mapped in this process (shared memory, threads: comm.Fabric.peer_buffer) and the
rows are fp32, the fused kernels write in place: `dispatch_send` lays out and writes every peer's block in one call
(cpu_kernels.pack_dispatch), and the expert pass can read the receive buffer and write each output into its source's
`y` block itself (`in_place_combine`, cpu_kernels.received_expert_mlp), then only signal (`combine_sent`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanocp.comm.fabric import DEFAULT_TIMEOUT_S, Fabric
from nanocp.comm.moe_dispatch import check_dispatch_inputs

from . import cpu_kernels


@dataclass
class PackedPending:
    """A dispatch whose tokens are sent: what the sender needs to combine the results."""

    seq: int
    tokens: int
    top_k: int
    result_rows: torch.Tensor  # int64 [T, k]: row of each (token, slot) result in the `y` buffer (-1 when none)


@dataclass
class PackedReceived:
    """What this rank received in one dispatch, source-major (source 0's rows first)."""

    seq: int
    rows: np.ndarray  # int64 [N]: row of each received token in `recv_x`
    local_expert: np.ndarray  # int64 [N]
    source_counts: list[int]  # [ranks]


def packed_layout(
    idx: np.ndarray, num_experts: int, ranks: int, cap: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dispatch payload layout of topk_idx [T, k] (-1 = no expert), in numpy (cpu_kernels.moe_dispatch_layout
    is the fused form) -> (n pairs, source token [n + ranks], tags [n + ranks], per_dst [ranks], result_rows [T, k]
    (-1 = none)): per destination rank a header row, then its pairs sorted by (expert, token)."""
    lx = num_experts // ranks
    t, k = idx.shape
    key = idx.reshape(-1) + 1  # 0 = no expert, sorts first
    order = np.argsort(key, kind="stable")  # pairs by (expert, token)
    per_expert = np.bincount(key, minlength=num_experts + 1)
    per_dst = per_expert[1:].reshape(ranks, lx).sum(axis=1)
    if per_dst.max() > cap:
        raise ValueError(f"{int(per_dst.max())} pairs for one rank exceed its capacity {cap}")
    n = t * k - int(per_expert[0])
    order = order[t * k - n :]
    expert = key[order] - 1
    dst = expert // lx
    starts = np.cumsum(per_dst) - per_dst  # first pair of each peer
    position = np.arange(n) + dst + 1  # payload row of each pair: after the headers of peers <= its own
    headers = starts + np.arange(ranks)
    tags = np.empty(n + ranks, dtype=np.int64)
    tags[position] = expert - dst * lx
    tags[headers] = per_dst
    source = np.zeros(n + ranks, dtype=np.int64)
    source[position] = order // k
    result_rows = np.full(t * k, -1, dtype=np.int64)
    result_rows[order] = dst * cap + np.arange(n) - starts[dst]
    return n, source, tags, per_dst, result_rows.reshape(t, k)


@dataclass
class _InPlaceViews:
    """Numpy views of the buffers a rank's in-place kernels read and write (every rank's mapped in this process)."""

    recv: np.ndarray  # [ranks * (cap + 1), row]: this rank's `x` receive buffer
    dispatch_blocks: list[np.ndarray]  # per rank d: [cap + 1, row], where d's `x` buffer takes this rank's block
    combine_blocks: list[np.ndarray]  # per rank s: [cap, hidden], where s's `y` buffer takes this rank's outputs


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
        size = torch.empty((), dtype=dtype).element_size()
        self.tag_dtype = torch.int32 if size <= 4 else torch.int64
        tag_bytes = torch.empty((), dtype=self.tag_dtype).element_size()
        if tag_bytes % size or (hidden * size) % tag_bytes:
            raise ValueError(f"a {dtype} row of {hidden} values cannot carry a {self.tag_dtype} tag")
        self.fabric = fabric
        self.num_experts = num_experts
        self.local_experts = num_experts // ranks
        self.hidden = hidden
        self.row = hidden + tag_bytes // size  # values per `x` row: hidden + the tag
        self.max_tokens = max_tokens_per_rank
        self.top_k = top_k
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.cap = max_tokens_per_rank * min(top_k, self.local_experts)
        self._names = {k: f"{name}.{k}" for k in ("x", "y")}
        fabric.register(self._names["x"], (ranks * (self.cap + 1), self.row), dtype, timeout_s)
        fabric.register(self._names["y"], (ranks * self.cap, hidden), dtype, timeout_s)
        self.dispatch_flag = fabric.reserve_flags(ranks)
        self.combine_flag = fabric.reserve_flags(ranks)
        self._peers = [r for r in range(ranks) if r != fabric.rank]
        self._empty_header = torch.zeros(1, self.row, dtype=dtype, device=fabric.buffer(self._names["y"]).device)
        self._seq = 0
        # Every rank's `x` and `y` buffer where this process can write it in place (its own always; peers' on a
        # load/store fabric: comm.Fabric.peer_buffer), else None: those rows go by put.
        self._targets = {
            k: [fabric.buffer(n) if d == fabric.rank else fabric.peer_buffer(d, n) for d in range(ranks)]
            for k, n in self._names.items()
        }
        self._in_place = self._numpy_views()

    @property
    def recv_x(self) -> torch.Tensor:
        """[ranks * (cap + 1), hidden]: the received token values (`PackedReceived.rows` index it)."""
        return self.fabric.buffer(self._names["x"])[:, : self.hidden]

    def _numpy_views(self) -> _InPlaceViews | None:
        """The buffers the in-place kernels write, as numpy views made once: fp32 on the CPU with every rank's
        buffers mapped here."""
        targets = self._targets["x"] + self._targets["y"]
        if self.dtype != torch.float32 or any(b is None or not b.is_cpu for b in targets):
            return None
        rank, cap = self.fabric.rank, self.cap
        return _InPlaceViews(
            recv=self.fabric.buffer(self._names["x"]).numpy(),
            dispatch_blocks=[x[rank * (cap + 1) : (rank + 1) * (cap + 1)].numpy() for x in self._targets["x"]],
            combine_blocks=[y[rank * cap : (rank + 1) * cap].numpy() for y in self._targets["y"]],
        )

    @property
    def in_place_combine(self) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """(this rank's `x` receive buffer [ranks * (cap + 1), row], and per source rank s the [cap, hidden] block
        of s's `y` buffer where this rank's outputs for s go) as numpy arrays, for a kernel that reads what the
        sources sent and writes the outputs where their combine reads them (cpu_kernels.received_expert_mlp; then
        `combine_sent`). None where that cannot be done in place (not fp32 on the CPU, a peer's buffer reachable by
        put only, or the fused kernels switched off)."""
        views = self._in_place if cpu_kernels.usable(self._empty_header) else None
        return None if views is None else (views.recv, views.combine_blocks)

    def _tags(self, rows: torch.Tensor) -> torch.Tensor:
        """The tag column of `x` rows [n, row] as a [n] integer view."""
        return rows[:, self.hidden :].view(self.tag_dtype)[:, 0]

    # ---- dispatch -----------------------------------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, check: bool = True) -> PackedPending:
        """x [T, hidden], topk_idx int64 [T, k] (-1 = no expert) -> the pending dispatch; every rank is signalled.
        check=False skips validating topk_idx (for a gate's own top-k output)."""
        idx = (
            check_dispatch_inputs(x, topk_idx, self.hidden, self.max_tokens, self.dtype, self.num_experts, self.top_k)
            if check
            else topk_idx.cpu().numpy()
        )  # [T, k]
        self._seq += 1
        rank, ranks = self.fabric.rank, self.fabric.world_size
        t, k = idx.shape
        if self._in_place is not None and cpu_kernels.usable(x):  # layout and rows straight into every peer's buffer
            result_rows = np.empty((t, k), dtype=np.int64)
            cpu_kernels.pack_dispatch(x, idx, self.num_experts, self.cap, self._in_place.dispatch_blocks, result_rows)
            self._signal_peers(self.dispatch_flag, self._seq)
            return PackedPending(self._seq, t, k, torch.from_numpy(result_rows))
        if t == 0:  # nothing to send: every peer gets an empty block (its header says 0)
            for d in range(ranks):
                self._put(d, "x", rank * (self.cap + 1), self._empty_header)
            self._signal_peers(self.dispatch_flag, self._seq)
            return PackedPending(self._seq, 0, k, torch.zeros(0, k, dtype=torch.int64))
        fused = cpu_kernels.usable(x)  # fp32: rows of hidden values + one int32 tag, the kernels' layout
        if fused:
            layout = cpu_kernels.moe_dispatch_layout(idx, self.num_experts, ranks, self.cap)
        else:
            layout = packed_layout(idx, self.num_experts, ranks, self.cap)
        n, source, tags, per_dst, result_rows = layout
        row = rank * (self.cap + 1)
        payload, first = None, 0
        targets = self._targets["x"]
        for d, count in enumerate(per_dst.tolist()):
            block = slice(first, first + 1 + count)
            first += 1 + count
            if fused and targets[d] is not None:  # packed straight into the receive buffer (own or mapped peer)
                cpu_kernels.pack_dispatch_rows(x, source[block], tags[block], targets[d][row : row + 1 + count])
                continue
            if payload is None:
                payload = self._payload(x, source, tags, fused)
            self._put(d, "x", row, payload[block])
        self._signal_peers(self.dispatch_flag, self._seq)
        return PackedPending(self._seq, t, k, torch.from_numpy(result_rows))

    def _payload(self, x: torch.Tensor, source: np.ndarray, tags: np.ndarray, fused: bool) -> torch.Tensor:
        """The payload rows [len(source), row]: each token's values, then its tag."""
        payload = torch.empty(len(source), self.row, dtype=self.dtype, device=x.device)
        if fused:
            cpu_kernels.pack_dispatch_rows(x, source, tags, payload)
            return payload
        payload[:, : self.hidden] = x.index_select(0, torch.from_numpy(source).to(x.device))
        self._tags(payload).copy_(torch.from_numpy(tags))
        return payload

    def wait_flags(self, pending: PackedPending) -> list[tuple[int, int]]:
        """(flag, value) pairs that must hold before dispatch_finish: every rank has sent its tokens."""
        return [(self.dispatch_flag + src, pending.seq) for src in self._peers]

    def dispatch_finish(self, pending: PackedPending) -> PackedReceived:
        """Read what every source sent (call after the dispatch flags hold)."""
        return self.read_received(pending.seq)

    def read_received(self, seq: int = 0) -> PackedReceived:
        """What the sources' last dispatch put into this rank's buffer, for the dispatch `seq`."""
        block = self.cap + 1
        tags = self._tags(self.fabric.buffer(self._names["x"])).cpu().numpy()  # [ranks * block]
        counts = tags[::block].tolist()
        if any(not 0 <= c <= self.cap for c in counts):
            raise ValueError(f"corrupt dispatch: counts {counts} outside [0, {self.cap}]")
        rows = np.concatenate([np.arange(s * block + 1, s * block + 1 + c) for s, c in enumerate(counts)])
        local = tags[rows].astype(np.int64)
        if len(local) and (local.min() < 0 or local.max() >= self.local_experts):
            raise ValueError(f"corrupt dispatch: local experts outside [0, {self.local_experts})")
        return PackedReceived(seq, rows, local, counts)

    # ---- combine ------------------------------------------------------------------------------------------
    def combine_send(self, y: torch.Tensor, received: PackedReceived) -> None:
        """y [N, hidden]: expert outputs of the received rows, in their order -> back to their sources."""
        if tuple(y.shape) != (len(received.rows), self.hidden):
            raise ValueError(f"y must be [{len(received.rows)}, {self.hidden}], got {tuple(y.shape)}")
        rank, cap = self.fabric.rank, self.cap
        offset = 0
        for src, count in enumerate(received.source_counts):
            if count:
                self._put(src, "y", rank * cap, y[offset : offset + count])
            offset += count
        self.combine_sent(received.seq)

    def combine_sent(self, seq: int) -> None:
        """The outputs for dispatch `seq` are in every source's `y` buffer: signal them."""
        self._signal_peers(self.combine_flag, seq)

    def combine_wait_flags(self, pending: PackedPending) -> list[tuple[int, int]]:
        """(flag, value) pairs that must hold before combine_finish: every rank has sent its outputs."""
        return [(self.combine_flag + src, pending.seq) for src in self._peers]

    def combine_finish(
        self, pending: PackedPending, topk_weights: torch.Tensor, dtype: torch.dtype, base: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out [T, hidden] = (base +) sum over the top-k slots of weight * expert output, accumulated in fp32."""
        if tuple(topk_weights.shape) != (pending.tokens, pending.top_k):
            raise ValueError(
                f"topk_weights must be [{pending.tokens}, {pending.top_k}], got {tuple(topk_weights.shape)}"
            )
        if pending.tokens == 0:
            return torch.zeros(0, self.hidden, dtype=dtype) if base is None else base
        buffer = self.fabric.buffer(self._names["y"])
        if base is not None and cpu_kernels.usable(buffer) and cpu_kernels.usable(base) and dtype == torch.float32:
            return cpu_kernels.weighted_combine(buffer, pending.result_rows, topk_weights.float(), base)
        rows = pending.result_rows.to(buffer.device)
        results = buffer.index_select(0, rows.view(-1).clamp(min=0))
        results = results.view(pending.tokens, pending.top_k, self.hidden).float()  # [T, k, hidden]
        weights = topk_weights.float()
        valid = rows >= 0
        if not bool(valid.all()):  # slots without an expert read row 0: weight 0, value 0
            weights = weights.masked_fill(~valid, 0.0)
            results = results.masked_fill(~valid[..., None], 0.0)
        routed = torch.bmm(weights[:, None, :], results)[:, 0].to(dtype)
        return routed if base is None else base + routed

    # ---- transport ----------------------------------------------------------------------------------------
    def _put(self, dst: int, buffer: str, row: int, rows: torch.Tensor) -> None:
        """rows into dst's buffer at `row`: a plain copy where this process can write the buffer in place (its own,
        a mapped peer's), a fabric put otherwise."""
        target = self._targets[buffer][dst]
        if target is not None:
            target[row : row + rows.shape[0]].copy_(rows)
        else:
            self.fabric.put(dst, self._names[buffer], row, rows)

    def _signal_peers(self, flag_base: int, seq: int) -> None:
        """Tell every other rank this rank's part of exchange `seq` is in place (its own part needs no flag)."""
        for dst in self._peers:
            self.fabric.signal(dst, flag_base + self.fabric.rank, seq)
