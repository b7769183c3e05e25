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
