"""FP8 block-quantized checkpoints (the official DeepSeek-V3 / R1 / Kimi-K2 layout), dequantized at load.

The checkpoints are written by tests/fp8_checkpoints.py (random weights quantized per block, partial blocks at the
edges); the model loaded from them must equal, tensor for tensor and logit for logit, a model built from the
dequantized weights, and its greedy tokens must equal transformers' on those weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from fp8_checkpoints import dequantize, quantize, write_dequantized_checkpoint, write_fp8_checkpoint

from nanocp.models import (
    CheckpointError,
    ConfigError,
    ModelConfig,
    SafetensorsCheckpoint,
    build_weights,
    greedy_generate,
    load_weights,
    prefill_forward,
    write_safetensors,
)
from nanocp.models.checkpoint import materialised_bytes
from nanocp.models.quantization import Fp8BlockQuantization, QuantizationError, dequantize_blocks

# 1 dense + 2 MoE layers, 16 experts; hidden 64, expert width 32, kv_a rows 64 + 16 = 80.
CONFIG = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
SEED = 5
# (128, 128): every tensor is one partial block; (16, 32): whole blocks except kv_a's 80 rows x q_b's 96 columns;
# (48, 40): partial blocks at every edge.
BLOCKS = [(128, 128), (16, 32), (48, 40)]


class DictSource:
    """A TensorSource over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.tensors[name].shape) if name in self.tensors else None

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def read_index(self, name: str, index: int) -> torch.Tensor:
        return self.tensors[name][index]


def _weights_equal(a, b, experts) -> None:
    assert torch.equal(a.embed_tokens, b.embed_tokens) and torch.equal(a.lm_head, b.lm_head)
    for la, lb in zip(a.layers, b.layers):
        for f in dataclasses.fields(la.attn):
            x, y = getattr(la.attn, f.name), getattr(lb.attn, f.name)
            assert (x is None and y is None) or torch.equal(x, y), f.name
        mlps = [(la.mlp, lb.mlp)] if la.moe is None else [(la.moe.shared, lb.moe.shared)]
        if la.moe is not None:
            assert torch.equal(la.moe.gate, lb.moe.gate)
            mlps += [(la.moe.experts[e], lb.moe.experts[e]) for e in experts]
        for x, y in mlps:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(getattr(x, proj), getattr(y, proj)), proj


# ---- dequantization ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(80, 64), (1, 1), (130, 257)])
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_blocks_equals_the_blockwise_product_in_every_chunking(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    q, s = quantize(w, block)
    ref = dequantize(q, s, block)
    for chunk in (1, block[0] * shape[1], 10**9):  # one row block at a time ... everything at once
        assert torch.equal(dequantize_blocks(q, s, block, torch.float32, chunk_elements=chunk), ref)
    assert torch.equal(dequantize_blocks(q, s, block, torch.bfloat16), ref.bfloat16())
    assert (ref - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits


def test_dequantize_blocks_refuses_a_scale_of_the_wrong_shape():
    q, s = quantize(torch.randn(80, 64), (16, 32))
    with pytest.raises(QuantizationError, match=r"scale shape \[5, 3\] .* \(expected \[5, 2\]\)"):
        dequantize_blocks(q, torch.ones(5, 3), (16, 32), torch.float32)


# ---- checkpoints ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_checkpoint_equals_the_model_on_its_dequantized_weights(tmp_path, block):
    config, real = write_fp8_checkpoint(tmp_path, CONFIG, SEED, block, max_shard_bytes=60_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2  # sharded, with an index
    loaded = load_weights(tmp_path)
    assert loaded.config.quantization == Fp8BlockQuantization(block)
    reference = build_weights(dataclasses.replace(config, quantization=None), DictSource(real))
    _weights_equal(loaded, reference, range(CONFIG.n_routed_experts))
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    assert torch.equal(prefill_forward(loaded, tokens).logits, prefill_forward(reference, tokens).logits)


def test_fp8_checkpoint_loads_in_bf16_with_one_rounding(tmp_path):
    config, real = write_fp8_checkpoint(tmp_path, CONFIG, SEED, (16, 32))
    loaded = load_weights(tmp_path, dtype=torch.bfloat16)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(loaded.layers[1].moe.experts[3].down_proj, real[name].bfloat16())
    assert loaded.layers[1].moe.e_score_correction_bias.dtype == torch.float32


def test_loading_shows_a_progress_bar_over_the_bytes_materialised(tmp_path, capsys):
    write_fp8_checkpoint(tmp_path, CONFIG, SEED, (16, 32))
    load_weights(tmp_path, expert_ids={0, 1}, dtype=torch.bfloat16, progress=True)
    config = ModelConfig.from_pretrained_dir(tmp_path)
    total = materialised_bytes(config, {0, 1}, torch.bfloat16)
    bar = capsys.readouterr().err.strip().splitlines()[-1]
    assert bar.startswith(f"loading {tmp_path}: 100%") and f"{total / 1024:.0f}k/{total / 1024:.0f}k" in bar


def test_an_instance_reads_only_its_experts_and_their_scales(tmp_path):
    write_fp8_checkpoint(tmp_path, CONFIG, SEED, (16, 32), max_shard_bytes=60_000)
    checkpoint = SafetensorsCheckpoint.open(tmp_path)
    mine = {2, 7}
    build_weights(ModelConfig.from_pretrained_dir(tmp_path), checkpoint, expert_ids=mine)
    expert_reads = [n for n in checkpoint.read_names if ".mlp.experts." in n]
    assert sorted(expert_reads) == sorted(
        f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight{suffix}"
        for i in (1, 2)
        for e in mine
        for p in ("gate", "up", "down")
        for suffix in ("", "_scale_inv")
    )


def test_fused_fp8_experts_are_read_one_expert_at_a_time(tmp_path):
    """transformers 5.x stacks experts (gate_up_proj [E, 2I, D], down_proj [E, D, I]); a stacked FP8 tensor's
    scale is stacked the same way, and an instance reads one expert's slice of both."""
    block, width = (16, 32), CONFIG.moe_intermediate_size
    _, real = write_fp8_checkpoint(tmp_path / "classic", CONFIG, SEED, block)
    stored = {n: t for n, t in real.items() if ".mlp.experts." not in n}
    for i in (1, 2):
        experts = [f"model.layers.{i}.mlp.experts.{e}" for e in range(CONFIG.n_routed_experts)]
        gate_up = torch.stack([torch.cat([real[f"{p}.{w}_proj.weight"] for w in ("gate", "up")]) for p in experts])
        down = torch.stack([real[f"{p}.down_proj.weight"] for p in experts])
        for name, stacked in (("gate_up_proj", gate_up), ("down_proj", down)):
            pairs = [quantize(w, block) for w in stacked]
            stored[f"model.layers.{i}.mlp.experts.{name}"] = torch.stack([q for q, _ in pairs])
            stored[f"model.layers.{i}.mlp.experts.{name}_scale_inv"] = torch.stack([s for _, s in pairs])
    write_safetensors(tmp_path / "fused", stored)
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "classic" / "config.json").read_text())
    checkpoint = SafetensorsCheckpoint.open(tmp_path / "fused")
    loaded = build_weights(ModelConfig.from_pretrained_dir(tmp_path / "fused"), checkpoint, expert_ids={4})
    name = "model.layers.2.mlp.experts.gate_up_proj"
    expected = dequantize(stored[name][4], stored[name + "_scale_inv"][4], block)
    assert torch.equal(loaded.layers[2].moe.experts[4].gate_proj, expected[:width])
    assert torch.equal(loaded.layers[2].moe.experts[4].up_proj, expected[width:])
    assert f"{name}_scale_inv[4]" in checkpoint.read_names and not any("[3]" in n for n in checkpoint.read_names)


def _rewrite(directory, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(path))


def test_fp8_checkpoint_problems_are_named(tmp_path):
    write_fp8_checkpoint(tmp_path, CONFIG, SEED, (16, 32))
    name = "model.layers.0.self_attn.q_a_proj.weight"  # [96, 64]: 6 x 2 blocks, the first tensor read
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has a '{name}_scale_inv' companion but config.json has no"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _rewrite(tmp_path, lambda t: t.__setitem__(name + "_scale_inv", torch.ones(7, 2)))
    with pytest.raises(CheckpointError, match=r"_scale_inv' has shape \[7, 2\], expected \[6, 2\] \(one scale per"):
        load_weights(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({name: t[name].float(), name + "_scale_inv": torch.ones(6, 2)}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has a scale companion but is torch.float32"):
        load_weights(tmp_path)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "quant_method='compressed-tensors'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "weight_block_size"),
        ({"quant_method": "fp8", "scale_fmt": "e8m0fnu"}, "scale_fmt"),
        ({"quant_method": "fp8", "input_scale": 1.0}, "input_scale"),
    ],
)
def test_unsupported_quantization_is_refused_naming_what_is_supported(quantization_config, message):
    d = {**CONFIG.to_hf_dict(), "quantization_config": quantization_config}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_official_quantization_configs_parse():
    v3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert ModelConfig.from_hf_dict({**CONFIG.to_hf_dict(), "quantization_config": v3}).quantization == (
        Fp8BlockQuantization((128, 128))
    )
    v31 = {**v3, "scale_fmt": "ue8m0"}
    config = ModelConfig.from_hf_dict({**CONFIG.to_hf_dict(), "quantization_config": v31})
    assert config.quantization == Fp8BlockQuantization((128, 128), "ue8m0")
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


# ---- against transformers --------------------------------------------------------------------------------------

KIMI_LIKE = dataclasses.replace(
    CONFIG,
    model_type="kimi_k2",
    n_group=1,
    topk_group=1,
    num_experts_per_tok=6,
    routed_scaling_factor=2.827,
    rope_theta=50000.0,
    rope_scaling=dataclasses.replace(CONFIG.rope_scaling, factor=32.0, beta_fast=1.0, beta_slow=1.0),
)


@pytest.mark.parametrize(("config", "block"), [(CONFIG, (48, 40)), (KIMI_LIKE, (16, 32))], ids=["v3", "kimi_k2"])
@torch.no_grad()
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, config, block):
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    written, real = write_fp8_checkpoint(tmp_path / "fp8", config, SEED, block)
    ours = load_weights(tmp_path / "fp8")
    assert ours.config.model_type == config.model_type
    hf_dir = write_dequantized_checkpoint(tmp_path / "hf", written, real)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    for length in (1, 9, 23):
        prompt = torch.randint(0, 256, (length,), generator=gen)
        out = hf.eval().generate(
            prompt[None],
            attention_mask=torch.ones(1, length, dtype=torch.int64),  # else a prompt token 0 would be padding
            max_new_tokens=8,
            do_sample=False,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert greedy_generate(ours, prompt.tolist(), 8) == out[0, length:].tolist()
