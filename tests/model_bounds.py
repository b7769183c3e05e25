"""fp32 error bounds of the DeepSeek-V3 steps and forward passes (models/deepseek_v3.py), from tests/tolerances.py.

Each function follows one reference step op by op on tolerances.Bounded values (exact fp64 value + the bound on an
fp32 evaluation's error, the errors of its inputs carried through), so a test compares two fp32 implementations of
the step within the sum of their bounds. `absorbed=True` bounds the prepared-weight form of
data_plane/decode_layers.py instead: W_UK folded into q_b and W_UV into o_proj, those products made in fp64 and
rounded to fp32 once (tolerances.rounded), then one GEMM.

These bound single steps. Chained through whole layers they are useless: a componentwise bound grows by sum |w|
at every GEMM (sqrt(k) times more than errors really grow) and one layer's bound already exceeds the gaps between
MoE gate choices, whose routing is discontinuous. Whole-model comparisons check the accuracy requirement instead
(tolerances.MODEL_RTOL).
"""

from __future__ import annotations

import tolerances as tol
import torch

from nanocp.models.deepseek_v3 import LATENT_NORM_EPS


def per_head(x: tol.Bounded) -> tol.Bounded:
    """[T, H, ...] <-> [H, T, ...]."""
    return x.map(lambda t: t.transpose(0, 1))


def rope(x: tol.Bounded, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> tol.Bounded:
    """models.apply_rotary of x [T, ..., rope] (pairs interleaved or halves), de-interleaved like it."""
    half = x.value.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    shape = (cos.shape[0],) + (1,) * (x.value.dim() - 2) + (half,)
    return tol.rotate(x1, x2, cos.view(shape), sin.view(shape))


def query(layer, x: tol.Bounded, positions: torch.Tensor) -> tuple[tol.Bounded, tol.Bounded, tol.Bounded]:
    """models._query of the normed input x [T, D] -> (q_in [T, q_in], q_nope [T, H, nope], roped q_pe)."""
    c, a = layer.config, layer.attn
    heads, nope = c.num_attention_heads, c.qk_nope_head_dim
    if a.q_proj is not None:
        q_in, q_weight = x, a.q_proj
    else:
        q_in, q_weight = tol.rms_norm(tol.linear(x, a.q_a_proj.T), a.q_a_norm, LATENT_NORM_EPS), a.q_b_proj
    q = tol.linear(q_in, q_weight.T).map(lambda t: t.view(t.shape[0], heads, -1))
    cos, sin = layer.rope.cos_sin(positions)
    return q_in, q[..., :nope], rope(q[..., nope:], cos, sin, c.rope_interleave)


def latent_kv(layer, x: tol.Bounded, positions: torch.Tensor) -> tol.Bounded:
    """models._latent_kv: x [T, D] normed -> [T, kv_lora + rope] = [RMSNorm(c_kv) | roped k_pe]."""
    c, a = layer.config, layer.attn
    lora = c.kv_lora_rank
    cos, sin = layer.rope.cos_sin(positions)
    compressed = tol.linear(x, a.kv_a_proj.T)
    latent = tol.rms_norm(compressed[:, :lora], a.kv_a_norm, LATENT_NORM_EPS)
    return tol.cat([latent, rope(compressed[:, lora:], cos, sin, c.rope_interleave)])


def decode_qkv(layer, h, positions: torch.Tensor, absorbed: bool = False) -> tuple[tol.Bounded, tol.Bounded]:
    """models.mla_decode_qkv: h [T, D] -> q_latent [T, H, kv_lora + rope], kv_new [T, kv_lora + rope]."""
    c = layer.config
    heads, nope = c.num_attention_heads, c.qk_nope_head_dim
    x = tol.rms_norm(h, layer.input_norm, c.rms_norm_eps)
    q_in, q_nope, q_pe = query(layer, x, positions)
    if absorbed:  # q_in @ (q_nope_h^T W_UK_h), the product rounded once
        q_weight = layer.attn.q_b_proj if layer.attn.q_proj is None else layer.attn.q_proj
        q_heads = q_weight.view(heads, nope + c.qk_rope_head_dim, -1)  # [H, nope + rope, q_in]
        w = tol.rounded(torch.einsum("hnq,hnc->hqc", q_heads[:, :nope].double(), layer.w_uk.double()))
        latent = per_head(tol.linear(q_in.map(lambda t: t.expand(heads, -1, -1)), w))
    else:  # (q_in @ q_nope_h^T) @ W_UK_h
        latent = per_head(tol.linear(per_head(q_nope), layer.w_uk))
    return tol.cat([latent, q_pe]), latent_kv(layer, x, positions)


def decode_output(layer, o_latent, h, absorbed: bool = False) -> tol.Bounded:
    """h + models.mla_decode_output(layer, o_latent): o_latent [T, H, kv_lora], h [T, D] -> [T, D]."""
    c = layer.config
    heads, t = c.num_attention_heads, o_latent.shape[0]
    o_latent = tol.as_bounded(o_latent)
    if absorbed:  # o_latent_h @ (W_UV_h^T o_proj_h^T), the product rounded once
        w = torch.einsum("hvc,dhv->hcd", layer.w_uv.double(), layer.attn.o_proj.view(-1, heads, c.v_head_dim).double())
        o = o_latent.map(lambda x: x.reshape(t, -1))
        return tol.linear(o, tol.rounded(w.reshape(-1, w.shape[-1])), base=h)
    o = per_head(tol.linear(per_head(o_latent), layer.w_uv.transpose(1, 2)))  # [T, H, v]
    return tol.linear(o.map(lambda x: x.reshape(t, -1)), layer.attn.o_proj.T, base=h)


def mlp(weights, x, base=None) -> tol.Bounded:
    """models.expert_ffn (+ base) of an MLPWeights."""
    gate_up = torch.cat([weights.gate_proj.T, weights.up_proj.T], dim=1)  # [D, 2I]
    return tol.swiglu_mlp(x, gate_up, weights.down_proj.T, base)


def final_logits(model, h) -> tol.Bounded:
    """models.logits: the final norm, then lm_head."""
    return tol.linear(tol.rms_norm(h, model.norm, model.config.rms_norm_eps), model.lm_head.T)


def gate_logits(layer, x) -> tol.Bounded:
    """The MoE gate's logits x @ W_gate^T."""
    return tol.linear(x, layer.moe.gate.float().T)


def moe_output(layer, x, idx: torch.Tensor, weights, adds: int = 0, base=None) -> tol.Bounded:
    """models.moe_forward_reference (+ base) given the gate's choice idx [T, k] and its weights (fp32 values or
    Bounded): the shared expert plus sum_j weights_j * expert_j(x), rows [T, D]. The k + 1 (+ base) terms are added
    in any order, with `adds` more additions (of partial sums, of zeros) on the way: gamma(terms + adds) of the
    terms' sizes."""
    x, weights = tol.as_bounded(x), tol.as_bounded(weights)
    base = None if base is None else tol.as_bounded(base)
    rows = []
    for t in range(x.value.shape[0]):
        terms = [] if layer.moe.shared is None else [mlp(layer.moe.shared, x[t : t + 1])]
        for j, e in enumerate(idx[t].tolist()):
            y = mlp(layer.moe.experts[e], x[t : t + 1])
            terms.append(tol.product(y, weights[t, j]))
        if base is not None:
            terms.append(base[t : t + 1])
        value = sum(term.value for term in terms)
        err = sum(term.err for term in terms) + tol.gamma(len(terms) + adds) * sum(term.mag for term in terms)
        rows.append(tol.Bounded(value[0], err[0]))
    return tol.Bounded(torch.stack([r.value for r in rows]), torch.stack([r.err for r in rows]))
