"""One DP-EP decode instance: paged latent KV pool, its slice of the experts, and the decode step.

The routing table's block updates are applied to the instance's block-table store first (block_store.py): an
incremental table that does not build on the store's last table is refused (StaleBlockTableError), the driver then
sends a full snapshot. An iteration runs `num_steps` decode sub-steps (multi-step execution; every instance runs
the same number: the MoE exchange is a barrier). In sub-step j a MoE row decodes its token at position first + j,
writing its KV into the tail shard's reserved slot n - window + j; rows with j >= window are masked (no KV write,
no expert, no output). The token sampled in sub-step j is the row's input in sub-step j + 1.

Per layer and sub-step, for the iteration's routing table (control_plane/lowering.py):
  1. projection + Q-routing: queries of the requests whose MoE binding is here; the new token's KV is written
     into the request's tail shard here; queries go to the other instances of each request's KV binding;
  2. paged attention over the local shards -> (o, lse) per (request, shard);
  3. Res-routing: partial results of remote requests go back to their MoE instance;
  4. LSE merge of all partials of the local requests, W_UV + o_proj, residual;
  5. FFN: dense MLP, or MoE gate -> dispatch -> local experts -> weighted combine (+ shared expert).
Every instance runs every layer (the MoE all-to-all is a barrier), also with an empty batch.

Two paths run the same phases: the eager path (default) sizes everything to the iteration; the graph path
(`graphs=GraphEngine`, data_plane/graph_runner.py) pads the iteration to the smallest covering bucket and runs the
phases between exchanges on the bucket's static buffers (CUDA graphs on GPU). A shape no bucket covers runs
eagerly, with a GraphFallbackWarning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch

from nanocp.comm.fabric import Fabric
from nanocp.comm.moe_dispatch import LowLatencyDispatcher
from nanocp.comm.routing import RoutingBackend
from nanocp.control_plane.lowering import RoutingTables
from nanocp.graphs import GraphEngine, GraphFallbackWarning
from nanocp.models import (
    DeepseekV3Weights,
    dense_mlp,
    embed,
    expert_ffn,
    logits,
    merge_attention_partials,
    mla_decode_output,
    mla_decode_qkv,
    moe_gate,
    post_attention_norm,
    shared_expert,
)

from .backends import Backends
from .block_store import BlockTableStore
from .experts import expert_slots, owned_experts
from .graph_runner import GraphRunner, execution_shape
from .kv_pool import PagedKVPool
from .sampling import SamplingParams, sample_token
from .timing import TimingLog


@dataclass(frozen=True)
class InstanceLimits:
    """Static upper bounds that size the receive buffers (the graph engine's pool uses the same bounds)."""

    max_moe_batch: int  # requests whose MoE binding is one instance
    max_q_recv: int  # queries received from other instances
    max_res_recv: int  # partial results received from other instances


@dataclass
class RowInput:
    """What the driver gives an instance for one of its MoE rows."""

    token: int  # the input of the first sub-step (later sub-steps take the token sampled before them)
    params: SamplingParams
    output_index: int  # index in the request's output of the token the first sub-step produces
    fallback_seed: int


@dataclass(frozen=True)
class Wait:
    """An exchange point: the iteration may go on once every (flag, value) pair holds on this instance."""

    flags: list[tuple[int, int]]


@dataclass
class RowOutput:
    batch_index: int
    token: int
    logits: torch.Tensor | None  # [vocab] when requested
    step: int = 0  # sub-step that produced the token (its output index is the row's output_index + step)


class DecodeInstance:
    def __init__(
        self,
        rank: int,
        model: DeepseekV3Weights,
        pool: PagedKVPool,
        fabric: Fabric,
        limits: InstanceLimits,
        timeout_s: float = 30.0,
        timing: TimingLog | None = None,
        graphs: GraphEngine | None = None,
        backends: Backends | None = None,
    ) -> None:
        c = model.config
        self.rank = rank
        self.model = model
        self.pool = pool
        self.fabric = fabric
        self.limits = limits
        self.timeout_s = timeout_s
        self.timing = timing or TimingLog(enabled=False)
        dtype = model.embed_tokens.dtype
        self.backends = backends or Backends.detect(model.embed_tokens.device, pool.page_size, dtype)
        heads, dqk, dv = c.num_attention_heads, c.kv_cache_dim, c.kv_lora_rank
        # Registration order is collective: every instance builds the same buffers in the same order.
        self.q_route = RoutingBackend(fabric, "q", max(1, limits.max_q_recv), (heads, dqk), dtype, timeout_s)
        # A partial result travels as one row: o (kv_lora values per head) with its LSE appended.
        self.res_route = RoutingBackend(
            fabric, "res", max(1, limits.max_res_recv), (heads, dv + 1), torch.float32, timeout_s
        )
        self.dispatcher = None
        if any(layer.moe is not None for layer in model.layers):
            make_dispatcher = self.backends.dispatcher or LowLatencyDispatcher
            slots = expert_slots(c.n_routed_experts, fabric.world_size)
            self.dispatcher = make_dispatcher(
                fabric, slots * fabric.world_size, c.hidden_size, limits.max_moe_batch, dtype, "moe", timeout_s
            )
            self.local_experts = owned_experts(rank, fabric.world_size, c.n_routed_experts)
            missing = set(self.local_experts) - model.expert_ids
            if missing:
                raise ValueError(f"instance {rank} must hold experts {sorted(missing)}")
        self._seq = 0
        self._expert_out: torch.Tensor | None = None
        # The graph path keeps the pool's last frame as scratch: the scheduler's frames are the others, and the
        # store's empty row (padding shards) points at the scratch frame.
        frames = pool.frames - (1 if graphs is not None else 0)
        fill = pool.frames - 1 if graphs is not None else 0
        self.block_store = BlockTableStore.for_instance(limits, frames, fill, pool.kv.device)
        self.graphs = graphs
        self._graph_runner = GraphRunner(self, graphs) if graphs is not None else None

    # ------------------------------------------------------------------ one decode iteration

    @torch.no_grad()
    def run_iteration(
        self, table: RoutingTables, rows: dict[int, RowInput], return_logits: bool = False
    ) -> list[RowOutput]:
        """Run every layer for this instance's part of the plan, blocking on the fabric at each exchange."""
        steps = self.iteration(table, rows, return_logits)
        try:
            wait = next(steps)
            while True:
                for flag, value in wait.flags:
                    self.fabric.wait(flag, value, self.timeout_s)
                wait = steps.send(None)
        except StopIteration as done:
            return done.value

    def iteration(self, table: RoutingTables, rows: dict[int, RowInput], return_logits: bool = False):
        """The iteration as a generator: it yields a `Wait` at every exchange and returns the sampled rows, one per
        (MoE row, sub-step inside its window), in sub-step order.

        `run_iteration` blocks on each Wait (one thread or process per instance); `InlineCluster` drives all
        instances' generators from one thread, resuming whichever instance's Wait is satisfied. The table is checked
        and its block updates applied before the first exchange (a refused table raises on the first resume).
        """
        self._check_table(table, rows)
        self.block_store.apply(table)
        shape = table.shape
        shards = torch.from_numpy(table.shards).long()  # [s, 4]
        ctx = dict(
            iteration=table.iteration,
            instance=self.rank,
            moe_batch=shape.moe_batch,
            shard_rows=shape.shard_rows,
            kv_tokens=int(shards[:, 2].sum()) if len(shards) else 0,
            q_recv=shape.q_recv,
            res_recv=shape.res_recv,
        )
        if self._graph_runner is not None:
            bucket = self.graphs.pick_bucket(execution_shape(table))
            if bucket is not None:
                with torch.no_grad():
                    return (yield from self._graph_runner.iteration(table, rows, return_logits, bucket, ctx))
            warnings.warn(
                f"instance {self.rank}: iteration shape {execution_shape(table)} fits no graph bucket "
                f"(largest {self.graphs.family.upper}); running it eagerly",
                GraphFallbackWarning,
                stacklevel=2,
            )
        plan = _StepTables.build(table, self.block_store, self.pool.page_size)
        device = self.model.embed_tokens.device
        batch_indices = table.moe[:, 0].tolist()
        tokens = [rows[b].token for b in batch_indices]
        outputs: list[RowOutput] = []
        with torch.no_grad():
            for j in range(table.num_steps):
                step = plan.sub_step(j)
                x = torch.tensor(tokens, dtype=torch.int64, device=device)
                h = embed(self.model, x) if len(x) else self._empty_hidden()  # [m, D]
                for layer in self.model.layers:
                    h = yield from self._layer(layer, h, step, ctx)
                with self.timing.phase("sampling", -1, ctx):
                    out = self._sample(h, step, batch_indices, rows, return_logits)
                outputs += out
                for o in out:  # each active row's sampled token is its next input
                    tokens[step.row_of[o.batch_index]] = o.token
        return outputs

    def _check_table(self, table: RoutingTables, rows: dict[int, RowInput]) -> None:
        if table.instance != self.rank:
            raise ValueError(f"instance {self.rank} got the routing table of instance {table.instance}")
        shape, lim = table.shape, self.limits
        if shape.moe_batch > lim.max_moe_batch or shape.q_recv > lim.max_q_recv or shape.res_recv > lim.max_res_recv:
            raise ValueError(f"instance {self.rank}: iteration shape {shape} exceeds its limits {lim}")
        missing = [int(b) for b in table.moe[:, 0] if int(b) not in rows]
        if missing:
            raise ValueError(f"instance {self.rank}: no input for batch rows {missing}")

    def _empty_hidden(self) -> torch.Tensor:
        e = self.model.embed_tokens
        return e.new_zeros(0, e.shape[1])

    def _layer(self, layer, h: torch.Tensor, step: _StepTables, ctx: dict):
        c, i = self.model.config, layer.index
        timing = self.timing
        with timing.phase("projection", i, ctx):
            q_latent, kv_new = mla_decode_qkv(layer, h, step.positions)  # [m, H, Dqk], [m, Dkv]
            if len(step.write_rows):  # masked rows (past their window) write nothing
                self.pool.write_tokens(i, step.new_frames, step.new_slots, kv_new[step.write_rows])
        seq = self._next_seq()
        with timing.phase("q_route", i, ctx):
            self.q_route.send(step.q_send, q_latent, seq)
        yield Wait(self.q_route.wait_flags(step.q_sources, seq))
        with timing.phase("attention", i, ctx):
            q_recv = self.q_route.recv
            # Shard queries: local ones from this instance's rows, remote ones from the receive buffer.
            q_shard = q_latent.new_empty(len(step.shard_lens), *q_latent.shape[1:])
            if len(step.local_shard_idx):
                q_shard[step.local_shard_idx] = q_latent[step.local_shard_moe_row]
            if len(step.remote_shard_idx):
                q_shard[step.remote_shard_idx] = q_recv[step.remote_shard_q_row]
            o, lse = self.backends.attention(
                q_shard, self.pool.kv[i], step.block_table, step.shard_lens, self.model.softmax_scale, c.kv_lora_rank
            )  # [s, H, kv_lora], [s, H]
        with timing.phase("res_route", i, ctx):
            self.res_route.send(step.res_send, torch.cat([o.float(), lse[..., None]], dim=-1), seq)
        yield Wait(self.res_route.wait_flags(step.res_sources, seq))
        with timing.phase("merge", i, ctx):
            res = self.res_route.recv[: step.n_res_recv]  # [r, H, kv_lora + 1]: partial o | lse
            o_parts = torch.cat([o[step.merge_local_shard], res[..., :-1].to(o.dtype)])  # [m + r, H, kv_lora]
            lse_parts = torch.cat([lse[step.merge_local_shard], res[..., -1]])
            if step.n_res_recv:
                o_merged = _merge_by_row(o_parts, lse_parts, step.merge_row, len(h))
            else:  # every local request has its whole KV here: its only partial is the result
                o_merged = o_parts
            h = h + mla_decode_output(layer, o_merged)
        x = post_attention_norm(layer, h)
        if layer.moe is None:
            with timing.phase("dense", i, ctx):
                return h + dense_mlp(layer, x)
        routed = yield from self._moe(layer, x, step.active, ctx)
        return h + routed

    def _moe(self, layer, x: torch.Tensor, active: torch.Tensor, ctx: dict):
        timing, i, dispatcher = self.timing, layer.index, self.dispatcher
        with timing.phase("dispatch", i, ctx):
            topk_idx, topk_weights = moe_gate(layer, x)  # [m, k]
            topk_idx = topk_idx.masked_fill(~active[:, None], -1)  # masked rows choose no expert
            pending = dispatcher.dispatch_send(x, topk_idx)
        yield Wait(dispatcher.wait_flags(pending))
        with timing.phase("experts", i, ctx):
            recv_x, _, handle = dispatcher.dispatch_finish(pending)
            if self._expert_out is None:  # static, like recv_x: only rows that hold tokens are written and sent
                self._expert_out = torch.empty_like(recv_x)  # [local_experts, ranks * max, D]
            y = self._expert_out
            for local, expert_id in enumerate(self.local_experts):
                rows = _expert_rows(handle, local, dispatcher.max_tokens)  # received rows
                if len(rows):
                    y[local, rows] = expert_ffn(layer.moe.experts[expert_id], recv_x[local, rows])
        with timing.phase("combine", i, ctx):
            dispatcher.combine_send(y, topk_idx, topk_weights, handle)
        yield Wait(dispatcher.wait_flags(handle))
        with timing.phase("combine", i, ctx):
            return dispatcher.combine_finish(handle, topk_weights, y.dtype) + shared_expert(layer, x)

    def _sample(
        self, h: torch.Tensor, step: _StepTables, batch_indices: list[int], rows: dict[int, RowInput], keep: bool
    ) -> list[RowOutput]:
        active = step.active_rows
        if not len(active):
            return []
        return self._sample_rows(logits(self.model, h[active]), [batch_indices[r] for r in active], rows, keep, step.j)

    def _sample_rows(
        self,
        step_logits: torch.Tensor,
        batch_indices: list[int],
        rows: dict[int, RowInput],
        keep: bool,
        step: int = 0,
    ) -> list[RowOutput]:
        """step_logits [a, vocab], one row per active MoE row (batch_indices in the same order) -> sampled rows of
        sub-step `step`."""
        out = []
        for r, batch_index in enumerate(batch_indices):
            inp = rows[batch_index]
            token = sample_token(step_logits[r], inp.params, inp.output_index + step, inp.fallback_seed)
            out.append(RowOutput(batch_index, token, step_logits[r].clone() if keep else None, step))
        return out

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


def _expert_rows(handle, local: int, max_tokens: int) -> torch.Tensor:
    """Rows of local expert `local`'s receive slab that hold tokens: the handle says so itself when its dispatcher
    packs them differently (DeepEP packs them at the front), else the reference layout."""
    own = getattr(handle, "expert_rows", None)
    return own(local) if own is not None else _slab_rows(handle.recv_layout[:, local], max_tokens)


def _slab_rows(counts: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Rows of an expert's receive slab that hold tokens: source s sent counts[s] rows from row s * max_tokens."""
    counts = counts.long()
    skip = torch.arange(len(counts)) * max_tokens - (torch.cumsum(counts, 0) - counts)  # [ranks]
    return torch.repeat_interleave(skip, counts) + torch.arange(int(counts.sum()))


def _merge_by_row(o_parts: torch.Tensor, lse_parts: torch.Tensor, row: torch.Tensor, m: int) -> torch.Tensor:
    """Merge partials o_parts [P, H, Dv] / lse_parts [P, H] that belong to moe rows row [P] -> o [m, H, Dv]."""
    if m == 0:
        return o_parts.new_zeros(0, *o_parts.shape[1:])
    counts = torch.bincount(row, minlength=m)
    k = int(counts.max())
    # Pack into [k, m, ...] with -inf padding so merge_attention_partials merges each row's parts.
    slot = torch.zeros_like(row)
    order = torch.argsort(row, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot[order] = torch.arange(len(row)) - starts[row[order]]
    o_pad = o_parts.new_zeros(k, m, *o_parts.shape[1:])
    lse_pad = lse_parts.new_full((k, m, lse_parts.shape[1]), float("-inf"))
    o_pad[slot, row] = o_parts
    lse_pad[slot, row] = lse_parts
    return merge_attention_partials(o_pad, lse_pad)[0]


@dataclass
class _StepTables:
    """The routing table turned into index tensors once per iteration (shared by every layer), with the fields of
    one sub-step j (`sub_step`): positions, the KV slots written, the tail shards' lengths, the active rows."""

    q_send: torch.Tensor  # [n, 3] (dst, src moe row, dst row)
    q_sources: list[int]
    local_shard_idx: torch.Tensor
    local_shard_moe_row: torch.Tensor
    remote_shard_idx: torch.Tensor
    remote_shard_q_row: torch.Tensor
    block_table: torch.Tensor  # [s, max_blocks] from the block-table store
    res_send: torch.Tensor  # [n, 3] (dst, src shard, dst row)
    res_sources: list[int]
    n_res_recv: int
    merge_local_shard: torch.Tensor  # [m] local shard index per moe row
    merge_row: torch.Tensor  # [m + r] moe row of each partial (local ones first, then received rows)
    row_of: dict[int, int]  # batch index -> moe row
    first: torch.Tensor  # [m] position of each moe row's first new token
    window: torch.Tensor  # [m] decode steps of each moe row
    tail_lens: torch.Tensor  # [m] tokens of each moe row's tail shard (its window's slots included)
    full_lens: torch.Tensor  # [s] tokens of every shard
    page_size: int
    # one sub-step
    j: int = 0
    positions: torch.Tensor | None = None  # [m] position of each moe row's token in sub-step j
    active: torch.Tensor | None = None  # [m] bool: j < window
    active_rows: list[int] | None = None  # moe rows with j < window
    write_rows: torch.Tensor | None = None  # [a] moe rows writing KV (the active ones)
    new_frames: torch.Tensor | None = None  # [a] frame of each written token's KV slot
    new_slots: torch.Tensor | None = None  # [a] slot inside that frame
    shard_lens: torch.Tensor | None = None  # [s] tokens attended in sub-step j

    @classmethod
    def build(cls, t: RoutingTables, store: BlockTableStore, page_size: int) -> _StepTables:
        moe = torch.from_numpy(t.moe).long()  # [m, 4]: batch index, first position, local tail shard, window
        shards = torch.from_numpy(t.shards).long()  # [s, 4]: batch index, q source, tokens, slot
        n_shards = len(shards)
        block_table = store.rows(t.shards[:, 3], max(1, t.max_blocks))  # [s, max_blocks]
        tail = moe[:, 2]
        if len(moe) and int(tail.min()) < 0:
            raise ValueError("a MoE row has no local tail shard (its new tokens must be written on its MoE instance)")
        local = shards[:, 1] < 0 if n_shards else torch.zeros(0, dtype=torch.bool)
        shard_to_moe_row = torch.full((n_shards,), -1, dtype=torch.int64)
        shard_to_moe_row[tail] = torch.arange(len(moe))
        q_send = torch.from_numpy(t.q_send).long()
        res_send = torch.from_numpy(t.res_send).long()
        res_recv = torch.from_numpy(t.res_recv).long()
        local_idx = torch.nonzero(local).flatten()
        remote_idx = torch.nonzero(~local).flatten()
        full_lens = shards[:, 2] if n_shards else torch.zeros(0, dtype=torch.int64)
        return cls(
            q_send=q_send[:, [1, 0, 2]] if len(q_send) else q_send.reshape(0, 3),
            q_sources=sorted({int(s) for s in t.q_recv[:, 0]}),
            local_shard_idx=local_idx,
            local_shard_moe_row=shard_to_moe_row[local_idx],
            remote_shard_idx=remote_idx,
            remote_shard_q_row=shards[remote_idx, 1],
            block_table=block_table,
            res_send=res_send[:, [1, 0, 2]] if len(res_send) else res_send.reshape(0, 3),
            res_sources=sorted({int(s) for s in t.res_recv[:, 0]}),
            n_res_recv=len(res_recv),
            merge_local_shard=tail,
            merge_row=torch.cat([torch.arange(len(moe)), res_recv[:, 1] if len(res_recv) else res_recv.reshape(0)]),
            row_of={int(b): r for r, b in enumerate(t.moe[:, 0])},
            first=moe[:, 1],
            window=moe[:, 3],
            tail_lens=full_lens[tail] if len(moe) else torch.zeros(0, dtype=torch.int64),
            full_lens=full_lens,
            page_size=page_size,
        )

    def sub_step(self, j: int) -> _StepTables:
        """Sub-step j: a row past its window (masked) keeps its last position and whole tail shard, writes
        nothing and is not sampled."""
        active = j < self.window  # [m]
        step = torch.minimum(torch.full_like(self.window, j), self.window - 1)  # [m]
        token_index = self.tail_lens - self.window + step  # [m] slot of the token in its tail shard
        shard_lens = self.full_lens.clone()
        shard_lens[self.merge_local_shard] = token_index + 1
        write_rows = torch.nonzero(active).flatten()
        write_index = token_index[write_rows]
        tail = self.merge_local_shard[write_rows]
        return replace(
            self,
            j=j,
            positions=self.first + step,
            active=active,
            active_rows=write_rows.tolist(),
            write_rows=write_rows,
            new_frames=self.block_table[tail, write_index // self.page_size].long(),
            new_slots=write_index % self.page_size,
            shard_lens=shard_lens,
        )
