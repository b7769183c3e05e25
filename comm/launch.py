"""Run one function per rank: as threads of this process, or as spawned local processes.

`run_processes` can also set up torch.distributed (gloo, TCP rendezvous on 127.0.0.1) in every child, so a
fabric test or a single-host deployment needs no launcher. Both runners bound the wait: a hung rank turns
into a TimeoutError, a failing rank into a RankError carrying its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any


class RankError(RuntimeError):
    """A rank's function raised; the message carries its traceback."""


def run_threads(fn: Callable[[int], Any], world_size: int, timeout_s: float = 60.0) -> list[Any]:
    """fn(rank) on `world_size` daemon threads; returns the results in rank order."""
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed: {errors[rank]!r}") from errors[rank]
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise TimeoutError(f"{', '.join(hung)} still running after {timeout_s}s")
    return results


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, args: Sequence[Any], dist_url: str | None, out) -> None:
    try:
        if dist_url is not None:
            import torch.distributed as dist

            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(
                "gloo", init_method=dist_url, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
            )
        result = fn(rank, world_size, *args)
        if dist_url is not None:
            dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - shipped to the parent
        out.put((rank, False, traceback.format_exc()))


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "nanocp.comm"])
    return ctx


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 120.0,
    torch_distributed: bool = False,
) -> list[Any]:
    """fn(rank, world_size, *args) in `world_size` fresh processes (fn must be importable, results
    picklable); with torch_distributed, each child first joins a gloo group rendezvousing on 127.0.0.1.
    Children fork from a forkserver that has already imported torch (cheap starts) where available."""
    ctx = _context()
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}" if torch_distributed else None
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, tuple(args), url, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(world_size):
            rank, ok, value = out.get(timeout=max(0.0, deadline - time.monotonic()))
            (results if ok else failures)[rank] = value
            if failures:
                break
    except queue.Empty:
        raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(results))} silent after {timeout_s}s") from None
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    if failures:
        rank = min(failures)
        raise RankError(f"rank {rank} failed:\n{failures[rank]}")
    return [results[r] for r in range(world_size)]
