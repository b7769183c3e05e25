"""The decode data plane on a GPU: two instances sharing it, driven by the engine, against the CPU path.

fp32: the same greedy tokens as the CPU cluster, logits within fp32 summation error. bf16: the logits that
produced each token stay within bf16 rounding of the CPU fp32 run's, up to the first token where the two runs
part (after it they decode different contexts). On the CPU dry run the "device" run is a second CPU run."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from gpu_target import gpu_marks, gpu_target
from test_gpu_graphs import replayable_plans
from test_graphs_decode import Cluster, N, fill_random, rows_for

from nanocp import LLM, SamplingParams
from nanocp.control_plane import CPBucketTable
from nanocp.models import ModelConfig, random_weights

pytestmark = gpu_marks()
DEVICE = gpu_target()
FORCE_CP = CPBucketTable((24, 10**9), (1, 2))  # prompts longer than 24 tokens are split over both instances
KWARGS = dict(decode_instances=2, cp_buckets=FORCE_CP, page_size=8, max_batch_per_instance=8)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 17, 30, 41, 58, 9))]

# fp32: every logit is a chain of sums of at most a few hundred products (hidden 256, intermediate 512); the GPU
# sums them in another order than the CPU, each order within gamma_n = n u (u = 2^-24) of the exact sum relative
# to the sum of magnitudes. Relative to max |logit| that is below 1e-5 for n <= 512 with margin for the norms
# (which divide by sqrt(mean square) of the same magnitude): 1e-4 holds with a factor 10 to spare.
FP32_RTOL = 1e-4
# bf16: 8 significand bits, unit roundoff u = 2^-8. The weights, the KV and every activation a layer stores are
# rounded (about 8 roundings per layer: norm, q/kv projections, attention output, o_proj, gate/up, down, residual);
# to first order their relative errors add along the residual stream: 8 L + 4 roundings with the embedding and the
# head, times a factor 4 for cancellation in the logits (measured relative to the largest logit of the row).
BF16_RTOL = 4 * (8 * ModelConfig.tiny().num_hidden_layers + 4) * 2.0**-8


def _run(device: str, dtype: torch.dtype, use_graphs: bool = False):
    with LLM("tiny", device=device, dtype=dtype, use_graphs=use_graphs, **KWARGS) as llm:
        outs = llm.generate(PROMPTS, PARAMS, return_logits=True)
    return [o.token_ids for o in outs], [[lg.float().cpu() for lg in o.logits] for o in outs]


@pytest.fixture(scope="module")
def cpu_fp32():
    return _run("cpu", torch.float32)


def _max_relative_error(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, ref))


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "graphs"])
def test_fp32_on_the_device_gives_the_cpu_greedy_tokens(cpu_fp32, use_graphs):
    tokens, logits = _run(DEVICE, torch.float32, use_graphs)
    ref_tokens, ref_logits = cpu_fp32
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert _max_relative_error(ours, ref) <= FP32_RTOL


def test_bf16_on_the_device_stays_within_bf16_rounding_of_fp32():
    """One iteration at a time (the same KV and input tokens before each), so no run parts from the other: every
    logits row of a bf16 cluster on the device against an fp32 cluster on the CPU. Every layer is dense: a MoE
    gate's near-tie may pick another expert under rounding, a discontinuity no rounding bound covers."""
    config = dataclasses.replace(ModelConfig.tiny(), first_k_dense_replace=ModelConfig.tiny().num_hidden_layers)
    ref = Cluster([random_weights(config) for _ in range(N)])
    ours = Cluster([random_weights(config, dtype=torch.bfloat16, device=DEVICE) for _ in range(N)], device=DEVICE,
                   dtype=torch.bfloat16)  # fmt: skip
    fill_random(ref.pools, 3)
    rnd, worst = random.Random(3), 0.0
    for plan, tables in replayable_plans(3, steps=6):
        for op, rp in zip(ours.pools, ref.pools):
            op.kv.copy_(rp.kv)
        rows = rows_for(plan, rnd)
        want, got = ref.run(tables, rows), ours.run(tables, rows)
        assert [o.batch_index for o in got] == [o.batch_index for o in want]
        for g, w in zip(got, want):
            worst = max(worst, float((g.logits.float().cpu() - w.logits).abs().max() / w.logits.abs().max()))
    assert 0 < worst <= BF16_RTOL, f"max relative logits error {worst:.3g} (bound {BF16_RTOL:.3g})"
