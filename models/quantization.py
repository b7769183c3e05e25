"""FP8 block-quantized checkpoints (the official DeepSeek-V3 / V3.1 / R1 and Kimi-K2 layout).

A quantized weight `W` [out, in] is stored as `float8_e4m3fn` next to a float32 `<name>_scale_inv`
[ceil(out / b0), ceil(in / b1)], one scale per b0 x b1 block (blocks at the bottom and right edges are partial when
b0 or b1 does not divide the shape); the real weight is `W[i, j] * scale_inv[i // b0, j // b1]`. A weight is
quantized exactly when its `_scale_inv` companion exists. `quantization_config` gives (b0, b1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
# Row blocks are dequantized a few at a time: the float32 temporaries stay around this many elements.
CHUNK_ELEMENTS = 1 << 22

_SUPPORTED = (
    "quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size [b0, b1], scale_fmt absent or "
    "'ue8m0'"
)


# modules_to_not_convert is informational: a weight is quantized exactly when its _scale_inv companion exists.
_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "modules_to_not_convert"}


class QuantizationError(ValueError):
    """A quantization_config nanocp cannot read exactly."""


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [b0, b1]}; V3.1's "scale_fmt": "ue8m0" (power-of-two scales) dequantizes the same way."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None

    def __post_init__(self) -> None:
        block = self.weight_block_size
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise QuantizationError(f"weight_block_size must be two positive ints [b0, b1], got {list(block)}")
        if self.scale_fmt not in (None, "ue8m0"):
            raise QuantizationError(f"unsupported scale_fmt={self.scale_fmt!r} (supported: absent or 'ue8m0')")

    @classmethod
    def from_hf_dict(cls, d: Any) -> Fp8BlockQuantization:
        """Parse quantization_config; anything but FP8 block quantization is an error naming what is supported."""
        if not isinstance(d, dict):
            raise QuantizationError(f"quantization_config must be an object, got {d!r}")
        method = d.get("quant_method")
        if method != "fp8":
            raise QuantizationError(
                f"unsupported quantization_config quant_method={method!r} (supported: {_SUPPORTED}; or no "
                "quantization_config): dequantize the checkpoint to bf16, or use its FP8 release"
            )
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise QuantizationError(f"unknown quantization_config key(s) {unknown} (supported: {_SUPPORTED})")
        for key, allowed in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
            if d.get(key, allowed) != allowed:
                raise QuantizationError(f"unsupported quantization_config {key}={d[key]!r} (supported: {allowed!r})")
        block = d.get("weight_block_size", [128, 128])
        if not isinstance(block, (list, tuple)):
            raise QuantizationError(f"weight_block_size must be two positive ints [b0, b1], got {block!r}")
        return cls(tuple(block), d.get("scale_fmt"))

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block_size),
        }
        if self.scale_fmt is not None:
            d["scale_fmt"] = self.scale_fmt
        return d


def scale_name(name: str) -> str:
    """The scale companion of a weight: 'x.weight' -> 'x.weight_scale_inv'."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """[..., out, in] -> [..., ceil(out / b0), ceil(in / b1)] (leading axes: stacked experts)."""
    if len(shape) < 2:
        raise QuantizationError(f"only weights of 2 or more dimensions are block-quantized, got shape {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """weight [out, in] (fp8), scale_inv [ceil(out / b0), ceil(in / b1)] -> [out, in] in dtype, on weight's device.

    Each element is float32(weight) * float32(its block's scale), rounded once to dtype. Rows go a few blocks at a
    time, so beyond the result only about chunk_elements float32 values are held."""
    if weight.dim() != 2:
        raise QuantizationError(f"dequantize_blocks takes a 2-D weight, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    b0, b1 = block
    if tuple(scale_inv.shape) != scale_shape((rows, cols), block):
        raise QuantizationError(
            f"scale shape {list(scale_inv.shape)} does not match weight {[rows, cols]} in {b0} x {b1} blocks"
            f" (expected {list(scale_shape((rows, cols), block))})"
        )
    scales = scale_inv.to(device=weight.device, dtype=torch.float32).repeat_interleave(b1, dim=1)[:, :cols]
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    step = b0 * max(1, chunk_elements // max(1, b0 * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        s = scales[r0 // b0 : -(-r1 // b0)].repeat_interleave(b0, dim=0)[: r1 - r0]
        out[r0:r1] = weight[r0:r1].to(torch.float32) * s
    return out
