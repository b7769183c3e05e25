"""Compute backends of a decode instance: shard attention, expert FFNs, routing kernels, MoE dispatcher.

`Backends.reference()` is plain torch on any device (what CPU runs and every test compares against).
`Backends.detect(device, ...)` keeps the reference except where a capability check passes: on a CUDA device FlashMLA
for shard attention (else the Triton split-KV MLA kernel, triton_mla.py) and the Triton routing kernels; torch's fused
flash-attention kernel for shard attention on CPU (cpu_attention.py). DeepEP (dispatcher) and DeepGEMM (experts,
which need DeepEP's packed receive layout) need a process group and are opted into explicitly (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nanocp.data_plane.kernels import (
    RoutingKernels,
    TorchRoutingKernels,
    select_routing_kernels,
    triton_unavailable_reason,
)
from nanocp.models import LayerWeights, expert_ffn, mla_paged_attention_with_lse

# (q [S, H, Dqk], kv_pages [P, page, Dqk], block_table int [S, B], lens int [S], scale, v_dim) -> (o, lse fp32)
AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (layer, local expert ids, recv_x [E_local, rows, D], recv_count int32 [E_local], out [E_local, rows, D]) -> None
ExpertsFn = Callable[[LayerWeights, Sequence[int], torch.Tensor, torch.Tensor, torch.Tensor], None]
# (fabric, num_experts, hidden, max_tokens_per_rank, dtype, name, timeout_s) -> a LowLatencyDispatcher-like object
DispatcherFactory = Callable[..., object]


def torch_experts(
    layer: LayerWeights,
    local_experts: Sequence[int],
    recv_x: torch.Tensor,
    recv_count: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Every local expert's FFN over its whole receive slab (static shapes: rows without a token hold stale data,
    their outputs are never sent back). recv_count is not needed: the slab's used rows are the dispatcher's."""
    for local, expert_id in enumerate(local_experts):
        out[local].copy_(expert_ffn(layer.moe.experts[expert_id], recv_x[local]))


@dataclass
class Backends:
    attention: AttentionFn = mla_paged_attention_with_lse
    experts: ExpertsFn = torch_experts
    kernels: RoutingKernels = field(default_factory=TorchRoutingKernels)
    dispatcher: DispatcherFactory | None = None  # None: comm.moe_dispatch.LowLatencyDispatcher over the fabric

    @classmethod
    def reference(cls) -> Backends:
        return cls()

    @classmethod
    def detect(cls, device: torch.device | str, page_size: int, dtype: torch.dtype) -> Backends:
        """Accelerated attention and routing kernels where the capability checks pass, the reference otherwise."""
        from .cpu_attention import CpuPagedAttention, fused_attention_unavailable_reason
        from .flashmla import FlashMLAAttention, flashmla_unavailable_reason

        device = torch.device(device)
        attention: AttentionFn = mla_paged_attention_with_lse
        if flashmla_unavailable_reason(device, page_size, dtype) is None:
            attention = FlashMLAAttention()
        elif device.type == "cuda" and triton_unavailable_reason(device) is None:
            from .triton_mla import TritonMLAAttention

            attention = TritonMLAAttention()
        elif device.type == "cpu" and fused_attention_unavailable_reason() is None:
            attention = CpuPagedAttention()
        return cls(attention=attention, kernels=select_routing_kernels(device))

    def describe(self) -> dict[str, str]:
        def name(obj) -> str:
            return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__

        return {
            "attention": name(self.attention),
            "experts": name(self.experts),
            "kernels": name(self.kernels),
            "dispatcher": "reference" if self.dispatcher is None else name(self.dispatcher),
        }


__all__ = ["AttentionFn", "Backends", "DispatcherFactory", "ExpertsFn", "torch_experts"]
