"""Per-phase timing log of a decode instance: one record per (iteration, instance, layer, phase).

The latency breakdown tool and the simulator's `cpu-tiny` profile read these records (JSON lines).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
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


@dataclass
class TimingLog:
    enabled: bool = True
    records: list[PhaseRecord] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str, layer: int, ctx: dict):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        yield
        self.records.append(PhaseRecord(phase=name, layer=layer, seconds=time.perf_counter() - start, **ctx))

    def dump(self, path: str | Path) -> None:
        with open(path, "a", encoding="utf-8") as f:
            for rec in self.records:
                f.write(json.dumps(asdict(rec)) + "\n")
        self.records.clear()


def read_timing_log(path: str | Path) -> list[PhaseRecord]:
    with open(path, encoding="utf-8") as f:
        return [PhaseRecord(**json.loads(line)) for line in f if line.strip()]
