"""What a benchmark ran on, recorded next to its numbers: the CPU model, its cores, the vector width the CPU kernels
were built for (16 fp32 lanes with AVX-512, 8 with AVX2: the same code is several times faster on one than the
other), the software versions and the load average (the machines are shared)."""

from __future__ import annotations

import os
import platform
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import torch

    from nanocp.data_plane import cpu_kernels

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "host": platform.node(),
        "cpu": cpu_model(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_kernel_vector_lanes": cpu_kernels.vector_lanes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in load],
    }


def describe(machine: dict[str, Any]) -> str:
    """One markdown line naming the machine of a result."""
    lanes = machine.get("cpu_kernel_vector_lanes")
    names = {16: "AVX-512", 8: "AVX2", 4: "SSE (a portable build)"}
    width = names.get(lanes, f"{lanes} lanes") if lanes else "not built"
    cpu, cpus, torch = machine["cpu"], machine["cpus"], machine["torch"]
    return f"Machine: {cpu}, {cpus} CPUs; CPU kernels built for {width}; torch {torch}."
