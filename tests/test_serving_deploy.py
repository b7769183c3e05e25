"""`nanocp deploy` / deploy/decode_cluster.py: a local Ray deployment on CPU instances serves the OpenAI API and
exits on SIGTERM without leaving processes behind; without GPUs it asks for --cpu-instances."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from nanocp.control_plane.api.local import free_port

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]


def wait_gone(pids: set[int], timeout_s: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.2)
    return alive


def test_deploy_script_serves_and_exits_cleanly_on_sigterm():
    port = free_port()
    cmd = [sys.executable, "deploy/decode_cluster.py", "--cpu-instances", "2", "--port", str(port)]
    cmd += ["--log-level", "warning", "--object-store-mb", "100"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "deployment not healthy in 180 s"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, stream=True))  # fmt: skip
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(tree) >= 4  # Ray's own processes plus the two instance actors
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    assert url in output and "curl " in output
    assert not wait_gone(tree), "processes of the deployment outlived it"


def test_deploy_without_gpus_asks_for_cpu_instances():
    cmd = [sys.executable, "-m", "nanocp.cli", "deploy", "--port", str(free_port()), "--object-store-mb", "100"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cpu-instances" in proc.stderr
