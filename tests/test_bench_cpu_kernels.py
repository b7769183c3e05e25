"""The kernel benchmark's pieces: the paired measurement alternates the two paths and reports torch / kernels; the
attention measurement runs the shard attention on both paths."""

from __future__ import annotations

import pytest
import torch

from nanocp.bench import bench_cpu_kernels as bench
from nanocp.data_plane import cpu_kernels
from nanocp.models import ModelConfig

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None, reason="CPU kernels not built")


def test_paired_alternates_the_paths_and_reports_the_ratio():
    seen = []

    def measure() -> float:
        path = "kernels" if cpu_kernels.usable(torch.zeros(1)) else "torch"
        seen.append(path)
        return {"kernels": 2.0, "torch": 5.0}[path]

    result = bench.paired(measure, repeats=3)
    assert seen == ["kernels", "torch"] * 3
    assert result["ms"] == {"kernels": 2.0, "torch": 5.0} and result["speedup"] == 2.5
    assert cpu_kernels.unavailable_reason() is None  # the switch is restored


@pytest.mark.parametrize("path", bench.PATHS)
def test_attention_ms_runs_the_shard_attention_on_each_path(path):
    ms = bench._with_path(path, lambda: bench.attention_ms(ModelConfig.tiny(), batch=3, seed=1, calls=2))
    assert ms > 0
