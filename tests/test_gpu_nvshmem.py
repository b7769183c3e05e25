"""NvshmemFabric against the in-process reference fabric: the same Q/Res routing exchange must deliver the same
receive buffers (needs >= 2 GPUs and nvshmem4py; skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from nanocp.comm import FabricTimeout, InProcessFabric, RoutingBackend
from nanocp.comm.launch import run_processes, run_threads
from nanocp.comm.nvshmem_fabric import NvshmemFabric, init_nvshmem, nvshmem_unavailable_reason

WORLD, ROWS, ROW_SHAPE = 2, 8, (4, 16)


def _reason() -> str | None:
    if torch.cuda.is_available() and torch.cuda.device_count() < WORLD:
        return f"needs {WORLD} GPUs, found {torch.cuda.device_count()}"
    return nvshmem_unavailable_reason()


REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def exchange(fabric, device) -> list[torch.Tensor]:
    """Two iterations: each rank sends two of its rows (swapped) to every other rank, then one row back."""
    rank, world = fabric.rank, fabric.world_size
    route = RoutingBackend(fabric, "q", ROWS, ROW_SHAPE, torch.bfloat16, timeout_s=60)
    seen = []
    for seq in (1, 2):
        g = torch.Generator().manual_seed(rank * 10 + seq)
        src = torch.randn(4, *ROW_SHAPE, generator=g).to(device, torch.bfloat16)
        sends = [(dst, 1, rank * 2) for dst in range(world) if dst != rank]
        sends += [(dst, 0, rank * 2 + 1) for dst in range(world) if dst != rank and seq == 1]
        recv = route.route(sends, src, [s for s in range(world) if s != rank], seq, timeout_s=60)
        seen.append(recv.float().cpu().clone())
    return seen


def _nvshmem_rank(rank: int, world: int):
    torch.cuda.set_device(rank)
    init_nvshmem()
    fabric = NvshmemFabric(rank, world, num_flags=16)
    try:
        seen = exchange(fabric, "cuda")
        with pytest.raises(FabricTimeout):
            fabric.wait(15, 1, timeout_s=0.2)  # nobody signals flag 15
        fabric.barrier(60)
        return seen
    finally:
        fabric.close()


def test_nvshmem_fabric_delivers_what_the_reference_fabric_delivers():
    fabrics = InProcessFabric.create(WORLD, num_flags=16)
    want = run_threads(lambda r: exchange(fabrics[r], "cpu"), WORLD, timeout_s=60)
    got = run_processes(_nvshmem_rank, WORLD, timeout_s=300, torch_distributed=True)
    for ours, ref in zip(got, want):
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
