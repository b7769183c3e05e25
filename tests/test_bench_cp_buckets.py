"""Offline CP-bucket profiling: the table follows the latency model's minimum and is monotone in length."""

from __future__ import annotations

from nanocp.bench.cp_buckets import dcp_attention_latency, length_grid, profile_cp_buckets
from nanocp.bench.latency_profile import LatencyProfile
from nanocp.control_plane import CPBucketTable


def test_table_picks_the_fastest_degree_and_is_monotone(tmp_path):
    profile = LatencyProfile.load("h200-deepseek-v3")
    table, rows = profile_cp_buckets(profile, instances_per_node=8)
    assert list(table.cps) == sorted(table.cps), "longer requests never get a smaller CP degree"
    assert table.lookup(2048) == 1 and table.lookup(512 * 1024) > 1
    for row in rows:
        lat = row["latency_s"]
        assert lat[row["best"]] == min(lat.values())
        assert table.lookup(row["length"]) >= row["best"]
    table.save(tmp_path / "t.json")
    assert CPBucketTable.load(tmp_path / "t.json") == table


def test_latency_model_behaves():
    profile = LatencyProfile.load("h200-deepseek-v3")
    # CP costs communication for short requests and pays off for long ones.
    assert dcp_attention_latency(profile, 2048, 1, 8) < dcp_attention_latency(profile, 2048, 8, 8)
    assert dcp_attention_latency(profile, 1 << 20, 8, 8) < dcp_attention_latency(profile, 1 << 20, 1, 8)
    grid = length_grid(1 << 16, per_octave=2, min_len=1024)
    assert grid[0] == 1024 and grid[-1] == 1 << 16 and grid == sorted(set(grid))
