"""Decode throughput of `nanocp.LLM` on the tiny model against HF transformers `generate`, same weights, same machine.

    python -m nanocp.bench.bench_decode [--batches 1 16 64] [--new-tokens 32]

Both sides run greedy decoding of the same random 32-token prompts, one after the other in the same process, and
report two rates:
- decode tokens/s (the goal's metric): tokens after each request's first, over the time from the moment every
  request has its first token to the end (nanocp: the requests' token timestamps; HF: a logits processor stamps
  each step, the first stamp ends the prefill);
- end-to-end tokens/s: all generated tokens over the whole call (prefill included on both sides).
Each configuration is compared with HF given the same CPU cores: torch threads = the cores the configuration keeps
busy (1 for the inline backend, min(instances + 1, cores) for processes, whose driver plans iteration t + 1 while
the instances run t and prefills with that many threads while they wait). The headline is 2 instances on the
processes backend (one instance per core, the DP-EP deployment shape of a 2-core machine); `--extra
N[:backend[:num_steps[:sequential]]] ...` adds labelled rows for other configurations (by default the headline
one iteration at a time and with 4 decode steps per iteration, and 4 and 1 inline instances), each interleaved with
its own HF runs. The machine's load average is recorded before and after (the machine is shared). A timed nanocp
run with the per-phase timing log on writes the per-instance phase breakdown
(bench/results/decode_tiny_timing.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from nanocp import LLM, SamplingParams
from nanocp.models import ModelConfig, save_tiny_checkpoint

from .machine import describe, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("inline", "threads", "processes")


@dataclass
class Rates:
    decode: float  # tokens after the first per request / seconds after the last first token
    end_to_end: float  # all generated tokens / seconds of the whole call


def prompts_for(batch: int, length: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(length)] for _ in range(batch)]


def cores_used(decode_instances: int, backend: str, overlap: bool = True) -> int:
    """CPU cores a configuration keeps busy: what HF gets as torch threads in its comparison. With overlapped
    iterations (processes backend) the driver plans while the instances run: it counts as one more."""
    if backend == "inline":
        return 1
    return min(decode_instances + (overlap and backend == "processes"), os.cpu_count() or 1)


def nanocp_rates(llm: LLM, prompts: list[list[int]], new_tokens: int) -> Rates:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    prefilled = max(o.metrics.token_times[0] for o in outs)
    last = max(o.metrics.token_times[-1] for o in outs)
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return Rates(decoded / (last - prefilled), sum(len(o.token_ids) for o in outs) / elapsed)


class _StepClock:
    """A logits processor that only stamps the time of each generation step (the first: the prefill is done)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def hf_rates(model, prompts: list[list[int]], new_tokens: int) -> Rates:
    from transformers import LogitsProcessorList

    ids = torch.tensor(prompts)
    clock = _StepClock()
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
        end = time.perf_counter()
    generated = out.shape[1] - ids.shape[1]
    return Rates((generated - 1) * ids.shape[0] / (end - clock.stamps[0]), generated * ids.shape[0] / (end - start))


def phase_breakdown(records) -> dict:
    """Mean seconds per iteration of each phase, per instance."""
    per = defaultdict(lambda: defaultdict(float))
    iterations = defaultdict(set)
    for r in records:
        per[r.instance][r.phase] += r.seconds
        iterations[r.instance].add(r.iteration)
    return {
        inst: {phase: total / max(1, len(iterations[inst])) for phase, total in sorted(phases.items())}
        for inst, phases in sorted(per.items())
    }


@dataclass(frozen=True)
class Config:
    decode_instances: int
    backend: str
    num_steps: int = 1  # decode steps per iteration (EngineConfig.num_steps)
    overlap: bool = True  # EngineConfig.overlap (overlapped iterations, processes backend)

    def describe(self) -> str:
        n = self.decode_instances
        steps = f", {self.num_steps} decode steps per iteration" if self.num_steps > 1 else ""
        sequential = ", one iteration at a time" if not self.overlap and self.backend == "processes" else ""
        return f"{n} decode instance{'s' if n > 1 else ''} ({self.backend} backend{steps}{sequential})"


SPEC = "N, N:backend, N:backend:num_steps or N:backend:num_steps:sequential"


def parse_config(spec: str, default_backend: str) -> Config:
    """ "N", "N:backend", "N:backend:num_steps" or "N:backend:num_steps:sequential" (overlap off) -> the
    configuration."""
    count, _, rest = spec.partition(":")
    backend, _, rest = rest.partition(":")
    steps, _, mode = rest.partition(":")
    backend = backend or default_backend
    steps = steps or "1"
    bad_count = not count.isdigit() or int(count) < 1
    bad_steps = not steps.isdigit() or int(steps) < 1
    if bad_count or backend not in BACKENDS or bad_steps or mode not in ("", "sequential"):
        raise argparse.ArgumentTypeError(f"bad configuration {spec!r}: expected {SPEC}, backend in {BACKENDS}")
    return Config(int(count), backend, int(steps), overlap=mode != "sequential")


def compare(hf, args, config: Config) -> list[dict]:
    """Per batch: median rates of nanocp in `config` and of HF on the same cores, over interleaved repeats."""
    cores = cores_used(config.decode_instances, config.backend, config.overlap)
    rows = []
    with LLM(
        "tiny",
        decode_instances=config.decode_instances,
        backend=config.backend,
        num_steps=config.num_steps,
        overlap=config.overlap,
        torch_threads=cores,
    ) as llm:
        # the engine set this process's torch threads to `cores`: HF runs with as many
        llm.generate(prompts_for(2, 8, 0), SamplingParams(max_tokens=2))  # warm up both sides
        hf_rates(hf, prompts_for(2, 8, 0), 2)
        for batch in args.batches:
            prompts = prompts_for(batch, args.prompt_len, batch)
            ours, theirs = [], []
            for _ in range(args.repeats):  # interleaved, so machine noise hits both sides alike
                ours.append(nanocp_rates(llm, prompts, args.new_tokens))
                theirs.append(hf_rates(hf, prompts, args.new_tokens))
            row = {"batch": batch, "hf_torch_threads": cores}
            for metric in ("decode", "end_to_end"):
                o = statistics.median(getattr(r, metric) for r in ours)
                t = statistics.median(getattr(r, metric) for r in theirs)
                row[metric] = {"nanocp_tok_s": o, "hf_tok_s": t, "ratio": o / t}
                row[metric]["runs"] = [[getattr(r, metric) for r in ours], [getattr(r, metric) for r in theirs]]
            rows.append(row)
            d, e = row["decode"], row["end_to_end"]
            print(
                f"{config.describe()}, batch {batch:3d}: decode nanocp {d['nanocp_tok_s']:8.1f} "
                f"HF {d['hf_tok_s']:8.1f} tok/s ({d['ratio']:4.2f}x); end-to-end {e['nanocp_tok_s']:8.1f} "
                f"vs {e['hf_tok_s']:8.1f} ({e['ratio']:4.2f}x)"
            )
    return rows


def threads(n: int) -> str:
    return f"{n} torch thread{'s' if n > 1 else ''}"


def pair_ratios(metric: dict) -> list[float]:
    """nanocp / HF of each interleaved pair of runs."""
    ours, theirs = metric["runs"]
    return [o / t for o, t in zip(ours, theirs)]


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| batch | decode: nanocp tok/s | HF tok/s | ratio | pairs: min-max | end-to-end: nanocp tok/s | HF tok/s "
        "| ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d, e = r["decode"], r["end_to_end"]
        pairs = pair_ratios(d)
        lines.append(
            f"| {r['batch']} | {d['nanocp_tok_s']:.1f} | {d['hf_tok_s']:.1f} | **{d['ratio']:.2f}x** | "
            f"{min(pairs):.2f}-{max(pairs):.2f}x | {e['nanocp_tok_s']:.1f} | {e['hf_tok_s']:.1f} | {e['ratio']:.2f}x |"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--backend", default="processes", choices=BACKENDS)
    ap.add_argument(
        "--extra",
        nargs="*",
        default=["2:processes:1:sequential", "2:processes:4", "4:inline", "1:inline"],
        help=f"extra rows: other configurations, {SPEC} (default: the headline one iteration at a time, and with 4 "
        "decode steps per iteration; 4 and 1 instances, inline backend)",
    )
    ap.add_argument("--out", default=str(RESULTS / "decode_tiny"))
    args = ap.parse_args(argv)
    from transformers import DeepseekV3ForCausalLM

    with tempfile.TemporaryDirectory() as ckpt:
        save_tiny_checkpoint(ckpt, ModelConfig.tiny())
        hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    load_before = os.getloadavg()
    headline = Config(args.decode_instances, args.backend)
    rows = compare(hf, args, headline)
    configs = [parse_config(spec, args.backend) for spec in args.extra]
    extra = {c: compare(hf, args, c) for c in configs if c != headline}
    load_after = os.getloadavg()
    with LLM("tiny", decode_instances=args.decode_instances, backend=args.backend, timing=True) as llm:
        llm.generate(prompts_for(16, args.prompt_len, 7), SamplingParams(max_tokens=8, temperature=0.0))
        records = llm.engine.timing_records()
    timing_path = Path(args.out + "_timing.jsonl")
    timing_path.unlink(missing_ok=True)
    from nanocp.data_plane.timing import TimingLog

    TimingLog(records=list(records)).dump(timing_path)  # dump() empties the list it is given
    result = {
        "benchmark": "decode throughput, tiny model, CPU",
        "machine": machine_info(),
        "settings": vars(args),
        "rows": rows,
        "extra_rows": {c.describe(): r for c, r in extra.items()},
        "load_average_1_5_15min": {"before": load_before, "after": load_after},
        "phase_seconds_per_iteration_batch16": phase_breakdown(records),
        "goal": "decode ratio >= 3 at batch 64",
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Decode throughput: nanocp.LLM vs HF transformers generate (tiny model, CPU)",
        "",
        f"Command: `python -m nanocp.bench.bench_decode` ({args.decode_instances} decode instances, "
        f"{args.backend} backend{', overlapped iterations' if args.backend == 'processes' else ''}, "
        f"HF with {threads(cores_used(args.decode_instances, args.backend))}; "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, median of {args.repeats} interleaved "
        "runs; the pairs column is the spread of the ratio over the interleaved pairs). Measured on this machine, "
        "not a model output. Decode tokens/s counts the tokens after each "
        "request's first over the time after the last first token; end-to-end counts every token over the whole "
        "call, prefill included.",
        "",
        *table(rows),
    ]
    for c, extra_rows in extra.items():
        lines += [
            "",
            f"Extra configuration, not the headline: {c.describe()}, "
            f"HF with {threads(cores_used(c.decode_instances, c.backend, c.overlap))}, "
            "interleaved with its own HF runs:",
            "",
            *table(extra_rows),
        ]
    lines += [
        "",
        f"Machine load average (1/5/15 min): before {', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (2 cores, shared with other work).",
        "",
        describe(result["machine"]),
    ]
    lines += ["", "Per-phase seconds per iteration, batch 16 (instance: phase=seconds):", ""]
    for inst, phases in result["phase_seconds_per_iteration_batch16"].items():
        lines.append(f"- instance {inst}: " + ", ".join(f"{p}={s * 1e3:.2f} ms" for p, s in phases.items()))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
