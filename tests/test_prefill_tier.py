"""CDSP prefill tier: planned, SP-executed, handed-off KV lands in the decode pages exactly as a single-instance
prefill computes it, with the same last-token logits; the Engine generates the same tokens with the tier."""

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
PAGE, FRAMES, DECODE = 8, 160, 3


def synthetic_models() -> list[PrefillLatencyModel]:
    """Eq. 1 models in which SP pays off already for a few hundred tokens, and ring wins with long history
    while Ulysses wins on fresh chunks, so plans chunk and mix both modes."""
    ring = {s: LatencyCoeffs(1e-3, 1e-4 / s, 0.8e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    ulysses = {s: LatencyCoeffs(1.5e-3, 0.8e-4 / s, 1.6e-6 / s, 0.5e-6 / s) for s in (1, 2, 4)}
    return [PrefillLatencyModel("ring", ring), PrefillLatencyModel("ulysses", ulysses)]


def random_destination(rng: random.Random, n: int, free: list[list[int]]) -> KVDestination:
    """Split n positions over 1-3 decode instances (random order), frames taken from each instance's free list."""
    k = rng.randint(1, min(DECODE, n))
    instances = rng.sample(range(DECODE), k)
    cuts = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    shards = []
    for instance, tokens in zip(instances, sizes):
        pages = -(-tokens // PAGE)
        frames = tuple(free[instance].pop(rng.randrange(len(free[instance]))) for _ in range(pages))
        shards.append(ShardDest(instance, tokens, frames))
    return KVDestination(tuple(shards))


def read_back(pools: list[PagedKVPool], destination: KVDestination) -> torch.Tensor:
    parts = []
    for shard in destination.shards:
        pages = pools[shard.instance].kv[:, list(shard.frames)]  # [L, pages, PAGE, Dkv]
        parts.append(pages.reshape(pages.shape[0], -1, pages.shape[-1])[:, : shard.tokens])
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("policy,backends,seed", [("fcfs", None, 0), ("fcfs", 1, 1), ("lars", 2, 2), ("lars", None, 3)])
def test_tier_kv_lands_in_decode_pages_like_a_single_instance_prefill(policy, backends, seed):
    rng = random.Random(seed)
    config = TierConfig(
        num_nodes=2,
        instances_per_node=2,
        queue_policy=policy,
        min_chunk_tokens=16,
        lars_quantum_s=0.01,
        transfer_backends=backends,
        improvement_rate=0.05,
        max_request_tokens=512,
    )
    pools = [PagedKVPool.allocate(3, FRAMES, PAGE, MODEL.config.kv_cache_dim, torch.float32) for _ in range(DECODE)]
    free = [list(range(FRAMES)) for _ in range(DECODE)]
    requests = []
    for k, n in enumerate([217, 235, 40, 152, 281]):  # lengths whose plans chunk under both policies
        tokens = [rng.randrange(256) for _ in range(n)]
        requests.append(PrefillRequest(f"r{k}", tokens, random_destination(rng, n, free), recompute=k == 2))
    with CdspPrefillTier(MODEL, config, synthetic_models()) as tier:
        logits = tier.prefill(requests, PoolSink(pools))
        schedule = tier.stats.schedule
    for r in requests:
        ref = prefill_forward(MODEL, torch.tensor(r.tokens))
        torch.testing.assert_close(read_back(pools, r.destination), ref.kv, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logits[r.rid], ref.logits[-1], atol=2e-5, rtol=1e-5)
    chunks_per_request = {r.rid: sum(d.rid == r.rid for d in schedule) for r in requests}
    assert max(chunks_per_request.values()) > 1, "no request was chunked: the test would not exercise CDSP"
    assert {d.attention for d in schedule} == {"ring", "ulysses"}
    assert {len(d.instances) for d in schedule} != {1}


def test_tier_rejects_bad_requests():
    with CdspPrefillTier(MODEL, TierConfig(max_request_tokens=64), synthetic_models()) as tier:
        dest = KVDestination((ShardDest(0, 4, (0,)),))
        sink = PoolSink([PagedKVPool.allocate(3, 4, PAGE, MODEL.config.kv_cache_dim, torch.float32)])
        with pytest.raises(TierError, match="duplicate"):
            tier.prefill([PrefillRequest("a", [1, 2, 3, 4], dest)] * 2, sink)
        with pytest.raises(TierError, match="holds 4 tokens"):
            tier.prefill([PrefillRequest("a", [1, 2, 3], dest)], sink)
        with pytest.raises(TierError, match="exceed"):
            tier.prefill([PrefillRequest("a", [1] * 65, dest)], sink)
        with pytest.raises(TierError, match="empty"):
            tier.prefill([PrefillRequest("a", [], dest)], sink)
        assert tier.prefill([], sink) == {}
    with pytest.raises(TierError, match="queue_policy"):
        CdspPrefillTier(MODEL, TierConfig(queue_policy="sjf"), synthetic_models())


def tier_prefill(engine, tier: CdspPrefillTier):
    """What the Engine's prefill becomes with the tier (the wiring the report documents)."""

    def _prefill(admitted, computed=None) -> None:  # the tier computes its own KV: an early packed one is unused
        requests = []
        for adm in admitted:
            req = engine.requests[adm.rid]
            context = (req.prompt + req.output)[: adm.context_len]
            moe = engine.scheduler.request_state(adm.rid).moe_instance
            destination = KVDestination.from_shard_pages(engine.scheduler.shard_pages(adm.rid), moe)
            requests.append(PrefillRequest(adm.rid, context, destination, adm.recompute))
        logits = tier.prefill(requests, engine.cluster)
        now = time.monotonic()
        for adm in admitted:
            if not adm.recompute:
                req = engine.requests[adm.rid]
                first = sample_token(logits[adm.rid], req.params, 0, req.seed)
                engine._append(req, first, logits[adm.rid].clone() if req.keep_logits else None, now)

    return _prefill


def test_engine_with_the_tier_generates_like_the_simple_prefill():
    rng = random.Random(9)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(30, 120))] for _ in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    force_cp = CPBucketTable((24, 10**9), (1, 4))  # KV split over 4 decode instances
    with LLM("tiny", decode_instances=4, cp_buckets=force_cp, page_size=4) as llm:
        baseline = llm.generate(prompts, params, return_logits=True)
    with LLM("tiny", decode_instances=4, cp_buckets=force_cp, page_size=4) as llm:
        config = TierConfig(instances_per_node=4, min_chunk_tokens=16, improvement_rate=0.05, max_request_tokens=256)
        with CdspPrefillTier(llm.engine.prefill_model, config, synthetic_models()) as tier:
            llm.engine._prefill = tier_prefill(llm.engine, tier)
            outs = llm.generate(prompts, params, return_logits=True)
            assert any(len(d.instances) > 1 for d in tier.stats.schedule)
    for base, out in zip(baseline, outs):
        assert out.token_ids == base.token_ids
        for a, b in zip(out.logits, base.logits):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
