"""DeepGEMM masked grouped FP8 experts against the torch experts (GPU test skipped without SM90 + deep_gemm);
the FP8 weights it is given (an FP8 checkpoint's own, else quantised at load) are checked on any device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.data_plane.backends import torch_experts
from nanocp.data_plane.backends.deepgemm import (
    FP8_MAX,
    DeepGemmExperts,
    checkpoint_expert_fp8,
    checkpoint_fp8_unusable_reason,
    deepgemm_unavailable_reason,
    expert_fp8_weights,
    quantize_per_block,
    quantize_per_token,
)
from nanocp.models import MLPWeights, ModelConfig, SafetensorsCheckpoint, load_weights, save_tiny_checkpoint
from nanocp.models.checkpoint import expert_names

REASON = deepgemm_unavailable_reason()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_per_token_quantisation_reconstructs_within_fp8_precision(rows, groups, seed):
    x = torch.randn(2, rows, groups * 128, generator=torch.Generator().manual_seed(seed)) * 3
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, rows, groups)
    back = (q.float().unflatten(-1, (groups, 128)) * scale[..., None]).flatten(-2)
    amax = x.abs().unflatten(-1, (groups, 128)).amax(-1, keepdim=True)
    # E4M3 keeps 3 mantissa bits: error <= 1/16 of the value, and the group max maps to 448 exactly
    assert bool(((back - x).abs().unflatten(-1, (groups, 128)) <= amax / 16 + 1e-6).all())
    assert torch.allclose(q.float().abs().unflatten(-1, (groups, 128)).amax(-1), torch.full_like(scale, FP8_MAX))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 3), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_per_block_quantisation_uses_one_scale_per_128x128_block(n, k, seed):
    w = torch.randn(2, n * 128, k * 128, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_per_block(w)
    assert q.shape == w.shape and scale.shape == (2, n, k)
    blocks = w.unflatten(-1, (k, 128)).unflatten(-3, (n, 128))
    expect = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX
    torch.testing.assert_close(scale, expect)
    back = q.float().unflatten(-1, (k, 128)).unflatten(-3, (n, 128)) * scale[..., :, None, :, None]
    assert bool(((back - blocks).abs() <= blocks.abs().amax(dim=(-3, -1), keepdim=True) / 16 + 1e-6).all())
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_per_block(torch.randn(100, 128))


class _Layer:
    """The part of LayerWeights the experts read."""

    def __init__(self, experts: dict[int, MLPWeights]):
        self.index = 1
        self.moe = type("MoE", (), {"experts": experts})()


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_deepgemm_experts_match_torch_experts_on_received_rows():
    g = torch.Generator().manual_seed(0)
    hidden, inter, local, rows = 256, 256, 3, 64
    experts = {
        e: MLPWeights(*(torch.randn(*shape, generator=g).div(16).to("cuda", torch.bfloat16)
                        for shape in ((inter, hidden), (inter, hidden), (hidden, inter))))
        for e in range(local)
    }  # fmt: skip
    layer = _Layer(experts)
    model = type("Model", (), {"layers": [layer]})()
    recv_x = torch.randn(local, rows, hidden, generator=g).to("cuda", torch.bfloat16)
    recv_count = torch.tensor([5, 0, 64], dtype=torch.int32, device="cuda")
    ours = torch.zeros(local, rows, hidden, dtype=torch.bfloat16, device="cuda")
    ref = torch.zeros_like(ours)
    DeepGemmExperts(model, range(local), expected_m=24)(layer, range(local), recv_x, recv_count, ours)
    torch_experts(layer, range(local), recv_x, recv_count, ref)
    for e, n in enumerate(recv_count.tolist()):
        if n:
            a, b = ours[e, :n].float(), ref[e, :n].float()
            assert float((a - b).norm() / b.norm()) < 0.05  # FP8 GEMMs against bf16


# ---- the weights DeepGEMM gets: an FP8 checkpoint's own, else quantised at load (any device) ---------------------
FP8_CONFIG = dataclasses.replace(
    ModelConfig.tiny(), hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128
)


def _stored(directory, name: str) -> torch.Tensor:
    return SafetensorsCheckpoint.open(directory).read(name)


def test_an_fp8_checkpoints_experts_reach_deepgemm_as_stored(tmp_path):
    """128 x 128 blocks (the releases' layout): the fp8 bytes and scales as the checkpoint stores them, never
    dequantized and quantised again; they stand for exactly the weights the loader dequantized."""
    write_fp8_checkpoint(tmp_path, FP8_CONFIG, seed=2, block=(128, 128))
    local = [1, 6]
    model = load_weights(tmp_path, expert_ids=set(local))
    weights, source = expert_fp8_weights(model, local)
    assert source == "checkpoint" and checkpoint_fp8_unusable_reason(model) is None
    layer = next(layer for layer in model.layers if layer.moe is not None)
    (gate_up, gate_up_scale), (down, down_scale) = weights[layer.index]
    for g, e in enumerate(local):
        gate, up, down_name = expert_names(layer.index, e)
        want = torch.cat([_stored(tmp_path, gate), _stored(tmp_path, up)])
        assert torch.equal(gate_up[g].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(down[g].view(torch.uint8), _stored(tmp_path, down_name).view(torch.uint8))
        assert torch.equal(gate_up_scale[g], torch.cat([_stored(tmp_path, gate + "_scale_inv"),
                                                        _stored(tmp_path, up + "_scale_inv")]))  # fmt: skip
        back = down[g].float().unflatten(1, (-1, 128)).unflatten(0, (-1, 128)) * down_scale[g][:, None, :, None]
        torch.testing.assert_close(back.flatten(2).flatten(0, 1), layer.moe.experts[e].down_proj, rtol=0, atol=0)


@pytest.mark.parametrize("block", [(16, 32), None])
def test_other_checkpoints_are_quantised_at_load(tmp_path, block):
    if block is None:
        model = load_weights(_plain_checkpoint(tmp_path), expert_ids={0, 3})
    else:
        write_fp8_checkpoint(tmp_path, FP8_CONFIG, seed=2, block=block)
        model = load_weights(tmp_path, expert_ids={0, 3})
    weights, source = expert_fp8_weights(model, [0, 3])
    assert source.startswith("quantised at load") and checkpoint_fp8_unusable_reason(model) in source
    layer = next(layer for layer in model.layers if layer.moe is not None)
    experts = [layer.moe.experts[e] for e in (0, 3)]
    gate_up = torch.stack([torch.cat([e.gate_proj, e.up_proj]) for e in experts])
    for got, want in zip(weights[layer.index][0], quantize_per_block(gate_up)):
        assert torch.equal(got.float(), want.float())
    with pytest.raises(ValueError, match="FP8"):
        checkpoint_expert_fp8(model, [0, 3])


def _plain_checkpoint(directory):
    save_tiny_checkpoint(directory, FP8_CONFIG, seed=2)
    return directory
