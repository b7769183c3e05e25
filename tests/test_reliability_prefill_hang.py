"""A prefill instance of the CDSP tier stops answering without dying: it is declared dead once silent for the
heartbeat timeout, the requests whose KV had not landed are re-planned on the survivors, and their KV and logits
are still exactly a single-instance prefill's."""

from __future__ import annotations

import random
import time

from test_reliability_prefill import (
    MODEL,
    assert_like_single_instance,
    new_pools,
    random_requests,
    sp_friendly_models,
    tier_config,
)

from nanocp.prefill.handoff import PoolSink
from nanocp.prefill.tier import CdspPrefillTier, TierConfig

HEARTBEAT_S = 0.3


def test_a_stopped_prefill_instance_is_declared_dead_after_the_heartbeat_timeout():
    requests = random_requests(random.Random(5), 4)
    pools = new_pools()
    config = TierConfig(**{**tier_config().__dict__, "heartbeat_timeout_s": HEARTBEAT_S})
    with CdspPrefillTier(MODEL, config, sp_friendly_models()) as tier:
        tier.executor.stop_instance(1, after_resumes=4)
        began = time.monotonic()
        logits = tier.prefill(requests, PoolSink(pools))
        took = time.monotonic() - began
        assert [f.instance for f in tier.failures] == [1]
        assert "no heartbeat for 0.3 s" in tier.failures[0].error
        assert 1 not in tier.failures[0].survivors
        assert_like_single_instance(pools, requests, logits)
    assert took >= HEARTBEAT_S  # it waited for the heartbeat timeout, not a fabric timeout (60 s)
    assert took < 30
