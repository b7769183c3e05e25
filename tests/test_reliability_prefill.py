"""A prefill instance of the CDSP tier dies (mid-chunk or between chunks): the requests whose KV had not landed are
re-planned on the surviving instances and their KV and logits are still exactly a single-instance prefill's; with no
instance left the call fails with an explicit error instead of hanging."""

from __future__ import annotations

import random
import time

import pytest
import torch

from nanocp import LLM, SamplingParams
from nanocp.control_plane import CPBucketTable
from nanocp.data_plane.kv_pool import PagedKVPool
from nanocp.data_plane.sampling import sample_token
from nanocp.models import load_model, prefill_forward
from nanocp.prefill.handoff import KVDestination, PoolSink, ShardDest
from nanocp.prefill.latency_model import LatencyCoeffs, PrefillLatencyModel
from nanocp.prefill.tier import CdspPrefillTier, PrefillRequest, TierConfig, TierError

MODEL = load_model("tiny")
PAGE, FRAMES, DECODE = 8, 200, 3


def sp_friendly_models() -> list[PrefillLatencyModel]:
    """Eq. 1 models in which SP pays off for a few hundred tokens, so plans chunk and use wide groups."""
    ring = {s: LatencyCoeffs(1e-3, 1e-4 / s, 0.8e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    ulysses = {s: LatencyCoeffs(1.5e-3, 0.8e-4 / s, 1.6e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    return [PrefillLatencyModel("ring", ring), PrefillLatencyModel("ulysses", ulysses)]


def tier_config(policy: str = "fcfs") -> TierConfig:
    return TierConfig(
        num_nodes=2,
        instances_per_node=2,
        queue_policy=policy,
        min_chunk_tokens=16,
        lars_quantum_s=0.01,
        improvement_rate=0.05,
        max_request_tokens=512,
    )


def random_requests(rng: random.Random, count: int) -> list[PrefillRequest]:
    """`count` prompts of random length, each split over 1-3 decode instances with frames from free lists."""
    free = [list(range(FRAMES)) for _ in range(DECODE)]
    out = []
    for k in range(count):
        n = rng.randint(60, 280)
        tokens = [rng.randrange(256) for _ in range(n)]
        parts = rng.randint(1, DECODE)
        instances = rng.sample(range(DECODE), parts)
        cuts = sorted(rng.sample(range(1, n), parts - 1))
        shards = []
        for instance, (a, b) in zip(instances, zip([0, *cuts], [*cuts, n])):
            frames = tuple(free[instance].pop(rng.randrange(len(free[instance]))) for _ in range(-(-(b - a) // PAGE)))
            shards.append(ShardDest(instance, b - a, frames))
        out.append(PrefillRequest(f"r{k}", tokens, KVDestination(tuple(shards)), recompute=rng.random() < 0.2))
    return out


def new_pools() -> list[PagedKVPool]:
    return [PagedKVPool.allocate(3, FRAMES, PAGE, MODEL.config.kv_cache_dim, torch.float32) for _ in range(DECODE)]


def read_back(pools: list[PagedKVPool], destination: KVDestination) -> torch.Tensor:
    parts = []
    for shard in destination.shards:
        pages = pools[shard.instance].kv[:, list(shard.frames)]  # [L, pages, PAGE, Dkv]
        parts.append(pages.reshape(pages.shape[0], -1, pages.shape[-1])[:, : shard.tokens])
    return torch.cat(parts, dim=1)


def assert_like_single_instance(pools, requests, logits) -> None:
    assert set(logits) == {r.rid for r in requests}
    for r in requests:
        ref = prefill_forward(MODEL, torch.tensor(r.tokens))
        torch.testing.assert_close(read_back(pools, r.destination), ref.kv, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits[r.rid], ref.logits[-1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("policy,seed", [("fcfs", 0), ("fcfs", 1), ("lars", 2), ("lars", 3)])
def test_instance_dying_mid_call_is_replanned_on_the_survivors(policy, seed):
    rng = random.Random(seed)
    requests = random_requests(rng, 5)
    victim, after = rng.randrange(4), rng.randint(0, 20)  # every instance resumes > 20 times in these calls
    pools = new_pools()
    with CdspPrefillTier(MODEL, tier_config(policy), sp_friendly_models()) as tier:
        tier.executor.kill_instance(victim, after_resumes=after)
        logits = tier.prefill(requests, PoolSink(pools))
        assert_like_single_instance(pools, requests, logits)
        assert [f.instance for f in tier.failures] == [victim]
        failure = tier.failures[0]
        assert failure.replanned and set(failure.replanned) <= {r.rid for r in requests}
        if policy == "fcfs":  # whole plans run one request after another: the first ones landed before the death
            assert len(failure.replanned) < len(requests)
        assert victim not in failure.survivors and len(failure.survivors) == 3
        assert tier.stats.failures == [failure]
        # later calls never plan the dead instance, and are still exact
        more = random_requests(random.Random(seed + 100), 3)
        pools = new_pools()
        logits = tier.prefill(more, PoolSink(pools))
        assert_like_single_instance(pools, more, logits)
        assert all(victim not in d.instances for d in tier.stats.schedule)
        assert tier.stats.failures == [] and any(len(d.instances) > 1 for d in tier.stats.schedule)


def test_losing_a_whole_node_keeps_the_node_layout():
    rng = random.Random(5)
    requests = random_requests(rng, 4)
    pools = new_pools()
    with CdspPrefillTier(MODEL, tier_config(), sp_friendly_models()) as tier:
        tier.executor.kill_instance(0)
        tier.executor.kill_instance(1, after_resumes=3)
        logits = tier.prefill(requests, PoolSink(pools))
        assert sorted(f.instance for f in tier.failures) == [0, 1]
        assert tier.members == [2, 3]
        assert (tier.planner.config.num_nodes, tier.planner.config.instances_per_node) == (1, 2)
    assert_like_single_instance(pools, requests, logits)


def test_no_instance_left_is_an_explicit_error_not_a_hang():
    requests = random_requests(random.Random(6), 3)
    with CdspPrefillTier(MODEL, tier_config(), sp_friendly_models()) as tier:
        for rank in range(4):
            tier.executor.kill_instance(rank, after_resumes=rank)
        began = time.monotonic()
        with pytest.raises(TierError, match="every prefill instance is gone"):
            tier.prefill(requests, PoolSink(new_pools()))
        assert time.monotonic() - began < 30
        assert sorted(f.instance for f in tier.failures) == [0, 1, 2, 3]
        assert tier.executor.requests == {}  # nothing left half-prefilled
    with pytest.raises(ValueError, match="outside"):
        CdspPrefillTier(MODEL, tier_config(), sp_friendly_models()).executor.kill_instance(4)


def test_engine_with_the_tier_survives_a_prefill_instance_death():
    """The Engine's prefill replaced by the tier (as in test_prefill_tier): a prefill instance dies while the
    requests are prefilled, and the generated tokens are those of the plain engine."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(40, 150))] for _ in range(5)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    force_cp = CPBucketTable((24, 10**9), (1, 4))
    with LLM("tiny", decode_instances=4, cp_buckets=force_cp, page_size=4) as llm:
        baseline = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny", decode_instances=4, cp_buckets=force_cp, page_size=4) as llm:
        engine = llm.engine
        config = TierConfig(instances_per_node=4, min_chunk_tokens=16, improvement_rate=0.05, max_request_tokens=256)
        with CdspPrefillTier(engine.prefill_model, config, sp_friendly_models()) as tier:

            def prefill(admitted, computed=None) -> None:  # the tier computes its own KV
                requests = []
                for adm in admitted:
                    req = engine.requests[adm.rid]
                    moe = engine.scheduler.request_state(adm.rid).moe_instance
                    destination = KVDestination.from_shard_pages(engine.scheduler.shard_pages(adm.rid), moe)
                    context = (req.prompt + req.output)[: adm.context_len]
                    requests.append(PrefillRequest(adm.rid, context, destination, adm.recompute))
                logits = tier.prefill(requests, engine.cluster)
                for adm in admitted:
                    if not adm.recompute:
                        req = engine.requests[adm.rid]
                        token = sample_token(logits[adm.rid], req.params, 0, req.seed)
                        engine._append(req, token, None, time.monotonic())

            engine._prefill = prefill
            tier.executor.kill_instance(0, after_resumes=7)
            outs = [o.token_ids for o in llm.generate(prompts, params)]
            assert [f.instance for f in tier.failures] == [0]
    assert outs == baseline
