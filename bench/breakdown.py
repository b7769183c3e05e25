"""Per-layer latency breakdown: attention, MoE all-to-all, CP communication and other, per decode instance.

Sources:
- a simulator result JSON: a single run (`nanocp sim run`, key `instance_layer_us`), the micro-benchmark
  (`sim_micro.json`, one breakdown per configuration) or the balance experiment (`sim_balance.json`, one per run);
- the real instances' timing logs: JSON lines of `data_plane.timing.PhaseRecord`.

For every source the result is one `Breakdown` per configuration: microseconds per layer, per instance, split into
the four components. The slowest instance is the straggler, the one with the most time outside the all-to-all
(everybody else waits for it inside dispatch/combine). Across instances we report max / median / min per component.

Timing-log phases map onto components as
    attention <- attention;  moe_a2a <- dispatch + combine (including the wait for the slowest instance, as a GPU
    profiler sees it);  cp_comm <- q_route + res_route;  other <- projection + merge + experts + dense.
Per layer = mean over (iteration, MoE layer), MoE layers being those with a dispatch record (all layers if there are
none). Sampling (once per iteration) is left out, as in the simulator's one-layer breakdown.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .latency_profile import BREAKDOWN

COMPONENTS = BREAKDOWN  # ("attention", "moe_a2a", "cp_comm", "other")
COMPONENT_LABELS = {
    "attention": "attention",
    "moe_a2a": "MoE all-to-all",
    "cp_comm": "CP communication",
    "other": "other",
}
COLORS = {"attention": "#4c72b0", "moe_a2a": "#dd8452", "cp_comm": "#c44e52", "other": "#8c8c8c"}
PHASE_COMPONENT = {
    "attention": "attention",
    "dispatch": "moe_a2a",
    "combine": "moe_a2a",
    "q_route": "cp_comm",
    "res_route": "cp_comm",
    "projection": "other",
    "merge": "other",
    "experts": "other",
    "dense": "other",
}
PER_ITERATION_PHASES = ("sampling",)


class BreakdownError(ValueError):
    """A breakdown source is missing, empty or not in a known format."""


@dataclass
class Breakdown:
    """Per-layer time (us) of every instance, split into COMPONENTS."""

    label: str
    per_instance_us: dict[str, np.ndarray]  # component -> [I]
    source: str = ""

    def __post_init__(self) -> None:
        missing = set(COMPONENTS) - set(self.per_instance_us)
        if missing:
            raise BreakdownError(f"breakdown {self.label!r} lacks components {sorted(missing)}")
        self.per_instance_us = {k: np.asarray(self.per_instance_us[k], dtype=float) for k in COMPONENTS}
        sizes = {len(v) for v in self.per_instance_us.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise BreakdownError(f"breakdown {self.label!r}: components need equal non-empty per-instance arrays")

    @property
    def num_instances(self) -> int:
        return len(self.per_instance_us["attention"])

    @property
    def total_us(self) -> np.ndarray:
        return sum(self.per_instance_us[k] for k in COMPONENTS)

    @property
    def slowest(self) -> int:
        """The straggler: most time outside the all-to-all (lowest index on ties)."""
        return int(np.argmax(self.total_us - self.per_instance_us["moe_a2a"]))

    def slowest_split(self) -> dict[str, float]:
        i = self.slowest
        return {k: float(self.per_instance_us[k][i]) for k in COMPONENTS}

    def across(self) -> dict[str, dict[str, float]]:
        """Per component: max, median, min and mean over instances."""
        stats = {"max": np.max, "median": np.median, "min": np.min, "mean": np.mean}
        return {k: {name: float(f(v)) for name, f in stats.items()} for k, v in self.per_instance_us.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "source": self.source,
            "num_instances": self.num_instances,
            "slowest": self.slowest,
            "slowest_us": self.slowest_split(),
            "across_instances_us": self.across(),
            "per_instance_us": {k: v.tolist() for k, v in self.per_instance_us.items()},
        }


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def from_timing_records(records: Iterable[Any], label: str, source: str = "") -> Breakdown:
    """Breakdown of real instances from PhaseRecords (dataclasses or dicts with the same fields)."""
    rows = [asdict(r) if not isinstance(r, Mapping) else r for r in records]
    if not rows:
        raise BreakdownError(f"{label}: no timing records")
    unknown = {r["phase"] for r in rows} - set(PHASE_COMPONENT) - set(PER_ITERATION_PHASES)
    if unknown:
        raise BreakdownError(f"{label}: unknown timing phases {sorted(unknown)}")
    moe_layers = {r["layer"] for r in rows if r["phase"] == "dispatch"}
    keep = [r for r in rows if r["layer"] >= 0 and (not moe_layers or r["layer"] in moe_layers)]
    if not keep:
        raise BreakdownError(f"{label}: no per-layer timing records")
    num_instances = max(r["instance"] for r in rows) + 1
    sums = {k: np.zeros(num_instances) for k in COMPONENTS}
    cells = [set() for _ in range(num_instances)]  # (iteration, layer) seen per instance
    for r in keep:
        sums[PHASE_COMPONENT[r["phase"]]][r["instance"]] += r["seconds"]
        cells[r["instance"]].add((r["iteration"], r["layer"]))
    counts = np.array([max(len(c), 1) for c in cells], dtype=float)
    return Breakdown(label, {k: v * 1e6 / counts for k, v in sums.items()}, source)


def read_timing_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise BreakdownError(f"{path}:{line_no}: not JSON ({e})") from None
            if not isinstance(rec, dict) or "phase" not in rec or "seconds" not in rec:
                raise BreakdownError(f"{path}:{line_no}: not a timing record (need phase, seconds, ...)")
            out.append(rec)
    return out


def from_result(data: Mapping[str, Any], label: str | None = None, source: str = "") -> list[Breakdown]:
    """Breakdowns in a simulator result: a single run, the micro-benchmark or the balance experiment."""
    if "instance_layer_us" in data:
        cfg = data.get("config", {})
        name = label or f"{cfg.get('policy', 'run')}"
        if not data["instance_layer_us"]:
            raise BreakdownError(f"{name}: the run has no iterations in its arrival window")
        return [Breakdown(name, data["instance_layer_us"], source)]
    experiment = data.get("experiment")
    if experiment == "micro":
        return [
            Breakdown(f"{r['longs_per_node']} long/node: {r['label']}", r["per_instance_layer_us"], source)
            for r in data["results"]
        ]
    if experiment == "balance":
        return [
            Breakdown(f"{r['load']} load: {r['label']}", r["instance_layer_us"], source)
            for r in data["runs"]
            if r.get("instance_layer_us")
        ]
    raise BreakdownError(f"{source or 'result'}: not a simulator run, micro or balance result")


def load_breakdowns(path: str | os.PathLike, label: str | None = None) -> list[Breakdown]:
    """Breakdowns from a file: a simulator result (.json) or a timing log (JSON lines)."""
    path = Path(path)
    if not path.is_file():
        raise BreakdownError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "phase" not in data:
        return from_result(data, label, str(path))
    return [from_timing_records(read_timing_records(path), label or path.stem, str(path))]


# ---------------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------------


def format_table(breakdowns: Sequence[Breakdown]) -> str:
    """Markdown: the slowest instance's split, then max / median per component across instances."""
    head = "| configuration | slowest | " + " | ".join(COMPONENT_LABELS[k] for k in COMPONENTS) + " | total |"
    lines = ["Slowest instance, us per layer:", "", head, "|---|---|" + "---|" * (len(COMPONENTS) + 1)]
    for b in breakdowns:
        s = b.slowest_split()
        cells = " | ".join(f"{s[k]:.1f}" for k in COMPONENTS)
        lines.append(f"| {b.label} | {b.slowest} | {cells} | {sum(s.values()):.1f} |")
    lines += ["", "Across instances, us per layer (max / median):", ""]
    lines.append("| configuration | " + " | ".join(COMPONENT_LABELS[k] for k in COMPONENTS) + " |")
    lines.append("|---|" + "---|" * len(COMPONENTS))
    for b in breakdowns:
        a = b.across()
        cells = " | ".join(f"{a[k]['max']:.1f} / {a[k]['median']:.1f}" for k in COMPONENTS)
        lines.append(f"| {b.label} | {cells} |")
    return "\n".join(lines) + "\n"


def plot_breakdowns(
    groups: Mapping[str, Sequence[Breakdown]], path: str | os.PathLike, title: str = "", short_labels: bool = True
) -> Path:
    """Stacked bars (slowest instance, us per layer) per configuration; one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not groups or not any(groups.values()):
        raise BreakdownError("nothing to plot")
    names = [g for g in groups if groups[g]]
    ncols = 2 if len(names) == 4 else min(len(names), 3)
    nrows = -(-len(names) // ncols)
    width = max(4.0, 0.55 * max(len(groups[g]) for g in names) + 1.5)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.2 * nrows), squeeze=False, sharey=True)
    flat = axes.ravel()
    for ax in flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(flat, names):
        items = groups[name]
        x = np.arange(len(items))
        bottom = np.zeros(len(items))
        for k in COMPONENTS:
            h = np.array([b.slowest_split()[k] for b in items])
            ax.bar(x, h, bottom=bottom, color=COLORS[k], label=COMPONENT_LABELS[k], width=0.7)
            bottom += h
        labels = [b.label.split(": ", 1)[-1] if short_labels else b.label for b in items]
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("slowest instance, us per layer")
    flat[0].legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_breakdown_report(
    breakdowns: Sequence[Breakdown], json_path: Path, md_path: Path, png_path: Path | None, title: str
) -> None:
    """JSON of every breakdown, markdown tables and (optionally) the stacked-bar PNG grouped by label prefix."""
    if not breakdowns:
        raise BreakdownError("no breakdowns to report")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"breakdowns": [b.to_dict() for b in breakdowns]}, indent=1) + "\n")
    md_path.write_text(f"# {title}\n\n" + format_table(breakdowns))
    if png_path is not None:
        plot_breakdowns(group_by_prefix(breakdowns), png_path, title)


def group_by_prefix(breakdowns: Sequence[Breakdown]) -> dict[str, list[Breakdown]]:
    """Group labels of the form 'group: name' by group (one group '' when there is no prefix)."""
    groups: dict[str, list[Breakdown]] = {}
    for b in breakdowns:
        group = b.label.split(": ", 1)[0] if ": " in b.label else ""
        groups.setdefault(group, []).append(b)
    return groups
