"""`nanocp serve` as users run it: the default processes backend, the printed URL and curl example (which must
work), the engine thread driving as SCHED_BATCH and the server thread not, a clean exit on SIGTERM with no instance
process left behind and no leak report at exit, and the documented --prefill-instances."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from nanocp.cli import build_parser
from nanocp.control_plane.api.local import free_port

REPO = Path(__file__).resolve().parents[1]


def test_serve_prints_a_working_curl_example_and_stops_cleanly_on_sigterm():
    port = free_port()
    cmd = [sys.executable, "-m", "nanocp.cli", "serve", "--port", str(port), "--decode-instances", "2"]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        while not any("cluster ready" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
        curl = next(line for line in lines if "curl " in line)
        body = json.loads(re.search(r"-d '(\{.*\})'", curl).group(1))
        assert f"curl {url}/v1/completions" in curl and "processes backend" in "".join(lines)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= body["max_tokens"]
        instances = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(instances) >= 2  # one process per decode instance
        if hasattr(os, "SCHED_BATCH"):  # the engine thread drives the instance processes as SCHED_BATCH
            policies = [os.sched_getscheduler(t.id) for t in psutil.Process(proc.pid).threads()]
            assert os.SCHED_BATCH in policies and os.SCHED_OTHER in policies
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, "".join(lines) + rest
    assert "leaked" not in rest, rest  # the frozen startup heap is given back before exit (nanobind's leak check)
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) for p in instances) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in instances)


def test_serve_defaults_and_prefill_instances_documentation():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert (args.model, args.prefill_instances, args.decode_instances, args.policy) == ("tiny", 2, 4, "nanocp")
    assert (args.host, args.port, args.backend, args.api_key) == ("127.0.0.1", 8000, "processes", None)
    serve = parser._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())
    assert "chunkwise dynamic sequence parallelism" in help_text
    from nanocp.cli_serve import _engine_config

    assert _engine_config(args).prefill_instances == 2  # the served engine runs the CDSP prefill tier
    bench = parser.parse_args(["bench", "serve", "--dataset", "mooncake", "--goodput", "ttft:100", "tpot:20"])
    assert bench.dataset == "mooncake" and bench.goodput == ["ttft:100", "tpot:20"]
    deploy = parser.parse_args(["deploy", "--cpu-instances", "3", "--address", "auto"])
    assert (deploy.cpu_instances, deploy.address, deploy.backend) == (3, "auto", "ray")


def test_serve_heartbeat_timeout_reaches_the_engine_and_bad_values_are_refused():
    from nanocp.cli_serve import _engine_config, _server_config

    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve"])).heartbeat_timeout_s == 3.0
    args = parser.parse_args(["serve", "--heartbeat-timeout", "1.5"])
    assert _engine_config(args).heartbeat_timeout_s == 1.5
    with pytest.raises(ValueError, match="--heartbeat-timeout must be > 0, got 0.0"):
        _server_config(parser.parse_args(["serve", "--heartbeat-timeout", "0"]))
