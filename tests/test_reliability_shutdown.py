"""A process cluster nobody closed: at interpreter exit its instance processes stop and its shared memory is freed,
without a traceback from the instances or the shared-memory segments."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from nanocp.comm import _shm

SCRIPT = textwrap.dedent(
    """
    from nanocp import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM("tiny", decode_instances=2, backend="processes")
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        print("PREFIX", llm.engine.cluster._info.prefix)
        print("TOKENS", len(out[0].token_ids))
    """
)


def test_an_unclosed_process_cluster_shuts_down_cleanly_at_exit(tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "TOKENS 4" in done.stdout
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    prefix = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("PREFIX"))
    assert _shm.list_prefix(prefix) == []
