"""The public request traces that workload tests read (../shared/traces, or $NANOCP_TRACES): a checkout without them
skips those tests instead of failing them."""

from __future__ import annotations

import pytest

from nanocp.bench.workloads import traces_dir

HAVE_TRACES = all((traces_dir() / name).is_file() for name in ("sharegpt4_short.csv", "azure_llm_2023_conv.csv"))
needs_traces = pytest.mark.skipif(not HAVE_TRACES, reason=f"the shared request traces are not in {traces_dir()}")
