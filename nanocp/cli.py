"""The `nanocp` command line. Each subcommand lives in the layer it drives and is imported only when used."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from . import __version__

# Layers that add subcommands: each module has `register(subparsers)` and imports its heavy parts lazily.
SUBCOMMAND_MODULES: list[str] = ["nanocp.cli_sim", "nanocp.cli_serve", "nanocp.prefill.cli"]


def command_group(sub: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    """The subcommands of `nanocp NAME ...`, created on first use: several layers add to one group (`profile`,
    `bench`), so each asks for the group instead of adding a parser of that name itself."""
    parser = sub.choices.get(name)
    if parser is None:
        parser = sub.add_parser(name, help=help)
        parser.set_defaults(func=lambda args, p=parser: p.print_help())
        parser._nanocp_group = parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND")
    return parser._nanocp_group


def cmd_profile_cp_buckets(args: argparse.Namespace) -> int:
    from .bench.cp_buckets import write_cp_buckets

    table = write_cp_buckets(args.profile, args.out, args.instances_per_node)
    print(json.dumps({"out": args.out, "max_lens": table.max_lens, "cps": table.cps}))
    return 0


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (embedded default) or an HF checkpoint directory")
    p.add_argument("--decode-instances", type=int, default=4, help="number of DP-EP decode instances (default 4)")
    p.add_argument("--instances-per-node", type=int, default=None, help="default: all instances on one node")
    p.add_argument(
        "--policy",
        default="nanocp",
        help="nanocp | least-batch | least-cache | round-robin | uniform-cp:K (default nanocp)",
    )
    p.add_argument("--backend", default="threads", choices=["threads", "processes"], help="instance runtime")
    p.add_argument("--kv-capacity-tokens", type=int, default=16384, help="KV capacity per instance, in tokens")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (64 for FlashMLA on GPU)")
    p.add_argument("--max-batch-per-instance", type=int, default=64)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        decode_instances=args.decode_instances,
        instances_per_node=args.instances_per_node,
        policy=args.policy,
        backend=args.backend,
        kv_capacity_tokens=args.kv_capacity_tokens,
        page_size=args.page_size,
        max_batch_per_instance=args.max_batch_per_instance,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": prompt}] for prompt in args.prompt], params)
        else:
            outs = llm.generate(args.prompt, params)
    for out in outs:
        record = {
            "prompt": llm.tokenizer.decode(out.prompt_token_ids),
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "ttft_s": out.metrics.ttft,
            "tpot_s": out.metrics.tpot,
            "preemptions": out.metrics.preemptions,
        }
        print(json.dumps(record, ensure_ascii=False))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from .weight_plan import format_bytes, parse_bytes, plan_weights

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown --dtype {args.dtype!r} (accepted: bfloat16, float16, float32)")
    plan = plan_weights(args.model, args.decode_instances, dtype)
    for w in plan.instances:
        line = {"instance": w.rank, "experts": list(w.experts), "checkpoint_bytes": w.checkpoint_bytes}
        line.update(resident_bytes=w.resident_bytes, resident=format_bytes(w.resident_bytes))
        print(json.dumps(line))
    if args.memory_per_instance is not None:
        plan.check_fits(parse_bytes(args.memory_per_instance))
    worst = plan.largest
    print(f"largest instance: {format_bytes(worst.resident_bytes)} of weights in {plan.dtype}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanocp", description="Serve MoE LLMs with dynamic (per-request) context parallelism."
    )
    parser.add_argument("--version", action="version", version=f"nanocp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="offline generation on a local decode cluster (like vLLM's LLM)")
    add_cluster_args(gen)
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as one user message through the checkpoint's chat template (as /v1/chat/completions)",
    )
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    plan = sub.add_parser(
        "plan", help="per-instance weight bytes of a checkpoint from its index alone; refuses a layout that cannot fit"
    )
    plan.add_argument("model", help="an HF checkpoint directory (config.json + model.safetensors.index.json)")
    plan.add_argument("--decode-instances", type=int, required=True, help="number of DP-EP decode instances")
    plan.add_argument("--dtype", default="bfloat16", help="compute dtype the weights are loaded in (default bfloat16)")
    plan.add_argument(
        "--memory-per-instance", default=None, help="e.g. 80GiB: refuse (exit 2) when an instance's weights exceed it"
    )
    plan.set_defaults(func=cmd_plan)

    profile = command_group(sub, "profile", "offline profiling (CP buckets, decode and prefill latency)")
    buckets = profile.add_parser("cp-buckets", help="length -> CP degree table from a latency profile")
    buckets.add_argument("--profile", default="h200-deepseek-v3", help="latency profile name or path")
    buckets.add_argument("--instances-per-node", type=int, default=8)
    buckets.add_argument("--out", default="control_plane/data/cp_buckets_default.json")
    buckets.set_defaults(func=cmd_profile_cp_buckets)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"nanocp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
