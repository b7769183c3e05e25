"""Request workloads for benchmarks and the cluster simulator.

A workload is a list of `Request(rid, arrival_s, input_len, output_len)` sorted by arrival. It is built from an
arrival process (Poisson, gamma with burstiness as in `vllm bench serve`, fixed rate, or a trace's timestamps) and a
length source (the ShareGPT-4 short trace, a GitHub-issue-style long distribution, the OpenRouter / ShareGPT-4o
length bins of NanoCP's Table 1, or a short+long mix), or replayed from a real trace (Azure CSV, Mooncake JSONL,
generic `arrival,input_len,output_len` CSV). Everything random draws from one `numpy.random.Generator` seeded by the
caller, so a workload is a pure function of its arguments.

GitHub-issue-style long lengths. Inputs are drawn from a quantile function that passes through five knots: the
lower edge 100K (quantile 0), Medha's P50 393K, NanoCP's bin edge 500K at quantile 0.6506 (100K-500K holds 65.06%),
Medha's P90 839K, and the upper edge 1M (quantile 1); between knots the quantile is interpolated linearly in
log(tokens) (log-uniform inside each segment). So the P50, P90 and both Table 1 bin masses hold exactly.
Outputs are log-normal with median 518 and sigma = ln(808 / 518) / z_0.9, so P50 = 518 and P90 = 808 (Medha).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

import numpy as np

Z_90 = 1.2815515655446004  # standard normal quantile at 0.9

# NanoCP Table 1: share (%) of requests per input-length bin <1k / 1k-10k / 10k-100k / 100k-500k / 500k-1M.
# The lower edge of the first bin is ours (32 tokens: shorter prompts than a chat template are not requests).
LENGTH_BIN_EDGES = (32, 1_000, 10_000, 100_000, 500_000, 1_000_000)
OPENROUTER_BINS = (31.82, 50.08, 16.42, 1.67, 0.0)
SHAREGPT4O_BINS = (85.7, 10.7, 3.5, 0.0, 0.0)
GITHUB_ISSUE_BINS = (0.0, 0.0, 0.0, 65.06, 34.94)

# Quantile knots of the GitHub-issue long inputs: (quantile, tokens). See the module docstring.
GITHUB_ISSUE_INPUT_KNOTS = ((0.0, 100_000), (0.5, 393_000), (0.6506, 500_000), (0.9, 839_000), (1.0, 1_000_000))
GITHUB_ISSUE_OUTPUT_P50 = 518
GITHUB_ISSUE_OUTPUT_P90 = 808
GITHUB_ISSUE_OUTPUT_MAX = 8192

TRACE_FILES = {
    "sharegpt4": "sharegpt4_short.csv",
    "azure-conv": "azure_llm_2023_conv.csv",
    "azure-code": "azure_llm_2023_code.csv",
    "mooncake": "mooncake_conversation.jsonl",
}


class WorkloadError(ValueError):
    """A workload could not be built from the given arguments or file."""


@dataclass(frozen=True)
class Request:
    rid: str
    arrival_s: float
    input_len: int
    output_len: int


# ---------------------------------------------------------------------------------------------------------------
# Arrival processes: each returns arrival times in seconds [n], non-decreasing, the first at 0.
# ---------------------------------------------------------------------------------------------------------------


def _check_count_rate(n: int, rate: float) -> None:
    if n < 0:
        raise WorkloadError(f"number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise WorkloadError(f"request rate must be > 0 (inf = all at once), got {rate}")


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """vLLM bench semantics: intervals ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate.

    burstiness 1 is Poisson; < 1 is burstier, > 1 more regular. rate = inf sends everything at t = 0. The first
    request arrives at 0 and request i after the sum of i intervals.
    """
    _check_count_rate(n, rate)
    if not burstiness > 0:
        raise WorkloadError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    # Unit-rate intervals scaled by 1/rate: the same seed gives the same pattern at every rate (capacity search).
    unit = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n - 1)  # [n-1]
    return np.concatenate([[0.0], np.cumsum(unit) / rate])


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson process: exponential intervals with mean 1/rate."""
    return gamma_arrivals(n, rate, 1.0, rng)


def fixed_rate_arrivals(n: int, rate: float) -> np.ndarray:
    """One request every 1/rate seconds."""
    _check_count_rate(n, rate)
    if math.isinf(rate):
        return np.zeros(n)
    return np.arange(n) / rate


def scale_arrivals(requests: Sequence[Request], factor: float) -> list[Request]:
    """Multiply every arrival time by `factor` (< 1 compresses a trace, i.e. raises its rate)."""
    if not factor > 0 or math.isinf(factor):
        raise WorkloadError(f"time scale factor must be finite and > 0, got {factor}")
    return [replace(r, arrival_s=r.arrival_s * factor) for r in requests]


def retime_to_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """Scale a trace's timestamps so that its mean request rate (n - 1 intervals over its span) equals `rate`."""
    if len(requests) < 2:
        raise WorkloadError("need at least two requests to define a trace's rate")
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        raise WorkloadError("trace has all requests at one instant; its rate cannot be rescaled")
    return scale_arrivals(requests, (len(requests) - 1) / span / rate)


# ---------------------------------------------------------------------------------------------------------------
# Length sources: `sample(n, rng) -> (input_lens [n], output_lens [n])`, int64.
# ---------------------------------------------------------------------------------------------------------------


class LengthSource(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class EmpiricalLengths:
    """Resample (input, output) pairs jointly, with replacement, from a trace's rows."""

    inputs: np.ndarray  # [rows] int64
    outputs: np.ndarray  # [rows] int64

    def __post_init__(self) -> None:
        if len(self.inputs) == 0 or len(self.inputs) != len(self.outputs):
            raise WorkloadError("empirical lengths need equally many (>0) inputs and outputs")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        idx = rng.integers(0, len(self.inputs), size=n)
        return self.inputs[idx].copy(), self.outputs[idx].copy()


@dataclass(frozen=True)
class GithubIssueLengths:
    """GitHub-issue-style long requests (Medha's P50/P90, NanoCP Table 1 bins); see the module docstring."""

    input_knots: tuple[tuple[float, int], ...] = GITHUB_ISSUE_INPUT_KNOTS
    output_p50: int = GITHUB_ISSUE_OUTPUT_P50
    output_p90: int = GITHUB_ISSUE_OUTPUT_P90
    output_max: int = GITHUB_ISSUE_OUTPUT_MAX

    def input_quantile(self, u: np.ndarray) -> np.ndarray:
        qs = np.array([q for q, _ in self.input_knots])
        logs = np.log([float(t) for _, t in self.input_knots])
        return np.exp(np.interp(u, qs, logs))

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        inputs = np.rint(self.input_quantile(rng.random(n))).astype(np.int64)
        sigma = math.log(self.output_p90 / self.output_p50) / Z_90
        outputs = np.rint(self.output_p50 * np.exp(sigma * rng.standard_normal(n))).astype(np.int64)
        return inputs, np.clip(outputs, 1, self.output_max)


@dataclass(frozen=True)
class BinnedLengths:
    """Inputs from a table of bin shares (log-uniform inside a bin); outputs from another source's outputs."""

    shares: tuple[float, ...]
    outputs_from: LengthSource
    edges: tuple[int, ...] = LENGTH_BIN_EDGES

    def __post_init__(self) -> None:
        if len(self.shares) != len(self.edges) - 1:
            raise WorkloadError(f"{len(self.shares)} bin shares for {len(self.edges) - 1} bins")
        if min(self.shares) < 0 or sum(self.shares) <= 0:
            raise WorkloadError(f"bin shares must be >= 0 with a positive sum, got {self.shares}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(self.shares, dtype=float)
        bins = rng.choice(len(p), size=n, p=p / p.sum())  # [n]
        lo = np.log(np.asarray(self.edges[:-1], dtype=float))[bins]
        hi = np.log(np.asarray(self.edges[1:], dtype=float))[bins]
        inputs = np.rint(np.exp(lo + (hi - lo) * rng.random(n))).astype(np.int64)
        _, outputs = self.outputs_from.sample(n, rng)
        return inputs, outputs


@dataclass(frozen=True)
class MixedLengths:
    """Exactly round(long_ratio * n) requests from `long`, the rest from `short`, at random positions."""

    short: LengthSource
    long: LengthSource
    long_ratio: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_ratio <= 1.0:
            raise WorkloadError(f"long ratio must be in [0, 1], got {self.long_ratio}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n_long = int(round(self.long_ratio * n))
        is_long = np.zeros(n, dtype=bool)
        is_long[rng.permutation(n)[:n_long]] = True
        inputs = np.empty(n, dtype=np.int64)
        outputs = np.empty(n, dtype=np.int64)
        inputs[~is_long], outputs[~is_long] = self.short.sample(n - n_long, rng)
        inputs[is_long], outputs[is_long] = self.long.sample(n_long, rng)
        return inputs, outputs


# ---------------------------------------------------------------------------------------------------------------
# Trace files
# ---------------------------------------------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def traces_dir() -> Path:
    """$NANOCP_TRACES if set, else ../shared/traces relative to the repository root."""
    env = os.environ.get("NANOCP_TRACES")
    return Path(env) if env else repo_root().parent / "shared" / "traces"


def resolve_trace(name_or_path: str | os.PathLike) -> Path:
    """A known trace name (sharegpt4, azure-conv, azure-code, mooncake), a file in the traces dir, or a path."""
    name = str(name_or_path)
    candidates = [Path(name), traces_dir() / TRACE_FILES.get(name, name)]
    for path in candidates:
        if path.is_file():
            return path
    raise WorkloadError(f"trace {name!r} not found (looked at {', '.join(str(c) for c in candidates)})")


def _positive_lengths(inputs: np.ndarray, outputs: np.ndarray, path: Path) -> tuple[np.ndarray, np.ndarray]:
    keep = (inputs > 0) & (outputs > 0)
    if not keep.any():
        raise WorkloadError(f"{path}: no row has positive input and output lengths")
    return inputs[keep], outputs[keep]


def sharegpt4_lengths(path: str | os.PathLike = "sharegpt4") -> EmpiricalLengths:
    """The ShareGPT-4 short trace's (num_prefill_tokens, num_decode_tokens) rows."""
    file = resolve_trace(path)
    with file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        inputs = np.array([int(float(r["num_prefill_tokens"])) for r in rows], dtype=np.int64)
        outputs = np.array([int(float(r["num_decode_tokens"])) for r in rows], dtype=np.int64)
    except KeyError as e:
        raise WorkloadError(f"{file}: missing column {e}") from None
    return EmpiricalLengths(*_positive_lengths(inputs, outputs, file))


def _requests_from_columns(times: Sequence[float], inputs: Sequence[int], outputs: Sequence[int]) -> list[Request]:
    order = np.argsort(np.asarray(times, dtype=float), kind="stable")
    t0 = float(times[order[0]]) if len(order) else 0.0
    return [
        Request(f"r{k}", float(times[i]) - t0, int(inputs[i]), int(outputs[i]))
        for k, i in enumerate(order)
        if int(inputs[i]) > 0 and int(outputs[i]) > 0
    ]


def _parse_azure_timestamp(text: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than datetime parses.
    whole, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure_trace(path: str | os.PathLike) -> list[Request]:
    """Azure LLM inference trace CSV: TIMESTAMP,ContextTokens,GeneratedTokens."""
    file = resolve_trace(path)
    with file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        times = [_parse_azure_timestamp(r["TIMESTAMP"]) for r in rows]
        return _requests_from_columns(
            times, [int(r["ContextTokens"]) for r in rows], [int(r["GeneratedTokens"]) for r in rows]
        )
    except KeyError as e:
        raise WorkloadError(f"{file}: missing Azure column {e}") from None


def load_mooncake_trace(path: str | os.PathLike) -> list[Request]:
    """Mooncake JSONL: one object per line with timestamp (ms), input_length, output_length."""
    file = resolve_trace(path)
    times, inputs, outputs = [], [], []
    with file.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                times.append(float(obj["timestamp"]) / 1000.0)
                inputs.append(int(obj["input_length"]))
                outputs.append(int(obj["output_length"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise WorkloadError(f"{file}:{line_no}: bad Mooncake record ({e})") from None
    return _requests_from_columns(times, inputs, outputs)


def load_generic_trace(path: str | os.PathLike) -> list[Request]:
    """Generic CSV with a header naming arrival (seconds), input_len, output_len."""
    file = resolve_trace(path)
    with file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        times = [float(r["arrival"]) for r in rows]
        return _requests_from_columns(times, [int(r["input_len"]) for r in rows], [int(r["output_len"]) for r in rows])
    except KeyError as e:
        raise WorkloadError(f"{file}: missing column {e} (need arrival,input_len,output_len)") from None


def load_trace(name_or_path: str | os.PathLike) -> list[Request]:
    """Replay a trace with its own timestamps; the format is taken from the file's extension and header."""
    file = resolve_trace(name_or_path)
    if file.suffix == ".jsonl":
        return load_mooncake_trace(file)
    with file.open(newline="") as f:
        header = next(csv.reader(f), [])
    if "TIMESTAMP" in header:
        return load_azure_trace(file)
    if "arrival" in header:
        return load_generic_trace(file)
    raise WorkloadError(f"{file}: unknown trace format (header {header}); ShareGPT-4 has no timestamps")


# ---------------------------------------------------------------------------------------------------------------
# Building workloads
# ---------------------------------------------------------------------------------------------------------------


def length_source(name: str) -> LengthSource:
    """Length source by name: sharegpt4, sharegpt4o, github-issue, openrouter, mix:<ratio> (e.g. mix:0.05, mix:5%).

    mix:<ratio> is ShareGPT-4 short requests plus that fraction of GitHub-issue long requests (mix:1 = all long).
    """
    if name == "sharegpt4":
        return sharegpt4_lengths()
    if name == "github-issue":
        return GithubIssueLengths()
    if name == "openrouter":
        return BinnedLengths(OPENROUTER_BINS, outputs_from=sharegpt4_lengths())
    if name == "sharegpt4o":
        return BinnedLengths(SHAREGPT4O_BINS, outputs_from=sharegpt4_lengths())
    if name.startswith("mix:"):
        text = name[4:]
        try:
            ratio = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise WorkloadError(f"bad long ratio in {name!r}") from None
        return MixedLengths(sharegpt4_lengths(), GithubIssueLengths(), ratio)
    raise WorkloadError(f"unknown length source {name!r}")


def make_requests(arrivals: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> list[Request]:
    if not len(arrivals) == len(inputs) == len(outputs):
        raise WorkloadError("arrivals, inputs and outputs differ in length")
    return [Request(f"r{i}", float(t), int(a), int(b)) for i, (t, a, b) in enumerate(zip(arrivals, inputs, outputs))]


def synthetic_workload(
    lengths: LengthSource | str,
    num_requests: int,
    rate: float,
    *,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[Request]:
    """num_requests requests with lengths from `lengths` and arrivals 'poisson', 'gamma' or 'fixed' at `rate`/s."""
    source = length_source(lengths) if isinstance(lengths, str) else lengths
    rng = np.random.default_rng(seed)
    if arrival == "poisson":
        times = poisson_arrivals(num_requests, rate, rng)
    elif arrival == "gamma":
        times = gamma_arrivals(num_requests, rate, burstiness, rng)
    elif arrival == "fixed":
        times = fixed_rate_arrivals(num_requests, rate)
    else:
        raise WorkloadError(f"unknown arrival process {arrival!r} (poisson, gamma, fixed)")
    inputs, outputs = source.sample(num_requests, rng)
    return make_requests(times, inputs, outputs)


def truncate_to_duration(requests: Sequence[Request], duration_s: float) -> list[Request]:
    """Requests arriving strictly before duration_s."""
    return [r for r in requests if r.arrival_s < duration_s]


def workload_summary(requests: Sequence[Request]) -> dict[str, float]:
    """Count, span, mean rate and input/output mean / P50 / P90 of a workload."""
    if not requests:
        return {"count": 0}
    t = np.array([r.arrival_s for r in requests])
    i = np.array([r.input_len for r in requests])
    o = np.array([r.output_len for r in requests])
    span = float(t.max() - t.min())
    out = {"count": len(requests), "span_s": span, "rate": (len(requests) - 1) / span if span > 0 else math.inf}
    for name, v in (("input", i), ("output", o)):
        out[f"{name}_mean"] = float(v.mean())
        out[f"{name}_p50"] = float(np.percentile(v, 50))
        out[f"{name}_p90"] = float(np.percentile(v, 90))
    return out


def build_workload(
    source: str,
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    num_requests: int | None = None,
    arrival: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
    time_scale: float | None = None,
) -> list[Request]:
    """One entry point for CLIs: a trace replay or a synthetic workload, cut to `duration_s` / `num_requests`.

    source: a trace (azure-conv, azure-code, mooncake, or a CSV/JSONL path with timestamps) replayed with its own
    timestamps, optionally multiplied by `time_scale` or retimed to `rate`; otherwise a length source name for
    `length_source` (sharegpt4, github-issue, openrouter, sharegpt4o, mix:<ratio>) with `arrival` at `rate`.
    """
    # sharegpt4 has no timestamps: it is a length source, not a replayable trace
    is_trace = (source in TRACE_FILES and source != "sharegpt4") or Path(source).suffix in (".csv", ".jsonl")
    if is_trace:
        reqs = load_trace(source)
        if time_scale is not None:
            reqs = scale_arrivals(reqs, time_scale)
        if rate is not None:
            reqs = retime_to_rate(reqs, rate)
    else:
        if rate is None:
            raise WorkloadError(f"a synthetic workload ({source}) needs a request rate")
        if num_requests is None:
            if duration_s is None or math.isinf(rate):
                raise WorkloadError("give num_requests, or a duration with a finite rate")
            num_requests = int(math.ceil(rate * duration_s * 1.5)) + 16  # enough to cover the duration
        reqs = synthetic_workload(source, num_requests, rate, arrival=arrival, burstiness=burstiness, seed=seed)
    if duration_s is not None:
        reqs = truncate_to_duration(reqs, duration_s)
    return reqs[:num_requests] if num_requests is not None else reqs
