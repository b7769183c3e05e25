"""Starting the service: engine construction (local cluster or Ray actors), `serve` and `deploy`.

`serve` runs the HTTP server (uvicorn) in this process with the engine loop thread behind it; the decode
instances are threads, local processes, or Ray actors. `deploy` connects to (or starts) a Ray cluster, places
one decode instance per GPU (or `cpu_instances` CPU instances) with placement groups, serves, and on exit
(SIGINT / SIGTERM) closes the engine, kills the actors, removes the placement groups and disconnects.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from nanocp.data_plane.ray_cluster import RayPlacement
from nanocp.engine import Engine, EngineConfig
from nanocp.startup_heap import freeze_startup_heap

from .graceful import make_server
from .server import ServerConfig, create_app


def build_engine(config: EngineConfig, placement: RayPlacement | None = None) -> Engine:
    """An Engine; backend "ray" puts its decode instances in Ray actors (ray.init must have been called)."""
    if config.backend != "ray":
        return Engine(config)
    placement = placement or RayPlacement(config.instances_per_node or config.decode_instances)
    return Engine(replace(config, cluster_options={"placement": placement, "allow_one_group": True}))


def curl_example(url: str, model: str, with_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $NANOCP_API_KEY"' if with_key else ""
    body = f'{{"model": "{model}", "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}}'
    return f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


@contextmanager
def _clean_exit_on_sigterm() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGTERM and then re-raises it: exit through SystemExit so that the
    caller's cleanup (engine, Ray) runs instead of the process dying on the default handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    placement: RayPlacement | None = None,
    log_level: str = "info",
    announce: Callable[[str], None] = print,
) -> None:
    """Run the OpenAI-compatible server until SIGINT / SIGTERM. A model whose config or tokenizer is broken fails
    here before anything is served; a cluster that cannot start (e.g. a corrupt or truncated checkpoint file) stops
    the server and its error is raised from here, so `nanocp serve` exits naming the file."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    name = server_config.model_name
    failure: list[Exception] = []

    def on_ready() -> None:
        freeze_startup_heap()
        announce(f"nanocp: cluster ready, accepting requests at {url}")

    def build() -> Engine:
        try:
            return build_engine(engine_config, placement)
        except Exception as e:
            failure.append(e)
            server.should_exit = True  # nothing will ever be served: stop rather than answer 503 forever
            raise

    app = create_app(server_config, build, on_ready)  # reads the model's config and tokenizer
    server = make_server(app, host, port, log_level)
    announce(
        f"nanocp: serving {name!r} at {url} ({engine_config.decode_instances} decode instances, "
        f"{engine_config.backend} backend, policy {engine_config.policy}); /health turns 200 once the cluster is up"
    )
    announce("  try: " + curl_example(url, name, server_config.api_key is not None))
    with _clean_exit_on_sigterm():
        try:
            server.run()
        finally:
            gc.unfreeze()  # the startup heap back to the collector: interpreter exit then frees it
    if failure:
        raise failure[0]


def deploy(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    address: str | None = None,
    decode_instances: int | None = None,
    gpus_per_node: int = 8,
    cpu_instances: int | None = None,
    fabric: str = "auto",
    object_store_mb: int = 256,
    log_level: str = "info",
    announce: Callable[[str], None] = print,
) -> None:
    """Serve with the decode instances as Ray actors. address None starts a local Ray cluster for this run.

    GPU mode: one instance per GPU of the Ray cluster (at most `decode_instances`, rounded down to whole nodes),
    gpus_per_node instances per placement group. CPU mode (cpu_instances N): N instances of one CPU each,
    engine_config.instances_per_node (default N) per placement group.
    """
    if cpu_instances is not None and cpu_instances < 1:
        raise ValueError(f"--cpu-instances must be >= 1, got {cpu_instances}")
    if address is None and cpu_instances is None and not _local_gpus():
        raise ValueError("this machine has no GPUs for a local Ray cluster; use --cpu-instances N to run on CPU")
    import ray

    if address:
        ray.init(address=address, logging_level="warning")
    else:
        cpus = max(os.cpu_count() or 1, cpu_instances or 1)
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            object_store_memory=object_store_mb << 20,
            logging_level="warning",
        )
    try:
        config, placement = _ray_layout(engine_config, decode_instances, gpus_per_node, cpu_instances, fabric)
        announce(
            f"nanocp: Ray cluster {ray.cluster_resources()}; {config.decode_instances} decode instances, "
            f"{placement.instances_per_node} per node"
        )
        serve(server_config, config, host, port, placement, log_level, announce)
    finally:
        ray.shutdown()


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _ray_layout(
    engine_config: EngineConfig,
    decode_instances: int | None,
    gpus_per_node: int,
    cpu_instances: int | None,
    fabric: str,
) -> tuple[EngineConfig, RayPlacement]:
    import ray

    if cpu_instances is not None:
        per_node = engine_config.instances_per_node or cpu_instances
        placement = RayPlacement(per_node, gpus_per_instance=0.0, fabric=fabric)
        config = replace(engine_config, backend="ray", decode_instances=cpu_instances, instances_per_node=per_node)
        return config, placement
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus == 0:
        raise ValueError("the Ray cluster has no GPUs; use --cpu-instances N to run the instances on CPU")
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    wanted = min(decode_instances, gpus) if decode_instances else gpus
    n = wanted - wanted % gpus_per_node
    if n == 0:
        raise ValueError(f"{wanted} GPUs do not fill one node of {gpus_per_node} (--gpus-per-node)")
    placement = RayPlacement(gpus_per_node, gpus_per_instance=1.0, fabric=fabric)
    return replace(engine_config, backend="ray", decode_instances=n, instances_per_node=gpus_per_node), placement
