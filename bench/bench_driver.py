"""The driver's CPU per decode step as the cluster's batch grows, with instances that answer at once.

    python -m nanocp.bench.bench_driver [--batches 64 256 1024 4096] [--instances 32]

A decode step's driver work is the plan (the C++ scheduler and the lowering), the row inputs of every MoE row, the
cluster round trip and the appends of the sampled tokens (stop checks included). On a GPU cluster the instances'
iteration takes tens of milliseconds; the driver must stay well below that at thousands of rows. Here the decode
cluster is replaced by one whose instances answer at once with a token per row (`InstantCluster`: no model, no
processes), so only the driver is timed. The prompts are admitted and prefilled first; then `--steps` decode steps
are timed (process CPU time), split by stage. Measured on this machine, not a model output.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import nanocp.engine as engine_module
from nanocp import SamplingParams
from nanocp.control_plane.lowering import RoutingTables
from nanocp.data_plane.instance import RowOutput
from nanocp.data_plane.row_messages import SampledRows, pack_outputs
from nanocp.engine import Engine, EngineConfig

RESULTS = Path(__file__).resolve().parent / "results"


class InstantCluster:
    """A decode cluster whose instances answer every MoE row at once (token = the row's batch index mod 200, one
    per sub-step of its window) and keep no KV: the engine's side of an iteration, without the instances."""

    incremental_tables = True

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def run_iteration(self, tables, rows, return_logits=False, full_tables=None) -> SampledRows:
        out = []
        for table in tables:
            for batch_index, _, _, window in RoutingTables.parse(table).moe.tolist():
                out += [RowOutput(batch_index, batch_index % 200, None, j) for j in range(window)]
        return pack_outputs(out)

    def write_kv(self, instance: int, frames: list[int], start_slot: int, kv) -> None:
        pass

    def timing_records(self) -> list:
        return []

    def dead_instances(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def instant_engine(instances: int, batch: int, new_tokens: int, prompt_len: int) -> Engine:
    """An engine on an InstantCluster sized for `batch` requests of prompt_len + new_tokens tokens."""
    real = engine_module.make_cluster
    engine_module.make_cluster = lambda backend, cfg, **options: InstantCluster(cfg)
    try:
        per_instance = -(-batch // instances)
        return Engine(
            EngineConfig(
                model="tiny",
                decode_instances=instances,
                backend="inline",
                kv_capacity_tokens=max(4096, 2 * per_instance * (prompt_len + new_tokens + 16)),
                max_batch_per_instance=max(256, 2 * per_instance),
            )
        )
    finally:
        engine_module.make_cluster = real


class StageClock:
    """CPU seconds spent in wrapped methods (the stages of a step), each without the wrapped calls nested in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._nested: list[float] = []  # per open call: CPU seconds of the wrapped calls inside it

    def wrap(self, obj, method: str, stage: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.process_time()
            self._nested.append(0.0)
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = time.process_time() - start
                self.seconds[stage] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed

        setattr(obj, method, timed)


GC_MODES = ("default", "frozen", "disabled")  # Python's cyclic GC as is; gc.freeze() after startup; gc.disable()


def measure(instances: int, batch: int, steps: int, prompt_len: int, seed: int, gc_mode: str = "default") -> dict:
    if gc_mode not in GC_MODES:
        raise ValueError(f"gc_mode must be one of {GC_MODES}, got {gc_mode!r}")
    new_tokens = steps + 8
    eng = instant_engine(instances, batch, new_tokens, prompt_len)
    if gc_mode == "frozen":  # what a server can do once its model is loaded: startup objects leave the GC's scans
        gc.collect()
        gc.freeze()
    elif gc_mode == "disabled":
        gc.disable()
    try:
        rnd = random.Random(seed)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"d{i}", [rnd.randrange(256) for _ in range(prompt_len)], params)
        while eng.scheduler.num_waiting:
            eng.step()  # admissions and prefills, not timed
        eng.step()
        clock = StageClock()
        clock.wrap(eng.scheduler, "step", "plan: scheduler step")
        clock.wrap(eng, "_moe_rows", "plan: lowering + MoE rows")
        clock.wrap(eng, "_launch", "row inputs")
        clock.wrap(eng.cluster, "run_iteration", "instant instances (not the driver)")
        clock.wrap(eng, "_collect", "appends + stop checks")
        per_step = []
        for _ in range(steps):
            start = time.process_time()
            eng.step()
            per_step.append(time.process_time() - start)
        rows = eng.scheduler.num_running
    finally:
        eng.close()
        if gc_mode == "frozen":
            gc.unfreeze()
        elif gc_mode == "disabled":
            gc.enable()
    stages = {stage: s / steps * 1e3 for stage, s in clock.seconds.items()}
    driver = statistics.mean(per_step) - clock.seconds["instant instances (not the driver)"] / steps
    return {
        "gc": gc_mode,
        "batch": batch,
        "rows_running": rows,
        "driver_ms_per_step": driver * 1e3,  # mean over the timed steps, the stand-in instances left out
        "step_ms_median": statistics.median(per_step) * 1e3,
        "us_per_row": driver / batch * 1e6,
        "stage_ms_per_step": stages,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gc", nargs="+", default=list(GC_MODES), choices=GC_MODES, help="Python GC settings to run")
    ap.add_argument("--out", default=str(RESULTS / "driver_steps"))
    args = ap.parse_args(argv)
    rows = [measure(args.instances, b, args.steps, args.prompt_len, b, mode) for mode in args.gc for b in args.batches]
    result = {"benchmark": "driver CPU per decode step, instant instances", "settings": vars(args), "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    stages = list(rows[0]["stage_ms_per_step"])
    lines = [
        "# Driver CPU per decode step, instances that answer at once (tiny model, CPU)",
        "",
        f"Command: `python -m nanocp.bench.bench_driver` ({args.instances} decode instances, policy nanocp, "
        f"{args.prompt_len}-token prompts, greedy, {args.steps} timed steps after every request is admitted; process "
        "CPU time per step, mean, without the stand-in instances; each stage is a method's own CPU per step, without "
        "the stages nested in it). Measured on this machine, not a model output.",
        "",
        "GC: `default` is Python's cyclic garbage collector as it comes; `frozen` calls gc.freeze() once the engine is "
        "built (the model's objects leave the collector's full scans); `disabled` turns the collector off for the "
        "timed steps (a bound, not a setting to ship).",
        "",
        "| GC | rows | driver ms/step | us/row | " + " | ".join(stages) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(stages),
    ]
    for r in rows:
        cells = " | ".join(f"{r['stage_ms_per_step'].get(s, 0.0):.2f}" for s in stages)
        lines.append(f"| {r['gc']} | {r['batch']} | {r['driver_ms_per_step']:.2f} | {r['us_per_row']:.1f} | {cells} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
