"""FlashMLA shard attention: the contract of models.mla_paged_attention_with_lse on DeepSeek's decode kernel.

Needs an SM90+ GPU, FlashMLA built from source (docs/gpu.md), pages of 64 tokens, bf16/fp16 KV, MLA with a
576-value latent key (512 + 64 rope) and 512-value latent value. Differences from the reference it hides:
q and the KV cache take a sequence / KV-head axis of 1; the scale must be passed (its default is 1/sqrt(576),
not DeepSeek's YaRN-corrected scale); an empty shard's LSE is +inf there and -inf here (o = 0 in both).
"""

from __future__ import annotations

import torch

FLASHMLA_PAGE_SIZE = 64
FLASHMLA_QK_DIM = 576
FLASHMLA_V_DIM = 512


def flashmla_unavailable_reason(device: torch.device | str, page_size: int, dtype: torch.dtype) -> str | None:
    """Why FlashMLA cannot serve this instance (None when it can)."""
    device = torch.device(device)
    if not torch.cuda.is_available():
        return "FlashMLA needs a CUDA GPU (none is available)"
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA devices, the instance runs on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"FlashMLA needs SM90 or newer, the GPU is SM{major}{minor}"
    if page_size != FLASHMLA_PAGE_SIZE:
        return f"FlashMLA needs pages of {FLASHMLA_PAGE_SIZE} tokens, the KV pool has {page_size}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashMLA needs a bf16/fp16 KV cache, the model runs in {dtype}"
    try:
        import flash_mla  # noqa: F401
    except ImportError as e:
        return f"flash_mla does not import ({e}); build it from source (docs/gpu.md)"
    return None


class FlashMLAAttention:
    """Callable with the signature of models.mla_paged_attention_with_lse."""

    name = "flashmla"

    def __init__(self) -> None:
        import flash_mla

        self._flash_mla = flash_mla

    def __call__(
        self,
        q_latent: torch.Tensor,  # [S, H, 576]
        kv_pages: torch.Tensor,  # [P, 64, 576]
        block_table: torch.Tensor,  # int [S, max_blocks]
        lens: torch.Tensor,  # int [S]
        scale: float,
        v_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> o [S, H, 512] (q's dtype), lse [S, H] fp32, natural log, -inf for an empty shard."""
        if q_latent.shape[-1] != FLASHMLA_QK_DIM or v_dim != FLASHMLA_V_DIM:
            raise ValueError(
                f"FlashMLA needs a {FLASHMLA_QK_DIM}-value query and a {FLASHMLA_V_DIM}-value output, "
                f"got {q_latent.shape[-1]} and {v_dim}"
            )
        if kv_pages.shape[1] != FLASHMLA_PAGE_SIZE:
            raise ValueError(f"FlashMLA needs pages of {FLASHMLA_PAGE_SIZE} tokens, got {kv_pages.shape[1]}")
        shards, heads = q_latent.shape[0], q_latent.shape[1]
        if shards == 0:
            return q_latent.new_zeros(0, heads, v_dim), q_latent.new_zeros(0, heads, dtype=torch.float32)
        lens = lens.to(torch.int32)
        # One query token per shard and one latent KV head: s_q * h_q // h_kv = H. Releases since Jan 2026 ignore
        # these arguments and return an empty schedule that the first call fills; older ones compute it here.
        sched, splits = self._flash_mla.get_mla_metadata(lens, heads, 1)
        out, lse = self._flash_mla.flash_mla_with_kvcache(
            q_latent.unsqueeze(1),  # [S, 1, H, 576]
            kv_pages.unsqueeze(2),  # [P, 64, 1, 576]
            block_table.to(torch.int32),
            lens,
            v_dim,
            sched,
            splits,
            softmax_scale=scale,
            causal=False,
        )  # out [S, 1, H, 512], lse [S, H, 1]
        lse = lse[:, :, 0]
        return out[:, 0], lse.masked_fill(lse == float("inf"), float("-inf"))
