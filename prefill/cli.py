"""Prefill-tier subcommands: `nanocp prefill-sim` (the simulated CDSP experiments) and `nanocp profile prefill`
(measure the CPU SP prefill path and fit Eq. 1). Heavy imports happen only when a command runs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def cmd_prefill_sim(args: argparse.Namespace) -> int:
    from .experiments import ARMS, ExperimentConfig, run_experiments, write_results

    known = [a.name for a in ARMS]
    arms = tuple(args.arms) if args.arms else tuple(known)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"unknown arms {unknown}; choose from {known}")
    config = ExperimentConfig(
        profiles=tuple(args.profiles),
        traces=tuple(args.traces),
        requests=args.requests,
        loads=tuple(args.loads),
        slo_scale=args.slo_scale,
        attainment=args.attainment,
        quantum_s=args.lars_quantum,
        seeds=tuple(args.seeds),
        arms=arms,
        rate_objective=args.rate_objective,
    )
    began = time.time()
    results = run_experiments(config, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    for path in write_results(results, config, Path(args.out), time.time() - began):
        print(f"wrote {path}")
    return 0


def cmd_profile_prefill(args: argparse.Namespace) -> int:
    from nanocp.models import load_model

    from .latency_model import PROFILE_DIR
    from .profiling import profile_cpu_prefill, write_report

    out = Path(args.out) if args.out else PROFILE_DIR / "cpu-tiny.json"
    model = load_model(args.model)
    models = profile_cpu_prefill(
        model,
        out,
        sp_sizes=args.sp,
        contexts=args.contexts,
        lengths=args.lengths,
        modes=args.modes,
        repeats=args.repeats,
        progress=lambda line: print(line, flush=True),
    )
    print(f"wrote {out}")
    for m in models:
        for sp, q in m.fit_quality.items():
            print(f"{m.attention} sp={sp}: R^2 {q.r2:.4f}, mean rel err {q.mean_rel_err:.1%}, max {q.max_rel_err:.1%}")
    if args.report:
        print(f"wrote {write_report(models, out, Path(args.report))}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from nanocp.cli import command_group

    sim = subparsers.add_parser(
        "prefill-sim", help="simulated prefill-tier experiments: CDSP vs fixed / elastic SP, single-chunk, LARS"
    )
    sim.add_argument("--profiles", nargs="+", default=["a100-llama3-8b", "h200-deepseek-v3"])
    sim.add_argument("--traces", nargs="+", default=["short", "medium", "long"], choices=["short", "medium", "long"])
    sim.add_argument("--requests", type=int, default=1000, help="requests per simulated run")
    sim.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="independent workloads")
    sim.add_argument(
        "--loads", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
        help="arrival rates as fractions of the SP=1 throughput bound",
    )  # fmt: skip
    sim.add_argument("--slo-scale", type=float, default=10.0, help="SLO: TTFT <= scale x idle-pool best TTFT")
    sim.add_argument("--attainment", type=float, default=0.9, help="capacity: fraction of requests within the SLO")
    sim.add_argument("--lars-quantum", type=float, default=1.0, help="longest LARS chunk (s) before preemption")
    sim.add_argument(
        "--rate-objective", default="mean", choices=["mean", "attainment"],
        help="improvement-rate search: lowest mean TTFT (Tetris) or highest SLO attainment",
    )  # fmt: skip
    sim.add_argument("--arms", nargs="+", default=None, help="subset of the compared systems (default: all)")
    sim.add_argument("--jobs", type=int, default=2, help="worker processes")
    sim.add_argument("--out", default=str(RESULTS / "prefill_sim"), help="output prefix (.json, .md, _<profile>.png)")
    sim.set_defaults(func=cmd_prefill_sim)

    profile = command_group(subparsers, "profile", "offline profiling (CP buckets, decode and prefill latency)")
    pf = profile.add_parser("prefill", help="measure the CPU SP prefill path (tiny model) and fit Eq. 1")
    pf.add_argument("--model", default="tiny")
    pf.add_argument("--out", default=None, help="profile JSON (default prefill/profiles/cpu-tiny.json)")
    pf.add_argument("--report", default=str(RESULTS / "prefill_profile_cpu_tiny.md"), help="markdown summary")
    pf.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    pf.add_argument("--contexts", type=int, nargs="+", default=[0, 256, 512, 1024])
    pf.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    pf.add_argument("--modes", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"])
    pf.add_argument("--repeats", type=int, default=3)
    pf.set_defaults(func=cmd_profile_prefill)
