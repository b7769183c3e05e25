"""FlashMLA shard attention against the torch reference (needs an SM90 GPU and flash_mla; skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from nanocp.data_plane.backends.flashmla import FlashMLAAttention, flashmla_unavailable_reason
from nanocp.models import mla_paged_attention_with_lse

REASON = flashmla_unavailable_reason("cuda", 64, torch.bfloat16)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.mark.parametrize("heads", [16, 128])
def test_flashmla_matches_the_reference_including_empty_shards(heads):
    g = torch.Generator().manual_seed(heads)
    shards, max_blocks, pages = 24, 9, 400
    q = (torch.randn(shards, heads, 576, generator=g) / 10).to("cuda", torch.bfloat16)
    kv = (torch.randn(pages, 64, 576, generator=g) / 10).to("cuda", torch.bfloat16)
    lens = torch.randint(1, max_blocks * 64 + 1, (shards,), generator=g)
    lens[::5] = 0  # padding shards / empty partials
    block_table = torch.randperm(pages, generator=g)[: shards * max_blocks].view(shards, max_blocks)
    lens, block_table = lens.to("cuda", torch.int32), block_table.to("cuda", torch.int32)
    scale = 0.1352  # DeepSeek-V3's YaRN-corrected scale is not FlashMLA's default 1/sqrt(576)
    o, lse = FlashMLAAttention()(q, kv, block_table, lens, scale, 512)
    ref_o, ref_lse = mla_paged_attention_with_lse(q.float(), kv.float(), block_table, lens, scale, 512)
    empty = lens == 0
    assert bool((lse[empty] == float("-inf")).all()) and not o[empty].any()
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(o[~empty].float(), ref_o[~empty], rtol=2e-2, atol=2e-2)


def test_flashmla_rejects_other_head_dims():
    q = torch.zeros(1, 4, 80, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, 80, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="576"):
        FlashMLAAttention()(
            q, kv, torch.zeros(1, 1, dtype=torch.int32, device="cuda"), torch.ones(1, device="cuda"), 0.1, 64
        )
