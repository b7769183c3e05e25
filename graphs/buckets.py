"""Bucketing of execution shapes: a bounded family of static shapes, and the smallest one that covers a shape.

An instance's execution shape in one iteration (NanoCP Section 5.2) is its MoE batch, its shard-attention rows,
the queries it receives, the partial results it receives, plus the widest block table among its shards. A graph
is captured per bucket; at run time the iteration is padded up to the smallest bucket that covers its shape.

A grid family is the product of three ladders: MoE batch M, remote rows R (received queries and received partial
results, each at most R) and block-table width B; its buckets are (M, M + R, R, R, B), because an instance's shard
rows are its own requests' local shards (one per MoE row) plus one per received query.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, fields

DIMS = ("moe_batch", "shard_rows", "q_recv", "res_recv", "max_blocks")


@dataclass(frozen=True)
class BucketShape:
    """One static shape (also used for an iteration's actual shape)."""

    moe_batch: int  # requests whose MoE binding is this instance
    shard_rows: int  # (request, shard) pairs attended here
    q_recv: int  # queries received from other instances
    res_recv: int  # partial results received from other instances
    max_blocks: int  # block-table width (pages of the longest local shard)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"BucketShape.{f.name} must be an int >= 0, got {value!r}")

    def covers(self, shape: BucketShape) -> bool:
        return all(a >= b for a, b in zip(astuple(self), astuple(shape)))

    def sizes(self) -> dict[str, int]:
        """Symbolic dimension name -> size, for resolving pool field shapes."""
        return dict(zip(DIMS, astuple(self)))

    @staticmethod
    def upper(shapes: Iterable[BucketShape]) -> BucketShape:
        """Component-wise maximum."""
        rows = [astuple(s) for s in shapes]
        if not rows:
            raise ValueError("upper() of no shapes")
        return BucketShape(*(max(col) for col in zip(*rows)))


def _ladder(values: Sequence[int], name: str, allow_zero: bool) -> tuple[int, ...]:
    ladder = tuple(sorted(set(int(v) for v in values)))
    low = 0 if allow_zero else 1
    if not ladder or ladder[0] < low:
        raise ValueError(f"{name} ladder must be non-empty with values >= {low}, got {list(values)}")
    return ladder


def geometric_ladder(top: int, growth: int = 2, start: int = 1, zero: bool = False) -> tuple[int, ...]:
    """start, start * growth, ... capped by top (top itself always included); 0 first when `zero`."""
    if top < start or growth < 2 or start < 1:
        raise ValueError(f"bad ladder: start={start} growth={growth} top={top}")
    values, v = [0] if zero else [], start
    while v < top:
        values.append(v)
        v *= growth
    values.append(top)
    return tuple(values)


@dataclass(frozen=True)
class BucketFamily:
    """A finite set of bucket shapes; `pick` returns the smallest one covering a shape, or None."""

    buckets: tuple[BucketShape, ...]

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("a bucket family needs at least one bucket")
        if len(set(self.buckets)) != len(self.buckets):
            raise ValueError("a bucket family must not repeat a bucket")
        object.__setattr__(self, "buckets", tuple(sorted(self.buckets, key=astuple)))

    @classmethod
    def grid(cls, moe_batch: Sequence[int], remote: Sequence[int], max_blocks: Sequence[int]) -> BucketFamily:
        """The product family: buckets (M, M + R, R, R, B) for M, R, B in the three ladders."""
        ms = _ladder(moe_batch, "moe_batch", allow_zero=False)
        rs = _ladder(remote, "remote", allow_zero=True)
        bs = _ladder(max_blocks, "max_blocks", allow_zero=False)
        return cls(tuple(BucketShape(m, m + r, r, r, b) for m, r, b in itertools.product(ms, rs, bs)))

    @classmethod
    def geometric(cls, max_moe_batch: int, max_remote: int, max_blocks: int, growth: int = 2) -> BucketFamily:
        """Grid family of geometric ladders up to the bounds: MoE batch 1, 2, 4, ...; remote rows 0, 1, growth,
        ...; block widths 1, growth, ..."""
        remote = geometric_ladder(max_remote, growth, zero=True) if max_remote > 0 else (0,)
        return cls.grid(geometric_ladder(max_moe_batch, growth), remote, geometric_ladder(max_blocks, growth * growth))

    @property
    def upper(self) -> BucketShape:
        """The bounds that size the shared pool."""
        return BucketShape.upper(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def pick(self, shape: BucketShape) -> BucketShape | None:
        """The smallest covering bucket: least MoE batch, then least shard rows, then least received rows, then
        least block width. For a grid family and a shape whose shard rows are at most its MoE batch plus its received
        queries (always so for a lowered routing table) this is the component-wise least covering bucket."""
        for bucket in self.buckets:  # sorted by (moe_batch, shard_rows, q_recv, res_recv, max_blocks)
            if bucket.covers(shape):
                return bucket
        return None
