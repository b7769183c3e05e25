"""Corrupt or truncated checkpoint files and configs: `nanocp serve` stops with a clear error naming the file and
never serves (the config before anything is announced, the weights before the cluster is ready)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanocp.control_plane.api.local import free_port
from nanocp.models import ModelConfig, save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
CONFIG = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, intermediate_size=96, moe_intermediate_size=32)


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|bos|>", "<|eos|>", "[UNK]", "hello", "world", "my", "name", "is"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_tiny_checkpoint(tmp_path, CONFIG, seed=3, max_shard_bytes=200_000)
    write_tokenizer(tmp_path)
    return tmp_path


def serve(model: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nanocp.cli", "serve", "--model", str(model), "--port", str(free_port())]
    cmd += ["--decode-instances", "2", "--backend", "threads", "--prefill-instances", "0", "--log-level", "critical"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)


def test_corrupt_config_is_named_before_anything_is_served(checkpoint):
    config = checkpoint / "config.json"
    config.write_text(config.read_text()[:40])
    run = serve(checkpoint)
    assert run.returncode == 2
    assert f"{config}: not valid JSON" in run.stderr
    assert "serving" not in run.stdout


def test_truncated_weights_stop_the_server_naming_the_shard(checkpoint):
    shard = sorted(checkpoint.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:1000])
    run = serve(checkpoint)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{shard.name}: corrupt or truncated" in run.stderr
    assert "cluster ready" not in run.stdout


def test_an_instance_process_that_dies_while_starting_fails_fast_with_the_reason(tmp_path: Path):
    """A script that builds a processes-backend LLM without a `__main__` guard: each spawned instance re-imports
    it and dies while bootstrapping. The driver reports the death in seconds (not after its 120 s start timeout),
    names the exit code and says what to fix."""
    script = tmp_path / "no_main_guard.py"
    script.write_text("from nanocp import LLM\nLLM(model='tiny', decode_instances=1, backend='processes')\n")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert run.returncode != 0
    assert "instance 0 died (exit code 1) while starting" in run.stderr, run.stderr[-2000:]
    assert "if __name__ == '__main__':" in run.stderr
