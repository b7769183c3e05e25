"""Decode data plane: outputs must not depend on placement (policy, CP degree, growth, preemption, backend)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from nanocp import LLM, SamplingParams
from nanocp.control_plane import CPBucketTable
from nanocp.models import ContiguousKVCache, decode_step, load_model, prefill_forward

FORCE_CP = CPBucketTable((24, 10**9), (1, 4))  # prompts longer than 24 tokens are split over 4 instances


@pytest.fixture(scope="module")
def reference_model():
    return load_model("tiny")


def reference_logits(model, prompt: list[int], output: list[int]) -> list[torch.Tensor]:
    """Single-instance run, teacher-forced on `output`: the logits that produced each output token."""
    pre = prefill_forward(model, torch.tensor(prompt))
    out = [pre.logits[-1]]
    cache = ContiguousKVCache.from_prefill([pre.kv], capacity=len(prompt) + len(output))
    for token in output[:-1]:
        out.append(decode_step(model, cache, torch.tensor([token]))[0])
    return out


def assert_logits_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 1e-5, f"step {step}: max relative error {rel:.2e}"


def random_prompts(n: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(256) for _ in range(rnd.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize(
    "policy,buckets",
    [
        ("nanocp", FORCE_CP),
        ("uniform-cp:2", None),
        ("uniform-cp:4", None),
        ("least-batch", None),
    ],
)
def test_logits_match_single_instance_for_every_policy(reference_model, policy, buckets):
    prompts = random_prompts(6, seed=hash(policy) & 0xFFFF)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("tiny", decode_instances=4, policy=policy, cp_buckets=buckets, page_size=8) as llm:
        outs = llm.generate(prompts, params, return_logits=True)
    for prompt, out in zip(prompts, outs):
        ref = reference_logits(reference_model, prompt, out.token_ids)
        assert_logits_close(out.logits, ref)
        assert out.token_ids == [int(r.argmax()) for r in ref]  # greedy tokens are the reference's
        assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_cp_is_really_used_and_growth_crosses_pages(reference_model):
    """Long prompts split over 4 instances; page size 4 makes every shard grow across many pages."""
    prompts = random_prompts(3, seed=11, low=40, high=70)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM("tiny", decode_instances=4, cp_buckets=FORCE_CP, page_size=4) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params, keep_logits=True)
        plan_splits = []
        while engine.has_unfinished():
            engine.step()
            live = [rid for rid, r in engine.requests.items() if r.finish_reason is None]
            plan_splits += [engine.scheduler.request_state(rid).kv_split for rid in live]
        outs = [engine.output_of(f"r{i}") for i in range(3)]
    assert any(len(split) == 4 for split in plan_splits), "CP > 1 was never used"
    for prompt, out in zip(prompts, outs):
        assert_logits_close(out.logits, reference_logits(reference_model, prompt, out.token_ids))


def test_preempted_and_relocated_requests_keep_their_outputs(reference_model):
    """A cluster too small for every request: growth relocates KV, the scheduler preempts and recomputes."""
    prompts = random_prompts(8, seed=5, low=20, high=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM("tiny", decode_instances=2, policy="least-batch", kv_capacity_tokens=96, page_size=4) as llm:
        outs = llm.generate(prompts, params, return_logits=True)
    assert sum(o.metrics.preemptions for o in outs) > 0, "the test did not exercise preemption"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == [int(r.argmax()) for r in reference_logits(reference_model, prompt, out.token_ids)]


def test_moe_binding_moves_do_not_change_outputs(reference_model):
    """Under nanocp, short requests finishing early make a long request's MoE binding move (no data moves)."""
    long_prompt = random_prompts(1, seed=21, low=50, high=60)[0]
    short_prompts = random_prompts(3, seed=22, low=3, high=8)
    greedy = dict(temperature=0.0, ignore_eos=True)
    with LLM("tiny", decode_instances=2, cp_buckets=FORCE_CP, page_size=8) as llm:
        engine = llm.engine
        engine.add_request("L", long_prompt, SamplingParams(max_tokens=12, **greedy), keep_logits=True)
        for i, p in enumerate(short_prompts):  # the first and last end early, the middle one keeps running
            engine.add_request(f"S{i}", p, SamplingParams(max_tokens=12 if i == 1 else 2, **greedy))
        moe_seen = set()
        while engine.has_unfinished():
            engine.step()
            if "L" in engine.scheduler and engine.scheduler.request_state("L").running:
                moe_seen.add(engine.scheduler.request_state("L").moe_instance)
        out = engine.output_of("L")
    assert len(moe_seen) > 1, "the MoE binding never moved"
    assert_logits_close(out.logits, reference_logits(reference_model, long_prompt, out.token_ids))


def test_every_backend_gives_the_same_tokens():
    prompts = random_prompts(4, seed=3, low=10, high=50)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=4, cp_buckets=FORCE_CP, page_size=8)
    tokens = {}
    for backend in ("inline", "threads", "processes"):
        with LLM("tiny", backend=backend, **kwargs) as llm:
            tokens[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["inline"] == tokens["threads"] == tokens["processes"]


def test_seeded_sampling_is_independent_of_placement():
    prompts = random_prompts(4, seed=9, low=10, high=50)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    with LLM("tiny", decode_instances=4, cp_buckets=FORCE_CP) as llm:
        a = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny", decode_instances=2, policy="least-cache") as llm:
        b = [o.token_ids for o in llm.generate(prompts, params)]
    assert a == b
    with LLM("tiny", decode_instances=2) as llm:
        c = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.9, seed=99))]
    assert c != a


def test_stop_strings_eos_and_text():
    with LLM("tiny", decode_instances=2) as llm:
        free = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        stop_token = free.token_ids[3]
        stopped = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_token,)))[0]
        first = free.token_ids.index(stop_token)
        assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
        text = free.text
        stop_str = text[2:4] if len(text) >= 4 else text[-1:]
        cut = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0.0, stop=(stop_str,), ignore_eos=True))[0]
        assert cut.finish_reason == "stop" and stop_str not in cut.text and text.startswith(cut.text)
        one = llm.generate([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0))[0]
        ref = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        assert one.token_ids == ref.token_ids[:1] and one.finish_reason in ("length", "stop")
        # every page is back once everything is done
        assert all(ld.kv_tokens == 0 for ld in llm.engine.scheduler.loads())


def test_single_token_requests_match_the_reference_prefill(reference_model):
    """max_tokens=1 requests never reach the decode cluster: one packed prefill gives each its only token."""
    rnd = random.Random(31)
    prompts = [[rnd.randrange(256) for _ in range(rnd.randrange(1, 20))] for _ in range(5)]
    params = [SamplingParams(max_tokens=1, temperature=t, seed=rnd.randrange(1000)) for t in (0.0, 0.0, 0.7, 1.2, 0.0)]
    with LLM("tiny", decode_instances=2) as llm:
        ones = llm.generate(prompts, params, return_logits=True)
        longer = [dataclasses.replace(p, max_tokens=3, ignore_eos=True) for p in params]
        firsts = llm.generate(prompts, longer)
        plain = llm.generate(prompts[:1], params[:1])[0]
        assert all(ld.kv_tokens == 0 for ld in llm.engine.scheduler.loads())
    for prompt, one, first in zip(prompts, ones, firsts):
        ref = prefill_forward(reference_model, torch.tensor(prompt)).logits[-1]
        assert len(one.token_ids) == 1 and one.token_ids == first.token_ids[:1]
        assert_logits_close(one.logits, [ref])
    assert plain.logits is None  # logits are kept only when asked for


def test_bad_requests_are_rejected_without_harming_others():
    with LLM("tiny", decode_instances=2) as llm:
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([[1, 2, 999]], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="context"):
            llm.generate([[1] * 10], SamplingParams(max_tokens=10**6))
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError):
            SamplingParams(top_p=0.0)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3


def test_graph_path_gives_the_same_tokens_as_eager():
    prompts = random_prompts(4, seed=13, low=10, high=50)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    kwargs = dict(decode_instances=4, cp_buckets=FORCE_CP, page_size=8, max_batch_per_instance=8)
    with LLM("tiny", **kwargs) as llm:
        eager = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM("tiny", use_graphs=True, **kwargs) as llm:
        graphs = [o.token_ids for o in llm.generate(prompts, params)]
    assert graphs == eager


def test_cdsp_prefill_tier_feeds_the_decode_cluster_like_the_driver_prefill(reference_model):
    """Prompts prefilled by the CDSP tier (chunkwise SP over 2 prefill instances, KV handed to the scheduler's
    pages) decode exactly like the single-instance reference, also with multi-step windows."""
    prompts = random_prompts(4, seed=31, low=5, high=90)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("tiny", decode_instances=4, cp_buckets=FORCE_CP, prefill_instances=2, num_steps=2) as llm:
        outs = llm.generate(prompts, params, return_logits=True)
        assert llm.engine.prefill_tier is not None
    for prompt, out in zip(prompts, outs):
        assert_logits_close(out.logits, reference_logits(reference_model, prompt, out.token_ids))
