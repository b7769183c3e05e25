"""The decode iteration on a graph bucket: a DecodeInstance's phases as pieces over static buffers.

`decode_fields` lays out the context of a bucket (routing-table index tensors, the new tokens' positions and KV
slots, block tables, payloads for Q, Res and LSE, activations); `build_graph_engine` makes the engine;
`stage_routing` turns a routing table into the padded index tensors of a bucket (host side) and the send lists of
the exchanges; `GraphRunner.iteration` runs the pieces between the exchanges, which stay outside the pieces.

Padding is inert: padding MoE rows write their KV to the scratch frame (the pool's last frame, never handed out
by the scheduler), choose no expert (top-k -1) and are never sent; padding shards have length 0 and point at the
scratch frame, so they attend to nothing (o = 0, lse = -inf); padding merge slots are -1 (no part).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanocp.control_plane.lowering import RoutingTables
from nanocp.graphs import BucketContext, BucketFamily, BucketShape, FieldSpec, GraphEngine
from nanocp.models import (
    ModelConfig,
    dense_mlp,
    embed,
    logits,
    mla_decode_output,
    mla_decode_qkv,
    moe_gate,
    post_attention_norm,
    shared_expert,
)

if TYPE_CHECKING:
    from .instance import DecodeInstance, InstanceLimits, RowInput


def max_parts(num_instances: int) -> int:
    """Partial results per request: one per shard, at most one shard per instance."""
    return num_instances


def decode_fields(
    config: ModelConfig,
    num_instances: int,
    max_moe_batch: int,
    dtype: torch.dtype,
    scratch_frame: int = 0,
    page_size: int = 1,
) -> list[FieldSpec]:
    """The context layout. Symbolic dims come from the bucket; padding block-table entries and KV slots point at
    `scratch_frame`. Int64 indices (torch indexing), int32 block table and lengths (FlashMLA's format)."""
    c = config
    scratch_slot = scratch_frame * page_size
    heads, dqk, dv, hidden = c.num_attention_heads, c.kv_cache_dim, c.kv_lora_rank, c.hidden_size
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    fields = [
        # routing metadata, injected every iteration
        FieldSpec("tokens", ("moe_batch",), i64, injected=True),
        FieldSpec("positions", ("moe_batch",), i64, injected=True),
        FieldSpec("kv_slot", ("moe_batch",), i64, injected=True, pad=scratch_slot),  # frame * page + slot
        FieldSpec("row_valid", ("moe_batch",), torch.bool, injected=True, pad=False),
        FieldSpec("q_pack_index", ("res_recv",), i64, injected=True),  # moe row per packed query (by dst, dst row)
        FieldSpec("shard_q_index", ("shard_rows",), i64, injected=True),  # into [q_latent ; received queries]
        FieldSpec("block_table", ("shard_rows", "max_blocks"), i32, injected=True, pad=scratch_frame),
        FieldSpec("shard_lens", ("shard_rows",), i32, injected=True),
        FieldSpec("res_pack_index", ("q_recv",), i64, injected=True),  # shard per packed result (by dst, dst row)
        FieldSpec("merge_index", ("moe_batch", max_parts(num_instances)), i64, injected=True, pad=-1),
        # payloads and activations
        FieldSpec("h", ("moe_batch", hidden), dtype),
        FieldSpec("q_latent", ("moe_batch", heads, dqk), dtype),
        FieldSpec("q_pack", ("res_recv", heads, dqk), dtype),
        FieldSpec("q_shard", ("shard_rows", heads, dqk), dtype),
        FieldSpec("o", ("shard_rows", heads, dv), dtype),
        FieldSpec("lse", ("shard_rows", heads), f32),
        FieldSpec("res_pack", ("q_recv", heads, dv + 1), f32),
        FieldSpec("x", ("moe_batch", hidden), dtype),
        FieldSpec("logits", ("moe_batch", c.vocab_size), dtype),
    ]
    if c.num_moe_layers:
        local = c.n_routed_experts // num_instances
        fields += [
            FieldSpec("topk_idx", ("moe_batch", c.num_experts_per_tok), i64),
            FieldSpec("topk_weights", ("moe_batch", c.num_experts_per_tok), f32),
            FieldSpec("recv_count", (local,), i32),
            FieldSpec("expert_out", (local, num_instances * max_moe_batch, hidden), dtype),
            FieldSpec("combined", ("moe_batch", hidden), dtype),
        ]
    return fields


def default_family(limits: InstanceLimits, max_blocks: int, growth: int = 2) -> BucketFamily:
    """Geometric ladders up to the instance's limits (received rows bounded by both receive buffers)."""
    remote = min(limits.max_q_recv, limits.max_res_recv)
    return BucketFamily.geometric(limits.max_moe_batch, remote, max_blocks, growth)


def build_graph_engine(
    config: ModelConfig,
    limits: InstanceLimits,
    num_instances: int,
    pool_frames: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    family: BucketFamily | None = None,
) -> GraphEngine:
    """The graph engine of one instance whose KV pool has `pool_frames` frames, the last being the scratch frame
    (allocate one frame more than the scheduler hands out)."""
    if pool_frames < 2:
        raise ValueError(f"the KV pool needs a scratch frame besides its pages, got {pool_frames} frames")
    family = family or default_family(limits, pool_frames - 1)
    upper = family.upper
    if upper.moe_batch > limits.max_moe_batch:
        raise ValueError(f"bucket MoE batch {upper.moe_batch} exceeds the limit {limits.max_moe_batch}")
    if upper.q_recv > limits.max_q_recv or upper.res_recv > limits.max_res_recv:
        raise ValueError(f"bucket receive rows {upper} exceed the receive buffers {limits}")
    fields = decode_fields(config, num_instances, limits.max_moe_batch, dtype, pool_frames - 1, page_size)
    return GraphEngine(family, fields, device=device)


# ---- routing table -> padded bucket metadata ------------------------------------------------------------------


@dataclass
class Exchanges:
    """What the exchanges of one iteration send and wait for (host side, real rows only)."""

    q_send: torch.Tensor  # [n, 3] (dst, row of q_pack, dst row)
    q_sources: list[int]
    res_send: torch.Tensor  # [n, 3] (dst, row of res_pack, dst row)
    res_sources: list[int]


def execution_shape(table: RoutingTables) -> BucketShape:
    s = table.shape
    blocks = int(table.shards[:, 4].max()) if len(table.shards) else 0
    return BucketShape(s.moe_batch, s.shard_rows, s.q_recv, s.res_recv, blocks)


def _packed_sends(send: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """send rows (src row, dst, dst row) ordered by (dst, dst row) -> (src rows in packed order, send list with
    packed source rows): consecutive packed rows go to consecutive rows of one destination (one put each)."""
    send = send.astype(np.int64)
    order = np.lexsort((send[:, 2], send[:, 1]))
    send = send[order]
    packed = np.stack([send[:, 1], np.arange(len(send)), send[:, 2]], axis=1) if len(send) else np.zeros((0, 3))
    return send[:, 0], torch.from_numpy(packed.astype(np.int64))


def stage_routing(
    staging: dict[str, torch.Tensor],
    table: RoutingTables,
    tokens: list[int],
    bucket: BucketShape,
    page_size: int,
    scratch_frame: int,
) -> Exchanges:
    """Write the table's rows into the bucket's staging views (already filled with padding); return the sends."""
    st = {name: t.numpy() for name, t in staging.items()}
    moe, shards, blocks = (a.astype(np.int64) for a in (table.moe, table.shards, table.blocks))
    m, s, r = len(moe), len(shards), len(table.res_recv)
    if len(blocks) and int(blocks.max()) >= scratch_frame:
        raise ValueError(
            f"routing table names frame {int(blocks.max())}, but frames >= {scratch_frame} are the graph path's "
            "scratch: allocate the KV pool with one frame more than the scheduler's frames"
        )
    st["tokens"][:m] = tokens
    st["positions"][:m] = moe[:, 1]
    st["row_valid"][:m] = True
    if s:
        counts = shards[:, 4]
        first = np.cumsum(counts) - counts
        row = np.repeat(np.arange(s), counts)
        col = np.arange(int(counts.sum())) - np.repeat(first, counts)
        st["block_table"][row, col] = blocks[np.repeat(shards[:, 3], counts) + col]
        st["shard_lens"][:s] = shards[:, 2]
    tail = moe[:, 2]
    if m and int(tail.min()) < 0:
        raise ValueError("a MoE row has no local tail shard (its new token must be written on its MoE instance)")
    if m:
        slot = shards[tail, 2] - 1  # the new token is the last token of the tail shard
        frames = st["block_table"][tail, slot // page_size].astype(np.int64)
        st["kv_slot"][:m] = frames * page_size + slot % page_size
    moe_row_of_shard = np.zeros(s, dtype=np.int64)
    moe_row_of_shard[tail] = np.arange(m)
    source = shards[:, 1] if s else np.zeros(0, dtype=np.int64)
    st["shard_q_index"][:s] = np.where(source < 0, moe_row_of_shard, bucket.moe_batch + source)
    q_rows, q_send = _packed_sends(table.q_send)
    st["q_pack_index"][: len(q_rows)] = q_rows
    res_rows, res_send = _packed_sends(table.res_send)
    st["res_pack_index"][: len(res_rows)] = res_rows
    merge = st["merge_index"]
    merge[:m, 0] = tail
    if r:
        owner = table.res_recv[:, 1].astype(np.int64)  # moe row of each received partial, in receive order
        order = np.argsort(owner, kind="stable")
        start = np.searchsorted(owner[order], owner[order], side="left")
        column = 1 + np.arange(r) - start
        if int(column.max()) >= merge.shape[1]:
            raise ValueError(f"a request has more than {merge.shape[1]} partial results")
        merge[owner[order], column] = bucket.shard_rows + order  # received row j is part S_b + j
    return Exchanges(
        q_send=q_send,
        q_sources=sorted({int(x) for x in table.q_recv[:, 0]}),
        res_send=res_send,
        res_sources=sorted({int(x) for x in table.res_recv[:, 0]}),
    )


# ---- the pieces and the iteration -------------------------------------------------------------------------------


class GraphRunner:
    """Runs a DecodeInstance's iteration on a graph bucket; the instance keeps its fabric exchanges."""

    def __init__(self, instance: DecodeInstance, engine: GraphEngine) -> None:
        self.inst = instance
        self.engine = engine
        pool = instance.pool
        self.page_size = pool.page_size
        self.scratch_frame = pool.frames - 1
        needed = {f.name for f in decode_fields(instance.model.config, instance.fabric.world_size, 1, torch.float32)}
        missing = needed - {f.name for f in engine.fields}
        if missing:
            raise ValueError(f"graph engine lacks the decode fields {sorted(missing)} (use build_graph_engine)")
        pad = {f.name: f.pad for f in engine.fields}
        if pad["block_table"] != self.scratch_frame or pad["kv_slot"] != self.scratch_frame * self.page_size:
            raise ValueError(
                f"graph engine pads with frame {pad['block_table']}, the pool's scratch frame is {self.scratch_frame}"
            )
        self.kernels = instance.backends.kernels
        self.pieces = self._make_pieces()
        engine.register_pieces(self.pieces)

    def _make_pieces(self) -> dict:
        model = self.inst.model
        pieces = {"embed": self._embed}
        for layer in model.layers:
            i = layer.index
            pieces[f"project.{i}"] = lambda ctx, layer=layer: self._project(ctx, layer)
            pieces[f"attend.{i}"] = lambda ctx, layer=layer: self._attend(ctx, layer)
            pieces[f"merge.{i}"] = lambda ctx, layer=layer: self._merge(ctx, layer)
            if layer.moe is None:
                pieces[f"dense.{i}"] = lambda ctx, layer=layer: self._dense(ctx, layer)
            else:
                pieces[f"gate.{i}"] = lambda ctx, layer=layer: self._gate(ctx, layer)
                pieces[f"experts.{i}"] = lambda ctx, layer=layer: self._experts(ctx, layer)
                pieces[f"moe_out.{i}"] = lambda ctx, layer=layer: self._moe_out(ctx, layer)
        pieces["logits"] = self._logits
        return pieces

    # ---- pieces: functions of the context only ---------------------------------------------------------
    def _embed(self, ctx: BucketContext) -> None:
        ctx["h"].copy_(embed(self.inst.model, ctx["tokens"]))

    def _project(self, ctx: BucketContext, layer) -> None:
        q_latent, kv_new = mla_decode_qkv(layer, ctx["h"], ctx["positions"])  # [M, H, Dqk], [M, Dkv]
        ctx["q_latent"].copy_(q_latent)
        kv = self.inst.pool.kv[layer.index]  # [frames, page, Dkv]
        self.kernels.scatter_rows(kv.view(-1, kv.shape[-1]), ctx["kv_slot"], kv_new)
        self.kernels.gather_rows(ctx["q_latent"], ctx["q_pack_index"], out=ctx["q_pack"])

    def _attend(self, ctx: BucketContext, layer) -> None:
        inst, c = self.inst, self.inst.model.config
        received = inst.q_route.recv[: ctx.bucket.q_recv]
        self.kernels.gather_two(ctx["q_latent"], received, ctx["shard_q_index"], out=ctx["q_shard"])
        o, lse = inst.backends.attention(
            ctx["q_shard"], inst.pool.kv[layer.index], ctx["block_table"], ctx["shard_lens"],
            inst.model.softmax_scale, c.kv_lora_rank,
        )  # fmt: skip
        ctx["o"].copy_(o)
        ctx["lse"].copy_(lse)
        self.kernels.pack_partials(ctx["o"], ctx["lse"], ctx["res_pack_index"], out=ctx["res_pack"])

    def _merge(self, ctx: BucketContext, layer) -> None:
        received = self.inst.res_route.recv[: ctx.bucket.res_recv]
        o_merged, _ = self.kernels.merge_routed(ctx["o"], ctx["lse"], received, ctx["merge_index"])
        h = ctx["h"]
        h.add_(mla_decode_output(layer, o_merged))
        ctx["x"].copy_(post_attention_norm(layer, h))

    def _dense(self, ctx: BucketContext, layer) -> None:
        ctx["h"].add_(dense_mlp(layer, ctx["x"]))

    def _gate(self, ctx: BucketContext, layer) -> None:
        topk_idx, topk_weights = moe_gate(layer, ctx["x"])
        ctx["topk_idx"].copy_(topk_idx.masked_fill(~ctx["row_valid"][:, None], -1))  # padding rows choose nothing
        ctx["topk_weights"].copy_(topk_weights)

    def _experts(self, ctx: BucketContext, layer) -> None:
        inst = self.inst
        inst.backends.experts(layer, inst.local_experts, inst.dispatcher.recv_x, ctx["recv_count"], ctx["expert_out"])

    def _moe_out(self, ctx: BucketContext, layer) -> None:
        ctx["h"].add_(ctx["combined"] + shared_expert(layer, ctx["x"]))

    def _logits(self, ctx: BucketContext) -> None:
        ctx["logits"].copy_(logits(self.inst.model, ctx["h"]))

    # ---- the iteration ---------------------------------------------------------------------------------
    def iteration(
        self, table: RoutingTables, rows: dict[int, RowInput], return_logits: bool, bucket: BucketShape, timing_ctx
    ) -> Iterator:
        """Generator like DecodeInstance.iteration: yields a Wait at every exchange, returns the sampled rows."""
        from .instance import Wait

        inst, engine, run = self.inst, self.engine, self._run
        ctx = engine.context(bucket)
        tokens = [rows[int(b)].token for b in table.moe[:, 0]]
        ex = stage_routing(engine.begin_injection(ctx), table, tokens, bucket, self.page_size, self.scratch_frame)
        engine.inject(ctx)
        timing = inst.timing
        run(ctx, "embed")
        for layer in inst.model.layers:
            i = layer.index
            with timing.phase("projection", i, timing_ctx):
                run(ctx, f"project.{i}")
            seq = inst._next_seq()
            with timing.phase("q_route", i, timing_ctx):
                inst.q_route.send(ex.q_send, ctx["q_pack"], seq)
            yield Wait(inst.q_route.wait_flags(ex.q_sources, seq))
            with timing.phase("attention", i, timing_ctx):
                run(ctx, f"attend.{i}")
            with timing.phase("res_route", i, timing_ctx):
                inst.res_route.send(ex.res_send, ctx["res_pack"], seq)
            yield Wait(inst.res_route.wait_flags(ex.res_sources, seq))
            with timing.phase("merge", i, timing_ctx):
                run(ctx, f"merge.{i}")
            if layer.moe is None:
                with timing.phase("dense", i, timing_ctx):
                    run(ctx, f"dense.{i}")
            else:
                yield from self._moe(ctx, layer, timing_ctx)
        with timing.phase("sampling", -1, timing_ctx):
            run(ctx, "logits")
            return inst._sample_rows(ctx["logits"][: len(tokens)], table.moe[:, 0].tolist(), rows, return_logits)

    def _moe(self, ctx: BucketContext, layer, timing_ctx):
        from .instance import Wait

        inst, run, i = self.inst, self._run, layer.index
        dispatcher, timing = inst.dispatcher, inst.timing
        with timing.phase("dispatch", i, timing_ctx):
            run(ctx, f"gate.{i}")
            pending = dispatcher.dispatch_send(ctx["x"], ctx["topk_idx"])
        yield Wait(dispatcher.wait_flags(pending))
        with timing.phase("experts", i, timing_ctx):
            _, recv_count, handle = dispatcher.dispatch_finish(pending)
            ctx["recv_count"].copy_(recv_count, non_blocking=True)
            run(ctx, f"experts.{i}")
        with timing.phase("combine", i, timing_ctx):
            dispatcher.combine_send(ctx["expert_out"], ctx["topk_idx"], ctx["topk_weights"], handle)
        yield Wait(dispatcher.wait_flags(handle))
        with timing.phase("combine", i, timing_ctx):
            ctx["combined"].copy_(dispatcher.combine_finish(handle, ctx["topk_weights"], ctx["combined"].dtype))
            run(ctx, f"moe_out.{i}")

    def _run(self, ctx: BucketContext, name: str) -> None:
        self.engine.run(ctx, name, self.pieces[name])
