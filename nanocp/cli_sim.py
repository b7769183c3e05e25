"""`nanocp sim ...`, `nanocp breakdown ...` and `nanocp profile ...`: the simulator's experiments, the per-layer
latency breakdown tool and the CPU data plane's profiler / fidelity check. Heavy imports happen inside commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_cluster(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="h200-deepseek-v3", help="latency profile name or path")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--instances-per-node", type=int, default=8)
    p.add_argument("--scheduler-backend", default="cpp", choices=["cpp", "python"])
    p.add_argument("--results-dir", type=Path, default=None, help="default bench/results")


def _cluster(args: argparse.Namespace):
    from nanocp.bench.experiments import ClusterShape

    return ClusterShape(args.nodes, args.instances_per_node, args.profile, args.scheduler_backend)


def _results_dir(args: argparse.Namespace) -> Path:
    from nanocp.bench.simulator import RESULTS_DIR

    return args.results_dir or RESULTS_DIR


def _print_paths(paths) -> None:
    for path in paths:
        print(f"wrote {path}")


# ------------------------------------------------------------------------------------------------ sim


def cmd_sim_micro(args: argparse.Namespace) -> int:
    from nanocp.bench import experiments as ex

    cfg = ex.MicroConfig(
        _cluster(args),
        shorts_per_instance=args.shorts_per_instance,
        short_len=args.short_len,
        long_len=args.long_len,
        longs_per_node=tuple(args.longs),
        shuffle=args.shuffle,
        seed=args.seed,
    )
    result = ex.run_micro(cfg, _csv(args.policies) if args.policies else None)
    _print_paths(ex.write_micro(result, _results_dir(args)))
    return 0


def _capacity_config(args: argparse.Namespace):
    from nanocp.bench import experiments as ex

    cfg = ex.CapacityConfig(_cluster(args), max_runs=args.max_runs, rel_tol=args.rel_tol, seed=args.seed)
    if args.workloads:
        cfg.workloads = tuple(_csv(args.workloads))
    if args.window:
        cfg.window_s = {w: args.window for w in cfg.workloads}
    for w in cfg.workloads:
        if w not in cfg.window_s or w not in cfg.guess_rps:
            if not args.window or not args.guess:
                raise ValueError(f"workload {w!r} has no default window/guess: pass --window and --guess")
            cfg.window_s[w], cfg.guess_rps[w] = args.window, args.guess
    if args.guess:
        cfg.guess_rps = {w: args.guess for w in cfg.workloads}
    return cfg


def cmd_sim_capacity(args: argparse.Namespace) -> int:
    from nanocp.bench import experiments as ex

    result = ex.run_capacity(_capacity_config(args), _csv(args.policies) if args.policies else None)
    _print_paths(ex.write_capacity(result, _results_dir(args)))
    return 0


def _balance_config(args: argparse.Namespace, capacity: dict | None):
    from nanocp.bench import experiments as ex

    low, high = args.low_rate, args.high_rate
    if low is None or high is None:
        nano = _nanocp_capacity(capacity, args.workload)
        if nano is None:
            raise ValueError("give --low-rate and --high-rate, or run `nanocp sim capacity` first")
        low = low if low is not None else args.low_fraction * nano
        high = high if high is not None else nano
    policies = tuple(_csv(args.policies)) if args.policies else ex.BalanceConfig().policies
    return ex.BalanceConfig(_cluster(args), args.workload, low, high, args.window, policies, seed=args.seed)


def _nanocp_capacity(capacity: dict | None, workload: str) -> float | None:
    try:
        rate = capacity["workloads"][workload]["policies"]["nanocp"]["capacity_rps"]
    except (TypeError, KeyError):
        return None
    return rate if rate > 0 else None


def _load_capacity(results_dir: Path) -> dict | None:
    path = results_dir / "sim_capacity.json"
    return json.loads(path.read_text()) if path.is_file() else None


def cmd_sim_balance(args: argparse.Namespace) -> int:
    from nanocp.bench import experiments as ex

    cfg = _balance_config(args, _load_capacity(_results_dir(args)))
    _print_paths(ex.write_balance(ex.run_balance(cfg), _results_dir(args)))
    return 0


def cmd_sim_run(args: argparse.Namespace) -> int:
    from nanocp.bench import experiments as ex
    from nanocp.bench.breakdown import format_table as breakdown_table
    from nanocp.bench.breakdown import from_result
    from nanocp.bench.simulator import write_result

    res = ex.run_single(args.workload, args.rate, args.policy, args.window, _cluster(args), seed=args.seed)
    name = args.name or f"sim_run_{args.policy}_{args.workload}".replace(":", "-")
    paths = write_result(res, name, _results_dir(args))
    data = json.loads(paths[0].read_text())
    data["instance_layer_us"], data["instance_layer_peak_us"] = res.instance_layer_us, res.instance_layer_peak_us
    paths[0].write_text(json.dumps(data, indent=1) + "\n")
    _print_paths(paths)
    print(paths[1].read_text())
    if res.instance_layer_us:
        print(breakdown_table(from_result(data, args.policy)))
    return 0


def cmd_sim_summary(args: argparse.Namespace) -> int:
    from nanocp.bench import experiments as ex

    _print_paths([ex.write_summary(_results_dir(args))])
    return 0


def cmd_sim_all(args: argparse.Namespace) -> int:
    """micro, capacity, balance (NanoCP's capacity on ShareGPT-4 + 1% long sets its rates), summary."""
    from nanocp.bench import experiments as ex

    out, cluster = _results_dir(args), _cluster(args)
    policies = _csv(args.policies) if args.policies else None
    _print_paths(ex.write_micro(ex.run_micro(ex.MicroConfig(cluster, seed=args.seed), policies), out))
    capacity = ex.run_capacity(_capacity_config(args), policies)
    _print_paths(ex.write_capacity(capacity, out))
    nano = _nanocp_capacity(capacity, "mix:0.01")
    if nano is None:
        raise ValueError("no NanoCP capacity for mix:0.01; cannot pick the balance experiment's rates")
    balance = ex.BalanceConfig(cluster, "mix:0.01", 0.3 * nano, nano, 60.0, seed=args.seed)
    _print_paths(ex.write_balance(ex.run_balance(balance), out))
    _print_paths([ex.write_summary(out)])
    return 0


# ------------------------------------------------------------------------------------------------ breakdown


def cmd_breakdown(args: argparse.Namespace) -> int:
    from nanocp.bench.breakdown import format_table, load_breakdowns, plot_breakdowns

    labels = args.label or []
    if labels and len(labels) != len(args.inputs):
        raise ValueError(f"{len(labels)} --label values for {len(args.inputs)} inputs")
    groups = {}
    for i, path in enumerate(args.inputs):
        items = load_breakdowns(path, labels[i] if labels else None)
        for b in items:
            group = b.label.rpartition(": ")[0]
            groups.setdefault(group or Path(path).stem, []).append(b)
    every = [b for items in groups.values() for b in items]
    table = format_table(every)
    print(table)
    if args.md:
        sources = ", ".join(f"`{x}`" for x in args.inputs)
        args.md.write_text(f"# {args.title or 'Per-layer latency breakdown'}\n\nSources: {sources}.\n\n{table}")
        print(f"wrote {args.md}")
    if not args.no_png:
        png = args.png or _default_png(args.inputs[0])
        print(f"wrote {plot_breakdowns(groups, png, args.title or 'Per-layer latency breakdown')}")
    if args.json:
        args.json.write_text(json.dumps({"breakdowns": [b.to_dict() for b in every]}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _default_png(first_input: str) -> Path:
    from nanocp.bench.simulator import RESULTS_DIR

    return RESULTS_DIR / f"breakdown_{Path(first_input).stem}.png"


# ------------------------------------------------------------------------------------------------ profile


def cmd_profile_decode(args: argparse.Namespace) -> int:
    from nanocp.bench import cpu_profile

    sweep = cpu_profile.SweepConfig(
        batch_sizes=tuple(args.batches),
        kv_lens=tuple(args.kv_lens),
        cp_degrees=tuple(args.cps),
        iterations=args.iterations,
        decode_instances=args.decode_instances,
        backend=args.backend,
        seed=args.seed,
    )
    command = "nanocp " + " ".join(sys.argv[1:])  # also when run as `python -m nanocp.cli`
    profile, stats = cpu_profile.profile_decode(sweep, command=command, timing_log=args.timing_log)
    path = cpu_profile.write_profile(profile, args.out)
    print(f"wrote {path}: {stats['records']} timing records, {stats['iterations']} iterations, {stats['wall_s']:.0f} s")
    return 0


def cmd_profile_fidelity(args: argparse.Namespace) -> int:
    from nanocp.bench import fidelity

    cfg = fidelity.FidelityConfig(
        profile=args.profile, num_requests=args.requests, repeats=args.repeats, backend=args.backend, seed=args.seed
    )
    result = fidelity.run_fidelity(cfg, timing_log=args.timing_log)
    _print_paths(fidelity.write_fidelity(result, _results_dir(args), note=args.note))
    s = result["summary"]
    print(f"median absolute percentage error {s['median_ape']:.1%} over {s['iterations']} iterations")
    return 0


# ------------------------------------------------------------------------------------------------ registration


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_sim(subparsers)
    _register_breakdown(subparsers)
    _register_profile(subparsers)


def _register_sim(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("sim", help="cluster simulator experiments (model outputs of a latency profile)")
    sub = sim.add_subparsers(dest="sim_command", metavar="EXPERIMENT", required=True)

    micro = sub.add_parser("micro", help="slowest instance's per-layer breakdown, 64 short + L long requests")
    _add_cluster(micro)
    micro.add_argument("--longs", type=_ints, default=[1, 3, 5, 7], help="long requests per node (default 1,3,5,7)")
    micro.add_argument("--shorts-per-instance", type=int, default=64)
    micro.add_argument("--short-len", type=int, default=2048)
    micro.add_argument("--long-len", type=int, default=512 * 1024)
    micro.add_argument("--shuffle", action="store_true", help="random arrival order instead of shorts first")
    micro.add_argument("--policies", default=None, help="comma-separated (default: every policy the scheduler has)")
    micro.add_argument("--seed", type=int, default=0)
    micro.set_defaults(func=cmd_sim_micro)

    cap = sub.add_parser("capacity", help="max rate at 99%% TPOT <= 50 ms and P99 TPOT per policy and workload")
    _add_capacity_args(cap)
    cap.set_defaults(func=cmd_sim_capacity)

    bal = sub.add_parser("balance", help="KV/batch imbalance, HoL blocking, CP usage at low and high load")
    _add_cluster(bal)
    bal.add_argument("--workload", default="mix:0.01")
    bal.add_argument("--low-rate", type=float, default=None, help="default: --low-fraction x NanoCP's capacity")
    bal.add_argument("--high-rate", type=float, default=None, help="default: NanoCP's capacity (sim_capacity.json)")
    bal.add_argument("--low-fraction", type=float, default=0.3)
    bal.add_argument("--window", type=float, default=60.0, help="seconds of arrivals")
    bal.add_argument("--policies", default=None, help="default nanocp,least-batch,least-cache,uniform-cp:8")
    bal.add_argument("--seed", type=int, default=0)
    bal.set_defaults(func=cmd_sim_balance)

    run = sub.add_parser("run", help="one serving run; writes sim_run_<policy>_<workload>.json/.md")
    _add_cluster(run)
    run.add_argument("--workload", default="mix:0.01", help="sharegpt4 | mix:<ratio> | github-issue | ...")
    run.add_argument("--rate", type=float, required=True, help="Poisson request rate, req/s")
    run.add_argument("--policy", default="nanocp")
    run.add_argument("--window", type=float, default=30.0, help="seconds of arrivals")
    run.add_argument("--name", default=None)
    run.add_argument("--seed", type=int, default=0)
    run.set_defaults(func=cmd_sim_run)

    all_ = sub.add_parser("all", help="micro + capacity + balance + summary (the committed results)")
    _add_capacity_args(all_)
    all_.set_defaults(func=cmd_sim_all)

    summary = sub.add_parser("summary", help="rewrite sim_summary.md from the experiments' JSON")
    summary.add_argument("--results-dir", type=Path, default=None)
    summary.set_defaults(func=cmd_sim_summary)


def _add_capacity_args(p: argparse.ArgumentParser) -> None:
    _add_cluster(p)
    p.add_argument("--workloads", default=None, help="comma-separated (default sharegpt4,mix:0.01,mix:0.05,mix:1)")
    p.add_argument("--policies", default=None, help="comma-separated (default: every policy the scheduler has)")
    p.add_argument("--window", type=float, default=None, help="seconds of arrivals for every workload")
    p.add_argument("--guess", type=float, default=None, help="first rate tried (req/s) for every workload")
    p.add_argument("--max-runs", type=int, default=7, help="runs per capacity search (default 7)")
    p.add_argument("--rel-tol", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)


def _register_breakdown(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("breakdown", help="per-layer latency breakdown of a simulator result or timing logs")
    p.add_argument("inputs", nargs="+", help="simulator result JSON(s) or timing logs (JSON lines of PhaseRecord)")
    p.add_argument("--label", action="append", help="label per input (repeat), default: from the file")
    p.add_argument("--png", type=Path, default=None, help="default bench/results/breakdown_<first input>.png")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the breakdowns as JSON")
    p.add_argument("--md", type=Path, default=None, help="also write the tables as markdown")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_breakdown)


def _register_profile(subparsers: argparse._SubParsersAction) -> None:
    from .cli import command_group

    sub = command_group(subparsers, "profile", "offline profiling (CP buckets, decode and prefill latency)")

    dec = sub.add_parser("decode", help="sweep the real CPU decode cluster and fit bench/profiles/cpu-tiny.json")
    dec.add_argument("--batches", type=_ints, default=[1, 4, 12, 32], help="requests per sweep point")
    dec.add_argument("--kv-lens", type=_ints, default=[32, 256, 1024], help="prompt lengths")
    dec.add_argument("--cps", type=_ints, default=[1, 2, 4], help="CP degrees forced for every request")
    dec.add_argument("--iterations", type=int, default=5, help="decode iterations timed per sweep point")
    dec.add_argument("--decode-instances", type=int, default=4)
    dec.add_argument("--backend", default="inline", choices=["inline", "threads"], help="instance runtime")
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--out", type=Path, default=None, help="default bench/profiles/cpu-tiny.json")
    dec.add_argument("--timing-log", type=Path, default=None, help="also write the raw PhaseRecords (JSON lines)")
    dec.set_defaults(func=cmd_profile_decode)

    fid = sub.add_parser("fidelity", help="simulator vs real CPU iteration times (writes fidelity_cpu_tiny.*)")
    fid.add_argument("--profile", default="cpu-tiny")
    fid.add_argument("--requests", type=int, default=24)
    fid.add_argument("--repeats", type=int, default=5, help="runs of the same workload (same seed)")
    fid.add_argument("--backend", default=None, choices=["inline", "threads"], help="default: the profile's")
    fid.add_argument("--seed", type=int, default=0)
    fid.add_argument("--results-dir", type=Path, default=None)
    fid.add_argument("--timing-log", type=Path, default=None, help="write the first run's PhaseRecords (JSON lines)")
    fid.add_argument("--note", default="", help="a paragraph appended to the markdown report")
    fid.set_defaults(func=cmd_profile_fidelity)
