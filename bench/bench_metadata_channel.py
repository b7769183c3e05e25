"""Metadata channel benchmark: push-to-visible latency of routing tables, per backend and table size.

The receiver (the instance side) runs in its own process; this process is the control plane. For every push
the sender takes t0 = perf_counter_ns() right before `push`, the receiver takes t1 right after `wait_table`
returned the validated table, and sends t1 back over a pipe; the next push starts only after that ack.
Latency = t1 - t0 (Linux's perf_counter is CLOCK_MONOTONIC, shared by all processes). The shm receiver spins
on the doorbell (yielding its core every few polls); tcp waits on a condition variable that the server thread
notifies. Frames carry CRC-32C checksums (hardware, google-crc32c). Measured on this CPU machine (not a GPU
cluster model).

    python -m nanocp.bench.bench_metadata_channel        # writes bench/results/metadata_channel.{json,md}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from nanocp.bench.machine import machine_info
from nanocp.comm import ShmMetadataReceiver, ShmMetadataSender, TcpMetadataReceiver, TcpMetadataSender
from nanocp.comm.metadata_channel import crc32c

REPO = Path(__file__).resolve().parents[1]
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10]
CAPACITY = 256 << 10
TOKEN = "bench-metadata-channel-token"
INSTANCE = 1


def receiver_main(backend: str, pushes: int, conn) -> None:
    """Instance process: owns the context buffer, acks each table with the time it became visible."""
    if backend == "shm":
        receiver = ShmMetadataReceiver(INSTANCE, CAPACITY)
        conn.send(receiver.info)
    else:
        receiver = TcpMetadataReceiver(INSTANCE, CAPACITY, TOKEN)
        conn.send(receiver.address)
    try:
        for seq in range(1, pushes + 1):
            payload = receiver.wait_table(seq, timeout_s=30)
            visible = time.perf_counter_ns()
            conn.send((receiver.last_seq, visible, len(payload)))
    finally:
        receiver.close()


def open_sender(backend: str, address):
    if backend == "shm":
        return ShmMetadataSender(address)
    return TcpMetadataSender(address, TOKEN, INSTANCE)


def measure(backend: str, sizes: list[int], pushes: int, warmup: int) -> list[dict]:
    total = len(sizes) * (warmup + pushes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(backend, total, child), daemon=True)
    proc.start()
    sender = open_sender(backend, parent.recv())
    rows, seq = [], 0
    try:
        for size in sizes:
            table = bytearray(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
            latencies = []
            for i in range(warmup + pushes):
                seq += 1
                table[:8] = seq.to_bytes(8, "little")  # every table differs
                start = time.perf_counter_ns()
                sender.push(seq, table)
                got_seq, visible, length = parent.recv()
                if (got_seq, length) != (seq, size):
                    raise RuntimeError(f"receiver saw table {got_seq} ({length} B), expected {seq} ({size} B)")
                if i >= warmup:
                    latencies.append((visible - start) / 1e3)
            lat = np.array(latencies)
            rows.append(
                {
                    "backend": backend,
                    "table_bytes": size,
                    "pushes": pushes,
                    "p50_us": round(float(np.percentile(lat, 50)), 1),
                    "p99_us": round(float(np.percentile(lat, 99)), 1),
                    "mean_us": round(float(lat.mean()), 1),
                    "min_us": round(float(lat.min()), 1),
                    "max_us": round(float(lat.max()), 1),
                    "crc32c_us": crc32c_cost_us(size),
                }
            )
            print(
                f"{backend:4s} {size >> 10:4d} KB  p50 {rows[-1]['p50_us']:8.1f} us  p99 {rows[-1]['p99_us']:8.1f} us"
            )
    finally:
        sender.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
    return rows


def crc32c_cost_us(size: int, repeat: int = 50) -> float:
    """Median time of one CRC-32C over `size` bytes; a push pays it twice (sender and receiver)."""
    data = os.urandom(size)
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        crc32c(data)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return round(float(np.median(times)), 1)


def write_results(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metadata_channel.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    lines = [
        "# Metadata channel: push-to-visible latency",
        "",
        f"Measured on this CPU machine: {m['cpu']}, {m['cpus']} cores, Python {m['python']}, torch {m['torch']}; "
        f"load average {m['load_average']} at start, {m.get('load_average_at_end')} at end "
        "(the cores are shared with other jobs, which shows in the tails).",
        f"{result['config']['pushes']} timed pushes per row after {result['config']['warmup']} warm-up pushes; "
        "receiver in a separate process; the next push starts after the previous table was acknowledged.",
        "Latency = time from `push` to `wait_table` returning the validated table (CLOCK_MONOTONIC).",
        "",
        "| backend | table | p50 (us) | p99 (us) | mean (us) | min (us) | max (us) | one crc32c (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['backend']} | {r['table_bytes'] >> 10} KB | {r['p50_us']} | {r['p99_us']} | {r['mean_us']} | "
            f"{r['min_us']} | {r['max_us']} | {r['crc32c_us']} |"
        )
    lines += [
        "",
        "Every push computes the table's CRC-32C twice (sender, receiver), the last column's cost each (zlib's",
        "CRC-32, used before, took about 60 us for 64 KB here); the rest is copies. The shm receiver spins on the",
        "doorbell, so the p99 tail comes from scheduling on shared cores.",
        "",
        "Command: `python -m nanocp.bench.bench_metadata_channel`",
        "",
    ]
    (out_dir / "metadata_channel.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--backends", nargs="+", default=["shm", "tcp"], choices=["shm", "tcp"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result = {
        "machine": machine_info(),
        "config": {"pushes": args.pushes, "warmup": args.warmup, "sizes": SIZES, "capacity": CAPACITY},
        "results": [row for b in args.backends for row in measure(b, SIZES, args.pushes, args.warmup)],
    }
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_results(result, args.out)


if __name__ == "__main__":
    main()
