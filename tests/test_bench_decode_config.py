"""The decode benchmark's configuration specs and the benchmark runner's selection (no benchmark is run)."""

from __future__ import annotations

import argparse

import pytest

from nanocp.bench import run_all
from nanocp.bench.bench_decode import Config, cores_used, parse_config, table


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("4", Config(4, "processes")),
        ("1:inline", Config(1, "inline")),
        ("2:processes:4", Config(2, "processes", 4)),
        ("3:threads:", Config(3, "threads")),
        ("2:processes:1:sequential", Config(2, "processes", 1, overlap=False)),
    ],
)
def test_parse_config(spec, want):
    assert parse_config(spec, "processes") == want


@pytest.mark.parametrize("spec", ["0", "x", "2:gpu", "2:inline:0", "2:inline:x", "-1:inline", "2:processes:1:fast"])
def test_parse_config_rejects_bad_specs(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="bad configuration"):
        parse_config(spec, "inline")


def test_config_describes_its_steps():
    four_steps = "2 decode instances (processes backend, 4 decode steps per iteration)"
    assert Config(2, "processes", 4).describe() == four_steps
    assert Config(1, "inline").describe() == "1 decode instance (inline backend)"
    sequential = "2 decode instances (processes backend, one iteration at a time)"
    assert Config(2, "processes", overlap=False).describe() == sequential


def test_hf_gets_the_cores_a_configuration_keeps_busy(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cores_used(4, "inline") == 1
    assert cores_used(1, "processes") == 2  # the overlapping driver plans on the other core
    assert cores_used(1, "processes", overlap=False) == 1
    assert cores_used(2, "processes") == 2
    assert cores_used(1, "threads") == 1


def test_run_all_lists_and_refuses_unknown_names(capsys):
    assert run_all.main(["--list", "--only", "decode", "cpu_kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["decode: -m nanocp.bench.bench_decode", "cpu_kernels: -m nanocp.bench.bench_cpu_kernels"]
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nope"])


def test_table_shows_the_median_ratio_and_the_spread_over_pairs():
    decode = {"nanocp_tok_s": 300.0, "hf_tok_s": 100.0, "ratio": 3.0, "runs": [[300.0, 200.0, 500.0], [100.0] * 3]}
    e2e = {"nanocp_tok_s": 250.0, "hf_tok_s": 100.0, "ratio": 2.5, "runs": [[250.0], [100.0]]}
    lines = table([{"batch": 64, "decode": decode, "end_to_end": e2e}])
    assert lines[-1] == "| 64 | 300.0 | 100.0 | **3.00x** | 2.00-5.00x | 250.0 | 100.0 | 2.50x |"
