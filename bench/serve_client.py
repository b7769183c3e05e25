"""Serving benchmark client, with the metrics of `vllm bench serve`.

    nanocp bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt4 --request-rate 4 --num-prompts 100 \\
        --goodput ttft:500 tpot:50 --result-file bench/results/serve_tiny.json

Requests are streamed (SSE, httpx async) with `stream_options.include_usage`; arrivals are Poisson at
--request-rate, or gamma with --burstiness (vLLM semantics: 1 = Poisson, < 1 burstier); --max-concurrency caps
requests in flight. Per request: TTFT (send -> first non-empty text chunk), ITL (gaps between later chunks), E2E
latency, TPOT = (E2E - TTFT) / (output tokens - 1) (excludes the first token), output tokens from `usage`.
Summary: mean / median / std / p90 / p99 of each, request and token throughput, and goodput (requests per second
that meet every SLO given with --goodput ttft:MS tpot:MS e2el:MS).

Datasets (lengths only; their text is synthesized): `sharegpt4` (ShareGPT-4 short trace, rows resampled),
`azure-conv` / `azure-code` (Azure LLM 2023 traces, rows in trace order), `mooncake` (Mooncake conversation
trace, in order), all read from ../shared/traces; `synthetic` (--input-len / --output-len, +-range ratio).
Arrival times always come from --request-rate / --burstiness, not from the traces' timestamps. Prompt lengths
are scaled to the served model: input_len = clip(round(trace_len * --input-scale), --min-input-len,
--max-input-len), output_len = min(trace_len, --max-tokens-cap). A prompt of n tokens is n random ASCII
letters and spaces: exactly n tokens for the tiny model's byte tokenizer (the completions endpoint adds one BOS
token, visible in usage.prompt_tokens); with a subword tokenizer the count is only approximate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from .workloads import gamma_arrivals, load_azure_trace, load_mooncake_trace, sharegpt4_lengths

DATASETS = ("sharegpt4", "azure-conv", "azure-code", "mooncake", "synthetic")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SLO_KEYS = ("ttft", "tpot", "e2el")
PROMPT_ALPHABET = np.array(list(string.ascii_letters + "     "))  # ~1 space per 11 characters


class BenchError(ValueError):
    """Bad benchmark arguments or an unusable server answer."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens the prompt was synthesized for
    output_len: int  # max_tokens


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # usage.prompt_tokens (or the synthesized length)
    output_tokens: int = 0
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, gaps between chunks after the first
    latency: float = 0.0  # s, send -> [DONE]
    start: float = 0.0  # s since the benchmark started
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ---- workloads ---------------------------------------------------------------------------------------------


def synthesize_prompt(n_tokens: int, rng: np.random.Generator) -> str:
    """n random ASCII letters / spaces: n tokens for a byte tokenizer."""
    return "".join(rng.choice(PROMPT_ALPHABET, size=n_tokens))


def dataset_lengths(args: argparse.Namespace, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(input_lens [n], output_lens [n]) of the dataset before scaling."""
    n = args.num_prompts
    if args.dataset == "synthetic":
        lo, hi = 1.0 - args.range_ratio, 1.0 + args.range_ratio
        inputs = np.rint(args.input_len * rng.uniform(lo, hi, n)).astype(np.int64)
        outputs = np.rint(args.output_len * rng.uniform(lo, hi, n)).astype(np.int64)
        return np.maximum(inputs, 1), np.maximum(outputs, 1)
    if args.dataset == "sharegpt4":
        return sharegpt4_lengths().sample(n, rng)
    trace = load_mooncake_trace("mooncake") if args.dataset == "mooncake" else load_azure_trace(args.dataset)
    if len(trace) < n:
        raise BenchError(f"dataset {args.dataset} has {len(trace)} requests, fewer than --num-prompts {n}")
    rows = trace[:n]
    return np.array([r.input_len for r in rows]), np.array([r.output_len for r in rows])


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    rng = np.random.default_rng(args.seed)
    inputs, outputs = dataset_lengths(args, rng)
    scale = 1.0 if args.dataset == "synthetic" else args.input_scale
    inputs = np.clip(np.rint(inputs * scale), args.min_input_len, args.max_input_len).astype(np.int64)
    outputs = np.minimum(outputs, args.max_tokens_cap).astype(np.int64)
    return [BenchRequest(synthesize_prompt(int(i), rng), int(i), int(o)) for i, o in zip(inputs, outputs)]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise BenchError(f"--goodput: unknown SLO {key!r} (use {', '.join(SLO_KEYS)})")
        try:
            ms = float(value)
        except ValueError:
            raise BenchError(f"--goodput: {item!r} is not KEY:MILLISECONDS") from None
        if not ms > 0:
            raise BenchError(f"--goodput: {key} must be > 0 ms, got {value}")
        slos[key] = ms / 1000.0
    return slos


# ---- one request -------------------------------------------------------------------------------------------


def request_body(args: argparse.Namespace, model: str, req: BenchRequest) -> dict:
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, body: dict, req: BenchRequest, t0: float) -> RequestResult:
    result = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    result.start = start - t0
    last, chunks = None, 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
        result.latency = time.perf_counter() - start
        if last is None:  # no visible text at all: TTFT is when the answer completed
            result.ttft = result.latency
        result.output_tokens = result.output_tokens or chunks
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# ---- the run -----------------------------------------------------------------------------------------------


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(base_url + "/v1/models")
    if response.status_code != 200:
        raise BenchError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    data = response.json().get("data") or []
    if not data:
        raise BenchError("the server lists no models")
    return data[0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Send the workload, return the results document (summary + per-request arrays)."""
    slos = parse_goodput(args.goodput)
    requests = build_requests(args)
    rng = np.random.default_rng(args.seed + 1)
    arrivals = gamma_arrivals(len(requests), args.request_rate, args.burstiness, rng)  # [n] s
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=100)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model or await discover_model(client, base_url)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="bench serve")
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            body = request_body(args, model, req)
            if semaphore is None:
                result = await send_request(client, base_url + args.endpoint, body, req, t0)
            else:
                async with semaphore:
                    result = await send_request(client, base_url + args.endpoint, body, req, t0)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, float(a)) for r, a in zip(requests, arrivals)))
        duration = time.perf_counter() - t0
        bar.close()
    summary = summarize(results, duration, slos)
    return {
        "config": _config_record(args, model),
        "summary": summary,
        "requests": [_request_record(r) for r in results],
    }


def _stats(values_s: list[float]) -> dict[str, float]:
    """mean / median / std / p90 / p99 in milliseconds (zeros when there is nothing to measure)."""
    if not values_s:
        return {"mean_ms": 0.0, "median_ms": 0.0, "std_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    v = np.asarray(values_s) * 1000.0
    return {
        "mean_ms": float(v.mean()),
        "median_ms": float(np.median(v)),
        "std_ms": float(v.std()),
        "p90_ms": float(np.percentile(v, 90)),
        "p99_ms": float(np.percentile(v, 99)),
    }


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return r.success and all(values[k] <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([gap for r in ok for gap in r.itl]),
        "e2el": _stats([r.latency for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["goodput"] = {
            "slos_ms": {k: v * 1000.0 for k, v in slos.items()},
            "good_requests": good,
            "request_goodput": good / duration_s,
        }
    return summary


def _config_record(args: argparse.Namespace, model: str) -> dict:
    record = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    record["model"] = model
    record["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return record


def _request_record(r: RequestResult) -> dict:
    record = asdict(r)
    record["tpot"] = r.tpot
    return record


def markdown_summary(doc: dict) -> str:
    c, s = doc["config"], doc["summary"]
    lines = [
        f"# Serving benchmark: {c['dataset']} on {c['model']}",
        "",
        f"`nanocp bench serve --dataset {c['dataset']} --num-prompts {c['num_prompts']} "
        f"--request-rate {c['request_rate']} --burstiness {c['burstiness']} --max-tokens-cap {c['max_tokens_cap']}`"
        f" against {c['base_url']} ({c['endpoint']}). Measured on this machine (CPU), not a GPU model.",
        "",
        *([c["notes"], ""] if c.get("notes") else []),
        "| metric | value |",
        "|---|---|",
        f"| completed / failed | {s['completed']} / {s['failed']} |",
        f"| duration | {s['duration_s']:.2f} s |",
        f"| input / output tokens | {s['total_input_tokens']} / {s['total_output_tokens']} |",
        f"| request throughput | {s['request_throughput']:.2f} req/s |",
        f"| output token throughput | {s['output_throughput']:.1f} tok/s |",
        f"| total token throughput | {s['total_token_throughput']:.1f} tok/s |",
    ]
    if "goodput" in s:
        g = s["goodput"]
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
        lines.append(f"| goodput ({slo}) | {g['request_goodput']:.2f} req/s ({g['good_requests']} requests) |")
    lines += ["", "| ms | mean | median | std | p90 | p99 |", "|---|---|---|---|---|---|"]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        m = s[key]
        lines.append(
            f"| {label} | {m['mean_ms']:.1f} | {m['median_ms']:.1f} | {m['std_ms']:.1f} | {m['p90_ms']:.1f} | "
            f"{m['p99_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def print_summary(doc: dict) -> None:
    s = doc["summary"]
    print(f"{'=' * 18} Serving Benchmark Result {'=' * 18}")
    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    if "goodput" in s:
        rows.append(("Request goodput (req/s)", f"{s['goodput']['request_goodput']:.2f}"))
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean_ms", "median_ms", "p90_ms", "p99_ms"):
            rows.append((f"{key.upper()} {stat[:-3]} (ms)", f"{s[key][stat]:.2f}"))
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    print("=" * 61)


# ---- command line ------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model id (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("NANOCP_API_KEY"), help="default: $NANOCP_API_KEY")
    p.add_argument("--dataset", default="sharegpt4", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-scale", type=float, default=0.1, help="trace prompt lengths are multiplied by this")
    p.add_argument("--min-input-len", type=int, default=4)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-tokens-cap", type=int, default=64, help="max_tokens = min(trace output length, cap)")
    p.add_argument("--input-len", type=int, default=128, help="synthetic: mean prompt length")
    p.add_argument("--output-len", type=int, default=32, help="synthetic: mean output length")
    p.add_argument("--range-ratio", type=float, default=0.0, help="synthetic: lengths uniform in len * (1 +- r)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens tokens (nanocp/vLLM extension)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-file", default=None, help="write the JSON results here")
    p.add_argument("--markdown-file", default=None, help="write a markdown summary here")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--notes", default="", help="free text stored with the results (e.g. the server's command line)")


def check_arguments(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not 1 <= args.min_input_len <= args.max_input_len:
        raise BenchError("need 1 <= --min-input-len <= --max-input-len")
    if args.max_tokens_cap < 1 or args.input_len < 1 or args.output_len < 1:
        raise BenchError("--max-tokens-cap, --input-len and --output-len must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise BenchError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    parse_goodput(args.goodput)


def main_from_args(args: argparse.Namespace) -> int:
    check_arguments(args)
    doc = asyncio.run(run_benchmark(args))
    print_summary(doc)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results written to {path}")
    if args.markdown_file:
        path = Path(args.markdown_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown_summary(doc))
    return 0 if doc["summary"]["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanocp bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
