"""Tiny checkpoints in the official FP8 layout (DeepSeek-V3 / R1, Kimi-K2), written independently of the loader.

Every linear weight of attention and of the MLPs (dense, shared and routed experts) is stored as float8_e4m3fn with
a float32 `<name>_scale_inv` [ceil(out / b0), ceil(in / b1)]; embeddings, lm_head, norms, the router and its bias
stay unquantized (bf16, the bias fp32), as in the official releases.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from nanocp.models import ModelConfig, write_safetensors
from nanocp.models.loader import RandomTensorSource
from nanocp.models.quantization import Fp8BlockQuantization

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_quantized_in_releases(name: str, shape: tuple[int, ...]) -> bool:
    """Which tensors the official FP8 releases quantize: the 2-D projections of attention and the MLPs."""
    if len(shape) != 2 or not name.endswith(".weight") or name.endswith(".mlp.gate.weight"):
        return False
    return (".self_attn." in name and "layernorm" not in name) or ".mlp." in name


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] fp32 -> (fp8 [out, in], float32 scale_inv [ceil(out / b0), ceil(in / b1)]), amax scaling; the
    edge blocks are partial (zero padded while their amax is taken)."""
    rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, b0, nc, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(FP8).view(nr * b0, nc * b1)[:rows, :cols].contiguous()
    return q, scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return q.float() * full


def write_fp8_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    seed: int,
    block: tuple[int, int],
    max_shard_bytes: int | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Write seeded random weights in the FP8 layout; returns the config written and the fp32 weights the
    checkpoint stands for (each quantized tensor dequantized, the others as stored)."""
    config = dataclasses.replace(config, quantization=Fp8BlockQuantization(block), dtype="bfloat16")
    source = RandomTensorSource(config, seed)
    stored: dict[str, torch.Tensor] = {}
    real: dict[str, torch.Tensor] = {}
    for name, shape in source.shapes.items():
        w = source.read(name)
        if is_quantized_in_releases(name, shape):
            q, s = quantize(w, block)
            stored[name], stored[name + "_scale_inv"] = q, s
            real[name] = dequantize(q, s, block)
        elif name.endswith("e_score_correction_bias"):
            stored[name] = real[name] = w
        else:
            stored[name] = w.to(torch.bfloat16)
            real[name] = stored[name].float()
    directory = Path(directory)
    write_safetensors(directory, stored, max_shard_bytes)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = hf.pop("dtype")
    (directory / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    return config, real


def write_dequantized_checkpoint(directory: str | Path, config: ModelConfig, real: dict[str, torch.Tensor]) -> Path:
    """The same model as plain fp32 safetensors without quantization_config (what transformers reads on CPU)."""
    directory = Path(directory)
    write_safetensors(directory, real)
    hf = dataclasses.replace(config, quantization=None, dtype="float32", model_type="deepseek_v3").to_hf_dict()
    (directory / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    return directory
