"""Suite-wide settings.

Hypothesis profiles: "ci" (loaded where CI=true) is derandomized: every test draws its examples from a fixed seed,
the digest of its own code, with no example database, so a commit's CI result is reproducible on any machine
(rerun with CI=true to replay a failure; --hypothesis-seed=N explores other seeds, reproducibly too). "dev" (every
other run) keeps exploring: a new random seed per run and the local example database (.hypothesis/), which replays
the failures it found first. HYPOTHESIS_PROFILE=<name> picks one explicitly. A failing example found either way
becomes an @example of its test.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("ci-seeded", derandomize=False, database=None, print_blob=True)  # ci + --hypothesis-seed
settings.register_profile("dev", print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() == "true" else "dev")
settings.load_profile(PROFILE)


def pytest_configure(config):
    # a seed given on the command line must win over derandomize (Hypothesis ignores seeds for derandomized tests)
    if config.getoption("hypothesis_seed", None) is not None and settings.default.derandomize:
        settings.load_profile("ci-seeded")


def hypothesis_line(config) -> str:
    seed = config.getoption("hypothesis_seed", None)
    if seed is not None:
        how = f"seed {seed} (--hypothesis-seed)"
    elif settings.default.derandomize:
        how = "derandomized: a fixed seed per test (the digest of its code)"
    else:
        how = "a random seed per test and run (pass --hypothesis-seed=N to fix one)"
    database = "none" if settings.default.database is None else "local (.hypothesis/)"
    return f"hypothesis: profile {settings.get_current_profile_name()!r}, {how}, example database {database}"


def pytest_report_header(config):
    return hypothesis_line(config)


def pytest_terminal_summary(terminalreporter, config):
    if config.option.verbose < 0:  # -q hides the header: say it at the end (make test runs pytest -q)
        terminalreporter.write_line(hypothesis_line(config))


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
