"""`nanocp serve`, `nanocp bench serve` and `nanocp deploy`: the serving subcommands (registered by nanocp.cli)."""

from __future__ import annotations

import argparse
import os

PREFILL_HELP = (
    "prefill instances of the CDSP prefill tier (default 2): prompts are computed with chunkwise dynamic sequence "
    "parallelism over them and their KV handed straight to the decode pages; 0 prefills on the engine's driver"
)


def register(sub: argparse._SubParsersAction) -> None:
    from .cli import add_cluster_args, command_group

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server on a local decode cluster")
    add_cluster_args(serve)
    serve.set_defaults(backend="processes")
    _set_help(serve, "backend", "instance runtime: threads, or one process per instance (default processes)")
    _add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    deploy = sub.add_parser("deploy", help="serve with the decode instances as Ray actors (one per GPU)")
    _add_deploy_cluster_args(deploy)
    _add_server_args(deploy)
    deploy.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray cluster)")
    deploy.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (decode instances) per node (default 8)")
    deploy.add_argument(
        "--cpu-instances", type=int, default=None, help="run N decode instances on CPU instead of one per GPU"
    )
    deploy.add_argument(
        "--fabric",
        default="auto",
        choices=["auto", "shm", "dist"],
        help="instance fabric: shared memory when all actors share a host (auto), torch.distributed/gloo (dist)",
    )
    deploy.add_argument("--object-store-mb", type=int, default=256, help="object store of a local Ray cluster")
    deploy.set_defaults(func=cmd_deploy)

    bench = command_group(sub, "bench", help="benchmarks")
    bench_serve = bench.add_parser("serve", help="benchmark a running server (like `vllm bench serve`)")
    from nanocp.bench.serve_client import add_arguments

    add_arguments(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)


def _set_help(p: argparse.ArgumentParser, dest: str, text: str) -> None:
    for action in p._actions:
        if action.dest == dest:
            action.help = text


def _add_deploy_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster options of `serve` minus --backend (always Ray actors); instance counts come from Ray."""
    p.add_argument("--model", default="tiny", help="'tiny' (embedded default) or an HF checkpoint directory")
    p.add_argument(
        "--decode-instances", type=int, default=None, help="at most this many GPU instances (default: every GPU)"
    )
    p.add_argument(
        "--instances-per-node", type=int, default=None, help="with --cpu-instances: instances per placement group"
    )
    p.add_argument("--policy", default="nanocp", help="nanocp | least-batch | least-cache | round-robin | uniform-cp:K")
    p.add_argument("--kv-capacity-tokens", type=int, default=16384, help="KV capacity per instance, in tokens")
    p.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (64 for FlashMLA on GPU)")
    p.add_argument("--max-batch-per-instance", type=int, default=64)
    p.set_defaults(backend="ray")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-instances", type=int, default=2, help=PREFILL_HELP)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("NANOCP_API_KEY"),
        help="require 'Authorization: Bearer <key>' on every endpoint but /health (default: $NANOCP_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: tiny / directory name)")
    p.add_argument(
        "--max-pending-requests", type=int, default=256, help="admission bound on waiting + running requests (429)"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted (413)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of chat requests that do not set it")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds an instance may stop answering without dying before it is declared dead and killed",
    )


def _server_config(args: argparse.Namespace):
    from nanocp.control_plane.api.server import ServerConfig

    if args.prefill_instances < 0:
        raise ValueError(f"--prefill-instances must be >= 0, got {args.prefill_instances}")
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    if not args.heartbeat_timeout > 0:
        raise ValueError(f"--heartbeat-timeout must be > 0, got {args.heartbeat_timeout}")
    return ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_pending_requests=args.max_pending_requests,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
    )


def _engine_config(args: argparse.Namespace, **overrides):
    from nanocp.control_plane import _core
    from nanocp.engine import EngineConfig

    from .cli import engine_kwargs

    kwargs = engine_kwargs(args) | {"prefill_instances": args.prefill_instances} | overrides
    if hasattr(args, "heartbeat_timeout"):
        kwargs["heartbeat_timeout_s"] = args.heartbeat_timeout
    kwargs["scheduler_backend"] = "cpp" if hasattr(_core, "SchedulerCore") else "python"
    return EngineConfig(model=args.model, **kwargs)


def cmd_serve(args: argparse.Namespace) -> int:
    from nanocp.control_plane.api.launch import serve

    server_config = _server_config(args)
    try:
        serve(server_config, _engine_config(args), args.host, args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from nanocp.control_plane.api.launch import deploy

    server_config = _server_config(args)
    engine_config = _engine_config(args, decode_instances=args.decode_instances or 1)  # Ray sets the count
    try:
        deploy(
            server_config,
            engine_config,
            args.host,
            args.port,
            address=args.address,
            decode_instances=args.decode_instances,
            gpus_per_node=args.gpus_per_node,
            cpu_instances=args.cpu_instances,
            fabric=args.fabric,
            object_store_mb=args.object_store_mb,
            log_level=args.log_level,
        )
    except KeyboardInterrupt:
        pass
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from nanocp.bench.serve_client import main_from_args

    return main_from_args(args)
