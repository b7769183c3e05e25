"""Length-bucket table: context length -> CP degree (NanoCP Alg. 1 line 8), loaded from an offline-profiled file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .spec import SchedulerError

DEFAULT_TABLE = Path(__file__).with_name("data") / "cp_buckets_default.json"


@dataclass(frozen=True)
class CPBucketTable:
    """Bucket k covers lengths <= max_lens[k] with degree cps[k]; longer lengths take the last degree."""

    max_lens: tuple[int, ...]
    cps: tuple[int, ...]
    provenance: str = ""

    def __post_init__(self) -> None:
        if not self.max_lens or len(self.max_lens) != len(self.cps):
            raise SchedulerError("CPBucketTable needs as many max_lens as cps, and at least one bucket")
        if any(b <= a for a, b in zip(self.max_lens, self.max_lens[1:])):
            raise SchedulerError(f"CPBucketTable.max_lens must be strictly increasing: {self.max_lens}")
        if any(c < 1 for c in self.cps):
            raise SchedulerError(f"CPBucketTable.cps must be >= 1: {self.cps}")

    def lookup(self, length: int) -> int:
        for max_len, cp in zip(self.max_lens, self.cps):
            if length <= max_len:
                return cp
        return self.cps[-1]

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> CPBucketTable:
        try:
            data = json.loads(Path(path).read_text())
            buckets = data["buckets"]
            return cls(
                tuple(int(b["max_len"]) for b in buckets),
                tuple(int(b["cp"]) for b in buckets),
                str(data.get("provenance", "")),
            )
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise SchedulerError(f"cannot read CP bucket table {path}: {e}") from e

    def save(self, path: str | Path) -> None:
        buckets = [{"max_len": m, "cp": c} for m, c in zip(self.max_lens, self.cps)]
        Path(path).write_text(json.dumps({"provenance": self.provenance, "buckets": buckets}, indent=2) + "\n")

    @classmethod
    def single(cls, cp: int = 1) -> CPBucketTable:
        return cls((1,), (cp,), "constant")
