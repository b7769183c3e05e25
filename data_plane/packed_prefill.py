"""The driver's prefill of admitted prompts on prepared weights (decode_layers.py), all prompts packed together.

Every projection, FFN and expert runs once over the tokens of all prompts (each expert as one GEMM pair over the
tokens that chose it). Attention runs in the absorbed (latent) form, like decode: a prompt's H query heads attend
over its latent KV rows (one KV head), so no per-head K/V is expanded and the KV written is the decode cache
format. Prompts are grouped by length (padding bounded by MAX_PADDING), each group right-padded into one batch
and attended in one fused call: under the causal mask a prompt's tokens never see its padding. Results equal
models.prefill_forward up to fp32 rounding (tests/test_data_plane_packed_prefill.py).
"""

from __future__ import annotations

import numpy as np
import torch

from nanocp.models import PrefillOutput

from .backends.cpu_attention import fused_attention_unavailable_reason
from .decode_layers import (
    DecodeWeights,
    RopeTable,
    add_attention_output,
    add_mlp,
    ffn_input,
    final_logits,
    moe_gate,
    project,
    routed_experts_sum,
)

MAX_PADDING = 1.25  # a length group's padded tokens are at most this many times its real tokens


def length_groups(lens: list[int]) -> list[list[int]]:
    """Prompt indices grouped by similar length: sorted by length, a group grows while (count x longest) stays
    within MAX_PADDING x its real tokens."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lens)), key=lambda i: lens[i]):
        if groups and (len(groups[-1]) + 1) * lens[i] <= MAX_PADDING * (total + lens[i]):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


class _Group:
    """One length group: rows of its prompts in the packed batch, right-padded to its longest prompt."""

    def __init__(self, members: list[int], starts: list[int], lens: list[int], heads: int, dtype: torch.dtype):
        longest = max(lens[i] for i in members)
        offsets = np.arange(longest)
        valid = offsets[None, :] < np.array([lens[i] for i in members])[:, None]  # [n, longest]
        rows = np.array([starts[i] for i in members])[:, None] + offsets[None, :]
        self.gather = torch.from_numpy(np.where(valid, rows, 0).reshape(-1))  # [n * longest]
        self.valid = torch.from_numpy(np.nonzero(valid.reshape(-1))[0])  # padded positions that hold tokens
        self.rows = torch.from_numpy(rows.reshape(-1)[valid.reshape(-1)])  # their packed rows
        self.size, self.longest, self.heads = len(members), longest, heads
        # query row (t, h) sees keys 0..t: [longest * H, longest] additive
        causal = np.where(offsets[None, :] <= np.repeat(offsets, heads)[:, None], 0.0, -np.inf).astype(np.float32)
        self.mask = torch.from_numpy(causal).to(dtype)[None, None]


def _attend(q_latent: torch.Tensor, kv: torch.Tensor, group: _Group, scale: float, v_dim: int) -> torch.Tensor:
    """q_latent [T, H, Dqk], kv [T, Dqk] packed -> o [tokens of the group, H, v_dim] in the group's row order."""
    n, longest, heads = group.size, group.longest, group.heads
    q = q_latent.index_select(0, group.gather).view(n, 1, longest * heads, -1)
    k = kv.index_select(0, group.gather).view(n, 1, longest, -1)
    if fused_attention_unavailable_reason() is None:
        o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, k, 0.0, False, attn_mask=group.mask, scale=scale
        )[0]
    else:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + group.mask.float()
        o = torch.matmul(torch.softmax(scores, dim=-1), k.float()).to(q.dtype)
    o = o.view(n * longest, heads, -1)[:, :, :v_dim]
    return o.index_select(0, group.valid)


@torch.no_grad()
def prefill_packed(w: DecodeWeights, prompts: list[torch.Tensor]) -> list[PrefillOutput]:
    """Causal forward of each prompt (tokens [T_i]) at positions 0..T_i - 1; `w` holds every routed expert
    (DecodeWeights.build(model, range(n_routed_experts))). Returns per prompt its KV [L, T_i, Dkv] and the logits
    of its last token [1, vocab], like models.prefill_forward_packed."""
    c = w.config
    if not prompts:
        return []
    for tokens in prompts:
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-d tensor, got shape {tuple(tokens.shape)}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= c.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} outside the vocabulary [0, {c.vocab_size})")
    if any(layer.mlp is None and layer.experts is None for layer in w.layers):
        raise ValueError("packed prefill needs every routed expert (DecodeWeights.build(model, all experts))")
    lens = [int(t.shape[0]) for t in prompts]
    starts = np.cumsum([0] + lens)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens]))
    rope = RopeTable.at(w.rope, positions)
    dtype = w.embed_tokens.dtype
    groups = [_Group(g, list(starts), lens, c.num_attention_heads, dtype) for g in length_groups(lens)]
    h = w.embed_tokens[torch.cat(prompts).to(w.embed_tokens.device)]  # [T, D]
    kvs = []
    for layer in w.layers:
        q_latent, kv_new = project(layer, c, h, rope)  # [T, H, Dqk], [T, Dkv]
        o = q_latent.new_empty(h.shape[0], c.num_attention_heads, c.kv_lora_rank)
        for group in groups:
            o.index_copy_(0, group.rows, _attend(q_latent, kv_new, group, c.softmax_scale, c.kv_lora_rank))
        h = add_attention_output(layer, h, o)
        x = ffn_input(layer, c, h)
        if layer.mlp is not None:
            h = add_mlp(layer.mlp, x, h)
        else:
            routed = routed_experts_sum(layer.experts, x, *moe_gate(layer, c, x))
            h = (add_mlp(layer.shared, x, h) if layer.shared is not None else h) + routed
        kvs.append(kv_new)
    kv = torch.stack(kvs)  # [L, T, Dkv]
    last = final_logits(w, h[torch.from_numpy(starts[1:] - 1)])  # [n, vocab]
    return [PrefillOutput(logits=last[i : i + 1], kv=kv[:, starts[i] : starts[i + 1]]) for i in range(len(prompts))]
