"""Rotary position embedding with DeepSeek's YaRN scaling, numerically as HF transformers' DeepseekV3 does it.

Layout: with `rope_interleave=True` (DeepSeek checkpoints) the rope dims come in interleaved pairs (x0, x1), (x2, x3),
...; the rotated result is written de-interleaved, [rotated evens | rotated odds], exactly as HF does. Queries and
keys use the same layout, so dot products are unaffected, and our latent KV cache holds k_pe in this layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig, YarnScaling, yarn_mscale


@dataclass(frozen=True)
class RotaryEmbedding:
    inv_freq: torch.Tensor  # [rope_dim // 2] fp32
    attention_factor: float  # multiplies cos and sin (YaRN magnitude correction; 1.0 without scaling)
    interleave: bool

    @classmethod
    def from_config(cls, config: ModelConfig, device: torch.device | str | None = None) -> RotaryEmbedding:
        dim, base = config.qk_rope_head_dim, config.rope_theta
        if config.rope_scaling is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attention_factor = 1.0
        else:
            inv_freq, attention_factor = _yarn_inv_freq(config.rope_scaling, dim, base)
        return cls(inv_freq.to(device), attention_factor, config.rope_interleave)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (absolute) -> cos, sin [T, rope_dim // 2] fp32, scaled by attention_factor."""
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [T, half]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, ..., rope_dim] by the positions [T] of its first axis."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin, self.interleave)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, ..., rope_dim], cos/sin [T, rope_dim // 2] -> rotated x, de-interleaved when `interleave`."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos = cos.to(x.dtype).view(shape)
    sin = sin.to(x.dtype).view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def softmax_scale(config: ModelConfig) -> float:
    """The q.k scale attention must use (FlashMLA needs it passed explicitly)."""
    return config.softmax_scale


def _yarn_inv_freq(yarn: YarnScaling, dim: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies: interpolate low frequencies by `factor`, keep high ones, ramp in between."""
    if yarn.attention_factor is not None:
        attention_factor = float(yarn.attention_factor)
    elif yarn.mscale and yarn.mscale_all_dim:
        attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(yarn.factor)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)  # [half]
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (yarn.factor * pos_freqs)

    low, high = _correction_range(yarn, dim, base)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp  # 1 on fast-rotating dims (kept), 0 on slow ones (interpolated)
    inv_freq = inv_freq_interpolation * (1 - extrapolation_weight) + inv_freq_extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _correction_range(yarn: YarnScaling, dim: int, base: float) -> tuple[float, float]:
    """Dims whose wavelength fits beta_fast .. beta_slow rotations in the original context."""

    def dim_for_rotations(num_rotations: float) -> float:
        context = yarn.original_max_position_embeddings
        return (dim * math.log(context / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for_rotations(yarn.beta_fast), dim_for_rotations(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
