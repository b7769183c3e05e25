"""Capability checks of the GPU backends: without the hardware or library each says why, and the instance keeps
the torch reference (runs everywhere)."""

from __future__ import annotations

import pytest
import torch

from nanocp.comm.nvshmem_fabric import NvshmemFabric, nvshmem_unavailable_reason
from nanocp.data_plane.backends import Backends, torch_experts
from nanocp.data_plane.backends.cpu_attention import CpuPagedAttention, fused_attention_unavailable_reason
from nanocp.data_plane.backends.deepep import deepep_unavailable_reason
from nanocp.data_plane.backends.deepgemm import deepgemm_unavailable_reason
from nanocp.data_plane.backends.flashmla import flashmla_unavailable_reason
from nanocp.data_plane.kernels import select_routing_kernels, triton_unavailable_reason
from nanocp.models import mla_paged_attention_with_lse


def test_cpu_instances_keep_the_reference_backends():
    """...except shard attention, which takes torch's fused CPU flash-attention kernel where torch has it."""
    backends = Backends.detect("cpu", 64, torch.bfloat16)
    fused = fused_attention_unavailable_reason() is None
    assert (
        isinstance(backends.attention, CpuPagedAttention)
        if fused
        else backends.attention is mla_paged_attention_with_lse
    )
    assert backends.experts is torch_experts
    assert backends.describe() == {
        "attention": "cpu-flash" if fused else "mla_paged_attention_with_lse",
        "experts": "torch_experts",
        "kernels": "torch",
        "dispatcher": "reference",
    }
    assert Backends.reference().attention is mla_paged_attention_with_lse
    assert select_routing_kernels("cpu").name == "torch"
    assert "not CUDA" in triton_unavailable_reason(torch.device("cpu"))
    assert "CUDA" in flashmla_unavailable_reason("cpu", 64, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without CUDA")
def test_without_cuda_every_accelerated_backend_says_why():
    for reason in (
        flashmla_unavailable_reason("cuda", 64, torch.bfloat16),
        deepep_unavailable_reason(),
        deepgemm_unavailable_reason(),
        nvshmem_unavailable_reason(),
    ):
        assert reason is not None and "CUDA" in reason
    with pytest.raises(RuntimeError, match="CUDA"):
        NvshmemFabric(0, 1, 4)
