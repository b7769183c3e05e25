"""Routing kernels of the decode data path: torch reference (any device) and Triton (CUDA; CPU under
TRITON_INTERPRET=1 for tests). `select_routing_kernels(device)` picks Triton on a CUDA device when Triton imports,
the torch reference otherwise."""

from __future__ import annotations

from typing import Protocol

import torch

from .reference import TorchRoutingKernels


class RoutingKernels(Protocol):
    name: str

    def gather_rows(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def scatter_rows(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor: ...

    def gather_two(
        self, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def pack_partials(
        self, o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def merge_routed(
        self,
        o: torch.Tensor,
        lse: torch.Tensor,
        res: torch.Tensor,
        index: torch.Tensor,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot serve `device` (None when they can)."""
    if device.type != "cuda":
        return f"device {device} is not CUDA (the Triton kernels run on CPU only under TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import: {e}"
    return None


def select_routing_kernels(device: torch.device | str) -> RoutingKernels:
    """Triton kernels on a CUDA device where Triton imports, the torch reference otherwise."""
    if triton_unavailable_reason(torch.device(device)) is None:
        from .triton_routing import TritonRoutingKernels

        return TritonRoutingKernels()
    return TorchRoutingKernels()


__all__ = ["RoutingKernels", "TorchRoutingKernels", "select_routing_kernels", "triton_unavailable_reason"]
