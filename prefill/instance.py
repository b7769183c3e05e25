"""One prefill instance of the CDSP tier: full model weights, the latent KV rows it holds for requests in prefill,
and the execution of its part of one chunk as a generator that yields at every exchange.

Per chunk on an SP group (Tetris Sec. 4.1), an instance:
  1. cache balancing: puts the tail of its history rows into the group members that hold too few (layer 0 before
     the first projection, layer l+1 right after layer l's attention, so the transfer overlaps layer l's o_proj +
     FFN and layer l+1's QKV projection); a receiver waits for layer l's rows only just before layer l's attention;
  2. per layer: QKV projection of its zigzag share of the chunk, attention against all history and chunk KV, then
     o_proj, residual and FFN on its own tokens;
     - "ring": the latent KV blocks of the group travel around the ring (latent rows, 576 values per token on
       DeepSeek-V3, not the expanded per-head k/v); each step forwards the block first and then attends to it, and
       the partial outputs merge by LSE;
     - "ulysses": all-to-all head parallelism: queries go to the member owning their heads, the latent KV of the
       group is all-gathered (MLA shares one latent row among all heads), outputs come back to their tokens' owner;
  3. keeps its new rows (and the balanced history) for the next chunk, and the last token's logits if asked.

Exchanges use the symmetric fabric (put, then signal a per-source flag with an increasing stamp). Keys carry
their absolute RoPE position and attention is causal by position, so any split of the KV gives the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanocp.comm.fabric import Fabric
from nanocp.models import (
    DeepseekV3Weights,
    LayerWeights,
    embed,
    ffn_forward,
    logits,
    merge_attention_partials,
    mla_expand_kv,
    mla_prefill_attention_with_lse,
    mla_prefill_output,
    mla_prefill_qkv,
    post_attention_norm,
)

ATTENTION_MODES = ("ring", "ulysses")


class PrefillExecError(RuntimeError):
    """A chunk cannot run as described (bad work item, missing state, capacity exceeded)."""


@dataclass(frozen=True)
class Wait:
    """An exchange point: the chunk may go on once every (flag, value) pair holds on this instance."""

    flags: list[tuple[int, int]]


@dataclass(frozen=True)
class BalanceSend:
    """Rows [row_start, row_start + count) of the sender's store go to `dst`'s balance buffer at `dst_offset`."""

    dst: int
    row_start: int
    count: int
    dst_offset: int


@dataclass(frozen=True)
class BalanceRecv:
    """`count` rows from `src` land at `offset` of this instance's balance buffer."""

    src: int
    count: int
    offset: int


@dataclass(frozen=True)
class ChunkWork:
    """This instance's part of one chunk (computed by the executor; every member gets a consistent view)."""

    rid: str
    seq: int  # executor-wide chunk sequence number: flag stamps grow with it
    attention: str
    group: tuple[int, ...]  # members in ring order (empty part for a holder outside the group)
    positions: torch.Tensor  # int64 [n_local] absolute positions of the chunk tokens this instance computes
    tokens: torch.Tensor  # int64 [n_local] their token ids
    block_sizes: tuple[int, ...]  # rows each member holds during the chunk (balanced history + its new rows)
    query_counts: tuple[int, ...]  # chunk tokens each member computes
    keep: int  # the first `keep` rows of the store stay; the tail is sent by `sends`
    sends: tuple[BalanceSend, ...]
    recvs: tuple[BalanceRecv, ...]
    want_logits: bool  # this instance computes the chunk's last token: return its logits


@dataclass
class LocalKV:
    """Latent KV rows one instance holds for one request: kv [L, n, Dkv], positions int64 [n]."""

    kv: torch.Tensor
    positions: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class ChunkOutput:
    """What an instance produced for a chunk: its new rows (all layers) and, for the owner of the last token,
    that token's logits."""

    new_kv: torch.Tensor  # [L, n_local, Dkv]
    positions: torch.Tensor  # int64 [n_local]
    logits: torch.Tensor | None = None  # [vocab]


@dataclass
class _Flags:
    """First flag index of each exchange kind; the flag of source rank r is base + r."""

    ring: int
    balance: int
    q_all2all: int
    o_all2all: int


@dataclass
class _Layer:
    """One layer's per-chunk state on this instance."""

    layer: LayerWeights
    q: torch.Tensor  # [n_local, H, Dqk]
    block: torch.Tensor  # [block_rows, Dkv] the latent rows this instance holds for this layer
    block_positions: torch.Tensor  # int64 [block_rows]


def head_ranges(num_heads: int, size: int) -> list[tuple[int, int]]:
    """Ulysses head split: member k owns heads [k * H // size, (k + 1) * H // size)."""
    return [(k * num_heads // size, (k + 1) * num_heads // size) for k in range(size)]


def expand_kv_heads(layer: LayerWeights, kv: torch.Tensor, heads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_expand_kv` for the heads [h0, h1) only: kv [N, Dkv] -> k [N, h, nope + rope], v [N, h, v]."""
    c = layer.config
    h0, h1 = heads
    per_head = c.qk_nope_head_dim + c.v_head_dim
    c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    weight = layer.attn.kv_b_proj[h0 * per_head : h1 * per_head]  # [(h1 - h0) * (nope + v), kv_lora]
    kv_heads = F.linear(c_kv, weight).view(kv.shape[0], h1 - h0, per_head)
    k_nope, v = kv_heads.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_pe = k_pe[:, None, :].expand(-1, h1 - h0, -1)
    return torch.cat([k_nope, k_pe], dim=-1), v


class PrefillInstance:
    """A prefill instance: model weights (all of them), its fabric rank and the KV of requests in prefill."""

    def __init__(self, rank: int, model: DeepseekV3Weights, fabric: Fabric, max_request_tokens: int) -> None:
        c = model.config
        if max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {max_request_tokens}")
        self.rank = rank
        self.model = model
        self.fabric = fabric
        self.cap = max_request_tokens
        self.world = fabric.world_size
        self.signal_hook: Callable[[int, int, int], None] | None = None  # (src, dst, flag), for timing
        self.store: dict[str, LocalKV] = {}
        dtype = model.embed_tokens.dtype
        heads, dqk, dkv, dv = c.num_attention_heads, c.qk_head_dim, c.kv_cache_dim, c.v_head_dim
        self.num_layers, self.heads, self.dkv = c.num_hidden_layers, heads, dkv
        # Registration is collective: every instance registers the same buffers in the same order.
        cap = self.cap
        self.ring_kv = fabric.register("pf_ring", (2 * cap, dkv), dtype)  # two layer-parity regions
        self.ring_pos = fabric.register("pf_ring_pos", (2 * cap,), torch.int64)
        self.bal_kv = fabric.register("pf_bal", (self.num_layers * cap, dkv), dtype)  # one region per layer
        self.bal_pos = fabric.register("pf_bal_pos", (cap,), torch.int64)
        self.uq = fabric.register("pf_uq", (cap * heads, dqk), dtype)  # (token, head) rows
        self.uq_pos = fabric.register("pf_uq_pos", (cap,), torch.int64)
        self.ag_kv = fabric.register("pf_ag", (cap, dkv), dtype)
        self.ag_pos = fabric.register("pf_ag_pos", (cap,), torch.int64)
        self.uo = fabric.register("pf_uo", (cap * heads, dv), dtype)
        w = self.world
        self.flags = _Flags(*(fabric.reserve_flags(w) for _ in range(4)))

    # ------------------------------------------------------------------ bookkeeping

    def holdings(self, rid: str) -> LocalKV | None:
        return self.store.get(rid)

    def drop(self, rid: str) -> None:
        """Forget a request's rows (its prefill is done and its KV has been handed off)."""
        self.store.pop(rid, None)

    def _stamp(self, seq: int, layer: int, step: int) -> int:
        return (seq * self.num_layers + layer) * (self.world + 1) + step + 1

    def _signal(self, dst: int, flag: int, value: int) -> None:
        self.fabric.signal(dst, flag, value)
        if self.signal_hook is not None:
            self.signal_hook(self.rank, dst, flag)

    def _empty_store(self) -> LocalKV:
        kv = torch.empty(self.num_layers, 0, self.dkv, dtype=self.model.embed_tokens.dtype)
        return LocalKV(kv, torch.empty(0, dtype=torch.int64))

    # ------------------------------------------------------------------ one chunk

    @torch.no_grad()
    def chunk(self, work: ChunkWork) -> Iterator[Wait]:
        """This instance's part of a chunk as a generator (yields `Wait`s, returns a `ChunkOutput`)."""
        if work.attention not in ATTENTION_MODES:
            raise PrefillExecError(f"unknown attention mode {work.attention!r}; choose one of {ATTENTION_MODES}")
        store = self.store.get(work.rid) or self._empty_store()
        if not 0 <= work.keep <= store.rows or sum(s.count for s in work.sends) != store.rows - work.keep:
            raise PrefillExecError(
                f"instance {self.rank}, request {work.rid}: keep {work.keep} + sends do not cover its {store.rows} rows"
            )
        if self.rank not in work.group:
            # A holder outside the group hands all of its rows over at once and takes no part in the chunk.
            for layer in range(self.num_layers):
                self._put_balance(work, store, layer)
            self._signal_balance(work, self.num_layers - 1)
            self.store[work.rid] = LocalKV(store.kv[:, : work.keep], store.positions[: work.keep])
            return ChunkOutput(store.kv[:, :0], store.positions[:0])
        if max(work.block_sizes) > self.cap:
            raise PrefillExecError(f"a block of {max(work.block_sizes)} rows exceeds the capacity {self.cap}")
        self._put_balance(work, store, 0)
        self._signal_balance(work, 0)
        model, positions = self.model, work.positions
        h = embed(model, work.tokens)  # [n_local, D]
        new_kvs = []
        for index, layer in enumerate(model.layers):
            q, kv_new = mla_prefill_qkv(layer, h, positions)  # [n, H, Dqk], [n, Dkv]
            new_kvs.append(kv_new)
            if work.recvs:
                yield Wait([(self.flags.balance + r.src, self._stamp(work.seq, index, 0)) for r in work.recvs])
            block, block_pos = self._local_block(work, store, index, kv_new)
            state = _Layer(layer, q, block, block_pos)
            if work.attention == "ring":
                o = yield from self._ring_attention(work, index, state)
            else:
                o = yield from self._ulysses_attention(work, index, state)
            if index + 1 < self.num_layers:
                self._put_balance(work, store, index + 1)
                self._signal_balance(work, index + 1)
            h = h + mla_prefill_output(layer, o)
            h = h + ffn_forward(layer, post_attention_norm(layer, h))
        new_kv = torch.stack(new_kvs)  # [L, n_local, Dkv]
        self._commit(work, store, new_kv)
        last = logits(model, h[-1:])[0] if work.want_logits else None
        return ChunkOutput(new_kv, positions, last)

    def _local_block(
        self, work: ChunkWork, store: LocalKV, layer: int, kv_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows this instance holds for `layer` during the chunk: kept history + received history + new rows."""
        received = sum(r.count for r in work.recvs)
        base = layer * self.cap
        kv = torch.cat([store.kv[layer, : work.keep], self.bal_kv[base : base + received], kv_new])
        pos = torch.cat([store.positions[: work.keep], self.bal_pos[:received], work.positions])
        return kv, pos

    def _commit(self, work: ChunkWork, store: LocalKV, new_kv: torch.Tensor) -> None:
        received = sum(r.count for r in work.recvs)
        bal = torch.stack([self.bal_kv[i * self.cap : i * self.cap + received] for i in range(self.num_layers)])
        kv = torch.cat([store.kv[:, : work.keep], bal, new_kv], dim=1)
        pos = torch.cat([store.positions[: work.keep], self.bal_pos[:received], work.positions])
        self.store[work.rid] = LocalKV(kv, pos)

    # ------------------------------------------------------------------ cache balancing

    def _put_balance(self, work: ChunkWork, store: LocalKV, layer: int) -> None:
        base = layer * self.cap
        for send in work.sends:
            rows = slice(send.row_start, send.row_start + send.count)
            self.fabric.put(send.dst, "pf_bal", base + send.dst_offset, store.kv[layer, rows])
            if layer == 0:
                self.fabric.put(send.dst, "pf_bal_pos", send.dst_offset, store.positions[rows])

    def _signal_balance(self, work: ChunkWork, layer: int) -> None:
        for send in work.sends:
            self._signal(send.dst, self.flags.balance + self.rank, self._stamp(work.seq, layer, 0))

    # ------------------------------------------------------------------ attention

    def _attend(self, state: _Layer, positions: torch.Tensor, kv: torch.Tensor, kv_positions: torch.Tensor):
        k, v = mla_expand_kv(state.layer, kv)
        return mla_prefill_attention_with_lse(state.q, k, v, positions, kv_positions, self.model.softmax_scale)

    def _ring_attention(self, work: ChunkWork, layer: int, state: _Layer) -> Iterator[Wait]:
        """Zigzag ring attention: s - 1 hops of latent KV blocks, each forwarded before it is attended to."""
        group, size = work.group, len(work.group)
        me = group.index(self.rank)
        nxt, prev = group[(me + 1) % size], group[(me - 1) % size]
        offsets = [sum(work.block_sizes[:k]) for k in range(size)]
        base = (layer % 2) * self.cap
        n_queries = state.q.shape[0]
        partials: list[tuple[torch.Tensor, torch.Tensor]] = []
        block, block_pos = state.block, state.block_positions
        for step in range(1, size):
            origin = (me - step + 1) % size  # the block in hand came from this member
            at = base + offsets[origin]
            self.fabric.put(nxt, "pf_ring", at, block)
            self.fabric.put(nxt, "pf_ring_pos", at, block_pos)
            self._signal(nxt, self.flags.ring + self.rank, self._stamp(work.seq, layer, step))
            if n_queries and block.shape[0]:
                partials.append(self._attend(state, work.positions, block, block_pos))
            yield Wait([(self.flags.ring + prev, self._stamp(work.seq, layer, step))])
            arrived = (me - step) % size
            rows = slice(base + offsets[arrived], base + offsets[arrived] + work.block_sizes[arrived])
            block, block_pos = self.ring_kv[rows], self.ring_pos[rows]
        if n_queries and block.shape[0]:
            partials.append(self._attend(state, work.positions, block, block_pos))
        if not partials:
            return state.q.new_zeros(0, self.heads, self.model.config.v_head_dim)
        o, _ = merge_attention_partials(torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))
        return o

    def _ulysses_attention(self, work: ChunkWork, layer: int, state: _Layer) -> Iterator[Wait]:
        """All-to-all head parallelism: q to the heads' owner, latent KV all-gathered, outputs back."""
        group, size = work.group, len(work.group)
        me = group.index(self.rank)
        heads = head_ranges(self.heads, size)
        counts, blocks = work.query_counts, work.block_sizes
        q_offsets = [sum(counts[:k]) for k in range(size)]
        kv_offsets = [sum(blocks[:k]) for k in range(size)]
        n_local = counts[me]
        dqk, dv = state.q.shape[-1], self.model.config.v_head_dim
        stamp = self._stamp(work.seq, layer, 0)
        for k, dst in enumerate(group):
            h0, h1 = heads[k]
            rows = state.q[:, h0:h1].reshape(n_local * (h1 - h0), dqk)  # [n_local * heads_k, Dqk]
            self.fabric.put(dst, "pf_uq", q_offsets[me] * (h1 - h0), rows)
            self.fabric.put(dst, "pf_uq_pos", q_offsets[me], work.positions)
            self.fabric.put(dst, "pf_ag", kv_offsets[me], state.block)
            self.fabric.put(dst, "pf_ag_pos", kv_offsets[me], state.block_positions)
            self._signal(dst, self.flags.q_all2all + self.rank, stamp)
        yield Wait([(self.flags.q_all2all + src, stamp) for src in group])
        h0, h1 = heads[me]
        total_q, total_kv = sum(counts), sum(blocks)
        if h1 > h0 and total_q:
            q = self.uq[: total_q * (h1 - h0)].view(total_q, h1 - h0, dqk)  # [T_chunk, heads_me, Dqk]
            k, v = expand_kv_heads(state.layer, self.ag_kv[:total_kv], heads[me])
            o, _ = mla_prefill_attention_with_lse(
                q, k, v, self.uq_pos[:total_q], self.ag_pos[:total_kv], self.model.softmax_scale
            )  # [T_chunk, heads_me, Dv]
            for k_, dst in enumerate(group):
                part = o[q_offsets[k_] : q_offsets[k_] + counts[k_]].reshape(counts[k_] * (h1 - h0), dv)
                self.fabric.put(dst, "pf_uo", counts[k_] * h0, part)
        for dst in group:
            self._signal(dst, self.flags.o_all2all + self.rank, stamp)
        yield Wait([(self.flags.o_all2all + src, stamp) for src in group])
        parts = [self.uo[n_local * a : n_local * b].view(n_local, b - a, dv) for a, b in heads if b > a]
        return torch.cat(parts, dim=1)  # [n_local, H, Dv]
