"""Expert FFNs with DeepGEMM's masked grouped FP8 GEMM over DeepEP's packed receive layout.

Each local expert g computes rows [0, masked_m[g]) of its slab, masked_m = recv_count from the DeepEP dispatch
(rows beyond it are skipped, so they keep whatever they held). Weights are FP8 E4M3 with one scale per 128 x 128
block: an FP8 checkpoint's own weights and scales where it has that layout (the official DeepSeek-V3 / R1 / Kimi-K2
releases: read as stored, never dequantized and re-quantized), else quantised once from the loaded weights;
activations get one scale per token per 128 channels (the SM90 recipe). SwiGLU:
gate|up GEMM -> silu(gate) * up -> requantise -> down GEMM. Needs an SM90 GPU and DeepGEMM (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanocp.models import DeepseekV3Weights, LayerWeights, SafetensorsCheckpoint
from nanocp.models.checkpoint import expert_names
from nanocp.models.quantization import scale_name

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # channels per scale


def deepgemm_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "DeepGEMM needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"this adapter uses DeepGEMM's SM90 FP8 recipe, the GPU is SM{major}{minor}"
    try:
        import deep_gemm

        deep_gemm.m_grouped_fp8_gemm_nt_masked  # noqa: B018 - present only in builds with the FP8 kernels
    except (ImportError, AttributeError) as e:
        return f"deep_gemm with m_grouped_fp8_gemm_nt_masked is not available ({e}); build it (docs/gpu.md)"
    return None


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 128) -> fp8 [..., K], fp32 scales [..., K / 128]: x ~ fp8 * scale."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"the last dimension ({x.shape[-1]}) must be a multiple of {GROUP}")
    groups = x.float().unflatten(-1, (-1, GROUP))  # [..., K/128, 128]
    scale = groups.abs().amax(-1).clamp(min=1e-4) / FP8_MAX
    return (groups / scale[..., None]).to(FP8).flatten(-2), scale


def quantize_per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (multiples of 128) -> fp8 [..., N, K], fp32 scales [..., N / 128, K / 128]."""
    n, k = w.shape[-2:]
    if n % GROUP or k % GROUP:
        raise ValueError(f"weight dims {n} x {k} must be multiples of {GROUP}")
    blocks = (
        w.float().unflatten(-1, (k // GROUP, GROUP)).unflatten(-3, (n // GROUP, GROUP))
    )  # [.., N/128, 128, K/128, 128]
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-4) / FP8_MAX  # [..., N/128, K/128]
    q = (blocks / scale[..., :, None, :, None]).to(FP8)
    return q.flatten(-4, -3).flatten(-2), scale


# One layer's local experts in DeepGEMM's layout: ((gate|up fp8 [G, 2I, D], scales [G, 2I/128, D/128]),
# (down fp8 [G, D, I], scales [G, D/128, I/128]))
ExpertFp8 = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def checkpoint_fp8_unusable_reason(model: DeepseekV3Weights) -> str | None:
    """Why the model's checkpoint cannot hand its FP8 experts to DeepGEMM as stored (None when it can)."""
    c = model.config
    block = getattr(c.quantization, "weight_block_size", None)
    if block is None:
        return f"{c.name!r} is not an FP8 block-quantized checkpoint"
    if tuple(block) != (GROUP, GROUP):
        return f"its FP8 blocks are {list(block)}, DeepGEMM's recipe needs [{GROUP}, {GROUP}]"
    if c.hidden_size % GROUP or c.moe_intermediate_size % GROUP:
        return f"hidden {c.hidden_size} and expert width {c.moe_intermediate_size} must be multiples of {GROUP}"
    return None


def checkpoint_expert_fp8(model: DeepseekV3Weights, local_experts: Sequence[int]) -> dict[int, ExpertFp8]:
    """Every MoE layer's local experts as the checkpoint stores them (fp8 weights and their `_scale_inv` block
    scales, which are DeepGEMM's scales: weight ~ fp8 * scale), gate and up stacked along the rows."""
    reason = checkpoint_fp8_unusable_reason(model)
    if reason is not None:
        raise ValueError(reason)
    ckpt = SafetensorsCheckpoint.open(model.config.name)
    out = {}
    for layer in model.layers:
        if layer.moe is None:
            continue
        parts = [[], [], [], []]  # gate|up fp8, gate|up scales, down fp8, down scales
        for e in local_experts:
            gate, up, down = expert_names(layer.index, e)
            tensors = [ckpt.read(n) for n in (gate, up, down)]
            scales = [ckpt.read(scale_name(n)) for n in (gate, up, down)]
            if any(t.dtype != FP8 for t in tensors):
                raise ValueError(f"expert {e} of layer {layer.index} is not stored as {FP8} in {model.config.name}")
            parts[0].append(torch.cat(tensors[:2]))
            parts[1].append(torch.cat(scales[:2]))
            parts[2].append(tensors[2])
            parts[3].append(scales[2])
        device = layer.moe.experts[local_experts[0]].down_proj.device
        stacked = [torch.stack(p).to(device) for p in parts]
        out[layer.index] = ((stacked[0], stacked[1].float()), (stacked[2], stacked[3].float()))
    return out


def expert_fp8_weights(model: DeepseekV3Weights, local_experts: Sequence[int]) -> tuple[dict[int, ExpertFp8], str]:
    """The local experts' FP8 weights for DeepGEMM, and where they came from: the checkpoint's own FP8 tensors
    where it has DeepGEMM's layout, else each layer's loaded weights quantised per 128 x 128 block."""
    reason = checkpoint_fp8_unusable_reason(model)
    if reason is None:
        return checkpoint_expert_fp8(model, local_experts), "checkpoint"
    weights = {}
    for layer in model.layers:
        if layer.moe is None:
            continue
        experts = [layer.moe.experts[e] for e in local_experts]
        gate_up = torch.stack([torch.cat([e.gate_proj, e.up_proj]) for e in experts])  # [G, 2I, D]
        down = torch.stack([e.down_proj for e in experts])  # [G, D, I]
        weights[layer.index] = (quantize_per_block(gate_up), quantize_per_block(down))
    return weights, f"quantised at load ({reason})"


class DeepGemmExperts:
    """A Backends.experts for DeepEP's layout: (layer, local experts, recv_x, recv_count, out) -> out filled."""

    name = "deepgemm"

    def __init__(self, model: DeepseekV3Weights, local_experts: Sequence[int], expected_m: int) -> None:
        reason = deepgemm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        import deep_gemm

        self._gemm = deep_gemm.m_grouped_fp8_gemm_nt_masked
        self.expected_m = expected_m
        self.local_experts = list(local_experts)
        self._weights, self.weight_source = expert_fp8_weights(model, self.local_experts)

    def __call__(
        self,
        layer: LayerWeights,
        local_experts: Sequence[int],
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        recv_count: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        if list(local_experts) != self.local_experts:
            raise ValueError(f"quantised for experts {self.local_experts}, called for {list(local_experts)}")
        gate_up_w, down_w = self._weights[layer.index]
        a = recv_x if isinstance(recv_x, tuple) else quantize_per_token(recv_x)  # DeepEP may deliver FP8 already
        groups, rows = a[0].shape[:2]
        inter = gate_up_w[0].shape[1] // 2
        gate_up = out.new_empty(groups, rows, 2 * inter)
        masked_m = recv_count.to(torch.int32)
        self._gemm(a, gate_up_w, gate_up, masked_m, self.expected_m)
        act = torch.nn.functional.silu(gate_up[..., :inter].float()) * gate_up[..., inter:].float()
        self._gemm(quantize_per_token(act), down_w, out, masked_m, self.expected_m)
