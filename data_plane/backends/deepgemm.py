"""Expert FFNs with DeepGEMM's masked grouped FP8 GEMM over DeepEP's packed receive layout.

Each local expert g computes rows [0, masked_m[g]) of its slab, masked_m = recv_count from the DeepEP dispatch
(rows beyond it are skipped, so they keep whatever they held). Weights are quantised once to FP8 E4M3 with one
scale per 128 x 128 block; activations get one scale per token per 128 channels (the SM90 recipe). SwiGLU:
gate|up GEMM -> silu(gate) * up -> requantise -> down GEMM. Needs an SM90 GPU and DeepGEMM (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanocp.models import DeepseekV3Weights, LayerWeights

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
        self._weights: dict[int, tuple] = {}
        for layer in model.layers:
            if layer.moe is None:
                continue
            experts = [layer.moe.experts[e] for e in self.local_experts]
            gate_up = torch.stack([torch.cat([e.gate_proj, e.up_proj]) for e in experts])  # [G, 2I, D]
            down = torch.stack([e.down_proj for e in experts])  # [G, D, I]
            self._weights[layer.index] = (quantize_per_block(gate_up), quantize_per_block(down))

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
