"""nanocp.graphs: the AOT graph engine (torch only).

- buckets: execution shapes, bucket families (grid of ladders), the smallest covering bucket
- pool: one contiguous static pool sized by the upper bounds, typed per-bucket views into it
- engine: per-bucket contexts, asynchronous metadata injection, capture/replay (CUDA graphs, or eager on CPU)
"""

from .buckets import DIMS, BucketFamily, BucketShape, geometric_ladder
from .engine import BucketContext, GraphEngine, GraphFallbackWarning, GraphReport, Piece
from .pool import DEFAULT_ALIGN, FieldSpec, PoolLayout, StaticPool

__all__ = [
    "DEFAULT_ALIGN",
    "DIMS",
    "BucketContext",
    "BucketFamily",
    "BucketShape",
    "FieldSpec",
    "GraphEngine",
    "GraphFallbackWarning",
    "GraphReport",
    "Piece",
    "PoolLayout",
    "StaticPool",
    "geometric_ladder",
]
