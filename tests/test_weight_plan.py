"""The planning check: per-instance weight bytes from a checkpoint's config.json and index alone, equal to what the
loader then reads and holds; a layout that cannot fit is refused naming the instance count that would."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from safetensors import safe_open

from nanocp.cli import main
from nanocp.data_plane.experts import owned_experts
from nanocp.models import ModelConfig, SafetensorsCheckpoint, build_weights, save_tiny_checkpoint
from nanocp.models.checkpoint import hf_tensor_shapes
from nanocp.models.quantization import scale_name
from nanocp.weight_plan import PlanError, format_bytes, parse_bytes, plan_weights

CONFIG = dataclasses.replace(ModelConfig.tiny(), hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


def _held_bytes(weights) -> int:
    """Every tensor a loaded model holds (lm_head once when tied)."""
    tensors = [weights.embed_tokens, weights.norm]
    if weights.lm_head is not weights.embed_tokens:
        tensors.append(weights.lm_head)
    for layer in weights.layers:
        tensors += [layer.input_norm, layer.post_attention_norm]
        tensors += [getattr(layer.attn, f.name) for f in dataclasses.fields(layer.attn)]
        mlps = [layer.mlp] if layer.moe is None else [layer.moe.shared, *layer.moe.experts.values()]
        if layer.moe is not None:
            tensors += [layer.moe.gate, layer.moe.e_score_correction_bias]
        tensors += [t for m in mlps if m is not None for t in (m.gate_proj, m.up_proj, m.down_proj)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _read_bytes(checkpoint: SafetensorsCheckpoint) -> int:
    """Bytes of the tensors the loader read, from their files' headers."""
    total = 0
    for name in checkpoint.read_names:
        with safe_open(str(checkpoint.directory / checkpoint.weight_map[name]), "pt") as f:
            piece = f.get_slice(name)
            total += math.prod(piece.get_shape()) * ITEMSIZE[piece.get_dtype()]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_equals_what_each_instance_reads_and_holds(tmp_path, dtype):
    write_fp8_checkpoint(tmp_path, CONFIG, seed=3, block=(48, 40), max_shard_bytes=60_000)
    plan = plan_weights(tmp_path, 3, dtype)  # 16 experts over 3 instances: 6, 6 and 4
    assert [w.experts for w in plan.instances] == [(0, 6), (6, 12), (12, 16)]
    assert plan.quantized_tensors > 0
    config = ModelConfig.from_pretrained_dir(tmp_path)
    for w in plan.instances:
        checkpoint = SafetensorsCheckpoint.open(tmp_path)
        weights = build_weights(config, checkpoint, set(owned_experts(w.rank, 3, 16)), dtype)
        assert w.resident_bytes == _held_bytes(weights)
        assert w.checkpoint_bytes == _read_bytes(checkpoint)


def test_plan_reads_no_tensor_data(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, max_shard_bytes=60_000, dtype=torch.bfloat16)
    before = plan_weights(tmp_path, 2)
    for shard in tmp_path.glob("model-*.safetensors"):
        shard.unlink()  # config.json and the index are all that is left
    assert plan_weights(tmp_path, 2) == before
    assert before.instances[0].checkpoint_bytes == before.instances[0].resident_bytes  # bf16 stored and loaded


def test_a_layout_that_cannot_fit_is_refused_naming_the_count_that_fits(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, max_shard_bytes=60_000)
    plan = plan_weights(tmp_path, 2, torch.float32)
    replicated, expert = plan.replicated_resident_bytes, plan.expert_resident_bytes
    memory = replicated + 5 * expert  # room for 5 experts: 16 experts need 4 instances
    plan.check_fits(plan.largest.resident_bytes)
    with pytest.raises(PlanError, match=r"instance 0 needs .* \+ 8 routed experts\), more .* at least 4 decode"):
        plan.check_fits(memory)
    plan_weights(tmp_path, 4, torch.float32).check_fits(memory)
    with pytest.raises(PlanError, match=r"instance 0 needs .* \+ 6 routed experts\)"):
        plan_weights(tmp_path, 3, torch.float32).check_fits(memory)  # 6 + 6 + 4
    with pytest.raises(PlanError, match="do not fit, whatever the instance count"):
        plan.check_fits(replicated + expert - 1)


def test_plan_names_a_tensor_missing_from_the_index(tmp_path):
    save_tiny_checkpoint(tmp_path, CONFIG, max_shard_bytes=60_000)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.2.mlp.experts.9.up_proj.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"does not list tensor 'model\.layers\.2\.mlp\.experts\.9\.up_proj\.weight'"):
        plan_weights(tmp_path, 2)


def test_deepseek_v3_fp8_on_32_and_8_instances(tmp_path):
    """The real DeepSeek-V3 release's layout (an index only, no data): its per-instance bytes, and 8 instances of
    80 GiB refused."""
    from test_models_config import DEEPSEEK_V3_CONFIG

    config = ModelConfig.from_hf_dict(
        {**DEEPSEEK_V3_CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    names = {}
    for name, shape in hf_tensor_shapes(config).items():
        names[name] = "model-00001-of-00001.safetensors"
        quantized = len(shape) == 2 and ("_proj" in name)
        if quantized:
            names[scale_name(name)] = names[name]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    (tmp_path / "config.json").write_text(json.dumps({**config.to_hf_dict(), "dtype": "bfloat16"}))
    plan = plan_weights(tmp_path, 32, torch.bfloat16)
    total_params = sum(math.prod(s) for s in hf_tensor_shapes(config).values())
    assert 670e9 < total_params < 672e9  # 671B without the MTP layer
    # bf16: 31.88 GiB replicated + 8 experts of 4.76 GiB; the FP8 files hold about half of it
    assert format_bytes(plan.largest.resident_bytes) == "69.95 GiB"
    assert format_bytes(plan.largest.checkpoint_bytes) == "36.81 GiB"
    plan.check_fits(parse_bytes("80GiB"))
    with pytest.raises(PlanError, match="at least 26 decode instances"):
        plan_weights(tmp_path, 8, torch.bfloat16).check_fits(parse_bytes("80GiB"))


def test_plan_command_line(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path, CONFIG, max_shard_bytes=60_000)
    assert main(["plan", str(tmp_path), "--decode-instances", "2", "--dtype", "float32"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["experts"] for line in lines] == [[0, 8], [8, 16]]
    assert main(["plan", str(tmp_path), "--decode-instances", "2", "--memory-per-instance", "64KiB"]) == 2
    assert "nanocp: error: instance 0 needs" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--decode-instances", "2", "--dtype", "int8"]) == 2
    assert "unknown --dtype 'int8'" in capsys.readouterr().err


def test_sizes_parse_and_print():
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("1.5 TB") == 1_500_000_000_000 and parse_bytes("12") == 12
    with pytest.raises(ValueError, match="cannot read '80 gigs' as a size"):
        parse_bytes("80 gigs")
    assert format_bytes(3 << 30) == "3.00 GiB" and format_bytes(10) == "10 B"
