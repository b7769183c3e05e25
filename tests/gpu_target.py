"""The device a GPU-marked test runs on: the CUDA GPU where there is one; the CPU in the GPU check's dry run
(`NANOCP_GPU_DRY_RUN=1`, `python -m nanocp.bench.gpu_check --dry-run`), so the same test code runs in CI; else
None (the test is skipped)."""

from __future__ import annotations

import os

import pytest
import torch

DRY_RUN_ENV = "NANOCP_GPU_DRY_RUN"


def gpu_target() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get(DRY_RUN_ENV) == "1" else None


def gpu_marks() -> list:
    """pytestmark of a GPU test module."""
    reason = f"needs a CUDA GPU (or {DRY_RUN_ENV}=1 for the CPU dry run)"
    return [pytest.mark.gpu, pytest.mark.skipif(gpu_target() is None, reason=reason)]
