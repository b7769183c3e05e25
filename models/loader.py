"""Building `DeepseekV3Weights` from a tensor source: an HF checkpoint on disk or seeded random weights.

Both sources are read tensor by tensor, so `expert_ids` limits what is ever materialised to one instance's experts.
Random weights derive one generator seed per tensor name: every process, and every subset of experts, sees the
same values for the same name.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from .checkpoint import (
    CheckpointError,
    SafetensorsCheckpoint,
    expert_names,
    fused_expert_names,
    hf_tensor_shapes,
    kept_in_float32,
    layer_prefix,
    materialised_bytes,
    write_safetensors,
)
from .config import ModelConfig
from .deepseek_v3 import AttentionWeights, DeepseekV3Weights, LayerWeights, MLPWeights, MoEWeights
from .quantization import FP8_DTYPE, dequantize_blocks, scale_name, scale_shape
from .rope import RotaryEmbedding

TINY_MODEL_NAME = "tiny"
TINY_SEED = 0


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def read(self, name: str) -> torch.Tensor: ...

    def read_index(self, name: str, index: int) -> torch.Tensor: ...


# ---- random weights ----------------------------------------------------------------------------------------


def name_seed(seed: int, name: str) -> int:
    """A generator seed for one tensor, stable across processes (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic fp32 values for a named tensor, scaled so activations stay O(1) through the network."""
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith("e_score_correction_bias"):
        return 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise
    return noise / math.sqrt(shape[-1])  # linear [out, in]: unit-variance outputs


class RandomTensorSource:
    """Seeded random weights under the classic HF names (per-expert layout)."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        self.shapes = hf_tensor_shapes(config)
        self.seed = seed

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name)

    def read(self, name: str) -> torch.Tensor:
        return random_tensor(name, self.shapes[name], self.seed)

    def read_index(self, name: str, index: int) -> torch.Tensor:
        return self.read(name)[index]


# ---- building weights --------------------------------------------------------------------------------------


def build_weights(
    config: ModelConfig,
    source: TensorSource,
    expert_ids: set[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> DeepseekV3Weights:
    """Read every tensor the model needs from source (routed experts: only expert_ids; None = all), dequantizing
    FP8 block-quantized ones to dtype; progress=True shows a bar over the bytes materialised."""
    if expert_ids is not None:
        bad = sorted(e for e in expert_ids if not 0 <= e < config.n_routed_experts)
        if bad:
            raise ValueError(f"expert ids {bad} outside [0, {config.n_routed_experts})")
    bar = LoadProgress(materialised_bytes(config, expert_ids, dtype), config.name) if progress else None
    reader = _Reader(source, config, dtype, torch.device(device), bar)
    try:
        rope = RotaryEmbedding.from_config(config, device)
        layers = [_build_layer(reader, config, i, expert_ids, rope) for i in range(config.num_hidden_layers)]
        embed_tokens = reader.get("model.embed_tokens.weight")
        lm_head = embed_tokens if config.tie_word_embeddings else reader.get("lm_head.weight")
        norm = reader.get("model.norm.weight")
    finally:
        if bar is not None:
            bar.close()
    return DeepseekV3Weights(
        config=config, embed_tokens=embed_tokens, layers=layers, norm=norm, lm_head=lm_head, rope=rope
    )


class LoadProgress:
    """A progress bar (tqdm) over the bytes of the weights being materialised."""

    def __init__(self, total_bytes: int, name: str) -> None:
        desc = f"loading {name}" if name else "loading weights"
        self.bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)

    def update(self, tensor: torch.Tensor) -> None:
        self.bar.update(tensor.numel() * tensor.element_size())

    def close(self) -> None:
        self.bar.close()


class _Reader:
    """Shape-checked, dtype-converting reads from a source; FP8 block-quantized weights (those with a `_scale_inv`
    companion) are dequantized on the target device, one tensor at a time."""

    def __init__(
        self,
        source: TensorSource,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        progress: LoadProgress | None = None,
    ):
        self.source, self.dtype, self.device = source, dtype, device
        self.shapes = hf_tensor_shapes(config, expert_ids=set())
        self.quantization = config.quantization
        self.progress = progress

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
        expected = shape or self.shapes[name]
        self.check_shape(name, expected)
        if self.scale_of(name, expected) is None:
            return self._done(self.source.read(name).to(device=self.device, dtype=dtype or self.dtype))
        weight = self.source.read(name).to(self.device)
        scale_inv = self.source.read(scale_name(name)).to(self.device)
        return self._done(self.dequantize(name, weight, scale_inv, dtype))

    def get_index(self, name: str, index: int, expected: tuple[int, ...]) -> torch.Tensor:
        self.check_shape(name, expected)
        if self.scale_of(name, expected) is None:
            return self._done(self.source.read_index(name, index).to(device=self.device, dtype=self.dtype))
        weight = self.source.read_index(name, index).to(self.device)
        scale_inv = self.source.read_index(scale_name(name), index).to(self.device)
        return self._done(self.dequantize(name, weight, scale_inv, None))

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        actual = self.source.shape(name)
        if actual is None:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {list(expected)})")
        if tuple(actual) != tuple(expected):
            raise CheckpointError(f"tensor {name!r} has shape {list(actual)}, expected {list(expected)}")

    def scale_of(self, name: str, expected: tuple[int, ...]) -> tuple[int, ...] | None:
        """The checked shape of name's scale companion, None when name is not quantized."""
        actual = self.source.shape(scale_name(name))
        if actual is None:
            return None
        if self.quantization is None:
            raise CheckpointError(
                f"tensor {name!r} has a {scale_name(name)!r} companion but config.json has no quantization_config:"
                " add the checkpoint's quantization_config (quant_method 'fp8', weight_block_size [b0, b1])"
            )
        if len(expected) < 2:
            raise CheckpointError(f"tensor {name!r} of shape {list(expected)} has a scale; only 2-D weights can")
        wanted = scale_shape(expected, self.quantization.weight_block_size)
        if tuple(actual) != wanted:
            b0, b1 = self.quantization.weight_block_size
            raise CheckpointError(
                f"tensor {scale_name(name)!r} has shape {list(actual)}, expected {list(wanted)} (one scale per"
                f" {b0} x {b1} block of {list(expected)})"
            )
        return wanted

    def dequantize(
        self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype | None
    ) -> torch.Tensor:
        if weight.dtype != FP8_DTYPE:
            raise CheckpointError(
                f"tensor {name!r} has a scale companion but is {weight.dtype}, expected {FP8_DTYPE} (float8_e4m3fn)"
            )
        assert self.quantization is not None  # scale_of checked it
        return dequantize_blocks(weight, scale_inv, self.quantization.weight_block_size, dtype or self.dtype)

    def _done(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.progress is not None:
            self.progress.update(tensor)
        return tensor


def _build_layer(
    reader: _Reader, config: ModelConfig, i: int, expert_ids: set[int] | None, rope: RotaryEmbedding
) -> LayerWeights:
    p, a = layer_prefix(i), f"{layer_prefix(i)}.self_attn"
    has_q_lora = config.q_lora_rank is not None
    attn = AttentionWeights(
        q_a_proj=reader.get(f"{a}.q_a_proj.weight") if has_q_lora else None,
        q_a_norm=reader.get(f"{a}.q_a_layernorm.weight") if has_q_lora else None,
        q_b_proj=reader.get(f"{a}.q_b_proj.weight") if has_q_lora else None,
        q_proj=None if has_q_lora else reader.get(f"{a}.q_proj.weight"),
        kv_a_proj=reader.get(f"{a}.kv_a_proj_with_mqa.weight"),
        kv_a_norm=reader.get(f"{a}.kv_a_layernorm.weight"),
        kv_b_proj=reader.get(f"{a}.kv_b_proj.weight"),
        o_proj=reader.get(f"{a}.o_proj.weight"),
    )
    mlp = moe = None
    if config.is_moe_layer(i):
        moe = _build_moe(reader, config, i, expert_ids)
    else:
        mlp = _read_mlp(reader, f"{p}.mlp")
    return LayerWeights(
        index=i,
        input_norm=reader.get(f"{p}.input_layernorm.weight"),
        post_attention_norm=reader.get(f"{p}.post_attention_layernorm.weight"),
        attn=attn,
        mlp=mlp,
        moe=moe,
        config=config,
        rope=rope,
    )


def _read_mlp(reader: _Reader, prefix: str) -> MLPWeights:
    return MLPWeights(
        gate_proj=reader.get(f"{prefix}.gate_proj.weight"),
        up_proj=reader.get(f"{prefix}.up_proj.weight"),
        down_proj=reader.get(f"{prefix}.down_proj.weight"),
    )


def _build_moe(reader: _Reader, config: ModelConfig, i: int, expert_ids: set[int] | None) -> MoEWeights:
    p = f"{layer_prefix(i)}.mlp"
    wanted = range(config.n_routed_experts) if expert_ids is None else sorted(expert_ids)
    return MoEWeights(
        gate=reader.get(f"{p}.gate.weight"),
        e_score_correction_bias=reader.get(f"{p}.gate.e_score_correction_bias", dtype=torch.float32),
        experts={e: _read_expert(reader, config, i, e) for e in wanted},
        shared=_read_mlp(reader, f"{p}.shared_experts") if config.n_shared_experts > 0 else None,
    )


def _read_expert(reader: _Reader, config: ModelConfig, i: int, e: int) -> MLPWeights:
    """One routed expert from either the classic per-expert tensors or a slice of the fused ones."""
    d, width = config.hidden_size, config.moe_intermediate_size
    gate_name, up_name, down_name = expert_names(i, e)
    gate_up_name, fused_down_name = fused_expert_names(i)
    if reader.source.shape(gate_name) is None and reader.source.shape(gate_up_name) is not None:
        num = config.n_routed_experts
        gate_up = reader.get_index(gate_up_name, e, (num, 2 * width, d))  # [2I, D], gate rows first
        return MLPWeights(
            gate_proj=gate_up[:width],
            up_proj=gate_up[width:],
            down_proj=reader.get_index(fused_down_name, e, (num, d, width)),
        )
    return MLPWeights(
        gate_proj=reader.get(gate_name, (width, d)),
        up_proj=reader.get(up_name, (width, d)),
        down_proj=reader.get(down_name, (d, width)),
    )


# ---- entry points ------------------------------------------------------------------------------------------


def load_weights(
    path: str | Path,
    config: ModelConfig | None = None,
    expert_ids: set[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> DeepseekV3Weights:
    """Load an HF DeepseekV3ForCausalLM checkpoint directory (config.json + safetensors, single or sharded; FP8
    block-quantized weights are dequantized to dtype tensor by tensor)."""
    config = config or ModelConfig.from_pretrained_dir(path)
    checkpoint = SafetensorsCheckpoint.open(path)
    return build_weights(config, checkpoint, expert_ids, dtype, device, progress)


def random_weights(
    config: ModelConfig,
    seed: int = TINY_SEED,
    expert_ids: set[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DeepseekV3Weights:
    return build_weights(config, RandomTensorSource(config, seed), expert_ids, dtype, device)


def load_model(
    model: str,
    expert_ids: set[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> DeepseekV3Weights:
    """ "tiny" -> the embedded random model (seed TINY_SEED); anything else is a checkpoint directory, read with a
    progress bar when progress=True."""
    if model == TINY_MODEL_NAME:
        return random_weights(ModelConfig.tiny(), TINY_SEED, expert_ids, dtype, device)
    return load_weights(model, None, expert_ids, dtype, device, progress)


def load_config(model: str) -> ModelConfig:
    """The config of "tiny" or of a checkpoint directory, without reading any weights."""
    return ModelConfig.tiny() if model == TINY_MODEL_NAME else ModelConfig.from_pretrained_dir(model)


def save_tiny_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    seed: int = TINY_SEED,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    fused_experts: bool = False,
) -> Path:
    """Write our seeded random weights as an HF-compatible checkpoint (config.json + safetensors).

    fused_experts=True stores experts as transformers 5.x's stacked gate_up_proj / down_proj instead of per expert.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source = RandomTensorSource(config, seed)
    tensors = {name: source.read(name).to(_storage_dtype(name, dtype)) for name in source.shapes}
    if fused_experts:
        tensors = _fuse_experts(config, tensors)
    write_safetensors(directory, tensors, max_shard_bytes)
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2), encoding="utf-8")
    return directory


def _storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if kept_in_float32(name) else dtype


def _fuse_experts(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            names = [expert_names(i, e) for e in range(config.n_routed_experts)]
            gate_up_name, down_name = fused_expert_names(i)
            out[gate_up_name] = torch.stack([torch.cat([tensors[g], tensors[u]]) for g, u, _ in names])
            out[down_name] = torch.stack([tensors[dn] for _, _, dn in names])
    expert_tensor_names = {n for i in range(config.num_hidden_layers) for n in _all_expert_names(config, i)}
    out.update({n: t for n, t in tensors.items() if n not in expert_tensor_names})
    return out


def _all_expert_names(config: ModelConfig, i: int) -> list[str]:
    if not config.is_moe_layer(i):
        return []
    return [n for e in range(config.n_routed_experts) for n in expert_names(i, e)]
