"""HF safetensors checkpoints of DeepseekV3ForCausalLM: tensor names and shapes, a lazy reader, a writer.

The reader opens each file's header only and reads a tensor when asked, so a process can materialise just the
experts it owns. It understands both the classic per-expert names (`mlp.experts.E.gate_proj.weight`, what
transformers 5.x `save_pretrained` writes) and the fused in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, D],
`mlp.experts.down_proj` [E, D, I]), reading one expert's slice of a fused tensor without the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the config; the message names the culprit."""


# ---- names and shapes --------------------------------------------------------------------------------------


def layer_prefix(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}"


def expert_names(layer_idx: int, expert_id: int) -> tuple[str, str, str]:
    """Classic per-expert names: gate, up, down."""
    p = f"{layer_prefix(layer_idx)}.mlp.experts.{expert_id}"
    return f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"


def fused_expert_names(layer_idx: int) -> tuple[str, str]:
    """transformers 5.x in-memory names: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I]."""
    p = f"{layer_prefix(layer_idx)}.mlp.experts"
    return f"{p}.gate_up_proj", f"{p}.down_proj"


def hf_tensor_shapes(config: ModelConfig, expert_ids: set[int] | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint (classic per-expert layout) -> shape; experts limited to expert_ids."""
    c = config
    d, heads = c.hidden_size, c.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = layer_prefix(i)
        shapes[f"{p}.input_layernorm.weight"] = (d,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
        a = f"{p}.self_attn"
        if c.q_lora_rank is None:
            shapes[f"{a}.q_proj.weight"] = (heads * c.qk_head_dim, d)
        else:
            shapes[f"{a}.q_a_proj.weight"] = (c.q_lora_rank, d)
            shapes[f"{a}.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[f"{a}.q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
        shapes[f"{a}.kv_a_proj_with_mqa.weight"] = (c.kv_cache_dim, d)
        shapes[f"{a}.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[f"{a}.kv_b_proj.weight"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[f"{a}.o_proj.weight"] = (d, heads * c.v_head_dim)
        if not c.is_moe_layer(i):
            shapes.update(_mlp_shapes(f"{p}.mlp", d, c.intermediate_size))
            continue
        shapes[f"{p}.mlp.gate.weight"] = (c.n_routed_experts, d)
        shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (c.n_routed_experts,)
        wanted = range(c.n_routed_experts) if expert_ids is None else sorted(expert_ids)
        for e in wanted:
            gate, up, down = expert_names(i, e)
            shapes[gate] = shapes[up] = (c.moe_intermediate_size, d)
            shapes[down] = (d, c.moe_intermediate_size)
        if c.n_shared_experts > 0:
            shapes.update(_mlp_shapes(f"{p}.mlp.shared_experts", d, c.moe_intermediate_size * c.n_shared_experts))
    shapes["model.norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


def kept_in_float32(name: str) -> bool:
    """The gate's correction bias stays float32 whatever the compute dtype (as in HF)."""
    return name.endswith("e_score_correction_bias")


def materialised_bytes(
    config: ModelConfig, expert_ids: set[int] | None = None, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of the weights a load materialises in dtype (routed experts: only expert_ids; None = all)."""
    return sum(
        math.prod(shape) * (4 if kept_in_float32(name) else dtype.itemsize)
        for name, shape in hf_tensor_shapes(config, expert_ids).items()
    )


def _mlp_shapes(prefix: str, d: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, d),
        f"{prefix}.up_proj.weight": (width, d),
        f"{prefix}.down_proj.weight": (d, width),
    }


# ---- lazy reader -------------------------------------------------------------------------------------------


@dataclass
class SafetensorsCheckpoint:
    """Lazy reader over model.safetensors, or shards listed by model.safetensors.index.json, or all *.safetensors.

    `read_names` records every tensor actually read (tests use it to prove non-owned experts stay on disk).
    """

    directory: Path
    weight_map: dict[str, str]  # tensor name -> file name inside directory
    read_names: list[str] = field(default_factory=list)
    _handles: dict[str, object] = field(default_factory=dict, repr=False)
    _shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsCheckpoint:
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: checkpoint directory does not exist")
        index_file = directory / INDEX_FILE
        if index_file.is_file():
            return cls(directory, _read_index(index_file))
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
        ckpt = cls(directory, {})
        for file in files:
            for name in ckpt._handle(file).keys():
                ckpt.weight_map[name] = file
        return ckpt

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of a stored tensor, None when the checkpoint does not have it."""
        if name not in self.weight_map:
            return None
        if name not in self._shapes:
            handle = self._handle(self.weight_map[name])
            try:
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())
            except SafetensorError as exc:
                raise CheckpointError(f"{self._path(name)}: tensor {name!r} is listed but unreadable ({exc})") from exc
        return self._shapes[name]

    def read(self, name: str) -> torch.Tensor:
        self.read_names.append(name)
        try:
            return self._handle(self.weight_map[name]).get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{self._path(name)}: cannot read tensor {name!r} ({exc})") from exc

    def read_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] along the first axis, reading only that slice from disk."""
        self.read_names.append(f"{name}[{index}]")
        try:
            return self._handle(self.weight_map[name]).get_slice(name)[index]
        except SafetensorError as exc:
            raise CheckpointError(f"{self._path(name)}: cannot read {name!r}[{index}] ({exc})") from exc

    def _path(self, name: str) -> Path:
        return self.directory / self.weight_map[name]

    def _handle(self, file: str):
        if file not in self._handles:
            path = self.directory / file
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file listed in the checkpoint is missing")
            try:
                self._handles[file] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
        return self._handles[file]


def _read_index(index_file: Path) -> dict[str, str]:
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index_file}: not valid JSON ({exc})") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file}: no 'weight_map' object")
    return {str(k): str(v) for k, v in weight_map.items()}


# ---- writer ------------------------------------------------------------------------------------------------


def write_safetensors(
    directory: str | Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None
) -> list[str]:
    """Write tensors as model.safetensors, or as HF-style shards + index when they exceed max_shard_bytes.
    Returns the file names written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous()
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return files
