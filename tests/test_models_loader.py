"""HF checkpoint loading: layouts (single, sharded, fused experts), expert subsets, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanocp.models import (
    CheckpointError,
    ConfigError,
    ModelConfig,
    SafetensorsCheckpoint,
    build_weights,
    load_model,
    load_weights,
    prefill_forward,
    random_weights,
    save_tiny_checkpoint,
)

# Smaller than tiny so that writing checkpoints stays cheap; still 1 dense + 2 MoE layers, 16 experts.
CONFIG = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
SEED = 7


@pytest.fixture(scope="module")
def reference():
    return random_weights(CONFIG, seed=SEED)


def _assert_same_weights(a, b, expert_ids=None):
    assert torch.equal(a.embed_tokens, b.embed_tokens) and torch.equal(a.lm_head, b.lm_head)
    assert torch.equal(a.norm, b.norm)
    for la, lb in zip(a.layers, b.layers):
        for f in dataclasses.fields(la.attn):
            x, y = getattr(la.attn, f.name), getattr(lb.attn, f.name)
            assert (x is None and y is None) or torch.equal(x, y), f.name
        assert torch.equal(la.input_norm, lb.input_norm)
        if la.moe is None:
            assert torch.equal(la.mlp.down_proj, lb.mlp.down_proj)
            continue
        assert torch.equal(la.moe.gate, lb.moe.gate)
        assert torch.equal(la.moe.e_score_correction_bias, lb.moe.e_score_correction_bias)
        assert torch.equal(la.moe.shared.up_proj, lb.moe.shared.up_proj)
        for e in expert_ids if expert_ids is not None else range(CONFIG.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(getattr(la.moe.experts[e], proj), getattr(lb.moe.experts[e], proj))


@pytest.mark.parametrize("layout", ["single", "sharded", "fused", "fused_sharded"])
def test_every_layout_loads_the_same_weights(tmp_path, reference, layout):
    save_tiny_checkpoint(
        tmp_path,
        CONFIG,
        seed=SEED,
        max_shard_bytes=200_000 if "sharded" in layout else None,
        fused_experts="fused" in layout,
    )
    if "sharded" in layout:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    _assert_same_weights(load_weights(tmp_path), reference)


def test_sharded_without_index_loads_by_scanning_files(tmp_path, reference):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, max_shard_bytes=200_000)
    (tmp_path / "model.safetensors.index.json").unlink()
    _assert_same_weights(load_weights(tmp_path), reference)


@pytest.mark.parametrize("fused", [False, True])
def test_only_requested_experts_are_read(tmp_path, reference, fused):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, fused_experts=fused)
    mine = {1, 6, 11, 12}
    checkpoint = SafetensorsCheckpoint.open(tmp_path)
    weights = build_weights(ModelConfig.from_pretrained_dir(tmp_path), checkpoint, expert_ids=mine)
    assert weights.expert_ids == mine
    _assert_same_weights(weights, reference, expert_ids=mine)
    expert_reads = [n for n in checkpoint.read_names if ".mlp.experts." in n]
    if fused:  # one slice per owned expert per fused tensor, never the whole stack
        assert sorted(expert_reads) == sorted(
            f"model.layers.{i}.mlp.experts.{p}[{e}]"
            for i in (1, 2)
            for e in mine
            for p in ("gate_up_proj", "down_proj")
        )
    else:
        read_experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in expert_reads}
        assert read_experts == mine and len(expert_reads) == 2 * 3 * len(mine)


def test_expert_ids_outside_the_model_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"expert ids \[16\]"):
        random_weights(CONFIG, expert_ids={3, 16})


def _rewrite(tmp_path, edit):
    """Apply edit(dict of tensors) to the single-file checkpoint in tmp_path."""
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.self_attn\.kv_b_proj\.weight'"):
        load_weights(tmp_path)


def test_missing_expert_is_named_unless_not_requested(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.9.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.9\.down_proj\.weight"):
        load_weights(tmp_path)
    assert load_weights(tmp_path, expert_ids={0, 1, 2, 3}).expert_ids == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("name", "shape"),
    [("model.layers.0.self_attn.q_b_proj.weight", (4 * 48, 95)), ("model.layers.1.mlp.gate.weight", (15, 64))],
)
def test_mis_shaped_tensor_is_named_with_both_shapes(tmp_path, name, shape):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED)
    _rewrite(tmp_path, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}' has shape \[{shape[0]}, {shape[1]}\]"):
        load_weights(tmp_path)


def test_mis_shaped_fused_experts_are_named(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, fused_experts=True)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.layers.2.mlp.experts.down_proj", torch.zeros(16, 64, 31)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.down_proj.*\[16, 64, 32\]"):
        load_weights(tmp_path, expert_ids={0})


@pytest.mark.parametrize("keep_fraction", [0.0, 0.001, 0.5, 0.999])
def test_truncated_safetensors_names_the_file(tmp_path, keep_fraction):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, max_shard_bytes=200_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt or truncated"):
        load_weights(tmp_path)


def test_missing_shard_and_corrupt_index_are_named(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, max_shard_bytes=200_000)
    index = tmp_path / "model.safetensors.index.json"
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.rename(tmp_path / "elsewhere.bin")
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard file listed in the checkpoint is missing"):
        load_weights(tmp_path)
    index.write_text(index.read_text()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        load_weights(tmp_path)


def test_checkpoint_directory_problems(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsCheckpoint.open(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG.to_hf_dict(), "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        load_weights(tmp_path)


def test_bf16_checkpoint_loads_in_the_requested_dtype(tmp_path, reference):
    save_tiny_checkpoint(tmp_path, CONFIG, seed=SEED, dtype=torch.bfloat16)
    weights = load_weights(tmp_path, dtype=torch.bfloat16)
    assert weights.layers[0].attn.kv_b_proj.dtype == torch.bfloat16
    assert weights.layers[1].moe.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(weights.layers[0].attn.o_proj, reference.layers[0].attn.o_proj.bfloat16())
    logits = prefill_forward(weights, torch.tensor([1, 2, 3, 4])).logits
    ref_logits = prefill_forward(reference, torch.tensor([1, 2, 3, 4])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert (logits.float().argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.5


def test_random_weights_are_deterministic_per_name_and_seed():
    a = load_model("tiny")
    b = random_weights(ModelConfig.tiny(), seed=0, expert_ids={15})
    c = random_weights(ModelConfig.tiny(), seed=1, expert_ids={15})
    assert torch.equal(a.layers[2].moe.experts[15].gate_proj, b.layers[2].moe.experts[15].gate_proj)
    assert not torch.equal(b.layers[2].moe.experts[15].gate_proj, c.layers[2].moe.experts[15].gate_proj)
    assert not torch.equal(a.layers[1].moe.experts[15].gate_proj, a.layers[2].moe.experts[15].gate_proj)
