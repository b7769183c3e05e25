"""One contiguous static buffer pool, sized by the bucket family's upper bounds and shared by every bucket.

Each field (a routing-table index tensor, a payload buffer, an activation) owns one aligned byte range of the pool,
sized for the largest bucket. A bucket's view of a field is the first numel(bucket shape) elements of that range,
reinterpreted with the bucket's shape, so every bucket reads and writes the same memory: no duplication across
buckets, and addresses that never change (what CUDA graph replay needs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

DEFAULT_ALIGN = 256  # bytes; keeps every field aligned for vectorised kernels and TMA


@dataclass(frozen=True)
class FieldSpec:
    """A named tensor of the pool. dims are ints or symbolic names resolved per bucket (BucketShape.sizes() plus
    the engine's constants). Injected fields hold routing metadata copied in from the host every iteration; their
    padding rows are set to `pad` (a value chosen to make padding inert, e.g. a scratch frame or -1)."""

    name: str
    dims: tuple[str | int, ...]
    dtype: torch.dtype
    injected: bool = False
    pad: int | float | bool = 0

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        try:
            return tuple(d if isinstance(d, int) else int(sizes[d]) for d in self.dims)
        except KeyError as e:
            raise ValueError(f"field {self.name!r}: unknown dimension {e.args[0]!r} (known: {sorted(sizes)})") from None

    def nbytes(self, sizes: Mapping[str, int]) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape(sizes):
            n *= d
        return n


@dataclass(frozen=True)
class FieldSlot:
    offset: int  # bytes from the start of the pool
    nbytes: int  # capacity (upper-bound size)


class PoolLayout:
    """Byte offsets of every field for the upper-bound sizes (a pure calculation: nothing is allocated)."""

    def __init__(self, fields: Sequence[FieldSpec], upper: Mapping[str, int], align: int = DEFAULT_ALIGN):
        if align < 1 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in {names}")
        self.fields = {f.name: f for f in fields}
        self.upper = dict(upper)
        self.slots: dict[str, FieldSlot] = {}
        offset = 0
        for f in fields:
            size = f.nbytes(upper)
            self.slots[f.name] = FieldSlot(offset, size)
            offset += -(-size // align) * align
        self.nbytes = offset

    def field_bytes(self) -> dict[str, int]:
        return {name: slot.nbytes for name, slot in self.slots.items()}


class StaticPool:
    """The allocated pool: one uint8 tensor, plus typed views of its fields."""

    def __init__(self, layout: PoolLayout, device: torch.device | str = "cpu", pin_memory: bool = False):
        self.layout = layout
        self.storage = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def view(self, name: str, sizes: Mapping[str, int]) -> torch.Tensor:
        """Field `name` shaped for `sizes`: the first numel elements of its range (contiguous)."""
        spec, slot = self.layout.fields[name], self.layout.slots[name]
        nbytes = spec.nbytes(sizes)
        if nbytes > slot.nbytes:
            raise ValueError(f"field {name!r}: {spec.shape(sizes)} needs {nbytes} bytes, the pool holds {slot.nbytes}")
        raw = self.storage[slot.offset : slot.offset + nbytes]
        return raw.view(spec.dtype).view(spec.shape(sizes))
