"""CUDA-graph replay of the decode pieces against the eager path on a GPU (skipped without CUDA).

The model is the tiny one with every layer dense: the reference MoE dispatcher keeps its bookkeeping on the CPU,
so MoE layers on a GPU need DeepEP (tests/test_gpu_deepep.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_graphs_decode import Cluster, N, assert_pools_close, assert_rows_close, fill_random, random_plans, rows_for

from nanocp.models import ModelConfig, random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graph_replay_equals_eager_on_gpu():
    config = dataclasses.replace(ModelConfig.tiny(), first_k_dense_replace=ModelConfig.tiny().num_hidden_layers)
    models = [random_weights(config, device="cuda") for _ in range(N)]
    eager, graph = Cluster(models, device="cuda"), Cluster(models, graphs=True, device="cuda")
    fill_random(eager.pools, 5)
    plans = list(random_plans(5, "nanocp", steps=6))
    for _ in range(2):  # first pass captures (its warm-up computes the results), second pass replays
        rnd = random.Random(5)
        for plan in plans:
            for gp, ep in zip(graph.pools, eager.pools):
                gp.kv.copy_(ep.kv)
            rows = rows_for(plan, rnd)
            want = eager.run(plan.tables, rows)
            got = graph.run(plan.tables, rows)
            torch.cuda.synchronize()
            assert_rows_close(got, want)
            assert_pools_close(graph.pools, eager.pools)
    report = graph.engines[0].report()
    assert report.mode == "cuda-graphs" and report.captured > 0
