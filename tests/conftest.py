"""Suite-wide settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_intra_op_thread():
    """The tiny model's ops are small and the CI machine has 2 shared cores: one intra-op thread avoids the
    oversubscription stalls of OpenMP fan-out (the engine sets the same by default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["cpu-kernels", "torch"])
def cpu_kernel_path(request):
    """Run a test on both paths of the eager decode math: the fused CPU kernels (skipped where not built) and the
    torch / numpy formulation (their reference)."""
    from nanocp.data_plane import cpu_kernels

    if request.param == "cpu-kernels" and cpu_kernels.unavailable_reason() is not None:
        pytest.skip(cpu_kernels.unavailable_reason())
    previous = cpu_kernels.set_enabled(request.param == "cpu-kernels")
    yield request.param
    cpu_kernels.set_enabled(previous)
