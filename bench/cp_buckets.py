"""Offline profiling of the length -> CP degree table (NanoCP Alg. 1 line 8).

For every length on a grid and every candidate degree c, the distributed attention latency of one request under
DCP is priced with a latency profile: c shards of L/c tokens attended in parallel (each with the profile's fixed
per-shard cost), the queries sent to and the partial results returned from the c - 1 remote shards over NVLink,
and the LSE merge. The degree with the lowest latency wins; adjacent lengths with the same winner become one bucket.

    nanocp profile cp-buckets --profile h200-deepseek-v3 --out control_plane/data/cp_buckets_default.json
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np

from nanocp.control_plane import CPBucketTable

from .latency_profile import LatencyProfile, RouteCounts

DEFAULT_DEGREES = (1, 2, 4, 8)


def length_grid(max_len: int = 1 << 20, per_octave: int = 4, min_len: int = 1024) -> list[int]:
    """Geometric grid of lengths (per_octave points per doubling), ending at max_len."""
    count = int(round(np.log2(max_len / min_len) * per_octave)) + 1
    return sorted({int(round(x)) for x in np.geomspace(min_len, max_len, count)})


def dcp_attention_latency(profile: LatencyProfile, length: int, degree: int, instances_per_node: int) -> float:
    """One layer's attention latency for one request of `length` tokens split over `degree` instances of a node."""
    n = instances_per_node
    kv = np.zeros(n)
    shards = np.zeros(n)
    kv[:degree] = length / degree
    shards[:degree] = 1
    attention = float(np.max(profile.attention_time(kv, shards, n)))
    node_of = np.zeros(n, dtype=np.int64)
    routes = RouteCounts.from_pairs([(0, i) for i in range(1, degree)], n)
    comm = float(np.max(profile.cp_comm_time(routes, node_of))) if degree > 1 else 0.0
    merge = float(profile.merge_time(degree, num_instances=n)) if degree > 1 else 0.0
    return attention + comm + merge


def profile_cp_buckets(
    profile: LatencyProfile,
    instances_per_node: int = 8,
    degrees: tuple[int, ...] = DEFAULT_DEGREES,
    grid: list[int] | None = None,
) -> tuple[CPBucketTable, list[dict]]:
    """The bucket table and the sweep behind it (one row per length: latency per degree and the winner)."""
    degrees = tuple(d for d in degrees if d <= instances_per_node)
    rows = []
    for length in grid or length_grid():
        lat = {d: dcp_attention_latency(profile, length, d, instances_per_node) for d in degrees}
        best = min(degrees, key=lambda d: (lat[d], d))  # ties go to the smaller degree (less traffic)
        rows.append({"length": length, "latency_s": lat, "best": best})
    # Monotone in length: once a degree wins, shorter degrees are not chosen again for longer requests.
    max_lens, cps, current = [], [], rows[0]["best"]
    for prev, row in zip(rows, rows[1:]):
        best = max(row["best"], current)
        if best != current:
            max_lens.append(prev["length"])
            cps.append(current)
            current = best
    max_lens.append(rows[-1]["length"])
    cps.append(current)
    when = datetime.date.today().isoformat()
    provenance = (
        f"nanocp profile cp-buckets on {when}: distributed attention latency per layer of one request under DCP, "
        f"priced with latency profile '{profile.name}' ({instances_per_node} instances per node, degrees "
        f"{list(degrees)}); minimum-latency degree per length, made monotone. Model output, not a GPU measurement."
    )
    return CPBucketTable(tuple(max_lens), tuple(cps), provenance), rows


def write_cp_buckets(profile_name: str, out: str | Path, instances_per_node: int = 8) -> CPBucketTable:
    table, _ = profile_cp_buckets(LatencyProfile.load(profile_name), instances_per_node)
    table.save(out)
    return table
