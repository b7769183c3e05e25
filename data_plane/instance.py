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

The eager path is the CPU hot loop: the routing table becomes index arrays once per iteration (numpy, host side),
the per-sub-step metadata (positions, rope rotation, KV slots, the attention backend's page gather and length mask)
once per sub-step, and each layer runs a few batched torch ops on weights prepared at start-up
(decode_layers.py). Work that the table shows to be empty is skipped: no Q/Res exchange or LSE merge without
CP > 1 rows, nothing but the MoE exchange and the local experts on an instance without requests. Its MoE exchange is
the packed dispatcher (moe_exchange.py: one put per peer and direction); instances with a graph engine or an
explicit dispatcher backend keep the static-slab dispatcher (comm.moe_dispatch, DeepEP), so a graph instance's
eager fallback still meets its peers on the same exchange.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from nanocp.comm.fabric import Fabric
from nanocp.comm.moe_dispatch import LowLatencyDispatcher
from nanocp.comm.routing import RoutingBackend
from nanocp.control_plane.lowering import RoutingTables
from nanocp.graphs import GraphEngine, GraphFallbackWarning
from nanocp.models import DeepseekV3Weights

from . import cpu_kernels
from .backends import Backends
from .block_store import BlockTableStore
from .decode_layers import (
    DecodeLayerWeights,
    DecodeWeights,
    GroupedExperts,
    KVWrite,
    RopeCache,
    RopeTable,
    add_mlp,
    dense_output,
    final_logits,
    grouped_experts,
    moe_input,
    project,
)
from .experts import expert_slots, owned_experts
from .graph_runner import GraphRunner, execution_shape
from .kv_pool import PagedKVPool
from .moe_exchange import PackedDispatcher, PackedPending
from .sampling import SamplingParams, sample_tokens
from .timing import TimingLog


@dataclass(frozen=True)
class InstanceLimits:
    """Static upper bounds that size the receive buffers (the graph engine's pool uses the same bounds)."""

    max_moe_batch: int  # requests whose MoE binding is one instance
    max_q_recv: int  # queries received from other instances
    max_res_recv: int  # partial results received from other instances


def fabric_flags(world_size: int) -> int:
    """Flags a fabric needs for decode instances: each exchange (Q, Res, token handoff, MoE dispatch, MoE combine)
    reserves one per peer."""
    return 5 * world_size


KEPT_TOKEN = -1  # RowInput.token: the token this instance sampled last for the row's request (overlapped iterations)


@dataclass
class RowInput:
    """What the driver gives an instance for one of its MoE rows."""

    token: int  # the input of the first sub-step (later sub-steps take the token sampled before them), or KEPT_TOKEN
    params: SamplingParams
    output_index: int  # index in the request's output of the token the first sub-step produces
    fallback_seed: int
    key: int = -1  # the request's stable key: names the token kept for it across iterations
    # a KEPT_TOKEN row whose request moved here: (instance that kept its token, row of this instance's handoff buffer)
    handoff: tuple[int, int] | None = None


@dataclass(frozen=True)
class Handoff:
    """A token this instance kept for a request that moved: it goes to row `row` of instance `dst`'s buffer."""

    key: int
    dst: int
    row: int


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
        shared: DecodeWeights | None = None,
    ) -> None:
        """`shared`: prepared replicated weights to use instead of preparing this model's own (the same model:
        instances of one process share them, each adds its routed experts)."""
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
        # Kept tokens of requests whose MoE instance changed between overlapped iterations (one int64 per row).
        self.token_route = RoutingBackend(fabric, "token", max(1, limits.max_moe_batch), (1,), torch.int64, timeout_s)
        self.dispatcher = None
        self.local_experts = range(0)
        # The packed exchange serves eager-only instances; a graph engine or a dispatcher backend needs the slabs.
        self.packed_moe = graphs is None and self.backends.dispatcher is None
        if any(layer.moe is not None for layer in model.layers):
            slots = expert_slots(c.n_routed_experts, fabric.world_size)
            num_slots = slots * fabric.world_size
            if self.packed_moe:
                self.dispatcher = PackedDispatcher(
                    fabric,
                    num_slots,
                    c.hidden_size,
                    limits.max_moe_batch,
                    c.num_experts_per_tok,
                    dtype,
                    "moe",
                    timeout_s,
                )
            else:
                make_dispatcher = self.backends.dispatcher or LowLatencyDispatcher
                self.dispatcher = make_dispatcher(
                    fabric, num_slots, c.hidden_size, limits.max_moe_batch, dtype, "moe", timeout_s
                )
            self.local_experts = owned_experts(rank, fabric.world_size, c.n_routed_experts)
            missing = set(self.local_experts) - model.expert_ids
            if missing:
                raise ValueError(f"instance {rank} must hold experts {sorted(missing)}")
        if shared is None:
            self.weights = DecodeWeights.build(model, self.local_experts)
        else:
            self.weights = shared.with_experts(model, self.local_experts)
        self._seq = 0
        self._softmax_scale = model.softmax_scale
        embed = self.weights.embed_tokens
        host = embed.is_cpu and embed.dtype == torch.float32
        self._embed_rows = embed.detach().numpy() if host else None  # a numpy lookup costs less on the host
        self._expert_out: torch.Tensor | None = None
        self._kv_rows = [layer_kv.view(-1, layer_kv.shape[-1]) for layer_kv in pool.kv]  # [frames * page, Dkv] each
        # The graph path keeps the pool's last frame as scratch: the scheduler's frames are the others, and the
        # store's empty row (padding shards) points at the scratch frame.
        frames = pool.frames - (1 if graphs is not None else 0)
        fill = pool.frames - 1 if graphs is not None else 0
        self.block_store = BlockTableStore.for_instance(limits, frames, fill, pool.kv.device)
        self.graphs = graphs
        self._graph_runner = GraphRunner(self, graphs) if graphs is not None else None
        # request key -> the last token sampled for it in the last iteration: the input of a KEPT_TOKEN row, so the
        # driver can send iteration t + 1 before it has iteration t's tokens (overlapped iterations)
        self._kept: dict[int, int] = {}

    # ------------------------------------------------------------------ one decode iteration

    @torch.no_grad()
    def run_iteration(
        self,
        table: RoutingTables,
        rows: dict[int, RowInput],
        return_logits: bool = False,
        handoffs: list[Handoff] = (),
    ) -> list[RowOutput]:
        """Run every layer for this instance's part of the plan, blocking on the fabric at each exchange."""
        steps = self.iteration(table, rows, return_logits, handoffs)
        try:
            wait = next(steps)
            while True:
                for flag, value in wait.flags:
                    self.fabric.wait(flag, value, self.timeout_s)
                wait = steps.send(None)
        except StopIteration as done:
            return done.value

    def iteration(
        self, table: RoutingTables, rows: dict[int, RowInput], return_logits: bool = False, handoffs: list[Handoff] = ()
    ):
        """The iteration as a generator: it yields a `Wait` at every exchange and returns the sampled rows, one per
        (MoE row, sub-step inside its window), in sub-step order. `handoffs`: tokens this instance kept for
        requests that moved to another MoE instance; they are sent before anything else.

        `run_iteration` blocks on each Wait (one thread or process per instance); `InlineCluster` drives all
        instances' generators from one thread, resuming whichever instance's Wait is satisfied. The table is checked
        and its block updates applied before the first exchange (a refused table raises on the first resume).
        """
        self._check_table(table, rows)
        self.block_store.apply(table)
        yield from self._hand_off(table.iteration, rows, handoffs)
        shape = table.shape
        ctx = dict(
            iteration=table.iteration,
            instance=self.rank,
            moe_batch=shape.moe_batch,
            shard_rows=shape.shard_rows,
            kv_tokens=int(table.shards[:, 2].sum()) if len(table.shards) else 0,
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
        tables = _IterationTables.build(table, self.block_store, self.pool.page_size)
        device = self.model.embed_tokens.device
        tokens = self.input_tokens(rows, tables.batch_indices)
        outputs: list[RowOutput] = []
        with torch.no_grad():
            for j in range(table.num_steps):
                step = tables.sub_step(
                    j, self.weights.rope_cache, self.backends.attention, self.model.embed_tokens.dtype
                )
                if tables.m and self._embed_rows is not None:
                    h = torch.from_numpy(self._embed_rows[tokens])  # [m, D]
                elif tables.m:
                    h = self.weights.embed_tokens[torch.tensor(tokens, dtype=torch.int64, device=device)]  # [m, D]
                else:
                    h = self.weights.embed_tokens[:0]
                for layer in self.weights.layers:
                    h = yield from self._layer(layer, h, tables, step, ctx)
                with self.timing.phase("sampling", -1, ctx):
                    out = self._sample(h, tables, step, rows, return_logits)
                outputs += out
                for o in out:  # each active row's sampled token is its next input
                    tokens[tables.row_of[o.batch_index]] = o.token
        self.keep_tokens(rows, tables.batch_indices, tokens)
        return outputs

    def _hand_off(self, seq: int, rows: dict[int, RowInput], handoffs: list[Handoff]):
        """Send the kept tokens of requests that moved away; wait for those of requests that moved here."""
        if handoffs:
            missing = [h.key for h in handoffs if h.key not in self._kept]
            if missing:
                raise ValueError(f"instance {self.rank}: no kept token to hand off for request keys {missing}")
            tokens = torch.tensor([[self._kept[h.key]] for h in handoffs], dtype=torch.int64)  # [n, 1]
            self.token_route.send([(h.dst, i, h.row) for i, h in enumerate(handoffs)], tokens, seq)
        sources = {row.handoff[0] for row in rows.values() if row.handoff is not None}
        if sources:
            yield Wait(self.token_route.wait_flags(sources, seq))

    def input_tokens(self, rows: dict[int, RowInput], batch_indices: list[int]) -> list[int]:
        """The first sub-step's input of each MoE row: the driver's token, or the one kept for its request (here,
        or handed over by the instance that had it)."""
        tokens = []
        for b in batch_indices:
            row = rows[b]
            if row.token != KEPT_TOKEN:
                tokens.append(row.token)
            elif row.handoff is not None:
                tokens.append(int(self.token_route.recv[row.handoff[1], 0]))
            elif row.key in self._kept:
                tokens.append(self._kept[row.key])
            else:
                raise ValueError(
                    f"instance {self.rank}: batch row {b} asks for the kept token of request key {row.key}, "
                    "which the last iteration here did not sample"
                )
        return tokens

    def keep_tokens(self, rows: dict[int, RowInput], batch_indices: list[int], tokens: list[int]) -> None:
        """After an iteration: each row's last token, by request key (only this iteration's rows are kept)."""
        self._kept = {rows[b].key: t for b, t in zip(batch_indices, tokens) if rows[b].key >= 0}

    def _check_table(self, table: RoutingTables, rows: dict[int, RowInput]) -> None:
        if table.instance != self.rank:
            raise ValueError(f"instance {self.rank} got the routing table of instance {table.instance}")
        shape, lim = table.shape, self.limits
        if shape.moe_batch > lim.max_moe_batch or shape.q_recv > lim.max_q_recv or shape.res_recv > lim.max_res_recv:
            raise ValueError(f"instance {self.rank}: iteration shape {shape} exceeds its limits {lim}")
        missing = [b for b in table.moe[:, 0].tolist() if b not in rows]
        if missing:
            raise ValueError(f"instance {self.rank}: no input for batch rows {missing}")

    def _layer(self, w: DecodeLayerWeights, h: torch.Tensor, tables: _IterationTables, step: _SubStep, ctx: dict):
        c, i, timing = self.model.config, w.index, self.timing
        kv_pages = self.pool.kv[i] if tables.s else None  # [frames, page, Dkv]
        q_latent = None
        with timing.phase("projection", i, ctx):
            if tables.m:  # each active row's new KV goes into its tail shard (masked rows, past their window: none)
                store = KVWrite(self._kv_rows[i], step.row_slots, step.write_rows, step.kv_slots)
                q_latent, _ = project(w, c, h, step.rope, store)  # [m, H, Dqk]
        seq = self._next_seq()
        with timing.phase("q_route", i, ctx):
            if tables.q_send is not None:
                self.q_route.send(tables.q_send, q_latent, seq)
        if tables.q_sources:
            yield Wait(self.q_route.wait_flags(tables.q_sources, seq))
        o = lse = None
        with timing.phase("attention", i, ctx):
            if tables.s:
                q_shard = tables.shard_queries(q_latent, self.q_route.recv)
                o, lse = self._attend(q_shard, kv_pages, tables, step)  # [s, H, kv_lora], [s, H]
        with timing.phase("res_route", i, ctx):
            if tables.res_send is not None:
                self.res_route.send(tables.res_send, torch.cat([o.float(), lse[..., None]], dim=-1), seq)
        if tables.res_sources:
            yield Wait(self.res_route.wait_flags(tables.res_sources, seq))
        if w.mlp is not None:  # a dense layer: the output projection and the MLP in one step
            with timing.phase("dense", i, ctx):
                return dense_output(w, c, h, self._merge(o, lse, tables)) if tables.m else h
        routed = None
        with timing.phase("merge", i, ctx):
            if tables.m:  # a MoE layer: the output projection, then on to the gate in one step
                h, *routed = moe_input(w, c, h, self._merge(o, lse, tables))
        return (yield from self._moe(w, h, routed, step, ctx))

    def _attend(self, q_shard: torch.Tensor, kv_pages: torch.Tensor, tables: _IterationTables, step: _SubStep):
        attention, scale, v_dim = self.backends.attention, self._softmax_scale, self.model.config.kv_lora_rank
        if step.attention_plan is not None:
            return attention.run(step.attention_plan, q_shard, kv_pages, scale, v_dim)
        return attention(q_shard, kv_pages, tables.block_table, step.shard_lens, scale, v_dim)

    def _merge(self, o: torch.Tensor, lse: torch.Tensor, tables: _IterationTables) -> torch.Tensor:
        """Partials of the local rows -> o [m, H, kv_lora]: the tail shard's alone when nothing was received."""
        if tables.merge_index is None:
            return o if tables.tail_index is None else o.index_select(0, tables.tail_index)
        received = self.res_route.recv[: tables.n_res_recv]  # [r, H, kv_lora + 1]: partial o | lse
        return self.backends.kernels.merge_routed(o, lse, received, tables.merge_index)[0]

    def _moe(self, w: DecodeLayerWeights, h: torch.Tensor, routed: list | None, step: _SubStep, ctx: dict):
        """routed: the FFN input x [m, D], topk_idx [m, k], topk_weights [m, k] (moe_input); None without rows."""
        c, i, timing, dispatcher = self.model.config, w.index, self.timing, self.dispatcher
        with timing.phase("dispatch", i, ctx):
            if routed is not None:
                x, topk_idx, topk_weights = routed
                if step.write_rows is not None:  # masked rows choose no expert
                    topk_idx = topk_idx.masked_fill(~step.active[:, None], -1)
            else:
                x = h
                topk_idx = torch.empty(0, c.num_experts_per_tok, dtype=torch.int64, device=h.device)
                topk_weights = torch.empty(0, c.num_experts_per_tok, dtype=torch.float32, device=h.device)
            if self.packed_moe:  # the gate's own top-k needs no check
                pending = dispatcher.dispatch_send(x, topk_idx, check=False)
            else:
                pending = dispatcher.dispatch_send(x, topk_idx)
        yield Wait(dispatcher.wait_flags(pending))
        if self.packed_moe:
            with timing.phase("experts", i, ctx):
                send = self._packed_experts(w.experts, pending)
            with timing.phase("combine", i, ctx):
                send()
                base = _with_shared_expert(w, x, h)  # while the peers' experts run
            yield Wait(dispatcher.combine_wait_flags(pending))
            with timing.phase("combine", i, ctx):
                return dispatcher.combine_finish(pending, topk_weights, h.dtype, base=base)
        with timing.phase("experts", i, ctx):
            recv_x, _, handle = dispatcher.dispatch_finish(pending)
            y = self._slab_experts(w, recv_x, handle)
        with timing.phase("combine", i, ctx):
            dispatcher.combine_send(y, topk_idx, topk_weights, handle)
            base = _with_shared_expert(w, x, h)  # while the peers' experts run
        yield Wait(dispatcher.wait_flags(handle))
        with timing.phase("combine", i, ctx):
            return base + dispatcher.combine_finish(handle, topk_weights, y.dtype)

    def _packed_experts(self, experts: GroupedExperts | None, pending: PackedPending) -> Callable[[], None]:
        """The local experts over what the packed dispatch delivered -> the call that sends their outputs back.
        Where the buffers allow it (cpu_kernels.received_expert_mlp: fp32, every source's buffer mapped here), one
        kernel reads the receive buffer and writes each output where its source's combine reads it: the send is
        only the signal."""
        dispatcher = self.dispatcher
        in_place = dispatcher.in_place_combine if experts is not None and experts.gate_up_panels is not None else None
        if in_place is not None:
            recv, outs = in_place
            cpu_kernels.received_expert_mlp(recv, dispatcher.cap, experts.gate_up_panels, experts.down_panels, outs)
            return partial(dispatcher.combine_sent, pending.seq)
        received = dispatcher.dispatch_finish(pending)
        y = grouped_experts(experts, dispatcher.recv_x, received.rows, received.local_expert)
        return partial(dispatcher.combine_send, y, received)

    def _slab_experts(self, w: DecodeLayerWeights, recv_x: torch.Tensor, handle) -> torch.Tensor:
        """Experts over a static-slab dispatcher's receive buffer [local, slab rows, D] -> outputs in the same
        layout (static, like recv_x: only rows that hold tokens are written and sent back)."""
        if self._expert_out is None:
            self._expert_out = torch.empty_like(recv_x)  # [local_experts, ranks * max, D]
        y, slab = self._expert_out, recv_x.shape[1]
        per_expert = [
            _expert_rows(handle, local, self.dispatcher.max_tokens) for local in range(len(self.local_experts))
        ]
        local = np.repeat(np.arange(len(per_expert)), [len(r) for r in per_expert])
        flat_rows = torch.cat(per_expert).long().cpu() + torch.from_numpy(local * slab)  # rows of recv_x.view(-1, D)
        if len(flat_rows):
            flat = recv_x.reshape(-1, recv_x.shape[-1])
            out = grouped_experts(w.experts, flat, flat_rows.numpy(), local)
            y.view(-1, y.shape[-1]).index_copy_(0, flat_rows.to(y.device), out)
        return y

    def _sample(
        self, h: torch.Tensor, tables: _IterationTables, step: _SubStep, rows: dict[int, RowInput], keep: bool
    ) -> list[RowOutput]:
        if not step.active_rows:
            return []
        active = h if step.write_rows is None else h.index_select(0, step.write_rows)
        batch_indices = [tables.batch_indices[r] for r in step.active_rows]
        return self._sample_rows(final_logits(self.weights, active), batch_indices, rows, keep, step.j)

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
        inputs = [rows[b] for b in batch_indices]
        tokens = sample_tokens(
            step_logits,
            [inp.params for inp in inputs],
            [inp.output_index + step for inp in inputs],
            [inp.fallback_seed for inp in inputs],
        )
        kept = step_logits.clone().unbind(0) if keep else [None] * len(tokens)
        return [RowOutput(b, t, lg, step) for b, t, lg in zip(batch_indices, tokens, kept)]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


def _with_shared_expert(w: DecodeLayerWeights, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h [m, D] plus the layer's shared expert of x (h itself without a shared expert or rows)."""
    return add_mlp(w.shared, x, h) if w.shared is not None and len(h) else h


def _expert_rows(handle, local: int, max_tokens: int) -> torch.Tensor:
    """Rows of local expert `local`'s receive slab that hold tokens: the handle says so itself when its dispatcher
    packs them differently (DeepEP packs them at the front), else the reference layout."""
    own = getattr(handle, "expert_rows", None)
    return own(local) if own is not None else _slab_rows(handle.recv_layout[:, local], max_tokens)


def _slab_rows(counts: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Rows of an expert's receive slab that hold tokens: source s sent counts[s] rows from row s * max_tokens."""
    counts = counts.long().cpu()  # host bookkeeping (the layout may live on a GPU)
    skip = torch.arange(len(counts)) * max_tokens - (torch.cumsum(counts, 0) - counts)  # [ranks]
    return torch.repeat_interleave(skip, counts) + torch.arange(int(counts.sum()))


@dataclass
class _IterationTables:
    """The routing table as index arrays, built once per iteration on the host (shared by every sub-step and
    layer). `None` marks work the table shows to be empty or the identity."""

    m: int  # MoE rows
    s: int  # shard rows
    batch_indices: list[int]  # [m]
    row_of: dict[int, int]  # batch index -> moe row
    first: np.ndarray  # [m] position of each moe row's first new token
    window: np.ndarray  # [m] decode steps of each moe row
    tail: np.ndarray  # [m] local tail shard of each moe row
    full_lens: np.ndarray  # [s] tokens of every shard (the window's reserved slots included)
    host_blocks: np.ndarray  # [s, max_blocks] int32 block tables (host copy)
    block_table: torch.Tensor  # [s, max_blocks] int32 on the pool's device
    page_size: int
    q_send: torch.Tensor | None  # [n, 3] (dst, src moe row, dst row)
    q_sources: list[int]
    shard_q_index: torch.Tensor | None  # [s] query row of each shard in [q_latent ; received queries]
    q_recv_rows: int  # received query rows the shards read (0: every shard is local)
    res_send: torch.Tensor | None  # [n, 3] (dst, src shard, dst row)
    res_sources: list[int]
    n_res_recv: int
    tail_index: torch.Tensor | None  # [m] int64 (None: shard i is moe row i's tail shard)
    merge_index: torch.Tensor | None  # [m, K] parts of each row (kernels.merge_routed), None when nothing arrives

    @classmethod
    def build(cls, t: RoutingTables, store: BlockTableStore, page_size: int) -> _IterationTables:
        if not len(t.moe) and not len(t.shards) and not len(t.q_send) and not len(t.res_send):
            return cls.idle(page_size)
        moe = t.moe.astype(np.int64)  # [m, 4]: batch index, first position, local tail shard, window
        shards = t.shards.astype(np.int64)  # [s, 4]: batch index, q source, tokens, slot
        m, s = len(moe), len(shards)
        tail = moe[:, 2]
        if m and int(tail.min()) < 0:
            raise ValueError("a MoE row has no local tail shard (its new tokens must be written on its MoE instance)")
        width = max(1, t.max_blocks)
        host_blocks = store.host[shards[:, 3], :width]  # [s, width] (a copy)
        block_table = torch.from_numpy(host_blocks) if store.on_host else store.rows(t.shards[:, 3], width)
        source = shards[:, 1]
        local = source < 0
        rows = np.arange(max(m, s))
        moe_row = np.full(s, -1, dtype=np.int64)
        moe_row[tail] = rows[:m]
        if (moe_row[local] < 0).any():
            raise ValueError("a local shard belongs to no MoE row of this instance")
        all_local = bool(local.all())
        if all_local:  # the common case: no query comes from another instance
            q_index, q_recv_rows = moe_row, 0
            identity = s == m and bool((moe_row == rows[:s]).all())  # then tail is the identity as well
        else:
            q_index = np.where(local, moe_row, m + source)
            q_recv_rows = int(source[~local].max()) + 1
            identity = False
        tail_identity = identity or (s == m and bool((tail == rows[:m]).all()))
        batch_indices = moe[:, 0].tolist()
        device = None if store.on_host else block_table.device
        res_recv = t.res_recv.astype(np.int64) if len(t.res_recv) else None
        return cls(
            m=m,
            s=s,
            batch_indices=batch_indices,
            row_of=dict(zip(batch_indices, range(m))),
            first=moe[:, 1],
            window=moe[:, 3],
            tail=tail,
            full_lens=shards[:, 2],
            host_blocks=host_blocks,
            block_table=block_table,
            page_size=page_size,
            q_send=_send_list(t.q_send),
            q_sources=sorted(set(t.q_recv[:, 0].tolist())) if len(t.q_recv) else [],
            shard_q_index=None if identity else _tensor(q_index, device),
            q_recv_rows=q_recv_rows,
            res_send=_send_list(t.res_send),
            res_sources=sorted(set(res_recv[:, 0].tolist())) if res_recv is not None else [],
            n_res_recv=0 if res_recv is None else len(res_recv),
            tail_index=None if tail_identity else _tensor(tail, device),
            merge_index=None if res_recv is None else _tensor(_merge_index(tail, res_recv[:, 1], s), device),
        )

    @classmethod
    def idle(cls, page_size: int) -> _IterationTables:
        """An instance with no request and no shard this iteration: it only takes part in the MoE exchange."""
        none = np.zeros(0, dtype=np.int64)
        return cls(
            m=0,
            s=0,
            batch_indices=[],
            row_of={},
            first=none,
            window=none,
            tail=none,
            full_lens=none,
            host_blocks=np.zeros((0, 1), dtype=np.int32),
            block_table=torch.zeros(0, 1, dtype=torch.int32),
            page_size=page_size,
            q_send=None,
            q_sources=[],
            shard_q_index=None,
            q_recv_rows=0,
            res_send=None,
            res_sources=[],
            n_res_recv=0,
            tail_index=None,
            merge_index=None,
        )

    def shard_queries(self, q_latent: torch.Tensor | None, q_recv: torch.Tensor) -> torch.Tensor:
        """The query of every shard [s, H, Dqk]: local rows' own, the others' from the receive buffer."""
        if self.shard_q_index is None:
            return q_latent
        if not self.q_recv_rows:
            return q_latent.index_select(0, self.shard_q_index)
        rows = q_recv[: self.q_recv_rows]
        parts = rows if q_latent is None or not len(q_latent) else torch.cat([q_latent, rows.to(q_latent.dtype)])
        return parts.index_select(0, self.shard_q_index)

    def sub_step(self, j: int, rope: RopeCache, attention, dtype: torch.dtype) -> _SubStep:
        """Sub-step j: a row past its window (masked) keeps its last position and whole tail shard, writes
        nothing and is not sampled."""
        if not self.m and not self.s:
            none = torch.zeros(0, dtype=torch.int64)
            return _SubStep(j, None, none.bool(), [], None, 0, none, none.numpy(), none, None)
        active = j < self.window  # [m]
        step = np.minimum(j, self.window - 1)  # [m]
        token_index = self.full_lens[self.tail] - self.window + step  # [m] slot of the token in its tail shard
        shard_lens = self.full_lens.copy()
        shard_lens[self.tail] = token_index + 1
        all_active = bool(active.all())
        if all_active:
            write, index, tails = np.arange(self.m), token_index, self.tail
        else:
            write = np.nonzero(active)[0]
            index, tails = token_index[write], self.tail[write]
        slots = self.host_blocks[tails, index // self.page_size].astype(np.int64) * self.page_size
        slots += index % self.page_size
        row_slots = slots if all_active else np.full(self.m, -1, dtype=np.int64)
        row_slots[write] = slots
        lens = torch.from_numpy(shard_lens)
        plan = None
        if self.s and hasattr(attention, "plan"):
            plan = attention.plan(self.block_table, lens, self.page_size, dtype)
        device = None if self.block_table.is_cpu else self.block_table.device
        return _SubStep(
            j=j,
            rope=rope.at(self.first + step) if self.m else None,
            active=_tensor(active, device),
            active_rows=write.tolist(),
            write_rows=None if all_active else _tensor(write, device),
            writes=len(write),
            kv_slots=_tensor(slots, device),
            row_slots=row_slots,
            shard_lens=lens if device is None else lens.to(device),
            attention_plan=plan,
        )


@dataclass
class _SubStep:
    j: int
    rope: RopeTable | None  # rotation of the moe rows' positions
    active: torch.Tensor  # [m] bool: j < window
    active_rows: list[int]  # moe rows with j < window
    write_rows: torch.Tensor | None  # [a] the active rows (None: every row is active)
    writes: int
    kv_slots: torch.Tensor  # [a] frame * page_size + slot of each active row's new KV
    row_slots: np.ndarray  # int64 [m] the same per moe row, -1 for a masked row
    shard_lens: torch.Tensor  # [s] tokens attended in sub-step j
    attention_plan: object | None  # the attention backend's per-sub-step plan, when it makes one


def _send_list(send: np.ndarray) -> torch.Tensor | None:
    """Table send rows (src row, dst, dst row) -> RoutingBackend's (dst, src row, dst row); None when empty."""
    if not len(send):
        return None
    return torch.from_numpy(np.ascontiguousarray(send[:, [1, 0, 2]].astype(np.int64)))


def _tensor(a: np.ndarray, device: torch.device | None) -> torch.Tensor:
    """a as a tensor on `device` (None: the host, sharing a's memory)."""
    t = torch.from_numpy(a)
    return t if device is None else t.to(device)


def _merge_index(tail: np.ndarray, owner: np.ndarray, s: int) -> np.ndarray:
    """Parts of each moe row for kernels.merge_routed: its tail shard (index < s), then its received partials
    (s + receive row), -1 padding. owner [r]: moe row of each received partial, in receive order."""
    m = len(tail)
    order = np.argsort(owner, kind="stable")
    first_of = np.searchsorted(owner[order], owner[order], side="left")
    column = 1 + np.arange(len(owner)) - first_of
    index = np.full((m, 1 + int(column.max())), -1, dtype=np.int64)
    index[:, 0] = tail
    index[owner[order], column] = s + order
    return index
