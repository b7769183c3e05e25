"""AOT context-driven graph engine (NanoCP Section 5.2, Algorithm 2).

Offline: one static pool sized by the bucket family's upper bounds; per bucket a context = views into it; on CUDA
a graph per (bucket, piece) captured with every piece sharing one CUDA-graph memory pool. At run time: pick the
smallest bucket covering the iteration's shape, fill the host staging copy of the routing metadata (padding rows
inert), inject it with asynchronous copies (`copy_(..., non_blocking=True)`), then replay the pieces.

A piece is a function of the context only (it reads and writes static buffers, never allocates what outlives it,
never syncs with the host). Without CUDA the same pieces run eagerly on the same static buffers: the bucketing,
pool and injection logic is identical, only the launch differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .buckets import BucketFamily, BucketShape
from .pool import DEFAULT_ALIGN, FieldSpec, PoolLayout, StaticPool

Piece = Callable[["BucketContext"], None]


class GraphFallbackWarning(UserWarning):
    """An iteration's shape fits no bucket: it runs eagerly (correct, without the graphs' benefits)."""


@dataclass
class BucketContext:
    """One bucket's views: `tensors` on the engine's device, `staging` (injected fields only) on the host."""

    bucket: BucketShape
    tensors: dict[str, torch.Tensor]
    staging: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


@dataclass
class GraphReport:
    buckets: int
    pieces: int  # graph pieces per bucket (the segments between exchanges)
    graphs: int  # buckets x pieces: the static graphs the engine captures (CUDA) or replays eagerly (CPU)
    captured: int  # CUDA graphs captured so far
    pool_bytes: int  # the shared static pool on the device
    staging_bytes: int  # the host staging copy of the injected fields
    mode: str  # "cuda-graphs" or "eager-replay"
    field_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class GraphEngine:
    def __init__(
        self,
        family: BucketFamily,
        fields: Sequence[FieldSpec],
        constants: Mapping[str, int] | None = None,
        device: torch.device | str = "cpu",
        use_cuda_graphs: bool | None = None,
        align: int = DEFAULT_ALIGN,
    ) -> None:
        self.family = family
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        if use_cuda_graphs and not on_cuda:
            raise ValueError(f"CUDA graphs need a CUDA device, the engine's device is {self.device}")
        self.use_cuda_graphs = on_cuda if use_cuda_graphs is None else use_cuda_graphs
        self.constants = dict(constants or {})
        clash = set(self.constants) & set(family.upper.sizes())
        if clash:
            raise ValueError(f"constants {sorted(clash)} shadow bucket dimensions")
        upper = {**self.constants, **family.upper.sizes()}
        self.fields = list(fields)
        self.layout = PoolLayout(self.fields, upper, align)
        self.pool = StaticPool(self.layout, self.device)
        injected = [f for f in self.fields if f.injected]
        self._staging_pool = StaticPool(PoolLayout(injected, upper, align), "cpu", pin_memory=on_cuda)
        self.contexts = {b: self._make_context(b) for b in family}
        self.pieces: list[str] = []
        self._graphs: dict[tuple[BucketShape, str], torch.cuda.CUDAGraph] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self._injected_event = None  # CUDA event after the last injection: staging may be rewritten after it

    # ---- buckets and contexts ---------------------------------------------------------------------------
    def pick_bucket(self, shape: BucketShape) -> BucketShape | None:
        """The smallest bucket covering `shape`, None when no bucket does (the caller runs eagerly)."""
        return self.family.pick(shape)

    def context(self, bucket: BucketShape) -> BucketContext:
        try:
            return self.contexts[bucket]
        except KeyError:
            raise ValueError(f"{bucket} is not a bucket of this engine") from None

    def _make_context(self, bucket: BucketShape) -> BucketContext:
        sizes = {**self.constants, **bucket.sizes()}
        tensors = {f.name: self.pool.view(f.name, sizes) for f in self.fields}
        staging = {f.name: self._staging_pool.view(f.name, sizes) for f in self.fields if f.injected}
        return BucketContext(bucket, tensors, staging)

    # ---- metadata injection -----------------------------------------------------------------------------
    def begin_injection(self, ctx: BucketContext) -> dict[str, torch.Tensor]:
        """The host staging views of `ctx`, every element set to its field's padding value; fill the real rows,
        then call `inject`."""
        if self._injected_event is not None:
            self._injected_event.synchronize()  # the previous async copies have read the staging
        for f in self.fields:
            if f.injected:
                ctx.staging[f.name].fill_(f.pad)
        return ctx.staging

    def inject(self, ctx: BucketContext) -> None:
        """Asynchronous host -> device copies of the staged routing metadata into the context."""
        for name, host in ctx.staging.items():
            ctx.tensors[name].copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            self._injected_event = torch.cuda.Event()
            self._injected_event.record()

    # ---- pieces: capture and replay ---------------------------------------------------------------------
    def register_pieces(self, names: Iterable[str]) -> None:
        """Declare the pieces run per bucket (for the report; capture itself is lazy or `capture_all`)."""
        for name in names:
            if name not in self.pieces:
                self.pieces.append(name)

    def run(self, ctx: BucketContext, name: str, piece: Piece) -> None:
        """Run one piece on `ctx`: replay its CUDA graph (captured at first use), or call it eagerly on CPU."""
        if not self.use_cuda_graphs:
            piece(ctx)
            return
        graph = self._graphs.get((ctx.bucket, name))
        if graph is None:
            self._capture(ctx, name, piece)  # its warm-up run computed this call's result
            return
        graph.replay()

    def capture_all(self, pieces: Mapping[str, Piece]) -> int:
        """AOT: capture every (bucket, piece) on inert (all-padding) contexts. Returns the number captured."""
        if not self.use_cuda_graphs:
            return 0
        self.register_pieces(pieces)
        before = len(self._graphs)
        for bucket, ctx in self.contexts.items():
            self.begin_injection(ctx)
            self.inject(ctx)
            for name, piece in pieces.items():
                if (bucket, name) not in self._graphs:
                    self._capture(ctx, name, piece)
        torch.cuda.synchronize(self.device)
        return len(self._graphs) - before

    def _capture(self, ctx: BucketContext, name: str, piece: Piece) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            piece(ctx)  # warm-up: lazy initialisation happens outside the capture, and it does this call's work
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            piece(ctx)
        self._graphs[(ctx.bucket, name)] = graph
        self.register_pieces([name])

    # ---- report -----------------------------------------------------------------------------------------
    def report(self) -> GraphReport:
        return GraphReport(
            buckets=len(self.family),
            pieces=len(self.pieces),
            graphs=len(self.family) * len(self.pieces),
            captured=len(self._graphs),
            pool_bytes=self.pool.nbytes,
            staging_bytes=self._staging_pool.nbytes,
            mode="cuda-graphs" if self.use_cuda_graphs else "eager-replay",
            field_bytes=self.layout.field_bytes(),
        )
