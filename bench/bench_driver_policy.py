"""The driver thread as SCHED_BATCH vs as normal while it drives instance processes, paired in one process.

    python -m nanocp.bench.bench_driver_policy [--batches 16 64] [--rounds 10]

Two `LLM`s of the same configuration (2 decode instances, processes backend, overlapped iterations), one with
`driver_sched_batch=True` (the default) and one with it off, run the same greedy batch alternately, `rounds` times
per batch size (the other LLM's instances sit idle meanwhile); both must produce the same tokens. Reported per batch:
median decode tokens/s of each (tokens after the first over the time after the last first token, as bench_decode),
their ratio and in how many of the alternating pairs the batch policy was faster. Measured on this machine, not a
model output. Writes bench/results/driver_policy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from nanocp import LLM, SamplingParams

from .bench_decode import RESULTS, nanocp_rates, prompts_for

MODES = {"batch": True, "normal": False}  # label -> driver_sched_batch


def run(batches: list[int], rounds: int, new_tokens: int) -> dict:
    llms = {
        label: LLM("tiny", decode_instances=2, backend="processes", driver_sched_batch=on)
        for label, on in MODES.items()
    }
    try:
        rows = []
        for batch in batches:
            prompts = prompts_for(batch, 32, batch)
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            tokens = {label: [o.token_ids for o in llm.generate(prompts, params)] for label, llm in llms.items()}
            if tokens["batch"] != tokens["normal"]:
                raise AssertionError(f"batch {batch}: the two policies produced different tokens")
            rates: dict[str, list[float]] = {label: [] for label in MODES}
            for _ in range(rounds):
                for label, llm in llms.items():
                    rates[label].append(nanocp_rates(llm, prompts, new_tokens).decode)
            med = {label: statistics.median(r) for label, r in rates.items()}
            wins = sum(b > n for b, n in zip(rates["batch"], rates["normal"]))
            rows.append(
                {
                    "batch": batch,
                    "decode_tok_s": rates,
                    "median": med,
                    "ratio": med["batch"] / med["normal"],
                    "pairs_won": wins,
                }
            )
            print(
                f"batch {batch:3d}: SCHED_BATCH driver {med['batch']:8.1f} vs normal {med['normal']:8.1f} tok/s "
                f"({med['batch'] / med['normal']:.2f}x, {wins} of {rounds} pairs faster)"
            )
        return {"rows": rows}
    finally:
        for llm in llms.values():
            llm.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "driver_policy"))
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    result = run(args.batches, args.rounds, args.new_tokens)
    result.update(
        benchmark="driver thread SCHED_BATCH vs normal, 2 instance processes, paired",
        settings=vars(args),
        load_average_before_after=[load_before, os.getloadavg()],
        cpus=os.cpu_count(),
    )
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Driver thread as SCHED_BATCH vs normal (tiny model, 2 decode instance processes, CPU)",
        "",
        "Command: `python -m nanocp.bench.bench_driver_policy`. Two `LLM`s (2 instances, processes backend, "
        f"overlapped iterations), `driver_sched_batch` on and off, the same greedy batch alternately, {args.rounds} "
        "rounds; the same tokens checked. Decode tokens/s as in bench_decode, median over the rounds. Measured on "
        f"this machine ({os.cpu_count()} vCPUs, shared), not a model output.",
        "",
        "| batch | SCHED_BATCH driver tok/s | normal driver tok/s | ratio | pairs faster |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        m = row["median"]
        lines.append(
            f"| {row['batch']} | {m['batch']:.1f} | {m['normal']:.1f} | **{row['ratio']:.2f}x** | "
            f"{row['pairs_won']} of {args.rounds} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
