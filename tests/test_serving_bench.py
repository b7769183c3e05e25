"""`nanocp bench serve`: workloads from the traces, metric arithmetic, and a short run against a served tiny model."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random

import numpy as np
import pytest
from shared_traces import needs_traces

from nanocp.bench.serve_client import (
    BenchError,
    RequestResult,
    add_arguments,
    build_requests,
    check_arguments,
    parse_goodput,
    run_benchmark,
    summarize,
)
from nanocp.bench.workloads import traces_dir
from nanocp.cli import main as cli_main
from nanocp.control_plane import _core
from nanocp.control_plane.api.local import ServerThread
from nanocp.control_plane.api.server import ServerConfig, create_app
from nanocp.engine import Engine, EngineConfig

SCHEDULER = "cpp" if hasattr(_core, "SchedulerCore") else "python"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--disable-tqdm", *argv])
    check_arguments(args)
    return args


@pytest.fixture(scope="module")
def server_url():
    config = EngineConfig(model="tiny", decode_instances=2, scheduler_backend=SCHEDULER)
    with ServerThread(create_app(ServerConfig(model="tiny"), lambda: Engine(config))) as thread:
        yield thread.url


# ---- workloads -----------------------------------------------------------------------------------------------


@needs_traces
def test_azure_trace_lengths_are_scaled_and_capped_in_trace_order():
    with (traces_dir() / "azure_llm_2023_conv.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))[:20]
    args = bench_args("--dataset", "azure-conv", "--num-prompts", "20", "--input-scale", "0.25",
                      "--max-input-len", "200", "--max-tokens-cap", "30")  # fmt: skip
    reqs = build_requests(args)
    for row, req in zip(rows, reqs):
        assert req.prompt_len == min(200, max(4, round(int(row["ContextTokens"]) * 0.25)))
        assert req.output_len == min(30, int(row["GeneratedTokens"]))
        assert len(req.prompt) == req.prompt_len and req.prompt.isascii()


@needs_traces
def test_mooncake_and_sharegpt_workloads_respect_the_caps():
    with (traces_dir() / "mooncake_conversation.jsonl").open() as f:
        first = [json.loads(next(f)) for _ in range(5)]
    reqs = build_requests(bench_args("--dataset", "mooncake", "--num-prompts", "5", "--max-input-len", "300"))
    assert [r.prompt_len for r in reqs] == [min(300, max(4, round(o["input_length"] * 0.1))) for o in first]
    assert [r.output_len for r in reqs] == [min(64, o["output_length"]) for o in first]
    seed = random.randrange(1 << 30)
    a = build_requests(bench_args("--dataset", "sharegpt4", "--num-prompts", "30", "--seed", str(seed)))
    b = build_requests(bench_args("--dataset", "sharegpt4", "--num-prompts", "30", "--seed", str(seed)))
    assert a == b  # a pure function of the seed
    assert all(4 <= r.prompt_len <= 1024 and 1 <= r.output_len <= 64 for r in a)


def test_synthetic_lengths_stay_in_their_range():
    args = bench_args("--dataset", "synthetic", "--num-prompts", "200", "--input-len", "100", "--output-len", "20",
                      "--range-ratio", "0.5", "--max-tokens-cap", "1000")  # fmt: skip
    reqs = build_requests(args)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10


@pytest.mark.parametrize(
    "argv",
    [
        ("--num-prompts", "0"),
        ("--request-rate", "0"),
        ("--goodput", "ttft"),
        ("--goodput", "speed:5"),
        ("--goodput", "ttft:-1"),
        ("--min-input-len", "50", "--max-input-len", "10"),
        ("--range-ratio", "1.5"),
    ],
)
def test_bad_arguments_are_rejected(argv):
    with pytest.raises(BenchError):
        bench_args(*argv)


# ---- metric arithmetic ---------------------------------------------------------------------------------------


def test_summary_matches_a_plain_computation():
    rnd = random.Random()
    results = []
    for _ in range(rnd.randint(5, 20)):
        out = rnd.randint(1, 12)
        ttft = rnd.uniform(0.01, 0.5)
        itl = [rnd.uniform(0.005, 0.1) for _ in range(out - 1)]
        results.append(RequestResult(True, rnd.randint(5, 50), out, ttft, itl, ttft + sum(itl)))
    results.append(RequestResult(False, 10, error="HTTP 500"))
    duration = rnd.uniform(1, 5)
    slos = parse_goodput(["ttft:300", "tpot:60"])
    s = summarize(results, duration, slos)
    ok = results[:-1]
    assert s["completed"] == len(ok) and s["failed"] == 1
    assert s["total_output_tokens"] == sum(r.output_tokens for r in ok)
    assert s["request_throughput"] == pytest.approx(len(ok) / duration)
    assert s["ttft"]["mean_ms"] == pytest.approx(1000 * np.mean([r.ttft for r in ok]))
    assert s["e2el"]["p99_ms"] == pytest.approx(1000 * np.percentile([r.latency for r in ok], 99))
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    assert s["tpot"]["median_ms"] == pytest.approx(1000 * np.median(tpots) if tpots else 0.0)
    assert s["itl"]["mean_ms"] == pytest.approx(1000 * np.mean([g for r in ok for g in r.itl]) if tpots else 0.0)
    good = sum(r.ttft <= 0.3 and (r.tpot or 0.0) <= 0.06 for r in ok)
    assert s["goodput"]["good_requests"] == good
    assert s["goodput"]["request_goodput"] == pytest.approx(good / duration)


# ---- against a server ----------------------------------------------------------------------------------------


def test_short_run_against_the_served_model_is_complete(server_url):
    args = bench_args("--base-url", server_url, "--dataset", "synthetic", "--num-prompts", "6", "--request-rate",
                      "20", "--input-len", "24", "--output-len", "6", "--ignore-eos", "--goodput", "ttft:60000",
                      "tpot:60000")  # fmt: skip
    doc = asyncio.run(run_benchmark(args))
    s, reqs = doc["summary"], doc["requests"]
    assert s["completed"] == 6 and s["failed"] == 0 and len(reqs) == 6
    assert all(r["output_tokens"] == 6 and r["prompt_len"] == 24 + 1 for r in reqs)  # + <|bos|>
    assert all(0 < r["ttft"] <= r["latency"] and len(r["itl"]) <= 5 for r in reqs)
    assert s["total_output_tokens"] == 36 and s["goodput"]["good_requests"] == 6
    assert s["e2el"]["mean_ms"] >= s["ttft"]["mean_ms"] > 0 and s["tpot"]["mean_ms"] > 0
    assert doc["config"]["model"] == "tiny" and json.loads(json.dumps(doc)) == doc


@needs_traces
def test_cli_writes_json_and_markdown(server_url, tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["bench", "serve", "--base-url", server_url, "--dataset", "sharegpt4", "--num-prompts", "4"]
    argv += ["--max-input-len", "64", "--max-tokens-cap", "5", "--endpoint", "/v1/chat/completions"]
    argv += ["--burstiness", "0.5", "--request-rate", "50", "--disable-tqdm"]
    argv += ["--result-file", str(out), "--markdown-file", str(md)]
    assert cli_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["completed"] == 4 and doc["config"]["endpoint"] == "/v1/chat/completions"
    assert set(doc["summary"]) >= {"ttft", "tpot", "itl", "e2el", "request_throughput", "output_throughput"}
    assert "| TTFT |" in md.read_text() and "sharegpt4" in md.read_text()
