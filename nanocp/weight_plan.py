"""Planning check: how a checkpoint's weights fall on N decode instances, from its config.json and its
model.safetensors.index.json alone (no tensor data is read; a checkpoint without an index has its safetensors
headers read instead).

Every instance holds the replicated weights (embedding, attention, dense MLPs, shared experts, gates, norm,
lm_head) and the routed experts of its contiguous range (`data_plane/experts.py`). For each instance the plan gives
the bytes it reads from the checkpoint (FP8 weights at 1 byte plus their float32 scales, the other tensors in the
config's dtype, the gate bias in float32) and the bytes its weights take once loaded in the compute dtype (FP8
weights are dequantized at load). `WeightPlan.check_fits` refuses a layout whose largest instance exceeds the
memory given and names the smallest instance count that fits. The CPU eager path adds a panel-packed copy of the
decode-layer weights (README, "Configuration"), which this plan does not count.

    nanocp plan /path/to/DeepSeek-V3 --decode-instances 32 --dtype bfloat16 --memory-per-instance 80GiB
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nanocp.data_plane.experts import owned_experts
from nanocp.models import CheckpointError, ModelConfig, SafetensorsCheckpoint
from nanocp.models.checkpoint import expert_names, fused_expert_names, hf_tensor_shapes, kept_in_float32
from nanocp.models.quantization import scale_name, scale_shape

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


class PlanError(ValueError):
    """A layout whose weights cannot fit, or a checkpoint whose index lacks what the model needs."""


@dataclass(frozen=True)
class InstanceWeights:
    rank: int
    experts: tuple[int, int]  # [first, last + 1) of its routed experts
    checkpoint_bytes: int  # read from the checkpoint
    resident_bytes: int  # held once loaded, in the compute dtype


@dataclass(frozen=True)
class WeightPlan:
    model: str
    num_instances: int
    dtype: str  # compute dtype
    quantized_tensors: int  # FP8 block-quantized tensors in the checkpoint (of those the model reads)
    replicated_resident_bytes: int
    expert_resident_bytes: int  # one routed expert over every MoE layer
    num_experts: int
    instances: tuple[InstanceWeights, ...]

    @property
    def largest(self) -> InstanceWeights:
        return max(self.instances, key=lambda w: w.resident_bytes)

    def smallest_fitting_count(self, memory_bytes: int) -> int | None:
        """The fewest instances whose largest holds at most memory_bytes; None when no count does."""
        room = memory_bytes - self.replicated_resident_bytes
        if room < 0 or (room < self.expert_resident_bytes and self.num_experts > 0):
            return None
        if self.num_experts == 0:
            return 1
        return math.ceil(self.num_experts / (room // self.expert_resident_bytes))

    def check_fits(self, memory_bytes: int) -> None:
        """Refuse (PlanError) a layout whose largest instance needs more than memory_bytes of weights."""
        worst = self.largest
        if worst.resident_bytes <= memory_bytes:
            return
        first, end = worst.experts
        what = (
            f"instance {worst.rank} needs {format_bytes(worst.resident_bytes)} of weights in {self.dtype}"
            f" (replicated {format_bytes(self.replicated_resident_bytes)} + {end - first} routed experts), more than"
            f" the {format_bytes(memory_bytes)} per instance"
        )
        fitting = self.smallest_fitting_count(memory_bytes)
        if fitting is None:
            raise PlanError(
                f"{what}; the replicated weights and one expert alone do not fit, whatever the instance count: give"
                " each instance more memory or use a smaller dtype"
            )
        raise PlanError(f"{what}: use at least {fitting} decode instances, or more memory per instance")

    def to_dict(self) -> dict:
        return {**asdict(self), "instances": [asdict(w) for w in self.instances]}


def plan_weights(model: str | Path, num_instances: int, dtype: torch.dtype = torch.bfloat16) -> WeightPlan:
    """Per-instance weight bytes of the checkpoint directory `model` over num_instances decode instances."""
    if not isinstance(num_instances, int) or num_instances < 1:
        raise PlanError(f"the instance count must be an int >= 1, got {num_instances!r}")
    config = ModelConfig.from_pretrained_dir(model)
    try:
        names = set(SafetensorsCheckpoint.open(model).weight_map)
    except CheckpointError as exc:
        raise PlanError(str(exc)) from exc
    sizes = _Sizes(config, names, dtype)
    replicated = hf_tensor_shapes(config, expert_ids=set())
    read_shared = sum(sizes.stored(name, shape) for name, shape in replicated.items())
    resident_shared = sum(sizes.resident(name, shape) for name, shape in replicated.items())
    experts = [sizes.expert(e) for e in range(config.n_routed_experts)]
    instances = []
    for rank in range(num_instances):
        mine = owned_experts(rank, num_instances, config.n_routed_experts)
        instances.append(
            InstanceWeights(
                rank,
                (mine.start, mine.stop),
                read_shared + sum(experts[e][0] for e in mine),
                resident_shared + sum(experts[e][1] for e in mine),
            )
        )
    return WeightPlan(
        model=str(model),
        num_instances=num_instances,
        dtype=str(dtype).removeprefix("torch."),
        quantized_tensors=sizes.quantized,
        replicated_resident_bytes=resident_shared,
        expert_resident_bytes=max((r for _, r in experts), default=0),
        num_experts=config.n_routed_experts,
        instances=tuple(instances),
    )


class _Sizes:
    """Stored and resident bytes of the model's tensors, checking that the index lists each one."""

    def __init__(self, config: ModelConfig, names: set[str], dtype: torch.dtype) -> None:
        self.config, self.names, self.dtype = config, names, dtype
        stored = getattr(torch, config.dtype, None)
        if not isinstance(stored, torch.dtype):
            raise PlanError(f"config.json's dtype {config.dtype!r} is not a torch dtype")
        self.stored_itemsize = stored.itemsize
        self.quantized = 0

    def stored(self, name: str, shape: tuple[int, ...]) -> int:
        if name not in self.names:
            raise PlanError(f"the checkpoint does not list tensor {name!r} (expected shape {list(shape)})")
        numel = math.prod(shape)
        if scale_name(name) in self.names:
            if self.config.quantization is None:
                raise PlanError(f"tensor {name!r} has a scale companion but config.json has no quantization_config")
            self.quantized += 1
            return numel + 4 * math.prod(scale_shape(shape, self.config.quantization.weight_block_size))
        return numel * (4 if kept_in_float32(name) else self.stored_itemsize)

    def resident(self, name: str, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * (4 if kept_in_float32(name) else self.dtype.itemsize)

    def expert(self, e: int) -> tuple[int, int]:
        """(stored, resident) bytes of routed expert e over every MoE layer, classic or fused layout."""
        c = self.config
        d, width = c.hidden_size, c.moe_intermediate_size
        stored = resident = 0
        for i in range(c.first_k_dense_replace, c.num_hidden_layers):
            gate, up, down = expert_names(i, e)
            gate_up, fused_down = fused_expert_names(i)
            if gate not in self.names and gate_up in self.names:  # transformers 5.x stacked experts
                tensors = [(gate_up, (2 * width, d)), (fused_down, (d, width))]
                stored += sum(self._slice(name, shape) for name, shape in tensors)
            else:
                tensors = [(gate, (width, d)), (up, (width, d)), (down, (d, width))]
                stored += sum(self.stored(name, shape) for name, shape in tensors)
            resident += sum(self.resident(name, shape) for name, shape in tensors)
        return stored, resident

    def _slice(self, name: str, shape: tuple[int, ...]) -> int:
        """One expert's slice of a stacked tensor (and of its stacked scales)."""
        if name not in self.names:
            raise PlanError(f"the checkpoint does not list tensor {name!r}")
        numel = math.prod(shape)
        if scale_name(name) in self.names and self.config.quantization is not None:
            return numel + 4 * math.prod(scale_shape(shape, self.config.quantization.weight_block_size))
        return numel * self.stored_itemsize


def parse_bytes(text: str) -> int:
    """'80GiB', '512 MiB', '1.5TB', '1000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size (accepted: a number with B, KB, MB, GB, TB, KiB ... TiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
