"""Decode under continuous arrivals: admitting plans overlapped with the iteration in flight vs always waiting.

    python -m nanocp.bench.bench_arrivals [--rates 20 100] [--requests 200] [--rounds 4]

Requests arrive as a Poisson process (seeded) while others decode, so many plans admit. Two engines of the same
configuration (2 decode instances, processes backend, overlapped iterations) replay the same arrivals through
`Engine.step`, alternating run by run: one with `overlap_admissions=True` (the default: an admitting plan is sent
before the iteration in flight returns unless a page it got may still be touched by that iteration; then its
prefill is computed while that iteration runs and written after it), one with `overlap_admissions=False` (every
admitting plan waits for the iteration in flight before its prefill). Both must produce the same
tokens (greedy); the benchmark checks it. Reported per rate: output tokens/s over the replay's wall time, median
time per output token (TPOT) and time to first token (TTFT) over the requests, and how many admitting plans made
with an iteration in flight were overlapped. Measured on this machine, not a model output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from nanocp import SamplingParams
from nanocp.engine import Engine, EngineConfig

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Arrival:
    at: float  # seconds after the replay starts
    prompt: list[int]
    max_tokens: int


@dataclass
class Replay:
    tokens_per_s: float
    tpot_ms: float  # median over requests with more than one token
    ttft_ms: float  # median over requests
    admissions_in_flight: int
    overlapped_admissions: int
    early_prefills: int  # admitting plans that waited, their prefill computed while the iteration in flight ran
    tokens: dict[str, list[int]]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[Arrival]:
    """n requests at `rate` per second; prompts of 16-128 random byte tokens, 16-64 new tokens."""
    rnd = random.Random(seed)
    at, out = 0.0, []
    for _ in range(n):
        at += rnd.expovariate(rate)
        prompt = [rnd.randrange(256) for _ in range(rnd.randint(16, 128))]
        out.append(Arrival(at, prompt, rnd.randint(16, 64)))
    return out


def replay(eng: Engine, arrivals: list[Arrival]) -> Replay:
    """Add each request at its arrival time, step while anything is unfinished."""
    counters = eng.admissions_in_flight, eng.overlapped_admissions, eng.early_prefills
    start = time.perf_counter()
    outs, next_arrival = {}, 0
    while next_arrival < len(arrivals) or eng.has_unfinished():
        now = time.perf_counter() - start
        while next_arrival < len(arrivals) and arrivals[next_arrival].at <= now:
            a = arrivals[next_arrival]
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            eng.add_request(f"a{next_arrival}", a.prompt, params)
            next_arrival += 1
        if not eng.has_unfinished():
            time.sleep(min(0.001, max(0.0, arrivals[next_arrival].at - now)))
            continue
        for out in eng.step():
            outs[out.request_id] = out
            eng.release(out.request_id)
    elapsed = time.perf_counter() - start
    tpots = [
        (o.metrics.token_times[-1] - o.metrics.token_times[0]) / (len(o.token_ids) - 1)
        for o in outs.values()
        if len(o.token_ids) > 1
    ]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs.values()]
    return Replay(
        sum(len(o.token_ids) for o in outs.values()) / elapsed,
        statistics.median(tpots) * 1e3,
        statistics.median(ttfts) * 1e3,
        eng.admissions_in_flight - counters[0],
        eng.overlapped_admissions - counters[1],
        eng.early_prefills - counters[2],
        {rid: o.token_ids for rid, o in outs.items()},
    )


def compare(engines: dict[bool, Engine], rate: float, requests: int, rounds: int) -> dict:
    """Both engines over the same arrivals, round by round (who goes first alternates)."""
    runs: dict[bool, list[Replay]] = {True: [], False: []}
    for r in range(rounds):
        arrivals = poisson_arrivals(requests, rate, seed=r)
        order = (True, False) if r % 2 == 0 else (False, True)
        for overlap in order:
            runs[overlap].append(replay(engines[overlap], arrivals))
        if runs[True][-1].tokens != runs[False][-1].tokens:
            raise AssertionError(f"rate {rate}, round {r}: the two engines produced different tokens")
    row = {"rate_per_s": rate}
    for overlap, name in ((True, "overlap_admissions"), (False, "admissions_wait")):
        rs = runs[overlap]
        row[name] = {
            "tokens_per_s": statistics.median(x.tokens_per_s for x in rs),
            "tpot_ms": statistics.median(x.tpot_ms for x in rs),
            "ttft_ms": statistics.median(x.ttft_ms for x in rs),
            "admissions_in_flight": sum(x.admissions_in_flight for x in rs),
            "overlapped_admissions": sum(x.overlapped_admissions for x in rs),
            "early_prefills": sum(x.early_prefills for x in rs),
            "tokens_per_s_runs": [x.tokens_per_s for x in rs],
        }
    row["rounds_faster_with_overlap"] = sum(a.tokens_per_s > b.tokens_per_s for a, b in zip(runs[True], runs[False]))
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[20.0, 100.0], help="arrivals per second")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "arrivals_tiny"))
    args = ap.parse_args(argv)
    engines = {
        overlap: Engine(
            EngineConfig(
                model="tiny", decode_instances=args.decode_instances, backend="processes", overlap_admissions=overlap
            )
        )
        for overlap in (True, False)
    }
    try:
        load_before = os.getloadavg()
        rows = [compare(engines, rate, args.requests, args.rounds) for rate in args.rates]
        load_after = os.getloadavg()
    finally:
        for eng in engines.values():
            eng.close()
    result = {
        "benchmark": "decode under Poisson arrivals, admitting plans overlapped vs waiting, tiny model, CPU",
        "settings": vars(args),
        "rows": rows,
        "load_average_1_5_15min": {"before": load_before, "after": load_after},
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    Path(args.out + ".md").write_text("\n".join(summary(args, rows, load_before, load_after)) + "\n")
    return result


def summary(args, rows: list[dict], load_before, load_after) -> list[str]:
    lines = [
        "# Decode under continuous arrivals: admitting plans overlapped vs waiting (tiny model, CPU)",
        "",
        f"Command: `python -m nanocp.bench.bench_arrivals` ({args.decode_instances} decode instances, processes "
        f"backend, overlapped iterations; {args.requests} Poisson arrivals per run, prompts of 16-128 tokens, 16-64 "
        f"new tokens, greedy; {args.rounds} rounds, the two engines alternating on the same arrivals, medians over "
        "rounds; both produced the same tokens in every round). Measured on this machine, not a model output.",
        "",
        "| arrivals/s | admissions | output tok/s | TPOT p50 ms | TTFT p50 ms | admitting plans overlapped | "
        "of the others, prefill computed in flight | rounds faster |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for key, label in (("overlap_admissions", "overlapped when safe"), ("admissions_wait", "always wait")):
            r = row[key]
            faster = f"{row['rounds_faster_with_overlap']}/{args.rounds}" if key == "overlap_admissions" else ""
            lines.append(
                f"| {row['rate_per_s']:g} | {label} | {r['tokens_per_s']:.0f} | {r['tpot_ms']:.2f} | "
                f"{r['ttft_ms']:.1f} | {r['overlapped_admissions']} of {r['admissions_in_flight']} | "
                f"{r['early_prefills']} | {faster} |"
            )
    lines += [
        "",
        f"Machine load average (1/5/15 min): before {', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (2 cores, shared with other work).",
    ]
    return lines


if __name__ == "__main__":
    main()
