"""The driver's packed prefill on prepared weights against the single-prompt reference prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.data_plane.decode_layers import DecodeWeights
from nanocp.data_plane.packed_prefill import MAX_PADDING, length_groups, prefill_packed
from nanocp.models import ModelConfig, prefill_forward, random_weights

TINY = ModelConfig.tiny()
PLAIN = dataclasses.replace(TINY, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1)


@pytest.fixture(scope="module", params=["tiny", "plain"])
def models(request):
    config = TINY if request.param == "tiny" else PLAIN
    model = random_weights(config, seed=7)
    return model, DecodeWeights.build(model, range(config.n_routed_experts))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("lens", [[1], [5, 17, 1, 33], [32] * 9, [3, 60, 4, 59, 12, 12, 13, 2]])
def test_packed_prefill_equals_the_reference_per_prompt(models, lens):
    model, weights = models
    gen = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in lens]
    outs = prefill_packed(weights, prompts)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        ref = prefill_forward(model, prompt)
        assert out.kv.shape == ref.kv.shape and out.logits.shape == (1, model.config.vocab_size)
        assert rel_err(out.kv, ref.kv) < 1e-5
        assert rel_err(out.logits[-1], ref.logits[-1]) < 1e-5


@settings(max_examples=50, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=30))
def test_length_groups_partition_the_prompts_with_bounded_padding(lens):
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert len(g) * max(lens[i] for i in g) <= MAX_PADDING * sum(lens[i] for i in g) or len(g) == 1


def test_packed_prefill_rejects_bad_prompts(models):
    model, weights = models
    with pytest.raises(ValueError, match="vocabulary"):
        prefill_packed(weights, [torch.tensor([1, model.config.vocab_size])])
    with pytest.raises(ValueError, match="non-empty"):
        prefill_packed(weights, [torch.tensor([], dtype=torch.int64)])
    with pytest.raises(ValueError, match="every routed expert"):
        prefill_packed(DecodeWeights.build(model, [0, 1]).with_experts(model, []), [torch.tensor([1, 2])])
    assert prefill_packed(weights, []) == []
