"""Per-stream stall when an instance is killed (SIGKILL) or stopped (SIGSTOP) under live greedy streams.

The engine runs as `nanocp serve` builds it (processes backend, 4 decode instances, the CDSP prefill tier with 2
instances) with `streams` greedy requests of `tokens` tokens; `fault_at_s` after the first step one instance is
hit:

- decode kill / stop: one decode instance process gets SIGKILL / SIGSTOP (a hang: declared dead after the
  heartbeat timeout, then killed);
- prefill kill / stop: `prefill_wave` new requests arrive and a prefill instance of the CDSP tier dies / stops
  answering at its next step of their prefill (the tier runs in the driver process: fault injection).

A stream's stall is the longest gap between two of its tokens (its first token excluded: that gap is its TTFT);
the result has each stream's, their p50 and max, the same before the fault for scale, and whether every stream's
tokens equal an untouched run's (inline cluster).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

FAULTS = ("kill", "stop")
TIERS = ("decode", "prefill")


@dataclass(frozen=True)
class StallConfig:
    fault: str = "kill"  # kill | stop
    tier: str = "decode"  # decode | prefill
    streams: int = 12
    tokens: int = 1500
    fault_at_s: float = 1.5
    heartbeat_timeout_s: float = 3.0
    decode_instances: int = 4
    prefill_instances: int = 2
    prefill_wave: int = 4  # prefill faults: requests that arrive with the fault
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fault not in FAULTS or self.tier not in TIERS:
            raise ValueError(f"fault must be one of {FAULTS} and tier one of {TIERS}: {self.fault!r}, {self.tier!r}")


def _prompts(rng: random.Random, count: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _max_gap(times: list[float], start: float = -np.inf, end: float = np.inf) -> float:
    gaps = [b - a for a, b in zip(times, times[1:]) if start <= b <= end]
    return max(gaps, default=0.0)


def measure_stall(cfg: StallConfig, reference: bool = True) -> dict:
    """Run the streams, inject the fault, and measure every stream's stall (see the module docstring)."""
    from nanocp import LLM, SamplingParams
    from nanocp.engine import Engine, EngineConfig

    rng = random.Random(cfg.seed)
    prompts = _prompts(rng, cfg.streams, 10, 80)
    wave = _prompts(rng, cfg.prefill_wave, 150, 300) if cfg.tier == "prefill" else []
    params = SamplingParams(max_tokens=cfg.tokens, temperature=0.0, ignore_eos=True)
    wave_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = Engine(
        EngineConfig(
            model="tiny",
            decode_instances=cfg.decode_instances,
            backend="processes",
            kv_capacity_tokens=8192,
            prefill_instances=cfg.prefill_instances,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        )
    )
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params)
        victim, fault_time, pid = None, None, None
        with engine.driving():
            began = time.monotonic()
            while engine.has_unfinished():
                engine.step()
                if fault_time is None and time.monotonic() - began >= cfg.fault_at_s:
                    victim, pid = _inject(engine, cfg, wave, wave_params)
                    fault_time = time.monotonic()
        outputs = [engine.output_of(f"s{i}") for i in range(cfg.streams)]
        recoveries = [r.error for r in engine.recoveries]
        prefill_failures = [f.error for f in engine.prefill_tier.failures] if engine.prefill_tier else []
        decode_left = engine.spec.num_instances
    finally:
        engine.close()
    if fault_time is None:
        raise RuntimeError(f"the streams ended before {cfg.fault_at_s} s: give them more tokens")
    stalls = [_max_gap(o.metrics.token_times, start=fault_time) for o in outputs]
    before = [_max_gap(o.metrics.token_times[1:], end=fault_time) for o in outputs]
    result = {
        "config": cfg.__dict__,
        "victim": victim,
        "victim_pid": pid,
        "streams_running_at_fault": sum(1 for o in outputs if o.metrics.token_times[-1] > fault_time),
        "stall_s": [round(s, 4) for s in stalls],
        "stall_p50_s": float(np.median(stalls)),
        "stall_max_s": float(max(stalls)),
        "gap_before_fault_max_s": float(max(before)),
        "completed": sum(1 for o in outputs if o.finish_reason == "length" and len(o.token_ids) == cfg.tokens),
        "decode_recoveries": recoveries,
        "prefill_failures": prefill_failures,
        "decode_instances_after": decode_left,
    }
    if reference:
        with LLM("tiny", backend="inline", decode_instances=cfg.decode_instances, kv_capacity_tokens=8192) as llm:
            clean = [o.token_ids for o in llm.generate(prompts, params)]
        result["identical_to_untouched"] = sum(o.token_ids == c for o, c in zip(outputs, clean))
    return result


def _inject(engine, cfg: StallConfig, wave: list[list[int]], wave_params) -> tuple[int, int | None]:
    """Hit one instance; returns (its index, its process id for a decode instance)."""
    if cfg.tier == "decode":
        victim = cfg.decode_instances // 2
        pid = engine.cluster.instance_pids()[victim]
        (engine.cluster.kill_instance if cfg.fault == "kill" else engine.cluster.stop_instance)(victim)
        return victim, pid
    victim = 0
    executor = engine.prefill_tier.executor
    (executor.kill_instance if cfg.fault == "kill" else executor.stop_instance)(victim, after_resumes=0)
    for i, p in enumerate(wave):
        engine.add_request(f"w{i}", p, wave_params)
    return victim, None
