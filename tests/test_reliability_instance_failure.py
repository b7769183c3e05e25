"""A decode instance process dies mid-run: the engine learns it at once (not after a fabric wait timeout), shrinks
the EP group to the survivors and every request still completes with the same tokens."""

from __future__ import annotations

import random
import time

from nanocp import LLM, SamplingParams
from nanocp.control_plane import CPBucketTable


def test_killed_instance_is_survived_with_identical_outputs():
    rnd = random.Random(8)
    prompts = [[rnd.randrange(256) for _ in range(rnd.randint(8, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=4, cp_buckets=CPBucketTable((24, 10**9), (1, 4)), page_size=8)
    with LLM("tiny", backend="inline", **kwargs) as llm:
        clean = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny", backend="processes", timeout_s=30.0, **kwargs) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        for _ in range(3):
            engine.step()
        engine.cluster.kill_instance(2)
        killed_at = time.monotonic()
        while not engine.recoveries:
            engine.step()
        # the survivors' fabric waits were aborted: no 30 s timeout, and the cluster was rebuilt in their processes
        assert time.monotonic() - killed_at < 10.0
        while engine.has_unfinished():
            engine.step()
        outs = [engine.output_of(f"r{i}") for i in range(len(prompts))]
        assert len(engine.recoveries) == 1 and engine.recoveries[0].dead_instances == (2,)
        assert engine.spec.num_instances == 3
        assert all(ld.kv_tokens == 0 for ld in engine.scheduler.loads())
    assert [o.token_ids for o in outs] == clean
    assert all(o.finish_reason == "length" for o in outs)
