"""The C++ CDSP planner core makes exactly the decisions of the Python reference."""

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nanocp.control_plane import _core
from nanocp.prefill.latency_model import LatencyCoeffs, PrefillLatencyModel, load_profile, profile_path
from nanocp.prefill.planner import CdspPlanner, ChunkPlan, CoreCdspPlanner, PlannerConfig, PlannerError

A100 = load_profile(profile_path("a100-llama3-8b"))
H200 = load_profile(profile_path("h200-deepseek-v3"))


def assert_same_plan(got: ChunkPlan, want: ChunkPlan) -> None:
    assert [(c.tokens, c.context, c.instances, c.attention) for c in got.chunks] == [
        (c.tokens, c.context, c.instances, c.attention) for c in want.chunks
    ]
    for a, b in zip(got.chunks, want.chunks):
        assert a.start == pytest.approx(b.start, rel=1e-9, abs=1e-12)
        assert a.end == pytest.approx(b.end, rel=1e-9, abs=1e-12)
    assert got.ttft == pytest.approx(want.ttft, rel=1e-9)
    assert got.queue_updates.keys() == want.queue_updates.keys()


@st.composite
def random_models(draw):
    """One or two attention modes with random non-negative coefficients for random power-of-two SP sizes."""
    modes = []
    for name in draw(st.sampled_from([["ring"], ["ring", "ulysses"]])):
        sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8, 16, 32, 64]), min_size=1, max_size=7, unique=True))
        coeffs = {}
        for s in sizes:
            coeffs[s] = LatencyCoeffs(
                draw(st.floats(0.0, 0.5)),
                draw(st.floats(1e-7, 1e-4)) / s,
                draw(st.floats(0.0, 1e-8)) / s,
                draw(st.floats(0.0, 1e-8)) / s,
            )
        modes.append(PrefillLatencyModel(name, coeffs))
    return modes


@st.composite
def scenarios(draw, max_instances=48):
    per_node = draw(st.integers(1, 8))
    nodes = draw(st.integers(1, max(1, max_instances // per_node)))
    n = nodes * per_node
    models = draw(st.one_of(st.sampled_from([A100, H200, H200[1:]]), random_models()))
    config = PlannerConfig(
        num_nodes=nodes,
        instances_per_node=per_node,
        max_sp=draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64])),
        improvement_rate=draw(st.floats(0.0, 0.9)),
        chunking=draw(st.booleans()) or draw(st.booleans()),
        min_chunk_tokens=draw(st.sampled_from([1, 16, 1024, 4096])),
    )
    if not any(s in m.coeffs for m in models for s in (1, 2, 4, 8, 16, 32, 64) if s <= min(config.max_sp, n)):
        config = PlannerConfig(**{**vars(config), "max_sp": 64})
    length = draw(st.integers(1, 1_000_000))
    # queue times on the scale of this prompt's prefill latency, so that chunking pays off often
    scale = min(m.latency(s, 0, length) for m in models for s in m.sp_sizes) * draw(st.floats(0.05, 4.0))
    if draw(st.booleans()):
        queue = [scale * u for u in draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))]
    else:  # coarse values: plenty of ties to exercise the tie-breaking
        queue = [scale * q / 4 for q in draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))]
    return models, config, length, queue


def planners(models, config):
    try:
        py = CdspPlanner(models, config)
    except PlannerError:
        with pytest.raises((PlannerError, ValueError)):
            CoreCdspPlanner(models, config)
        return None
    return py, CoreCdspPlanner(models, config)


@settings(max_examples=250, deadline=None)
@given(scenario=scenarios())
def test_core_matches_python_cdsp(scenario):
    models, config, length, queue = scenario
    pair = planners(models, config)
    if pair is not None:
        py, core = pair
        assert core.sizes == py.sizes == core.core.sizes
        want = py.plan(length, queue)
        event(f"chunks={len(want.chunks)}")
        assert_same_plan(core.plan(length, queue), want)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_core_matches_python_on_loaded_pools(seed):
    # busy multi-node pools and long prompts: the regime where plans have several chunks
    rng = random.Random(seed)
    models = rng.choice([A100, H200, H200[:1]])
    per_node = rng.choice([2, 4, 8, 6, 3])
    nodes = rng.randint(1, 48 // per_node)
    config = PlannerConfig(
        num_nodes=nodes,
        instances_per_node=per_node,
        max_sp=rng.choice([8, 16, 32, 64]),
        improvement_rate=rng.uniform(0.0, 0.6),
        min_chunk_tokens=rng.choice([1, 256, 1024]),
    )
    length = int(2 ** rng.uniform(12, 20))
    scale = models[0].latency(models[0].sp_sizes[-1], 0, length) * rng.uniform(0.2, 3.0)
    queue = [scale * rng.random() for _ in range(config.num_instances)]
    if rng.random() < 0.3:  # whole groups finishing together, as after earlier plans
        queue = [queue[i - i % rng.choice([1, 2, 4])] for i in range(len(queue))]
    py, core = CdspPlanner(models, config), CoreCdspPlanner(models, config)
    want = py.plan(length, queue)
    event(f"chunks={len(want.chunks)}")
    assert_same_plan(core.plan(length, queue), want)


@settings(max_examples=80, deadline=None)
@given(scenario=scenarios(), policy=st.sampled_from(["fixed", "elastic"]))
def test_core_matches_python_baselines(scenario, policy):
    models, config, length, queue = scenario
    sizes = sorted({s for m in models for s in m.sp_sizes if s <= config.num_instances})
    if not sizes:
        return
    config = PlannerConfig(**{**vars(config), "policy": policy, "fixed_sp": sizes[-1]})
    pair = planners(models, config)
    if pair is not None:
        py, core = pair
        assert_same_plan(core.plan(length, queue), py.plan(length, queue))


@pytest.mark.parametrize("max_sp", [64, 128])
def test_core_matches_python_on_large_pools(max_sp):
    config = PlannerConfig(num_nodes=max_sp // 8, instances_per_node=8, max_sp=max_sp, improvement_rate=0.3)
    py, core = CdspPlanner(H200, config), CoreCdspPlanner(H200, config)
    rng = random.Random(max_sp)
    for _ in range(6):
        length = int(2 ** rng.uniform(12, 18))
        queue = [rng.uniform(0.0, 5.0) for _ in range(config.num_instances)]
        assert_same_plan(core.plan(length, queue), py.plan(length, queue))


@pytest.mark.parametrize("per_node, nodes, max_sp", [(6, 12, 64), (12, 6, 64), (8, 16, 128)])
def test_core_matches_python_on_large_loaded_pools(per_node, nodes, max_sp):
    # nodes that straddle bitset words, groups finishing together (ties, idle instances): pruning, memo and re-basing
    rng = random.Random(per_node * 100 + nodes)
    config = PlannerConfig(num_nodes=nodes, instances_per_node=per_node, max_sp=max_sp, improvement_rate=0.3)
    py, core = CdspPlanner(H200, config), CoreCdspPlanner(H200, config)
    for _ in range(5):
        length = int(2 ** rng.uniform(14, 18))
        queue: list[float] = []
        while len(queue) < config.num_instances:
            queue += [0.0 if rng.random() < 0.2 else rng.uniform(0.0, 3.0)] * rng.choice([1, 2, 4, 8])
        queue = queue[: config.num_instances]
        assert_same_plan(core.plan(length, queue), py.plan(length, queue))


def test_core_planner_wraps_core_errors():
    planner = CoreCdspPlanner(A100, PlannerConfig(num_nodes=1, instances_per_node=4, max_sp=4))
    with pytest.raises(PlannerError, match="queue time per instance"):
        planner.plan(1000, [0.0] * 5)
    with pytest.raises(PlannerError, match="finite"):
        planner.plan(1000, [0.0, -2.0, 0.0, 0.0])
    with pytest.raises(PlannerError, match="length"):
        planner.plan(1.5, [0.0] * 4)
    assert planner.plan(1000, [0, 1, 2, 3]).ttft > 0  # ints are fine


def test_core_rejects_bad_input():
    config = PlannerConfig(num_nodes=1, instances_per_node=4, max_sp=4)
    core = CoreCdspPlanner(A100, config).core
    with pytest.raises(ValueError, match="queue time per instance"):
        core.plan(1000, [0.0] * 3)
    with pytest.raises(ValueError, match="finite"):
        core.plan(1000, [0.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ValueError, match="length"):
        core.plan(0, [0.0] * 4)
    with pytest.raises(ValueError, match="improvement_rate"):
        _core.CdspPlanner(["ring"], [[(1, 0.1, 1e-5, 0.0, 0.0)]], 1, 4, 4, 1.5, True, 1, "cdsp", 0)
    with pytest.raises(ValueError, match="policy"):
        _core.CdspPlanner(["ring"], [[(1, 0.1, 1e-5, 0.0, 0.0)]], 1, 4, 4, 0.3, True, 1, "greedy", 0)
    with pytest.raises(ValueError, match="power-of-two"):
        _core.CdspPlanner(["ring"], [[(3, 0.1, 1e-5, 0.0, 0.0)]], 1, 4, 4, 0.3, True, 1, "cdsp", 0)
    with pytest.raises(ValueError, match="rows"):
        core.benchmark([1000, 2000], [0.0] * 4)


def test_core_benchmark_times_every_plan():
    config = PlannerConfig(num_nodes=2, instances_per_node=8, max_sp=16)
    core = CoreCdspPlanner(A100, config).core
    rng = random.Random(0)
    lengths = [rng.randint(1000, 200_000) for _ in range(20)]
    queues = [rng.uniform(0, 3) for _ in range(20 * 16)]
    ns = core.benchmark(lengths, queues)
    assert len(ns) == 20 and all(t > 0 for t in ns)
