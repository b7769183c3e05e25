"""Run the benchmarks of the README's table one after the other (`make bench`); each writes its own results under
bench/results/.

    python -m nanocp.bench.run_all [--only NAME ...] [--skip NAME ...] [--list]

The serving benchmark is not included: it needs a running server (`nanocp serve`, then `nanocp bench serve`).
Stops at the first benchmark that fails and names it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from .bench_decode import RESULTS

PY = [sys.executable, "-m"]
BENCHMARKS: dict[str, list[list[str]]] = {  # name -> commands, run in order
    "scheduler": [PY + ["nanocp.bench.bench_scheduler"]],
    "decode": [PY + ["nanocp.bench.bench_decode"]],
    "arrivals": [PY + ["nanocp.bench.bench_arrivals"]],
    "driver": [PY + ["nanocp.bench.bench_driver"]],
    "driver_policy": [PY + ["nanocp.bench.bench_driver_policy"]],
    "cpu_kernels": [PY + ["nanocp.bench.bench_cpu_kernels"]],
    "metadata_channel": [PY + ["nanocp.bench.bench_metadata_channel"]],
    "cdsp_planner": [PY + ["nanocp.bench.bench_cdsp_planner"]],
    "fidelity": [PY + ["nanocp.cli", "profile", "decode"], PY + ["nanocp.cli", "profile", "fidelity"]],
    "sim": [PY + ["nanocp.cli", "sim", "all"]],
    "prefill_sim": [PY + ["nanocp.cli", "prefill-sim"]],
    "graphs_pool": [PY + ["nanocp.data_plane.graph_runner", str(RESULTS / "graphs_pool_deepseek_v3")]],
    "reliability": [PY + ["nanocp.bench.reliability"]],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    ap.add_argument("--skip", nargs="+", choices=sorted(BENCHMARKS), default=[], help="leave these out")
    ap.add_argument("--list", action="store_true", help="print the benchmarks and their commands, run nothing")
    args = ap.parse_args(argv)
    chosen = [name for name in (args.only or BENCHMARKS) if name not in args.skip]
    for name in chosen:
        for cmd in BENCHMARKS[name]:
            if args.list:
                print(f"{name}: {' '.join(cmd[1:])}")
                continue
            print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
            start = time.monotonic()
            code = subprocess.call(cmd)
            if code != 0:
                print(f"benchmark {name!r} failed (exit code {code}): {' '.join(cmd[1:])}", file=sys.stderr)
                return code
            print(f"== {name}: done in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
