"""ModelConfig parsing (strict about math-changing keys) and YaRN rope numerics against HF transformers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from nanocp.models import ConfigError, ModelConfig, RotaryEmbedding, YarnScaling, softmax_scale

# DeepSeek-V3's published config.json, minus its fp8 quantization_config.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v3_config_parses_to_its_shapes():
    c = ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    assert (c.kv_cache_dim, c.q_latent_dim, c.qk_head_dim) == (576, 576, 192)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (256, 8, 8, 4)
    assert c.num_moe_layers == 58 and not c.is_moe_layer(2) and c.is_moe_layer(3)
    assert c.rope_scaling == YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    mscale = 0.1 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert c.dtype == "bfloat16" and c.eos_token_ids == (1,)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("model_type", "deepseek_v2", r"model_type='deepseek_v2' \(supported: 'deepseek_v3', 'kimi_k2'"),
        ("scoring_func", "softmax", "scoring_func"),
        ("topk_method", "greedy", "topk_method"),
        ("hidden_act", "gelu", "hidden_act"),
        ("attention_bias", True, "attention_bias"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
        ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ("sliding_window", 4096, "sliding_window"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "'linear'"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "'dynamic'"),
        ("rope_scaling", {"type": "yarn", "factor": 4.0, "low_freq_factor": 1}, "low_freq_factor"),
        ("rope_scaling", {"type": "yarn"}, "factor"),
        ("qk_head_dim", 100, "qk_head_dim"),
        ("n_group", 7, "n_group"),
        ("topk_group", 9, "topk_group"),
        ("num_experts_per_tok", 200, "num_experts_per_tok"),
        ("eos_token_id", 999999, "eos_token_id"),
    ],
)
def test_unsupported_or_math_changing_keys_are_errors_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG, key: value})


def test_missing_layer_count_is_an_error():
    d = dict(DEEPSEEK_V3_CONFIG)
    del d["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("layout", ["legacy", "transformers5"])
def test_hf_dict_round_trip(layout):
    for config in (ModelConfig.tiny(), dataclasses.replace(ModelConfig.tiny(), rope_scaling=None, q_lora_rank=None)):
        d = config.to_hf_dict()
        if layout == "transformers5":  # what transformers 5.x save_pretrained writes
            rope = d.pop("rope_scaling") or {"rope_type": "default"}
            d["rope_parameters"] = {**rope, "rope_theta": d.pop("rope_theta")}
        assert ModelConfig.from_hf_dict(d) == config


def test_transformers_saved_config_parses(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(**ModelConfig.tiny().to_hf_dict())
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_pretrained_dir(tmp_path) == ModelConfig.tiny()


def test_full_transformers_config_dict_parses():
    """to_dict() without diffing writes every base-class attribute; none of them may be mistaken for math."""
    transformers = pytest.importorskip("transformers")
    d = transformers.DeepseekV3Config(**ModelConfig.tiny().to_hf_dict()).to_dict()
    assert "output_router_logits" in d and "id2label" in d
    assert ModelConfig.from_hf_dict(d) == ModelConfig.tiny()


def test_corrupt_or_absent_config_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "hidden_')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_pretrained_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3_CONFIG, "scoring_func": "softmax"}))
    with pytest.raises(ConfigError, match=r"config\.json: unsupported scoring_func"):
        ModelConfig.from_pretrained_dir(tmp_path)


# The published config.json files of other DeepSeek-V3-architecture checkpoints (their keys that differ from V3's).
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
KIMI_K2_CONFIG = {
    **DEEPSEEK_V3_CONFIG,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "quantization_config": FP8_BLOCK,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "transformers_version": "4.48.3",
    "vocab_size": 163840,
}
MOONLIGHT_CONFIG = {
    **{k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "num_nextn_predict_layers"},
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "topk_group": 1,
    "vocab_size": 163840,
}


def test_kimi_k2_moonlight_and_fp8_deepseek_configs_parse():
    kimi = ModelConfig.from_hf_dict(KIMI_K2_CONFIG)
    assert kimi.model_type == "kimi_k2" and kimi.quantization.weight_block_size == (128, 128)
    assert (kimi.n_routed_experts, kimi.n_group, kimi.topk_group, kimi.num_attention_heads) == (384, 1, 1, 64)
    assert kimi.rope_scaling == YarnScaling(32.0, 4096, 1.0, 1.0, 1.0, 1.0) and kimi.rope_theta == 50000.0
    assert kimi.routed_scaling_factor == 2.827 and kimi.eos_token_ids == (163585,)
    assert ModelConfig.from_hf_dict(kimi.to_hf_dict()) == kimi
    moonlight = ModelConfig.from_hf_dict(MOONLIGHT_CONFIG)
    assert moonlight.q_lora_rank is None and moonlight.rope_scaling is None and moonlight.n_shared_experts == 2
    v3_fp8 = ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG, "quantization_config": FP8_BLOCK})  # V3, R1
    assert v3_fp8.quantization.weight_block_size == (128, 128) and v3_fp8.model_type == "deepseek_v3"
    v31 = ModelConfig.from_hf_dict({**DEEPSEEK_V3_CONFIG, "quantization_config": {**FP8_BLOCK, "scale_fmt": "ue8m0"}})
    assert v31.quantization.scale_fmt == "ue8m0"


def test_kimi_k2_thinking_int4_is_refused_naming_what_is_supported():
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}
    with pytest.raises(ConfigError, match=r"quant_method='compressed-tensors' \(supported: quant_method 'fp8'"):
        ModelConfig.from_hf_dict({**KIMI_K2_CONFIG, "quantization_config": int4})


YARN_CASES = [
    None,
    YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    YarnScaling(factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=0.707),
    YarnScaling(factor=8.0, original_max_position_embeddings=64, beta_fast=16.0, mscale=0.707, mscale_all_dim=1.0),
    YarnScaling(factor=2.0, original_max_position_embeddings=256, truncate=False),
    YarnScaling(factor=3.0, original_max_position_embeddings=256, attention_factor=1.3, mscale_all_dim=0.5),
]


@pytest.mark.parametrize("yarn", YARN_CASES)
@pytest.mark.parametrize("rope_dim", [16, 64])
def test_rope_frequencies_attention_factor_and_softmax_scale_match_hf(yarn, rope_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = dataclasses.replace(ModelConfig.tiny(), qk_rope_head_dim=rope_dim, rope_scaling=yarn, rope_theta=5000.0)
    hf_config = transformers.DeepseekV3Config(**config.to_hf_dict())
    rope = RotaryEmbedding.from_config(config)
    if yarn is None:
        inv_freq = 1.0 / (5000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        factor = 1.0
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(rope.inv_freq, inv_freq)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)
    assert softmax_scale(config) == pytest.approx(DeepseekV3Attention(hf_config, 0).scaling, rel=1e-12)


@pytest.mark.parametrize("interleave", [True, False])
def test_rotary_matches_hf_and_preserves_relative_dot_products(interleave):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = dataclasses.replace(ModelConfig.tiny(), rope_interleave=interleave)
    rope = RotaryEmbedding.from_config(config)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, 16, generator=gen)  # [T, H, rope]
    k = torch.randn(7, 16, generator=gen)
    positions = torch.randint(0, 10000, (7,), generator=gen)
    cos, sin = rope.cos_sin(positions)
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # HF's [B, T, rope]
    apply = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    hf_q, hf_k = apply(q.transpose(0, 1)[None], k[None, None], full_cos, full_sin)
    assert torch.equal(rope.apply(q, positions), hf_q[0].transpose(0, 1))
    assert torch.equal(rope.apply(k, positions), hf_k[0, 0])

    shifted = rope.apply(q, positions + 123)[:, 0] @ rope.apply(k, positions + 123).T
    torch.testing.assert_close(shifted, rope.apply(q, positions)[:, 0] @ rope.apply(k, positions).T, atol=1e-3, rtol=0)
