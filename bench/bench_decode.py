"""Decode throughput of `nanocp.LLM` on the tiny model against HF transformers `generate`, same weights, same machine.

    python -m nanocp.bench.bench_decode [--batches 1 16 64] [--new-tokens 32]

Both sides run greedy decoding of the same random 32-token prompts, one after the other in the same process, and
report generated tokens per second (prefill included on both sides). The headline is the default cluster (4 decode
instances, inline backend); `--extra N[:backend] ...` adds clearly labelled rows for other configurations (by
default 1 inline instance, and 2 instances on the processes backend: one process per core of a 2-core machine), each
interleaved with its own HF runs. The machine's load average is recorded before and after (the machine is shared).
A timed nanocp run with the per-phase timing log on writes the per-instance phase breakdown
(bench/results/decode_tiny_timing.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from nanocp import LLM, SamplingParams
from nanocp.models import ModelConfig, save_tiny_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("inline", "threads", "processes")


def prompts_for(batch: int, length: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(length)] for _ in range(batch)]


def nanocp_tokens_per_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def hf_tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


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


def parse_config(spec: str, default_backend: str) -> tuple[int, str]:
    """ "N" or "N:backend" -> (decode instances, backend)."""
    count, _, backend = spec.partition(":")
    backend = backend or default_backend
    if not count.isdigit() or int(count) < 1 or backend not in BACKENDS:
        raise argparse.ArgumentTypeError(f"bad configuration {spec!r}: expected N or N:backend, backend in {BACKENDS}")
    return int(count), backend


def compare(hf, args, decode_instances: int, backend: str) -> list[dict]:
    """Per batch: median tokens/s of nanocp (`decode_instances` on `backend`) and HF over interleaved repeats."""
    rows = []
    with LLM("tiny", decode_instances=decode_instances, backend=backend) as llm:
        llm.generate(prompts_for(2, 8, 0), SamplingParams(max_tokens=2))  # warm up both sides
        hf_tokens_per_s(hf, prompts_for(2, 8, 0), 2)
        for batch in args.batches:
            prompts = prompts_for(batch, args.prompt_len, batch)
            ours, theirs = [], []
            for _ in range(args.repeats):  # interleaved, so machine noise hits both sides alike
                ours.append(nanocp_tokens_per_s(llm, prompts, args.new_tokens))
                theirs.append(hf_tokens_per_s(hf, prompts, args.new_tokens))
            o, t = statistics.median(ours), statistics.median(theirs)
            rows.append({"batch": batch, "nanocp_tok_s": o, "hf_tok_s": t, "ratio": o / t, "runs": [ours, theirs]})
            label = f"{decode_instances} instances ({backend}), batch {batch:3d}"
            print(f"{label}: nanocp {o:8.1f} tok/s  HF {t:8.1f} tok/s  ratio {o / t:5.2f}x")
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-instances", type=int, default=4)
    ap.add_argument("--backend", default="inline", choices=BACKENDS)
    ap.add_argument(
        "--extra",
        nargs="*",
        default=["1", "2:processes"],
        help="extra rows: other configurations, N or N:backend (default: 1 instance; 2 processes, one per core)",
    )
    ap.add_argument("--out", default=str(RESULTS / "decode_tiny"))
    args = ap.parse_args(argv)
    from transformers import DeepseekV3ForCausalLM

    with tempfile.TemporaryDirectory() as ckpt:
        save_tiny_checkpoint(ckpt, ModelConfig.tiny())
        hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    load_before = os.getloadavg()
    rows = compare(hf, args, args.decode_instances, args.backend)
    configs = [parse_config(spec, args.backend) for spec in args.extra]
    extra = {c: compare(hf, args, *c) for c in configs if c != (args.decode_instances, args.backend)}
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
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "settings": vars(args),
        "rows": rows,
        "extra_rows": {f"{n} decode instances, {b} backend": r for (n, b), r in extra.items()},
        "load_average_1_5_15min": {"before": load_before, "after": load_after},
        "phase_seconds_per_iteration_batch16": phase_breakdown(records),
        "goal": "ratio >= 3 at batch 64",
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Decode throughput: nanocp.LLM vs HF transformers generate (tiny model, CPU)",
        "",
        f"Command: `python -m nanocp.bench.bench_decode` ({args.decode_instances} decode instances, "
        f"{args.backend} backend, "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy, median of {args.repeats} interleaved "
        "runs). Measured on this machine, not a model output.",
        "",
        "| batch | nanocp tok/s | HF tok/s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['batch']} | {r['nanocp_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f}x |" for r in rows]
    for (n, backend), extra_rows in extra.items():
        lines += [
            "",
            f"Extra configuration, not the headline: {n} decode instance{'s' if n > 1 else ''} "
            f"({backend} backend), interleaved with its own HF runs:",
            "",
            "| batch | nanocp tok/s | HF tok/s | ratio |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['batch']} | {r['nanocp_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f}x |" for r in extra_rows
        ]
    lines += [
        "",
        f"Machine load average (1/5/15 min): before {', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)} (2 cores, shared with other work).",
    ]
    lines += ["", "Per-phase seconds per iteration, batch 16 (instance: phase=seconds):", ""]
    for inst, phases in result["phase_seconds_per_iteration_batch16"].items():
        lines.append(f"- instance {inst}: " + ", ".join(f"{p}={s * 1e3:.2f} ms" for p, s in phases.items()))
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
