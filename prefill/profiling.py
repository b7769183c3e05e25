"""Measure the real CPU SP prefill path and fit Eq. 1 (`nanocp profile prefill` -> prefill/profiles/cpu-tiny.json).

For every attention mode, SP size and (C, L) on a grid, a request of C + L tokens is prefilled on the first `sp`
instances of an `SpPrefillExecutor` in two chunks: C tokens (the history, not timed) and L tokens (timed). The
time is the chunk's critical-path latency from the executor's `CriticalPathClock`: every member's compute is
measured (thread CPU time, one intra-op thread) and a wait ends no earlier than the signals it waited for, i.e. the
latency with one core per instance and instantaneous (in-process) links. After one untimed warm-up per (mode, SP),
repeats are rounds over the whole grid and the minimum per point is kept (the machine may be shared), then Eq. 1 is
fitted per SP size with its fit quality.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nanocp.models import DeepseekV3Weights

from .latency_model import PROFILE_DIR, PrefillLatencyModel, save_profile
from .sp_exec import ChunkSpec, SpPrefillExecutor

DEFAULT_CONTEXTS = (0, 256, 512, 1024)
DEFAULT_LENGTHS = (64, 128, 256, 512, 1024)
DEFAULT_SP = (1, 2, 4)
DEFAULT_MODES = ("ring", "ulysses")


def measure_chunk(executor: SpPrefillExecutor, sp: int, mode: str, context: int, tokens: int, seed: int) -> float:
    """Critical-path seconds of an L-token chunk after a C-token history, both on instances 0..sp-1."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, executor.model.config.vocab_size, (context + tokens,), generator=gen)
    group = tuple(range(sp))
    executor.start("profile", prompt)
    try:
        if context:
            executor.run_chunk("profile", ChunkSpec(context, group, mode))
        return executor.run_chunk("profile", ChunkSpec(tokens, group, mode)).latency_s
    finally:
        executor.finish("profile")


def measure_samples(
    model: DeepseekV3Weights,
    sp_sizes: Sequence[int] = DEFAULT_SP,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    modes: Sequence[str] = DEFAULT_MODES,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[int, list[tuple[int, int, float]]]]:
    """(C, L, seconds) samples per attention mode and SP size, seconds = min over `repeats` runs."""
    if repeats < 1 or not sp_sizes or not contexts or not lengths or min(lengths) < 1 or min(contexts) < 0:
        raise ValueError("need repeats >= 1, SP sizes, contexts >= 0 and lengths >= 1")
    executor = SpPrefillExecutor(model, max(sp_sizes), max(contexts) + max(lengths), timing=True)
    grid = [(mode, sp, c, n) for mode in modes for sp in sp_sizes for c in contexts for n in lengths]
    best: dict[tuple[str, int, int, int], float] = {}
    try:
        for mode in modes:
            for sp in sp_sizes:
                measure_chunk(executor, sp, mode, max(contexts), max(lengths), seed=repeats)  # warm-up
        # Repeats are rounds over the whole grid, so a burst of load from other processes hits different points in
        # different rounds; the minimum per point is kept.
        for r in range(repeats):
            for mode, sp, context, tokens in grid:
                seconds = measure_chunk(executor, sp, mode, context, tokens, seed=r)
                key = (mode, sp, context, tokens)
                best[key] = min(seconds, best.get(key, float("inf")))
                if progress is not None:
                    progress(f"round {r + 1}/{repeats} {mode} sp={sp} C={context} L={tokens}: {seconds * 1e3:.1f} ms")
    finally:
        executor.close()
    samples: dict[str, dict[int, list[tuple[int, int, float]]]] = {}
    for mode, sp, context, tokens in grid:
        samples.setdefault(mode, {}).setdefault(sp, []).append((context, tokens, best[(mode, sp, context, tokens)]))
    return samples


def fit_profile(
    samples: dict[str, dict[int, list[tuple[int, int, float]]]], provenance: dict
) -> list[PrefillLatencyModel]:
    return [PrefillLatencyModel.fit_samples(mode, by_sp, dict(provenance)) for mode, by_sp in samples.items()]


def profile_cpu_prefill(
    model: DeepseekV3Weights,
    out: str | Path = PROFILE_DIR / "cpu-tiny.json",
    sp_sizes: Sequence[int] = DEFAULT_SP,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    modes: Sequence[str] = DEFAULT_MODES,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[PrefillLatencyModel]:
    """Measure, fit and write the profile; returns the fitted models (with fit quality). Runs with one intra-op
    thread: the clock counts the driver thread's CPU time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.time()
    try:
        samples = measure_samples(model, sp_sizes, contexts, lengths, modes, repeats, progress)
    finally:
        torch.set_num_threads(previous)
    provenance = {
        "kind": "measured by nanocp on CPU (tiny model, fp32), then Eq. 1 fitted (weighted least squares, >= 0)",
        "method": "chunk of L tokens after C history tokens on SP instances 0..sp-1 of SpPrefillExecutor; "
        "critical-path latency (each member's compute measured in thread CPU time, waits carry the sender's clock: "
        "one core per instance, in-process links, copies counted in the sender's compute); one untimed warm-up per "
        "(mode, SP), then rounds over the grid, min per point",
        "model": model.config.name or "tiny",
        "grid": {"contexts": list(contexts), "lengths": list(lengths), "sp": list(sp_sizes), "repeats": repeats},
        "samples": {mode: {str(sp): rows for sp, rows in by_sp.items()} for mode, by_sp in samples.items()},
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "torch_threads": 1,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "seconds_spent": round(time.time() - started, 1),
    }
    models = fit_profile(samples, provenance)
    save_profile(
        out,
        models,
        name=Path(out).stem,
        description="tiny DeepSeek-V3-style model, SP prefill on CPU (one core per instance), Eq. 1 fitted",
        provenance={"hardware": f"CPU ({platform.processor() or platform.machine()}), shared machine"},
    )
    return models


def write_report(models: list[PrefillLatencyModel], profile: str | Path, out: Path) -> Path:
    """Markdown summary of a measured profile: coefficients, fit quality, measured vs fitted samples."""
    lines = [
        "# CPU SP prefill profile (tiny model, measured)",
        "",
        f"Profile: `{profile}` (written by `nanocp profile prefill`). Critical-path latency of the real SP prefill "
        "path (`prefill/sp_exec.py`): every member's compute measured, waits carry the sender's clock (one core per "
        "instance, in-process links); min over repeats. Eq. 1 fitted per SP size (weighted least squares, "
        "coefficients >= 0).",
        "",
        "| mode | SP | a (ms) | b (us/token) | c (ns/token^2) | d (ns/token^2) | R^2 | mean rel err | max rel err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        for sp, k in m.coeffs.items():
            q = m.fit_quality[sp]
            lines.append(
                f"| {m.attention} | {sp} | {k.a * 1e3:.2f} | {k.b * 1e6:.2f} | {k.c * 1e9:.3f} | {k.d * 1e9:.3f} | "
                f"{q.r2:.4f} | {q.mean_rel_err:.1%} | {q.max_rel_err:.1%} |"
            )
    first = models[0].provenance
    lines += ["", "Measured (C, L) -> ms, and the fit:", ""]
    for m in models:
        for sp, rows in m.provenance.get("samples", {}).get(m.attention, {}).items():
            cells = ", ".join(f"({c}, {n}) {t * 1e3:.0f}/{m.latency(int(sp), c, n) * 1e3:.0f}" for c, n, t in rows)
            lines.append(f"- {m.attention} SP {sp}: {cells}")
    lines += ["", f"Machine: {first.get('machine')}; {first.get('seconds_spent')} s.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out
