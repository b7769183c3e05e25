"""GPU bring-up: the one prepared command a lent GPU machine runs (`make gpu-check`, docs/gpu.md), and its CPU dry
run (`--dry-run`: the same steps on the CPU at tiny sizes; part of the test suite, so the script cannot rot).

    python -m nanocp.bench.gpu_check --out DIR [--dry-run] [--budget-s 330]

Steps, each in its own process with its own time limit (a failure or a hang costs that step only):
1. env: the GPU, driver, CUDA, torch and Triton versions; which GPU libraries import and which backend the data
   plane picks for each concern;
2. tests: the GPU-marked tests (CUDA graphs at every bucket, the decode data plane on the GPU against the CPU path,
   the FlashMLA / DeepGEMM / DeepEP / NVSHMEM adapters where their libraries exist) and the Triton routing kernels
   compiled for the GPU (TRITON_INTERPRET=0), each test's outcome recorded;
3. decode: the tiny model's decode on the device, two instances sharing it, eager against CUDA graphs (tokens/s);
4. layer: one DeepSeek-V3 layer at real dimensions timed per phase, fitted into a measured simulator profile and
   compared with the published-figure H200 profile (`nanocp.bench.gpu_layer`).
Writes DIR/gpu_check.json (every step's result, labelled with the GPU, driver, CUDA and torch versions),
DIR/gpu_check.md (the summary) and DIR/gpu_check.log (each step's output tail), plus the layer step's files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # a checkout (editable install): where tests/ lives
GPU_TESTS = (
    "tests/test_gpu_capability_checks.py",
    "tests/test_gpu_graphs.py",
    "tests/test_gpu_decode.py",
    "tests/test_kernels_routing.py",
    "tests/test_kernels_triton_mla.py",
    "tests/test_gpu_flashmla.py",
    "tests/test_gpu_deepgemm.py",
    "tests/test_gpu_deepep.py",
    "tests/test_gpu_nvshmem.py",
)
STEPS = ("env", "tests", "decode", "layer")
# Share of the budget each step may take (the rest is start-up slack); the layer step is told its own budget.
SHARES = {"env": 0.06, "tests": 0.36, "decode": 0.2, "layer": 0.32}
DRY_RUN_ENV = "NANOCP_GPU_DRY_RUN"


# ---- step 1: environment -----------------------------------------------------------------------------------------
def _command_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if out.returncode == 0 and lines else None


def environment(device: str) -> dict[str, Any]:
    """What the check ran on: GPU, driver, CUDA, library versions, and each accelerated backend's availability."""
    import importlib.util

    import torch

    from nanocp.comm.nvshmem_fabric import nvshmem_unavailable_reason
    from nanocp.data_plane.backends import Backends
    from nanocp.data_plane.backends.deepep import deepep_unavailable_reason
    from nanocp.data_plane.backends.deepgemm import deepgemm_unavailable_reason
    from nanocp.data_plane.backends.flashmla import flashmla_unavailable_reason
    from nanocp.data_plane.kernels import triton_unavailable_reason

    env: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "driver": _command_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "nvcc": _command_line(["nvcc", "--version"]),
        "cpus": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "sms": props.multi_processor_count,
            "memory_bytes": props.total_memory,
        }
    else:
        from .machine import cpu_model

        env["gpu"] = None
        env["cpu"] = cpu_model()
    env["libraries"] = {
        name: importlib.util.find_spec(name) is not None for name in ("flash_mla", "deep_ep", "deep_gemm", "nvshmem")
    }
    env["unavailable"] = {
        "flashmla": flashmla_unavailable_reason(device, 64, torch.bfloat16),
        "deepep": deepep_unavailable_reason(),
        "deepgemm": deepgemm_unavailable_reason(),
        "nvshmem": nvshmem_unavailable_reason(),
        "triton": triton_unavailable_reason(torch.device(device)),
    }
    env["backends"] = Backends.detect(device, 64, torch.bfloat16).describe()
    return env


# ---- step 2: tests -----------------------------------------------------------------------------------------------
def junit_outcomes(path: Path) -> list[dict[str, str]]:
    """Each test case of a pytest JUnit XML file: its id, outcome (passed / failed / error / skipped) and the first
    line of the reason where it did not pass."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "reason": message})
    return cases


def run_tests(dry_run: bool, timeout_s: float) -> dict[str, Any]:
    """The GPU tests under pytest (the dry run: on the CPU via NANOCP_GPU_DRY_RUN=1, Triton interpreted)."""
    files = [f for f in GPU_TESTS if (REPO / f).is_file()]
    if not files:
        return {"status": "error", "error": f"no tests under {REPO} (run from a checkout)"}
    env = dict(os.environ)
    if dry_run:
        env[DRY_RUN_ENV] = "1"
    else:
        env["TRITON_INTERPRET"] = "0"  # compile the Triton kernels for the GPU
        env.pop(DRY_RUN_ENV, None)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += files
        proc, elapsed = _run(cmd, timeout_s, env, cwd=REPO)
        cases = junit_outcomes(junit) if junit.is_file() else []
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    ok = proc is not None and proc.returncode == 0 and not counts["failed"] and not counts["error"]
    return {
        "status": "ok" if ok else ("timeout" if proc is None else "failed"),
        "seconds": round(elapsed, 1),
        "counts": counts,
        "cases": cases,
        "output_tail": _tail(proc, 30000),
    }


# ---- step 3: decode of the tiny model ----------------------------------------------------------------------------
def decode_rates(device: str, batches: list[int], new_tokens: int, dtype_name: str) -> list[dict[str, Any]]:
    """Greedy decode of random 32-token prompts by two instances sharing `device`, eager and with graphs; each
    configuration runs once to warm up (graph capture, allocator) and once timed."""
    import torch

    from nanocp import LLM

    from .bench_decode import nanocp_rates, prompts_for

    dtype = getattr(torch, dtype_name)
    rows = []
    for graphs in (False, True):
        kwargs = dict(decode_instances=2, max_batch_per_instance=max(batches), device=device, dtype=dtype)
        with LLM("tiny", use_graphs=graphs, **kwargs) as llm:
            for batch in batches:
                prompts = prompts_for(batch, 32, seed=batch)
                nanocp_rates(llm, prompts, new_tokens)  # warm-up: the same shapes, so every bucket is captured
                rates = nanocp_rates(llm, prompts, new_tokens)
                rows.append(
                    {
                        "mode": "cuda-graphs" if graphs and device != "cpu" else ("graphs" if graphs else "eager"),
                        "dtype": dtype_name,
                        "batch": batch,
                        "new_tokens": new_tokens,
                        "decode_tokens_per_s": round(rates.decode, 1),
                        "end_to_end_tokens_per_s": round(rates.end_to_end, 1),
                    }
                )
    return rows


# ---- orchestration -----------------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout_s: float, env=None, cwd=None) -> tuple[subprocess.CompletedProcess | None, float]:
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1), env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        proc = None
    return proc, time.monotonic() - start


def _tail(proc: subprocess.CompletedProcess | None, chars: int = 4000) -> str:
    if proc is None:
        return "(timed out)"
    return (proc.stdout + proc.stderr)[-chars:]


def _child_step(step: str, args: argparse.Namespace, result_file: Path) -> dict[str, Any]:
    """Run one step in a child process (`--step`), which writes its result to `result_file`."""
    cmd = [sys.executable, "-m", "nanocp.bench.gpu_check", "--step", step, "--result", str(result_file)]
    cmd += ["--out", str(args.out), "--budget-s", str(args.budget_s)] + (["--dry-run"] if args.dry_run else [])
    timeout = SHARES[step] * args.budget_s
    proc, elapsed = _run(cmd, timeout)
    if proc is not None and proc.returncode == 0 and result_file.is_file():
        result = json.loads(result_file.read_text())
        return {"status": "ok", "seconds": round(elapsed, 1), **result, "output_tail": _tail(proc, 1500)}
    status = "timeout" if proc is None else "failed"
    return {"status": status, "seconds": round(elapsed, 1), "output_tail": _tail(proc)}


def run_step(step: str, args: argparse.Namespace) -> dict[str, Any]:
    """The body of one step, in this process."""
    device = "cpu" if args.dry_run else "cuda"
    if step == "env":
        return environment(device)
    if step == "decode":
        if args.dry_run:
            return {"rows": decode_rates("cpu", [1, 4], 4, "float32")}
        return {"rows": decode_rates(device, [1, 8, 64], 64, "bfloat16") + decode_rates(device, [8], 64, "float32")}
    if step == "layer":
        from . import gpu_layer

        budget = SHARES["layer"] * args.budget_s * 0.8  # the rest: start-up, fitting, writing
        argv = ["--device", device, "--budget-s", f"{budget:.0f}", "--out", str(args.out)]
        code = gpu_layer.main(argv + (["--tiny"] if args.dry_run else []))
        written = sorted(p.name for p in Path(args.out).glob("*deepseek-v3*.json")) + sorted(
            p.name for p in Path(args.out).glob("gpu_layer_*")
        )
        if code != 0:
            raise RuntimeError(f"gpu_layer exited with {code}")
        return {"files": written}
    raise ValueError(f"unknown step {step!r} (steps: {', '.join(STEPS)})")


def summary_markdown(result: dict[str, Any]) -> str:
    env = result["steps"]["env"]
    label = (
        f"{env.get('gpu') or env.get('cpu', 'CPU')}, driver {env.get('driver')}, CUDA {env.get('cuda')}, "
        f"torch {env.get('torch')}, triton {env.get('triton')}"
        if env.get("status") == "ok"
        else "environment step failed"
    )
    lines = [
        f"# GPU check{' (CPU dry run)' if result['dry_run'] else ''}",
        "",
        f"Ran {result['started']} on {label}; {result['seconds']:.0f} s in all "
        f"(`python -m nanocp.bench.gpu_check{' --dry-run' if result['dry_run'] else ''}`).",
        "",
        "| step | status | seconds | result |",
        "|---|---|---|---|",
    ]
    for step in STEPS:
        s = result["steps"][step]
        lines.append(f"| {step} | {s['status']} | {s.get('seconds', '')} | {_step_line(step, s)} |")
    if env.get("status") == "ok":
        lines += ["", f"Backends picked on the device: {env.get('backends')}.", ""]
        lines += [f"- {name}: {reason or 'available'}" for name, reason in env.get("unavailable", {}).items()]
    tests = result["steps"]["tests"]
    bad = [c for c in tests.get("cases", []) if c["outcome"] in ("failed", "error")]
    if bad:
        lines += ["", "## Tests that failed", ""] + [f"- `{c['test']}`: {c['reason']}" for c in bad]
    skipped = [c for c in tests.get("cases", []) if c["outcome"] == "skipped"]
    if skipped:
        lines += ["", "## Tests skipped", ""] + [f"- `{c['test']}`: {c['reason']}" for c in skipped]
    rows = result["steps"]["decode"].get("rows", [])
    if rows:
        lines += ["", "## Tiny-model decode on the device (2 instances sharing it)", ""]
        lines += ["| mode | dtype | batch | decode tokens/s | end-to-end tokens/s |", "|---|---|---|---|---|"]
        for r in rows:
            rates = f"{r['decode_tokens_per_s']} | {r['end_to_end_tokens_per_s']}"
            lines.append(f"| {r['mode']} | {r['dtype']} | {r['batch']} | {rates} |")
    return "\n".join(lines) + "\n"


def _step_line(step: str, s: dict[str, Any]) -> str:
    if s["status"] != "ok" and step != "tests":
        return (s.get("output_tail") or "").strip().splitlines()[-1][:200] if s.get("output_tail") else ""
    if step == "env":
        return f"{s.get('gpu') or 'no GPU'} ({s.get('capability', 'cpu')})"
    if step == "tests":
        c = s.get("counts", {})
        return f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, " + (
            f"{c.get('skipped', 0)} skipped"
        )
    if step == "decode":
        return f"{len(s.get('rows', []))} configurations"
    return ", ".join(s.get("files", []))


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Every step in turn, each in a child process; the combined result (also written under args.out)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), time.monotonic()
    steps: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in STEPS:
            print(f"[gpu-check] {step} ...", flush=True)
            if step == "tests":
                steps[step] = run_tests(args.dry_run, SHARES[step] * args.budget_s)
            else:
                steps[step] = _child_step(step, args, Path(tmp) / f"{step}.json")
            print(f"[gpu-check] {step}: {steps[step]['status']} ({steps[step].get('seconds')} s)", flush=True)
    result = {"dry_run": args.dry_run, "started": started, "seconds": time.monotonic() - t0, "steps": steps}
    (out / "gpu_check.log").write_text(
        "".join(f"===== {k} =====\n{v.get('output_tail', '')}\n" for k, v in steps.items()), encoding="utf-8"
    )
    for v in steps.values():
        v.pop("output_tail", None)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "gpu_check.md").write_text(summary_markdown(result), encoding="utf-8")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanocp.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=".", help="directory for the results (default: the current directory)")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds for all steps together (default 330)")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # internal: run one step in this process
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU here (use --dry-run for the CPU dry run)", file=sys.stderr)
            return 2
    if args.step:
        Path(args.result).write_text(json.dumps(run_step(args.step, args)), encoding="utf-8")
        return 0
    result = check(args)
    print((Path(args.out) / "gpu_check.md").read_text(encoding="utf-8"))
    return 0 if all(s["status"] == "ok" for s in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
