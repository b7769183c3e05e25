"""CDSP planner latency (C++ core and Python reference) next to Tetris Table 2.

For max SP 8, 16, 32, 64, 128 (nodes of 8 instances, as many nodes as max SP needs) the planner plans 1000
requests with random lengths and queue states, in two regimes:

- iid: lengths log-uniform in [4k, 256k] (Table 1's range), every instance's queue time uniform in [0, 5] s;
- loaded: queue states snapshotted at arrivals of a simulated prefill tier (Poisson arrivals at ~70% of the
  pool's capacity, same lengths, every request planned and committed by the planner itself), so groups that
  finish together share queue times as in a real cluster.

Latency model: the DeepSeek-V3 / H200 profile (ring + Ulysses modes, a first-principles model, so the plans are
model outputs) with improvement rate 0.3. A third regime, iid-a100, uses the A100 LLaMA3-8B profile fitted to Tetris
Table 1 (the paper's own setting; it only has SP <= 16, so max SP 8 and 16) with queue times uniform in [0, 1] s.

The C++ time is measured inside the core around each plan call (min of 5 repeats per request to filter preemption
on the shared machine); the Python reference is timed on the first `--python-plans` requests of each set, whose
plans are also checked to be identical.

Run: python -m nanocp.bench.bench_cdsp_planner  (writes bench/results/cdsp_planner.{json,md})
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np

from nanocp.prefill.improvement_rate import poisson_arrivals
from nanocp.prefill.latency_model import load_profile, profile_path
from nanocp.prefill.planner import CdspPlanner, CoreCdspPlanner, PlannerConfig

RESULTS = Path(__file__).resolve().parent / "results"
PAPER_TABLE2_US = {8: (22.8, 52.5), 16: (25.8, 86.8), 32: (22.9, 53.4), 64: (24.9, 45.1), 128: (30.6, 73.7)}
GOAL_US = (30.0, 90.0)  # average, maximum
PROFILE, A100_PROFILE = "h200-deepseek-v3", "a100-llama3-8b"
MIN_LEN, MAX_LEN, MAX_QUEUE_S, A100_MAX_QUEUE_S = 4096, 262144, 5.0, 1.0


def random_lengths(rng: random.Random, count: int) -> list[int]:
    return [int(2 ** rng.uniform(np.log2(MIN_LEN), np.log2(MAX_LEN))) for _ in range(count)]


def iid_states(config: PlannerConfig, count: int, seed: int, max_queue: float) -> tuple[list[int], list[list[float]]]:
    rng = random.Random(seed)
    lengths = random_lengths(rng, count)
    return lengths, [[rng.uniform(0.0, max_queue) for _ in range(config.num_instances)] for _ in lengths]


def loaded_states(
    models, config: PlannerConfig, count: int, seed: int, load: float = 0.7
) -> tuple[list[int], list[list[float]]]:
    """Queue states seen by arriving requests in a simulated prefill tier at `load` x its capacity."""
    rng = random.Random(seed)
    warmup = count // 2
    lengths = random_lengths(rng, count + warmup)
    # capacity estimate: every request on 8 instances (the mid-size SP group)
    sp = min(8, config.num_instances)
    work = statistics.mean(min(m.latency(sp, 0, n) for m in models) * sp for n in lengths)
    arrivals = poisson_arrivals(load * config.num_instances / work, len(lengths), rng)
    planner = CoreCdspPlanner(models, config)
    busy_until = [0.0] * config.num_instances
    states = []
    for now, length in zip(arrivals, lengths):
        queue = [max(0.0, t - now) for t in busy_until]
        states.append(queue)
        for instance, q in planner.plan(length, queue).queue_updates.items():
            busy_until[instance] = now + q
    return lengths[warmup:], states[warmup:]


def time_core(planner: CoreCdspPlanner, lengths: list[int], states: list[list[float]], repeats: int) -> np.ndarray:
    flat = [q for state in states for q in state]
    runs = np.array([planner.core.benchmark(lengths, flat) for _ in range(repeats)])  # [repeats, count] ns
    return runs.min(axis=0) / 1e3  # us


def time_python(planner, lengths: list[int], states: list[list[float]]) -> tuple[np.ndarray, list]:
    times, plans = [], []
    for length, state in zip(lengths, states):
        t0 = time.perf_counter()
        plans.append(planner.plan(length, state))
        times.append((time.perf_counter() - t0) * 1e6)
    return np.array(times), plans


def same_plan(a, b) -> bool:
    key = lambda p: [(c.tokens, c.instances, c.attention) for c in p.chunks]
    return key(a) == key(b) and abs(a.ttft - b.ttft) <= 1e-9 * abs(b.ttft)


def bench_one(max_sp: int, regime: str, count: int, python_plans: int, repeats: int, seed: int) -> dict:
    config = PlannerConfig(num_nodes=max(1, max_sp // 8), instances_per_node=8, max_sp=max_sp, improvement_rate=0.3)
    models = load_profile(profile_path(A100_PROFILE if regime == "iid-a100" else PROFILE))
    if regime == "iid":
        lengths, states = iid_states(config, count, seed, MAX_QUEUE_S)
    elif regime == "iid-a100":
        lengths, states = iid_states(config, count, seed, A100_MAX_QUEUE_S)
    else:
        lengths, states = loaded_states(models, config, count, seed)
    core = CoreCdspPlanner(models, config)
    core_us = time_core(core, lengths, states, repeats)
    wrapper_us, core_plans = time_python(core, lengths[:python_plans], states[:python_plans])
    python_us, python_plans_out = time_python(
        CdspPlanner(models, config), lengths[:python_plans], states[:python_plans]
    )
    identical = all(same_plan(a, b) for a, b in zip(core_plans, python_plans_out))
    chunks = [len(p.chunks) for p in core_plans]
    slowest = int(core_us.argmax())
    slowest_plan = core.plan(lengths[slowest], states[slowest])
    return {
        "max_sp": max_sp,
        "regime": regime,
        "instances": config.num_instances,
        "plans": count,
        "core_avg_us": float(core_us.mean()),
        "core_p50_us": float(np.median(core_us)),
        "core_p99_us": float(np.percentile(core_us, 99)),
        "core_max_us": float(core_us.max()),
        "core_via_python_avg_us": float(wrapper_us.mean()),
        "python_avg_us": float(python_us.mean()),
        "python_over_core": float(python_us.mean() / core_us[:python_plans].mean()),
        "python_plans": python_plans,
        "plans_identical": identical,
        "mean_chunks": float(np.mean(chunks)),
        "slowest_length": lengths[slowest],
        "slowest_chunks": len(slowest_plan.chunks),
        "paper_avg_us": PAPER_TABLE2_US[max_sp][0],
        "paper_max_us": PAPER_TABLE2_US[max_sp][1],
    }


def goal_met(row: dict) -> bool:
    return row["core_avg_us"] <= GOAL_US[0] and row["core_max_us"] <= GOAL_US[1]


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# CDSP planner latency (Tetris Algorithms 1-3)",
        "",
        f"{meta['description']}",
        "",
        "| max SP | regime | C++ avg / p99 / max (us) | Tetris Table 2 avg / max (us) | goal avg<=30, max<=90 "
        "| C++ via Python avg (us) | Python avg (us) | Python / C++ | mean chunks | slowest: tokens, chunks "
        "| plans identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = goal_met(r)
        lines.append(
            f"| {r['max_sp']} | {r['regime']} | {r['core_avg_us']:.1f} / {r['core_p99_us']:.1f} / "
            f"{r['core_max_us']:.1f} | {r['paper_avg_us']} / {r['paper_max_us']} | {'met' if ok else 'missed'} "
            f"| {r['core_via_python_avg_us']:.1f} | {r['python_avg_us']:.0f} | {r['python_over_core']:.0f}x "
            f"| {r['mean_chunks']:.2f} | {r['slowest_length']}, {r['slowest_chunks']} "
            f"| {r['plans_identical']} ({r['python_plans']}) |"
        )
    missed = [f"{r['max_sp']} {r['regime']}" for r in rows if not goal_met(r)]
    lines += [
        "",
        f"Goal missed at (max SP, regime): {', '.join(missed) if missed else 'none'}. The search is the exact "
        "Algorithm 1 (every (s_current, s_next) pair, no limit on depth or candidates): the C++ core only skips "
        "what provably cannot beat the best plan found (node-aware ready times of the groups GetGroup can build, an "
        "instance-second capacity bound on the work before the last chunk, the child's own single-chunk TTFT, pairs "
        "whose child is a subset of an earlier pair's, repeated sub-problems), so its plans are those of the "
        "unpruned search: 'plans identical' compares them with the Python reference, whose pruning is tested "
        "against its unpruned search. The slowest requests are long prompts on big, unevenly loaded pools (whose "
        "best plans have several chunks). The paper does not state its length or queue distributions, so its "
        "Table 2 is a reference point, not the same experiment. All latencies are planner CPU time; the plans come "
        "from latency models (model outputs), not from GPUs. This shared VM runs the same binary up to ~1.5x "
        "slower at times (other tenants), which min-of-repeats does not remove, so tails differ between runs.",
        "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}`.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    load_start = os.getloadavg()[0]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=1000)
    parser.add_argument("--python-plans", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-sp", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--out", type=Path, default=RESULTS / "cdsp_planner")
    args = parser.parse_args()
    rows = []
    for regime in ("iid", "loaded", "iid-a100"):
        for max_sp in args.max_sp:
            if regime == "iid-a100" and max_sp > 16:
                continue
            row = bench_one(max_sp, regime, args.plans, args.python_plans, args.repeats, args.seed)
            rows.append(row)
            print(
                f"max SP {max_sp:4d} {regime:6s}: C++ avg {row['core_avg_us']:7.1f} us, max {row['core_max_us']:8.1f} "
                f"us; Python {row['python_over_core']:.0f}x; identical {row['plans_identical']}"
            )
    meta = {
        "description": "Planning latency of the CDSP planner per request; latency profile "
        f"{PROFILE} (model output), improvement rate 0.3, nodes of 8 instances; lengths log-uniform "
        f"{MIN_LEN}..{MAX_LEN}; iid = queue times uniform [0, {MAX_QUEUE_S}] s per instance, loaded = queue "
        f"states from a simulated tier at ~70% load; iid-a100 = profile {A100_PROFILE}, queue times uniform "
        f"[0, {A100_MAX_QUEUE_S}] s. C++ timed inside the core, min of "
        f"{args.repeats} repeats per request; Python timed on the first {args.python_plans} requests.",
        "machine": f"{platform.processor() or platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, shared 2-core CPU, load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end",
        "command": "python -m nanocp.bench.bench_cdsp_planner",
        "goal_us": {"avg": GOAL_US[0], "max": GOAL_US[1]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, meta))


if __name__ == "__main__":
    main()
