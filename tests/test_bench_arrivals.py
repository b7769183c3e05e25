"""The arrivals benchmark's workload and replay (the benchmark itself runs under `python -m`)."""

from __future__ import annotations

from nanocp.bench.bench_arrivals import poisson_arrivals, replay
from nanocp.engine import Engine, EngineConfig


def test_poisson_arrivals_are_seeded_increasing_and_in_range():
    a, b = poisson_arrivals(50, 10.0, seed=1), poisson_arrivals(50, 10.0, seed=1)
    assert a == b and a != poisson_arrivals(50, 10.0, seed=2)
    times = [x.at for x in a]
    assert times == sorted(times) and times[0] > 0
    assert all(16 <= len(x.prompt) <= 128 and 16 <= x.max_tokens <= 64 for x in a)
    assert all(0 <= t < 256 for x in a for t in x.prompt)


def test_replay_serves_every_arrival_to_its_max_tokens():
    arrivals = poisson_arrivals(6, 200.0, seed=3)
    eng = Engine(EngineConfig(model="tiny", decode_instances=2, backend="inline"))
    try:
        result = replay(eng, arrivals)
    finally:
        eng.close()
    assert {rid: len(t) for rid, t in result.tokens.items()} == {f"a{i}": a.max_tokens for i, a in enumerate(arrivals)}
    assert result.tokens_per_s > 0 and result.tpot_ms > 0 and result.ttft_ms > 0
    assert result.overlapped_admissions == 0  # the inline backend runs one iteration at a time
