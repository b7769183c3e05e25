"""Our DeepSeek-V3 math against HF transformers' DeepseekV3ForCausalLM on the same random weights (fp32, CPU).

Each config goes: our seeded weights -> save_tiny_checkpoint -> HF from_pretrained -> HF save_pretrained -> our
loader, so both checkpoint directions are exercised, then prompt logits and greedy continuations are compared.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from nanocp.models import (
    ContiguousKVCache,
    ModelConfig,
    YarnScaling,
    decode_step,
    greedy_generate,
    load_weights,
    prefill_forward,
    random_weights,
    save_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)
# HF builds a zero-width shared-expert MLP when n_shared_experts == 0
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

TINY = ModelConfig.tiny()
CONFIGS = {
    # dense + MoE, q_lora, n_group 4 / topk_group 2, one shared expert, yarn with mscale == mscale_all_dim
    "tiny": TINY,
    # plain q_proj, no rope scaling, a single expert group, two shared experts, unnormalised weights, rope
    # without interleave, tied embeddings
    "plain": dataclasses.replace(
        TINY,
        q_lora_rank=None,
        rope_scaling=None,
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        norm_topk_prob=False,
        rope_interleave=False,
        tie_word_embeddings=True,
    ),
    # two dense layers, no shared expert, yarn whose cos/sin attention factor is not 1 (mscale != mscale_all_dim)
    # and a short original context so that positions of a few dozen tokens sit in the interpolated band
    "yarn_mscale": dataclasses.replace(
        TINY,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        n_shared_experts=0,
        n_group=8,
        topk_group=3,
        num_experts_per_tok=3,
        routed_scaling_factor=1.7,
        rope_theta=500.0,
        rope_scaling=YarnScaling(
            factor=8.0, original_max_position_embeddings=64, beta_fast=16.0, mscale=0.707, mscale_all_dim=1.0
        ),
        max_position_embeddings=512,
    ),
}
SEEDS = {"tiny": 11, "plain": 12, "yarn_mscale": 13}


def _prompts(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (t,), generator=gen) for t in lengths]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, our weights loaded from HF's own save, HF model)."""
    name = request.param
    config = CONFIGS[name]
    ours_dir = tmp_path_factory.mktemp(f"{name}_ours")
    save_tiny_checkpoint(ours_dir, config, seed=SEEDS[name])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        ours_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    hf_dir = tmp_path_factory.mktemp(f"{name}_hf")
    hf.save_pretrained(hf_dir)
    return name, load_weights(hf_dir), hf


def _assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * scale)


def test_round_trip_through_hf_keeps_every_weight(pair):
    name, model, _ = pair
    direct = random_weights(CONFIGS[name], seed=SEEDS[name])
    assert torch.equal(model.embed_tokens, direct.embed_tokens)
    assert torch.equal(model.lm_head, direct.lm_head)
    for ours, ref in zip(model.layers, direct.layers):
        assert torch.equal(ours.attn.kv_b_proj, ref.attn.kv_b_proj)
        if ref.moe is not None:
            assert torch.equal(ours.moe.e_score_correction_bias, ref.moe.e_score_correction_bias)
            for e in (0, 5, CONFIGS[name].n_routed_experts - 1):
                assert torch.equal(ours.moe.experts[e].gate_proj, ref.moe.experts[e].gate_proj)
                assert torch.equal(ours.moe.experts[e].down_proj, ref.moe.experts[e].down_proj)


@torch.no_grad()
def test_prompt_logits_match_hf(pair):
    name, model, hf = pair
    for tokens in _prompts(4, seed=SEEDS[name]):
        ref = hf(tokens[None]).logits[0]
        _assert_logits_close(prefill_forward(model, tokens).logits, ref)


@torch.no_grad()
def test_absorbed_decode_logits_match_hf_teacher_forced(pair):
    """Prefill half a sequence, decode the rest token by token; every step's logits match HF's full forward."""
    name, model, hf = pair
    tokens = _prompts(1, seed=100 + SEEDS[name])[0]
    tokens = torch.cat([tokens, torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(5))])
    ref = hf(tokens[None]).logits[0]
    split = tokens.shape[0] - 12
    cache = ContiguousKVCache.from_prefill([prefill_forward(model, tokens[:split]).kv], capacity=tokens.shape[0])
    for i in range(split, tokens.shape[0]):
        _assert_logits_close(decode_step(model, cache, tokens[i : i + 1])[0], ref[i])


@torch.no_grad()
def test_greedy_continuation_matches_hf_generate(pair):
    name, model, hf = pair
    for tokens in _prompts(3, seed=200 + SEEDS[name]):
        out = hf.generate(
            tokens[None], max_new_tokens=8, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0
        )
        assert greedy_generate(model, tokens.tolist(), 8) == out[0, tokens.shape[0] :].tolist()


@torch.no_grad()
def test_hf_kv_cache_equals_our_latent_cache(pair):
    """Our prefill KV is exactly what HF caches (normalised latent | roped k_pe), layer by layer."""
    name, model, hf = pair
    tokens = _prompts(1, seed=300 + SEEDS[name])[0]
    cache = hf(tokens[None], use_cache=True).past_key_values
    ours = prefill_forward(model, tokens).kv  # [L, T, kv_lora + rope]
    for i, layer in enumerate(cache.layers):
        hf_kv = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)  # [T, kv_lora + rope]
        torch.testing.assert_close(ours[i], hf_kv, rtol=1e-5, atol=1e-5)
