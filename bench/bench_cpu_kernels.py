"""The fused fp32 CPU kernels against their torch reference path, paired in one process.

    python -m nanocp.bench.bench_cpu_kernels [--batches 16 64] [--repeats 5]

Three comparisons, each alternating the two paths run by run (`cpu_kernels.set_enabled`) so that the machine's drift
hits both alike:
- the decode step: `LLM.generate` on the tiny model (1 instance, inline backend, greedy), milliseconds per decode
  step (time after the last first token / steps);
- the routed experts of one MoE layer (`decode_layers.grouped_experts`, 16 experts, top-4 routing of `batch`
  tokens): the grouped expert kernel against the padded bmm path, with the weights cold (the calls cycle over
  enough layers' experts to leave the cache) as in a decode step;
- the shard attention of one layer (`backends.cpu_attention.CpuPagedAttention`: `batch` shards of ATTENTION_CONTEXT
  tokens in scattered 16-token pages, the tiny model's 4 heads of 80 values): the C++ kernel reading the pages in
  place against torch's flash-attention kernel over the gathered pages (its plan built once, as a sub-step does).
Measured on this machine, not a model output. Writes bench/results/cpu_kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from nanocp import LLM
from nanocp.data_plane import cpu_kernels
from nanocp.data_plane import decode_layers as dl
from nanocp.data_plane.backends.cpu_attention import CpuPagedAttention
from nanocp.models import ModelConfig

from .bench_decode import RESULTS, nanocp_rates, prompts_for
from .machine import describe, machine_info

PATHS = ("kernels", "torch")
COLD_LAYERS = 12  # 12 layers x 16 experts x 384 KB = 75 MB of expert weights: more than the caches keep
ATTENTION_CONTEXT = 48  # tokens per shard: the mean context of bench_decode's requests (32-token prompts, 32 new)
PAGE = 16


def _with_path(path: str, fn):
    previous = cpu_kernels.set_enabled(path == "kernels")
    try:
        return fn()
    finally:
        cpu_kernels.set_enabled(previous)


def decode_step_ms(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Milliseconds per decode step: the batch over bench_decode's decode tokens/s."""
    return len(prompts) / nanocp_rates(llm, prompts, new_tokens).decode * 1e3


def expert_layers(c: ModelConfig, seed: int) -> list[dl.GroupedExperts]:
    """COLD_LAYERS layers of routed experts shaped like model c's (fresh random weights)."""
    hidden, inter, experts = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
    gen = torch.Generator().manual_seed(seed)
    return [
        dl.GroupedExperts(
            torch.randn(experts, hidden, 2 * inter, generator=gen) * 0.05,
            torch.randn(experts, inter, hidden, generator=gen) * 0.05,
        )
        for _ in range(COLD_LAYERS)
    ]


def experts_ms(layers: list[dl.GroupedExperts], batch: int, top_k: int, seed: int, calls: int = 20) -> float:
    """Milliseconds per grouped_experts call: `batch` tokens, each routed to top_k distinct experts."""
    rng = np.random.default_rng(seed)
    num_experts, hidden = layers[0].gate_up.shape[0], layers[0].gate_up.shape[1]
    source = torch.from_numpy(rng.standard_normal((batch, hidden)).astype(np.float32))
    rows = np.repeat(np.arange(batch, dtype=np.int64), top_k)
    local = np.concatenate([rng.choice(num_experts, top_k, replace=False) for _ in range(batch)]).astype(np.int64)
    start = time.perf_counter()
    for i in range(calls):
        dl.grouped_experts(layers[i % len(layers)], source, rows, local)
    return (time.perf_counter() - start) / calls * 1e3


def attention_ms(c: ModelConfig, batch: int, seed: int, calls: int = 50) -> float:
    """Milliseconds per shard-attention call of `batch` shards of ATTENTION_CONTEXT tokens each."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-ATTENTION_CONTEXT // PAGE)
    pages = 4 * batch * blocks  # the shards' pages scattered over a pool 4 times their size
    width = c.kv_lora_rank + c.qk_rope_head_dim
    kv_pages = torch.randn(pages, PAGE, width, generator=gen)
    q = torch.randn(batch, c.num_attention_heads, width, generator=gen)
    block_table = torch.randperm(pages, generator=gen)[: batch * blocks].view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), ATTENTION_CONTEXT, dtype=torch.int64)
    attention = CpuPagedAttention()
    plan = attention.plan(block_table, lens, PAGE, q.dtype)
    start = time.perf_counter()
    for _ in range(calls):
        attention.run(plan, q, kv_pages, 0.1, c.kv_lora_rank)
    return (time.perf_counter() - start) / calls * 1e3


def paired(measure, repeats: int) -> dict:
    """Median of each path over `repeats` alternating runs, and their ratio (torch / kernels)."""
    runs = {p: [] for p in PATHS}
    for _ in range(repeats):
        for p in PATHS:
            runs[p].append(_with_path(p, measure))
    med = {p: statistics.median(v) for p, v in runs.items()}
    return {"ms": med, "runs_ms": runs, "speedup": med["torch"] / med["kernels"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "cpu_kernels"))
    args = ap.parse_args(argv)
    if cpu_kernels.unavailable_reason() is not None:
        raise SystemExit(f"cannot compare: {cpu_kernels.unavailable_reason()}")
    step, experts, attention = {}, {}, {}
    config = ModelConfig.tiny()
    with LLM("tiny", decode_instances=1, backend="inline") as llm:
        for batch in args.batches:
            prompts = prompts_for(batch, 32, batch)
            for path in PATHS:  # warm up both paths
                _with_path(path, partial(decode_step_ms, llm, prompts, 4))
            step[batch] = paired(partial(decode_step_ms, llm, prompts, args.new_tokens), args.repeats)
    layers = expert_layers(config, seed=0)
    for batch in args.batches:
        experts[batch] = paired(partial(experts_ms, layers, batch, config.num_experts_per_tok, batch), args.repeats)
        attention[batch] = paired(partial(attention_ms, config, batch, batch), args.repeats)
    for batch in args.batches:
        s, e, a = step[batch], experts[batch], attention[batch]
        print(
            f"batch {batch:3d}: decode step {s['ms']['kernels']:.2f} vs {s['ms']['torch']:.2f} ms "
            f"({s['speedup']:.2f}x); routed experts {e['ms']['kernels']:.3f} vs {e['ms']['torch']:.3f} ms "
            f"({e['speedup']:.2f}x); attention {a['ms']['kernels']:.3f} vs {a['ms']['torch']:.3f} ms "
            f"({a['speedup']:.2f}x)"
        )
    result = {
        "benchmark": "fused fp32 CPU kernels vs the torch reference path, paired",
        "machine": machine_info(),
        "settings": vars(args),
        "decode_step": {str(b): v for b, v in step.items()},
        "routed_experts": {str(b): v for b, v in experts.items()},
        "attention": {str(b): v for b, v in attention.items()},
        "attention_context": ATTENTION_CONTEXT,
        "load_average_1_5_15min": os.getloadavg(),
    }
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Fused fp32 CPU kernels vs their torch reference path (tiny model, CPU)",
        "",
        "Command: `python -m nanocp.bench.bench_cpu_kernels`. Measured on this machine, not a model output; each "
        f"row is the median of {args.repeats} runs per path, the paths alternating run by run in one process.",
        "",
        describe(result["machine"]),
        "",
        "- decode step: `LLM.generate`, 1 instance (inline), greedy, ms per decode step;",
        "- routed experts: one MoE layer's `grouped_experts` (16 experts, top-4), the grouped expert kernel vs the "
        "padded bmm path, weights cold;",
        f"- attention: one layer's shard attention, `batch` shards of {ATTENTION_CONTEXT} tokens in scattered "
        f"{PAGE}-token pages, the C++ kernel on the pages vs torch's flash-attention kernel on the gathered pages.",
        "",
        "| batch | decode step: kernels ms | torch ms | speedup | routed experts: kernel ms | padded bmm ms "
        "| speedup | attention: kernel ms | flash ms | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in args.batches:
        s, e, a = step[batch], experts[batch], attention[batch]
        lines.append(
            f"| {batch} | {s['ms']['kernels']:.2f} | {s['ms']['torch']:.2f} | **{s['speedup']:.2f}x** | "
            f"{e['ms']['kernels']:.3f} | {e['ms']['torch']:.3f} | **{e['speedup']:.2f}x** | "
            f"{a['ms']['kernels']:.3f} | {a['ms']['torch']:.3f} | **{a['speedup']:.2f}x** |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
