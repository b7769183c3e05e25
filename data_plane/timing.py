"""Per-phase timing log of a decode instance: one record per (iteration, instance, layer, phase).

The latency breakdown tool and the simulator's `cpu-tiny` profile read these records (JSON lines). A phase holds the
steps the fp32 CPU path runs in one kernel call: a MoE layer's "merge" also holds the output projection, the FFN norm
and the gate (decode_layers.moe_input), a dense layer's "dense" its whole step after the attention (the merge, the
output projection and the MLP: decode_layers.dense_output), and "experts" the send of the experts' outputs when they
are written in place (the "combine" then only signals).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = (
    "projection",
    "q_route",
    "attention",
    "res_route",
    "merge",
    "dispatch",
    "experts",
    "combine",
    "dense",
    "sampling",
)


@dataclass
class PhaseRecord:
    iteration: int
    instance: int
    layer: int  # -1 for per-iteration phases (sampling)
    phase: str
    seconds: float
    moe_batch: int  # requests whose MoE binding is this instance
    shard_rows: int  # (request, shard) pairs attended here
    kv_tokens: int  # KV tokens attended here
    q_recv: int
    res_recv: int


class _Untimed:
    """The phase context of a disabled log: nothing to do (one shared object, no allocation per phase)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_UNTIMED = _Untimed()


class _Timed:
    __slots__ = ("log", "name", "layer", "ctx", "start")

    def __init__(self, log: TimingLog, name: str, layer: int, ctx: dict) -> None:
        self.log, self.name, self.layer, self.ctx = log, name, layer, ctx

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:  # a phase that raised is not a measurement
            seconds = time.perf_counter() - self.start
            self.log.records.append(PhaseRecord(phase=self.name, layer=self.layer, seconds=seconds, **self.ctx))


@dataclass
class TimingLog:
    enabled: bool = True
    records: list[PhaseRecord] = field(default_factory=list)

    def phase(self, name: str, layer: int, ctx: dict):
        """Context manager timing one phase (records nothing when the log is disabled)."""
        return _Timed(self, name, layer, ctx) if self.enabled else _UNTIMED

    def dump(self, path: str | Path) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for rec in self.records:
                f.write(json.dumps(asdict(rec)) + "\n")
        self.records.clear()


def read_timing_log(path: str | Path) -> list[PhaseRecord]:
    with open(path, encoding="utf-8") as f:
        return [PhaseRecord(**json.loads(line)) for line in f if line.strip()]
