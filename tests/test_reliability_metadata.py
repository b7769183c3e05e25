"""Routing-table pushes that are lost, corrupted or torn are detected and resent; outputs are unaffected."""

from __future__ import annotations

import random

from nanocp import LLM, SamplingParams
from nanocp.comm.metadata_channel import Fault
from nanocp.control_plane import CPBucketTable


def test_lost_corrupt_and_torn_tables_are_resent_never_executed():
    rnd = random.Random(4)
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(10, 50))] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=4, cp_buckets=CPBucketTable((24, 10**9), (1, 4)), page_size=8)
    with LLM("tiny", backend="inline", **kwargs) as llm:
        clean = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny", backend="processes", metadata_timeout_s=0.5, **kwargs) as llm:
        cluster = llm.engine.cluster
        cluster.inject_metadata_fault(1, Fault.DROP)
        cluster.inject_metadata_fault(2, Fault.CORRUPT)
        cluster.inject_metadata_fault(0, Fault.TEAR)
        cluster.inject_metadata_fault(0, Fault.CORRUPT)  # the resend of the torn table is corrupted too
        faulty = [o.token_ids for o in llm.generate(prompts, params)]
        assert cluster.resyncs == 4
    assert faulty == clean
