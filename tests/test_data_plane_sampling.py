"""Token sampling: a tiny temperature is greedy (no overflow), batched sampling equals row-by-row sampling."""

from __future__ import annotations

import torch

from nanocp.data_plane.sampling import SamplingParams, sample_token, sample_tokens


def test_a_tiny_temperature_samples_the_argmax_without_overflow():
    gen = torch.Generator().manual_seed(0)
    for temperature in (1e-30, 1e-300, 5e-324):
        for seed in range(5):
            logits = torch.randn(260, generator=gen) * 30
            params = SamplingParams(temperature=temperature, top_k=40, top_p=0.9, seed=seed)
            assert sample_token(logits, params, output_index=seed, fallback_seed=0) == int(logits.argmax())
    shifted = torch.randn(260, generator=gen).double()
    probs = torch.softmax((shifted - shifted.max()) / 1e-30, dim=-1)
    assert torch.isfinite(probs).all() and float(probs.sum()) == 1.0


def test_batched_sampling_equals_row_by_row_sampling():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 260, generator=gen)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.7, seed=11),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
    ]
    index, seeds = [0, 4, 2, 9, 1, 3, 5], [17, 18, 19, 20, 21, 22, 23]
    want = [sample_token(logits[r], params[r], index[r], seeds[r]) for r in range(7)]
    assert sample_tokens(logits, params, index, seeds) == want
    greedy = [SamplingParams(temperature=0.0)] * 7
    assert sample_tokens(logits, greedy, index, seeds) == logits.argmax(dim=-1).tolist()
    assert sample_tokens(logits[:0], [], [], []) == []


def test_batched_greedy_rows_take_the_first_maximum_like_torch():
    """Greedy rows take numpy's argmax on the CPU: torch's answer on ties (the first) and NaN rows, fp32 and fp64."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        logits = torch.randint(0, 4, (40, 260), generator=gen).to(dtype)  # many ties
        logits[3, 100] = float("nan")
        logits[5, [7, 200]] = float("nan")
        greedy = [SamplingParams(temperature=0.0)] * 40
        assert sample_tokens(logits, greedy, [0] * 40, [0] * 40) == [int(torch.argmax(row)) for row in logits]
