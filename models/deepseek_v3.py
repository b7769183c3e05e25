"""DeepSeek-V3 model math in plain torch, split into the phases a DP-EP decode instance runs separately.

Decode uses MLA in its absorbed form: the query's nope part is folded through W_UK into the latent space, so a head's
query is kv_lora_rank + qk_rope_head_dim values and the KV cache holds one latent vector per token
([normalised c_kv | roped k_pe], 576 values for DeepSeek-V3); the attention output stays latent until W_UV and o_proj.
Attention over a KV shard returns (o, lse) so partial results from several shards merge exactly.

Prefill uses the non-absorbed form (k and v expanded per head, like HF transformers) and writes the same latent KV
cache, so a prompt's KV can be put into pages and decoding continues from it.

Residual stream convention: `mla_decode_qkv` / `mla_prefill_qkv` take the residual stream h and apply the input
RMSNorm themselves; `post_attention_norm` gives the FFN input; callers add attention and FFN outputs to h.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .rope import RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps


# ---- weights -----------------------------------------------------------------------------------------------


@dataclass
class MLPWeights:
    """SwiGLU MLP: a dense layer's MLP, one routed expert, or the (merged) shared experts."""

    gate_proj: torch.Tensor  # [I, D]
    up_proj: torch.Tensor  # [I, D]
    down_proj: torch.Tensor  # [D, I]


@dataclass
class AttentionWeights:
    q_a_proj: torch.Tensor | None  # [q_lora, D]          (None when q_lora_rank is None)
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b_proj: torch.Tensor | None  # [H * qk_head, q_lora]
    q_proj: torch.Tensor | None  # [H * qk_head, D]        (only when q_lora_rank is None)
    kv_a_proj: torch.Tensor  # [kv_lora + rope, D]
    kv_a_norm: torch.Tensor  # [kv_lora]
    kv_b_proj: torch.Tensor  # [H * (nope + v), kv_lora]
    o_proj: torch.Tensor  # [D, H * v]


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, D]
    e_score_correction_bias: torch.Tensor  # [E] fp32
    experts: dict[int, MLPWeights]  # only the experts this process materialised
    shared: MLPWeights | None  # n_shared_experts merged into one MLP of width n_shared * moe_intermediate


@dataclass
class LayerWeights:
    index: int
    input_norm: torch.Tensor  # [D]
    post_attention_norm: torch.Tensor  # [D]
    attn: AttentionWeights
    mlp: MLPWeights | None  # dense layers (index < first_k_dense_replace)
    moe: MoEWeights | None  # MoE layers
    config: ModelConfig = field(repr=False)
    rope: RotaryEmbedding = field(repr=False)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, nope, kv_lora]: latent -> per-head k_nope (a view of kv_b_proj)."""
        c = self.config
        return self._kv_b_heads()[:, : c.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, v, kv_lora]: latent -> per-head v (a view of kv_b_proj)."""
        c = self.config
        return self._kv_b_heads()[:, c.qk_nope_head_dim :]

    def _kv_b_heads(self) -> torch.Tensor:
        c = self.config
        return self.attn.kv_b_proj.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)


@dataclass
class DeepseekV3Weights:
    config: ModelConfig
    embed_tokens: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D] (the embedding itself when tie_word_embeddings)
    rope: RotaryEmbedding = field(repr=False)

    @property
    def softmax_scale(self) -> float:
        return self.config.softmax_scale

    @property
    def expert_ids(self) -> set[int]:
        """Routed experts materialised in this process (the same set in every MoE layer)."""
        moe_layers = [layer.moe for layer in self.layers if layer.moe is not None]
        return set(moe_layers[0].experts) if moe_layers else set()


# ---- shared pieces -----------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] -> weight * x / rms(x), the variance computed in fp32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def embed(model: DeepseekV3Weights, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] int -> h [T, D]."""
    return model.embed_tokens[tokens]


def logits(model: DeepseekV3Weights, h: torch.Tensor) -> torch.Tensor:
    """h [T, D] (residual stream after the last layer) -> logits [T, vocab]."""
    return F.linear(rms_norm(h, model.norm, model.config.rms_norm_eps), model.lm_head)


def post_attention_norm(layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    """h [T, D] residual stream -> FFN input [T, D]."""
    return rms_norm(h, layer.post_attention_norm, layer.config.rms_norm_eps)


def _query(layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] normed input -> q_nope [T, H, nope], q_pe [T, H, rope] (roped)."""
    c, a = layer.config, layer.attn
    if a.q_proj is not None:
        q = F.linear(x, a.q_proj)
    else:
        q = F.linear(rms_norm(F.linear(x, a.q_a_proj), a.q_a_norm, LATENT_NORM_EPS), a.q_b_proj)
    q = q.view(x.shape[0], c.num_attention_heads, c.qk_head_dim)  # [T, H, qk_head]
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    return q_nope, layer.rope.apply(q_pe, positions)


def _latent_kv(layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, D] normed input -> kv [T, kv_lora + rope] = [rmsnorm(c_kv) | roped k_pe]."""
    c, a = layer.config, layer.attn
    compressed = F.linear(x, a.kv_a_proj)  # [T, kv_lora + rope]
    c_kv, k_pe = compressed.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    c_kv = rms_norm(c_kv, a.kv_a_norm, LATENT_NORM_EPS)
    return torch.cat([c_kv, layer.rope.apply(k_pe, positions)], dim=-1)


# ---- MLA, absorbed decode form -----------------------------------------------------------------------------


def mla_decode_qkv(layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] residual stream, positions [T] -> q_latent [T, H, kv_lora + rope], kv_new [T, kv_lora + rope].

    q_latent = [q_nope @ W_UK (per head) | roped q_pe]; kv_new is what the cache stores for these tokens.
    """
    x = rms_norm(h, layer.input_norm, layer.config.rms_norm_eps)
    q_nope, q_pe = _query(layer, x, positions)
    q_latent_nope = torch.einsum("thn,hnc->thc", q_nope, layer.w_uk)  # [T, H, kv_lora]
    return torch.cat([q_latent_nope, q_pe], dim=-1), _latent_kv(layer, x, positions)


def mla_attention_with_lse(
    q_latent: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA attention over a (shard of the) latent KV cache.

    q_latent [B, H, Dqk], kv [B, N, Dqk] (the first lens[b] rows are valid), lens [B] ->
    o_latent [B, H, v_dim] (softmax over the valid rows of kv[..., :v_dim]), lse [B, H] fp32 natural log.
    A request with no valid rows gets o = 0 and lse = -inf, which `merge_attention_partials` ignores.
    """
    n = kv.shape[1]
    scores = torch.einsum("bhd,bnd->bhn", q_latent.float(), kv.float()) * scale  # [B, H, N]
    valid = torch.arange(n, device=kv.device)[None, :] < lens.to(kv.device)[:, None]  # [B, N]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    probs = torch.exp(scores - _finite_or_zero(lse)[..., None])  # rows with lse = -inf become all 0
    o = torch.einsum("bhn,bnc->bhc", probs, kv[..., :v_dim].float())
    return o.to(q_latent.dtype), lse


def mla_paged_attention_with_lse(
    q_latent: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged form: kv_pages [P, page_size, Dqk], block_table int [B, max_blocks] (row b lists the pages of
    request b's shard in token order; entries past ceil(lens[b] / page_size) are ignored), lens [B]."""
    b, max_blocks = block_table.shape
    page_size = kv_pages.shape[1]
    pages = kv_pages[block_table.long().clamp(min=0)]  # [B, max_blocks, page_size, Dqk]
    kv = pages.reshape(b, max_blocks * page_size, kv_pages.shape[-1])
    return mla_attention_with_lse(q_latent, kv, lens, scale, v_dim)


def merge_attention_partials(os: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge K partial attentions over disjoint KV parts: os [K, ..., Dv], lses [K, ...] (natural log, -inf for
    an empty part) -> o [..., Dv], lse [...] with lse = logsumexp_k(lse_k), o = sum_k exp(lse_k - lse) o_k."""
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - _finite_or_zero(lse)[None])  # [K, ...]; all parts empty -> all 0
    o = (weights[..., None] * os.float()).sum(dim=0)
    return o.to(os.dtype), lse


def mla_decode_output(layer: LayerWeights, o_latent: torch.Tensor) -> torch.Tensor:
    """o_latent [T, H, kv_lora] (merged) -> attention output [T, D] (W_UV per head, then o_proj)."""
    o = torch.einsum("thc,hvc->thv", o_latent, layer.w_uv)  # [T, H, v]
    return F.linear(o.flatten(1), layer.attn.o_proj)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


# ---- MLA, non-absorbed prefill form ------------------------------------------------------------------------


def mla_prefill_qkv(layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] residual stream, positions [T] -> q [T, H, nope + rope] (rope part roped), kv_new [T, Dkv]."""
    x = rms_norm(h, layer.input_norm, layer.config.rms_norm_eps)
    q_nope, q_pe = _query(layer, x, positions)
    return torch.cat([q_nope, q_pe], dim=-1), _latent_kv(layer, x, positions)


def mla_expand_kv(layer: LayerWeights, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [N, kv_lora + rope] latent cache rows -> k [N, H, nope + rope], v [N, H, v]."""
    c = layer.config
    c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    kv_heads = F.linear(c_kv, layer.attn.kv_b_proj).view(kv.shape[0], c.num_attention_heads, -1)
    k_nope, v = kv_heads.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_pe = k_pe[:, None, :].expand(-1, c.num_attention_heads, -1)
    return torch.cat([k_nope, k_pe], dim=-1), v


def mla_prefill_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    kv_positions: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention by absolute position (key allowed iff kv_position <= q_position), so any chunk of keys
    (ring / zigzag attention) gives a partial that merges exactly.

    q [T, H, Dqk], k [N, H, Dqk], v [N, H, Dv], q_positions [T], kv_positions [N] ->
    o [T, H, Dv], lse [T, H] fp32 (o = 0, lse = -inf for a query with no visible key).
    """
    scores = torch.einsum("thd,nhd->htn", q.float(), k.float()) * scale  # [H, T, N]
    visible = kv_positions.to(q.device)[None, :] <= q_positions.to(q.device)[:, None]  # [T, N]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.exp(scores - _finite_or_zero(lse)[..., None])
    o = torch.einsum("htn,nhv->thv", probs, v.float())
    return o.to(q.dtype), lse.transpose(0, 1).contiguous()


def mla_prefill_output(layer: LayerWeights, o: torch.Tensor) -> torch.Tensor:
    """o [T, H, v] -> attention output [T, D]."""
    return F.linear(o.flatten(1), layer.attn.o_proj)


# ---- MoE ---------------------------------------------------------------------------------------------------


def moe_gate(layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] FFN input -> topk_idx int64 [T, k] (by descending biased score), topk_weights fp32 [T, k].

    Sigmoid scores; e_score_correction_bias is added for the choice only; experts are chosen inside the
    topk_group groups with the highest sum of their top-2 biased scores; the weights are the unbiased scores,
    normalised to sum 1 when norm_topk_prob, times routed_scaling_factor.
    """
    c, moe = layer.config, layer.moe
    scores = F.linear(x.float(), moe.gate.float()).sigmoid()  # [T, E]
    choice = scores + moe.e_score_correction_bias.float()
    if c.n_group > 1:
        grouped = choice.view(x.shape[0], c.n_group, c.experts_per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        top_groups = group_scores.topk(c.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(c.experts_per_group, dim=1), float("-inf"))
    topk_idx = choice.topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
    topk_weights = scores.gather(1, topk_idx)
    if c.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, topk_weights * c.routed_scaling_factor


def expert_ffn(expert: MLPWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [n, D] -> [n, D]."""
    return F.linear(F.silu(F.linear(x, expert.gate_proj)) * F.linear(x, expert.up_proj), expert.down_proj)


def moe_routed_partial(
    layer: LayerWeights,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_ids: Iterable[int] | None = None,
) -> torch.Tensor:
    """Weighted sum over the routed experts in `expert_ids` only (default: all), x [T, D] -> [T, D].

    Summing this over a partition of the experts (plus `shared_expert`) gives the full MoE output, so an
    instance can run just the experts it owns on the tokens routed to them.
    """
    experts = layer.moe.experts
    wanted = sorted(experts) if expert_ids is None else sorted(set(expert_ids))
    if expert_ids is None and len(experts) != layer.config.n_routed_experts:
        missing = sorted(set(range(layer.config.n_routed_experts)) - set(experts))
        raise ValueError(f"layer {layer.index}: experts {missing} are not materialised in this process")
    absent = [e for e in wanted if e not in experts]
    if absent:
        raise ValueError(f"layer {layer.index}: experts {absent} are not materialised in this process")
    out = torch.zeros_like(x)
    for e in wanted:
        rows, slots = torch.nonzero(topk_idx == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        y = expert_ffn(experts[e], x[rows]) * topk_weights[rows, slots, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


def shared_expert(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D] (zeros when the model has no shared experts)."""
    shared = layer.moe.shared
    return torch.zeros_like(x) if shared is None else expert_ffn(shared, x)


def dense_mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D] for a dense layer."""
    return expert_ffn(layer.mlp, x)


def moe_forward_reference(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The whole MoE block on one device: x [T, D] FFN input -> [T, D] (routed + shared, no residual)."""
    topk_idx, topk_weights = moe_gate(layer, x)
    return moe_routed_partial(layer, x, topk_idx, topk_weights) + shared_expert(layer, x)


def ffn_forward(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """Dense MLP or full MoE of this layer: x [T, D] -> [T, D]."""
    return dense_mlp(layer, x) if layer.moe is None else moe_forward_reference(layer, x)


# ---- single-device reference forward passes ----------------------------------------------------------------


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [T, vocab]
    kv: torch.Tensor  # [L, T, kv_lora + rope] latent KV of the new tokens, decode-cache format


def prefill_forward(
    model: DeepseekV3Weights, tokens: torch.Tensor, past_kv: torch.Tensor | None = None
) -> PrefillOutput:
    """Causal forward of tokens [T] placed after past_kv [L, P, Dkv] (P = 0 when None) at positions P..P+T-1."""
    c = model.config
    _check_tokens(c, tokens)
    past_len = 0 if past_kv is None else past_kv.shape[1]
    if past_kv is not None and (past_kv.dim() != 3 or past_kv.shape[0] != c.num_hidden_layers):
        raise ValueError(f"past_kv must be [L={c.num_hidden_layers}, P, {c.kv_cache_dim}], got {past_kv.shape}")
    positions = torch.arange(past_len, past_len + tokens.shape[0], device=tokens.device)
    kv_positions = torch.arange(past_len + tokens.shape[0], device=tokens.device)
    h = embed(model, tokens)
    new_kv = []
    for layer in model.layers:
        q, kv_new = mla_prefill_qkv(layer, h, positions)
        kv_all = kv_new if past_kv is None else torch.cat([past_kv[layer.index].to(kv_new.dtype), kv_new])
        k, v = mla_expand_kv(layer, kv_all)
        o, _ = mla_prefill_attention_with_lse(q, k, v, positions, kv_positions, model.softmax_scale)
        h = h + mla_prefill_output(layer, o)
        h = h + ffn_forward(layer, post_attention_norm(layer, h))
        new_kv.append(kv_new)
    return PrefillOutput(logits=logits(model, h), kv=torch.stack(new_kv))


def prefill_forward_packed(model: DeepseekV3Weights, prompts: list[torch.Tensor]) -> list[PrefillOutput]:
    """Causal forward of several prompts at once: projections and FFNs run on all tokens packed together,
    attention per prompt. Each result equals `prefill_forward(model, prompt)` (logits of the last token only:
    [1, vocab])."""
    c = model.config
    for tokens in prompts:
        _check_tokens(c, tokens)
    lens = [int(t.shape[0]) for t in prompts]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    positions = torch.cat([torch.arange(n, device=t.device) for n, t in zip(lens, prompts)])  # [T]
    h = embed(model, torch.cat(prompts))  # [T, D]
    kvs = []
    for layer in model.layers:
        q, kv_new = mla_prefill_qkv(layer, h, positions)
        k, v = mla_expand_kv(layer, kv_new)
        o = torch.empty(q.shape[0], c.num_attention_heads, c.v_head_dim, dtype=q.dtype, device=q.device)
        for a, b in zip(bounds[:-1], bounds[1:]):
            part = slice(a, b)
            o[part] = mla_prefill_attention_with_lse(
                q[part], k[part], v[part], positions[part], positions[part], model.softmax_scale
            )[0]
        h = h + mla_prefill_output(layer, o)
        h = h + ffn_forward(layer, post_attention_norm(layer, h))
        kvs.append(kv_new)
    kv = torch.stack(kvs)  # [L, T, Dkv]
    last = logits(model, h[[b - 1 for b in bounds[1:]]])  # [n, vocab]
    return [
        PrefillOutput(logits=last[i : i + 1], kv=kv[:, a:b]) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]


@dataclass
class ContiguousKVCache:
    """Per-request contiguous latent KV for the reference decode: kv [L, B, capacity, Dkv], lens int64 [B]."""

    kv: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def from_prefill(cls, prompt_kvs: list[torch.Tensor], capacity: int) -> ContiguousKVCache:
        """prompt_kvs: one [L, T_b, Dkv] per request (e.g. PrefillOutput.kv)."""
        if not prompt_kvs:
            raise ValueError("need at least one request")
        lens = [kv.shape[1] for kv in prompt_kvs]
        if max(lens) > capacity:
            raise ValueError(f"a prompt of {max(lens)} tokens does not fit capacity {capacity}")
        first = prompt_kvs[0]
        kv = first.new_zeros(first.shape[0], len(prompt_kvs), capacity, first.shape[2])
        for b, prompt_kv in enumerate(prompt_kvs):
            kv[:, b, : prompt_kv.shape[1]] = prompt_kv
        return cls(kv=kv, lens=torch.tensor(lens, dtype=torch.int64, device=first.device))


def decode_step(model: DeepseekV3Weights, cache: ContiguousKVCache, tokens: torch.Tensor) -> torch.Tensor:
    """One decode iteration for B requests, built from the phase functions: tokens [B] (at positions cache.lens)
    -> logits [B, vocab]. Writes the tokens' KV into the cache and advances cache.lens in place."""
    c = model.config
    _check_tokens(c, tokens)
    positions = cache.lens.clone()  # [B]
    if int(positions.max()) >= cache.kv.shape[2]:
        raise ValueError(f"KV cache capacity {cache.kv.shape[2]} exhausted")
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    h = embed(model, tokens)
    for layer in model.layers:
        q_latent, kv_new = mla_decode_qkv(layer, h, positions)
        cache.kv[layer.index, rows, positions] = kv_new.to(cache.kv.dtype)
        o_latent, _ = mla_attention_with_lse(
            q_latent, cache.kv[layer.index], positions + 1, model.softmax_scale, c.kv_lora_rank
        )
        h = h + mla_decode_output(layer, o_latent)
        h = h + ffn_forward(layer, post_attention_norm(layer, h))
    cache.lens += 1
    return logits(model, h)


@torch.no_grad()
def greedy_generate(
    model: DeepseekV3Weights, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> list[int]:
    """Reference greedy continuation: prefill the prompt, then absorbed decode steps. Returns the new tokens."""
    if max_new_tokens <= 0:
        return []
    tokens = torch.tensor(prompt, dtype=torch.int64, device=model.embed_tokens.device)
    prefill = prefill_forward(model, tokens)
    cache = ContiguousKVCache.from_prefill([prefill.kv], capacity=len(prompt) + max_new_tokens)
    out = [int(prefill.logits[-1].argmax())]
    while len(out) < max_new_tokens and not (stop_at_eos and out[-1] in model.config.eos_token_ids):
        step_logits = decode_step(model, cache, tokens.new_tensor([out[-1]]))
        out.append(int(step_logits[0].argmax()))
    return out


def _check_tokens(config: ModelConfig, tokens: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.numel() == 0:
        raise ValueError(f"tokens must be a non-empty 1-d tensor, got shape {tuple(tokens.shape)}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= config.vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} outside the vocabulary [0, {config.vocab_size})")
