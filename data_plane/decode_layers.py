"""DeepSeek-V3 decode math on weights prepared once per instance: the eager decode path's hot loop.

The reference phase functions (models/deepseek_v3.py) stay the plain statements of the math. This module runs the
same phases with fewer and larger torch ops, on weights rearranged when the instance starts:
- linear weights transposed to [in, out]: `x @ W` is a plain GEMM (F.linear on [out, in] weights is about twice
  as slow on CPU at decode batch sizes);
- q_a_proj and kv_a_proj fused into one GEMM (both read the normed hidden state), gate and up projections fused;
- W_UK folded into q_b_proj and W_UV into o_proj (the query goes straight into the latent space, the merged latent
  output straight to the hidden size) when that costs at most ABSORB_MAX_FLOP_RATIO times the FLOPs of the two
  small GEMMs (true for the tiny model, false for DeepSeek-V3's widths, which keep the per-head products);
- the rope dims of q_b_proj and kv_a_proj reordered into (x1, x2) pairs, so the rotation is one complex multiply;
  rotated values are written de-interleaved ([x1' | x2']), the layout of the KV cache and of HF;
- the instance's routed experts stacked into [E_local, D, 2I] / [E_local, I, D] for grouped GEMMs (bmm);
- on the fp32 CPU path, every weight also packed into panels (`Linear`, `GroupedExperts`): decode batches (up to
  PANEL_MAX_ROWS rows) run their GEMMs in the C++ kernels on them, a projection or a SwiGLU MLP in one call.
Results equal the reference up to fp32 rounding (tests/test_data_plane_decode_layers.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nanocp.models import DeepseekV3Weights, LayerWeights, MLPWeights, ModelConfig, RotaryEmbedding, rms_norm
from nanocp.models.deepseek_v3 import LATENT_NORM_EPS

from . import cpu_kernels

ABSORB_MAX_FLOP_RATIO = 2.0
SEGMENT_MIN_ROWS = 64  # grouped experts: mean tokens per expert from which per-expert GEMMs beat padded bmm's
PANEL_MAX_ROWS = 128  # GEMMs of up to this many rows (decode batches) take the panel kernel; more (prefill): torch's
_COMPLEX_ROPE_DTYPES = (torch.float32, torch.float64)


# ---- prepared weights -----------------------------------------------------------------------------------------


def _panels(w: torch.Tensor) -> np.ndarray | None:
    """The panel-packed copy of an fp32 CPU weight [..., in, out] for the GEMM kernels (None where they do not
    run). It doubles these weights' memory: the [in, out] tensor stays for torch's GEMMs (prefill batches, the
    reference path, other dtypes and devices)."""
    if cpu_kernels.panel_width() is None or w.dtype != torch.float32 or not w.is_cpu:
        return None
    return cpu_kernels.pack_panels(w)


@dataclass
class Linear:
    """A weight prepared for `x @ W`: [in, out] for torch's GEMMs, and its panels for the CPU GEMM kernel, which
    decode batches take (few rows and a cold weight: the kernel reads the weight once, in order; see
    cpu_kernels.cpp)."""

    weight: torch.Tensor  # [in, out]
    panels: np.ndarray | None  # cpu_kernels.pack_panels(weight)

    @classmethod
    def of(cls, weight: torch.Tensor) -> Linear:
        """weight [in, out] (made contiguous)."""
        weight = weight.contiguous()
        return cls(weight, _panels(weight))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __call__(self, x: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> x @ W [T, out] (+ base [T, out])."""
        if self.takes(x):
            return cpu_kernels.linear(x, self.panels, self.weight.shape[1], base)
        return torch.mm(x, self.weight) if base is None else torch.addmm(base, x, self.weight)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes through the panel kernel (a decode batch on the fp32 CPU path)."""
        return self.panels is not None and x.shape[0] <= PANEL_MAX_ROWS and cpu_kernels.usable(x)


@dataclass
class GatedMLP:
    """SwiGLU MLP with [in, out] weights."""

    gate_up: Linear  # [D, 2I]: gate | up
    down: Linear  # [I, D]

    @classmethod
    def of(cls, mlp: MLPWeights) -> GatedMLP:
        return cls(Linear.of(torch.cat([mlp.gate_proj, mlp.up_proj]).T), Linear.of(mlp.down_proj.T))

    def __call__(self, x: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> SwiGLU(x) [T, D] (+ base): one kernel call for a decode batch on the fp32 CPU path."""
        if self.gate_up.takes(x):
            return cpu_kernels.gated_mlp(x, self.gate_up.panels, self.down.panels, self.down.shape[0], base)
        return self.down(swiglu(self.gate_up(x)), base=base)


@dataclass
class GroupedExperts:
    """One layer's local routed experts, stacked for grouped GEMMs."""

    gate_up: torch.Tensor  # [E_local, D, 2I]
    down: torch.Tensor  # [E_local, I, D]

    def __post_init__(self) -> None:
        self.gate_up_panels = _panels(self.gate_up)  # [E_local, P, D, W]: the grouped expert kernel's layout
        self.down_panels = _panels(self.down)  # [E_local, P', I, W]

    @classmethod
    def of(cls, experts: Sequence[MLPWeights]) -> GroupedExperts:
        gate_up = [torch.cat([e.gate_proj, e.up_proj]).T for e in experts]
        return cls(torch.stack(gate_up).contiguous(), torch.stack([e.down_proj.T for e in experts]).contiguous())


@dataclass
class DecodeAttentionWeights:
    qkv_a: Linear  # [D, q_lora + kv_lora + rope] (no q_lora: [D, kv_lora + rope]); rope dims in pair order
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: Linear  # [q_in, H * (kv_lora + rope)] absorbed, else [q_in, H * (nope + rope)]; q_in = q_lora or D
    w_uk: torch.Tensor | None  # [H, nope, kv_lora] when the query is not absorbed
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_o: Linear  # [H * kv_lora, D] absorbed (W_UV, then o_proj), else o_proj as [H * v, D]
    w_uv: torch.Tensor | None  # [H, kv_lora, v] when the output is not absorbed


@dataclass
class DecodeLayerWeights:
    index: int
    input_norm: torch.Tensor  # [D]
    post_attention_norm: torch.Tensor  # [D]
    attn: DecodeAttentionWeights
    mlp: GatedMLP | None  # dense layers
    gate: Linear | None  # [D, E] fp32 (MoE layers)
    gate_bias: torch.Tensor | None  # [E] fp32
    shared: GatedMLP | None
    experts: GroupedExperts | None  # this instance's routed experts, in local order

    def __post_init__(self) -> None:
        norms = (self.input_norm, self.attn.q_a_norm, self.attn.kv_a_norm)
        self.fp32_norms = all(n is None or n.dtype == torch.float32 for n in norms)  # what the fused kernels read


@dataclass
class DecodeWeights:
    config: ModelConfig
    embed_tokens: torch.Tensor  # [V, D]
    layers: list[DecodeLayerWeights]
    norm: torch.Tensor  # [D]
    lm_head: Linear  # [D, V]
    rope: RotaryEmbedding
    rope_cache: RopeCache

    @classmethod
    def build(cls, model: DeepseekV3Weights, local_experts: Sequence[int] = ()) -> DecodeWeights:
        """Prepare `model` for decoding; `local_experts` (global ids, in local order) are stacked per MoE layer."""
        layers = [_prepare_layer(layer, local_experts) for layer in model.layers]
        rope_cache = RopeCache(model.rope, model.config.max_position_embeddings)
        lm_head = Linear.of(model.lm_head.T)
        return cls(model.config, model.embed_tokens, layers, model.norm, lm_head, model.rope, rope_cache)

    def with_experts(self, model: DeepseekV3Weights, local_experts: Sequence[int]) -> DecodeWeights:
        """These prepared weights (the same tensors, not copies) with `model`'s routed experts `local_experts`."""
        if model.config != self.config:
            raise ValueError("shared decode weights belong to another model config")
        layers = [
            dataclasses.replace(w, experts=_stack_experts(layer, local_experts))
            for w, layer in zip(self.layers, model.layers)
        ]
        return dataclasses.replace(self, layers=layers)


def rope_pair_order(config: ModelConfig) -> torch.Tensor:
    """Permutation of the rope dims that puts each rotated pair (x1_i, x2_i) side by side."""
    half = config.qk_rope_head_dim // 2
    if config.rope_interleave:  # the checkpoint's own layout: pairs (x0, x1), (x2, x3), ...
        return torch.arange(2 * half)
    return torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).flatten()  # halves -> pairs


def _absorb(cost_absorbed: int, cost_apart: int) -> bool:
    return cost_absorbed <= ABSORB_MAX_FLOP_RATIO * cost_apart


def _prepare_attention(layer: LayerWeights) -> DecodeAttentionWeights:
    c, a = layer.config, layer.attn
    heads, nope, rope, lora, v = (
        c.num_attention_heads,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.kv_lora_rank,
        c.v_head_dim,
    )
    dtype = a.kv_a_proj.dtype
    pair = rope_pair_order(c)
    kv_a = torch.cat([a.kv_a_proj[:lora], a.kv_a_proj[lora:][pair]])  # [kv_lora + rope, D]
    q_plain = a.q_b_proj if a.q_proj is None else a.q_proj  # [H * (nope + rope), q_in]
    q_in = q_plain.shape[1]
    q_heads = q_plain.view(heads, nope + rope, q_in)
    q_nope, q_rope = q_heads[:, :nope], q_heads[:, nope:][:, pair]  # [H, nope, q_in], [H, rope, q_in]
    w_uk, w_uv = layer.w_uk, layer.w_uv  # [H, nope, kv_lora], [H, v, kv_lora]
    absorb_q = _absorb(q_in * heads * lora, q_in * heads * nope + heads * nope * lora)
    if absorb_q:  # per head [q_in, kv_lora] = q_nope_h^T @ W_UK_h, then the head's rope columns
        latent = torch.einsum("hnq,hnc->hqc", q_nope.double(), w_uk.double()).to(dtype)  # [H, q_in, kv_lora]
        q_b = torch.cat([latent, q_rope.transpose(1, 2)], dim=2)  # [H, q_in, kv_lora + rope]
    else:
        q_b = torch.cat([q_nope, q_rope], dim=1).transpose(1, 2)  # [H, q_in, nope + rope]
    q_b = q_b.transpose(0, 1).reshape(q_in, -1)
    absorb_o = _absorb(heads * lora * c.hidden_size, heads * lora * v + heads * v * c.hidden_size)
    o_heads = a.o_proj.view(c.hidden_size, heads, v)  # [D, H, v]
    if absorb_o:  # per head [kv_lora, D] = W_UV_h^T @ o_proj_h^T
        w_o = torch.einsum("hvc,dhv->hcd", w_uv.double(), o_heads.double()).to(dtype).reshape(heads * lora, -1)
    else:
        w_o = a.o_proj.T.contiguous()
    qkv_a = kv_a if a.q_proj is not None else torch.cat([a.q_a_proj, kv_a])
    return DecodeAttentionWeights(
        qkv_a=Linear.of(qkv_a.T),
        q_a_norm=a.q_a_norm,
        q_b=Linear.of(q_b),
        w_uk=None if absorb_q else w_uk.contiguous(),
        kv_a_norm=a.kv_a_norm,
        w_o=Linear.of(w_o),
        w_uv=None if absorb_o else w_uv.transpose(1, 2).contiguous(),
    )


def _stack_experts(layer: LayerWeights, local_experts: Sequence[int]) -> GroupedExperts | None:
    moe = layer.moe
    if moe is None or not len(local_experts):
        return None
    missing = [e for e in local_experts if e not in moe.experts]
    if missing:
        raise ValueError(f"layer {layer.index}: local experts {missing} are not materialised")
    return GroupedExperts.of([moe.experts[e] for e in local_experts])


def _prepare_layer(layer: LayerWeights, local_experts: Sequence[int]) -> DecodeLayerWeights:
    moe = layer.moe
    experts = _stack_experts(layer, local_experts)
    return DecodeLayerWeights(
        index=layer.index,
        input_norm=layer.input_norm,
        post_attention_norm=layer.post_attention_norm,
        attn=_prepare_attention(layer),
        mlp=None if layer.mlp is None else GatedMLP.of(layer.mlp),
        gate=None if moe is None else Linear.of(moe.gate.float().T),
        gate_bias=None if moe is None else moe.e_score_correction_bias.float(),
        shared=None if moe is None or moe.shared is None else GatedMLP.of(moe.shared),
        experts=experts,
    )


# ---- the phases -------------------------------------------------------------------------------------------------


@dataclass
class RopeTable:
    """Rotation of the rows of one sub-step (shared by every layer): as complex frequencies for torch's rotation and
    as (cos, sin) pairs for the fused CPU kernels; a table made with one makes the other on first use."""

    _freqs: torch.Tensor | None  # [T, half] complex: cos + i sin (YaRN attention factor included)
    _cos_sin: np.ndarray | None = None  # [T, half, 2] fp32

    @property
    def freqs(self) -> torch.Tensor:
        if self._freqs is None:  # the pairs as complex64: a view, the same values
            self._freqs = torch.view_as_complex(torch.from_numpy(self._cos_sin))
        return self._freqs

    @property
    def per_head(self) -> torch.Tensor:
        """[T, 1, half]: broadcasts over the query heads."""
        return self.freqs[:, None, :]

    @property
    def cos_sin(self) -> np.ndarray:
        """[T, half, 2] fp32 (cos, sin) pairs, contiguous: what the fused CPU kernels read."""
        if self._cos_sin is None:
            pairs = torch.view_as_real(self.freqs.to(torch.complex64)).cpu()  # a GPU table's pairs: a host copy
            self._cos_sin = np.ascontiguousarray(pairs.numpy())
        return self._cos_sin

    @property
    def cos(self) -> torch.Tensor:
        return self.freqs.real

    @property
    def sin(self) -> torch.Tensor:
        return self.freqs.imag

    @classmethod
    def at(cls, rope: RotaryEmbedding, positions: torch.Tensor) -> RopeTable:
        cos, sin = rope.cos_sin(positions)
        return cls(torch.complex(cos, sin))


class RopeCache:
    """The RopeTable rows of every position below `limit`, computed once (grown on demand, doubling): a sub-step
    then looks its rows up with one index instead of recomputing cos/sin (the same values, elementwise)."""

    def __init__(self, rope: RotaryEmbedding, limit: int) -> None:
        self.rope = rope
        self.limit = limit
        self._grow(0)

    def _grow(self, size: int) -> None:
        table = RopeTable.at(self.rope, torch.arange(size))
        self.freqs = table.freqs  # [positions, half]
        self.cos_sin = table.cos_sin  # [positions, half, 2]: the kernels' rows, looked up without a conversion

    def at(self, positions: np.ndarray) -> RopeTable:
        """positions [T] int64 -> their RopeTable."""
        top = int(positions.max()) + 1 if len(positions) else 0
        if top > self.limit:
            return RopeTable.at(self.rope, torch.from_numpy(positions))
        if top > len(self.freqs):
            self._grow(min(self.limit, max(top, 2 * len(self.freqs), 1024)))
        if not self.freqs.is_cpu:  # a GPU model: its rows on the GPU, the host pairs only if a kernel asks
            return RopeTable(self.freqs[torch.from_numpy(positions).to(self.freqs.device)])
        if self.freqs.dtype == torch.complex64:  # the complex rows only where a torch path asks for them
            return RopeTable(None, self.cos_sin[positions])
        return RopeTable(self.freqs[torch.from_numpy(positions)], self.cos_sin[positions])


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: the fused CPU kernel or torch's fused op where they compute what `models.rms_norm` does (fp32)."""
    if cpu_kernels.usable(x) and x.dim() == 2 and weight.dtype == torch.float32:
        return cpu_kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    return rms_norm(x, weight, eps)


def _rotated(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, ..., rope] fp32/fp64 in pair order, freqs broadcastable to [T, ..., half] -> the rotated pairs as
    [T, ..., 2, half] (x1' then x2'), a strided view of the complex product."""
    pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))
    if pairs.storage_offset() % 2 or pairs.stride(-2) != 2 or any(s % 2 for s in pairs.stride()[:-2]):
        # view_as_complex needs whole complex numbers; a one-row view at an odd offset already counts as
        # contiguous, so copy it into fresh storage
        pairs = pairs.clone(memory_format=torch.contiguous_format)
    return torch.view_as_real(torch.view_as_complex(pairs) * freqs).transpose(-1, -2)


def rotate_pairs(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """x [T, ..., rope] in pair order -> rotated, de-interleaved [T, ..., rope] ([x1' | x2'])."""
    half = x.shape[-1] // 2
    if x.dtype in _COMPLEX_ROPE_DTYPES:
        freqs = rope.freqs.view(rope.freqs.shape[0], *(1,) * (x.dim() - 2), half)
        return _rotated(x, freqs).flatten(-2)
    shape = (rope.cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = rope.cos.to(x.dtype).reshape(shape), rope.sin.to(x.dtype).reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class KVWrite:
    """Where `project` stores the new tokens' KV: row i of the batch into rows[slots[i]] (-1: row i stores none)."""

    rows: torch.Tensor  # [frames * page, kv_lora + rope]: a layer's KV pages, flattened
    slots: np.ndarray  # int64 [T]
    stored: torch.Tensor | None  # int64 [a]: the batch rows with a slot (None: every row)
    stored_slots: torch.Tensor  # int64 [a]: their slots


def project(
    w: DecodeLayerWeights, c: ModelConfig, h: torch.Tensor, rope: RopeTable, store: KVWrite | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D] residual stream -> q_latent [T, H, kv_lora + rope], kv_new [T, kv_lora + rope] (as
    models.mla_decode_qkv); with `store`, kv_new's rows are also written into the KV pages."""
    a, heads = w.attn, c.num_attention_heads
    if a.w_uk is None and a.qkv_a.takes(h) and w.fp32_norms:  # one kernel call (q_b has panels like qkv_a)
        eps, q_norm = c.rms_norm_eps, a.q_a_norm
        args = (a.kv_a_norm, LATENT_NORM_EPS, rope.cos_sin, a.q_b.panels, heads)
        if store is None or not cpu_kernels.usable(store.rows):
            return _stored(cpu_kernels.mla_project(h, w.input_norm, eps, a.qkv_a.panels, q_norm, *args), store)
        return cpu_kernels.mla_project(h, w.input_norm, eps, a.qkv_a.panels, q_norm, *args, store.rows, store.slots)
    return _stored(_project_steps(w, c, h, rope), store)


def _stored(projected: tuple[torch.Tensor, torch.Tensor], store: KVWrite | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`projected` (q_latent, kv_new), kv_new's rows written as `store` says."""
    if store is not None and len(store.stored_slots):
        kv_new = projected[1] if store.stored is None else projected[1].index_select(0, store.stored)
        store.rows.index_copy_(0, store.stored_slots, kv_new.to(store.rows.dtype))
    return projected


def _project_steps(
    w: DecodeLayerWeights, c: ModelConfig, h: torch.Tensor, rope: RopeTable
) -> tuple[torch.Tensor, torch.Tensor]:
    """`project` in several kernel calls or torch ops."""
    a, t = w.attn, h.shape[0]
    heads, lora, rope_dim = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    x = norm(h, w.input_norm, c.rms_norm_eps)
    qkv = a.qkv_a(x)  # [T, q_lora + kv_lora + rope]
    if a.w_uk is None and cpu_kernels.usable(qkv) and a.kv_a_norm.dtype == torch.float32:
        q_in, kv_new = cpu_kernels.mla_qkv_post(qkv, a.q_a_norm, a.kv_a_norm, LATENT_NORM_EPS, rope.cos_sin)
        q_latent = a.q_b(x if q_in is None else q_in).view(t, heads, lora + rope_dim)
        return cpu_kernels.rope_heads_(q_latent, lora, rope.cos_sin), kv_new
    q_lora = qkv.shape[1] - lora - rope_dim
    kv_new = torch.cat(
        [
            norm(qkv[:, q_lora : q_lora + lora], a.kv_a_norm, LATENT_NORM_EPS),
            rotate_pairs(qkv[:, q_lora + lora :], rope),
        ],
        dim=1,
    )
    q_in = x if a.q_a_norm is None else norm(qkv[:, :q_lora], a.q_a_norm, LATENT_NORM_EPS)
    if a.w_uk is None:  # absorbed: [T, H, kv_lora + rope] straight from the GEMM
        q_latent = a.q_b(q_in).view(t, heads, lora + rope_dim)
        q_pe = q_latent[..., lora:]
        if q_latent.dtype in _COMPLEX_ROPE_DTYPES:  # rotate in place: one copy of the product
            q_pe.unflatten(-1, (2, rope_dim // 2)).copy_(_rotated(q_pe, rope.per_head))
        else:
            q_pe.copy_(rotate_pairs(q_pe, rope))
        return q_latent, kv_new
    q = a.q_b(q_in).view(t, heads, -1)  # [T, H, nope + rope]
    nope = q.shape[-1] - rope_dim
    latent = torch.bmm(q[..., :nope].transpose(0, 1), a.w_uk).transpose(0, 1)  # [T, H, kv_lora]
    return torch.cat([latent, rotate_pairs(q[..., nope:], rope)], dim=-1), kv_new


def add_attention_output(w: DecodeLayerWeights, h: torch.Tensor, o_latent: torch.Tensor) -> torch.Tensor:
    """h [T, D] + attention output of the merged o_latent [T, H, kv_lora] (as models.mla_decode_output)."""
    a, t = w.attn, h.shape[0]
    if a.w_uv is None:
        return a.w_o(o_latent.reshape(t, -1), base=h)
    o = torch.bmm(o_latent.transpose(0, 1), a.w_uv).transpose(0, 1)  # [T, H, v]
    return a.w_o(o.reshape(t, -1), base=h)


def ffn_input(w: DecodeLayerWeights, c: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    return norm(h, w.post_attention_norm, c.rms_norm_eps)


def add_mlp(mlp: GatedMLP, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h [T, D] + SwiGLU(x [T, D])."""
    return mlp(x, base=h)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    if cpu_kernels.usable(gate_up):
        return cpu_kernels.silu_mul(gate_up.view(-1, gate_up.shape[-1])).view(*gate_up.shape[:-1], -1)
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def dense_output(w: DecodeLayerWeights, c: ModelConfig, h: torch.Tensor, o_latent: torch.Tensor) -> torch.Tensor:
    """A dense layer from the merged o_latent [T, H, kv_lora]: h + attention output, plus its MLP of that [T, D]
    (add_attention_output, then add_mlp of ffn_input; one kernel call for a decode batch on the fp32 CPU path)."""
    a, mlp = w.attn, w.mlp
    if a.w_uv is None and a.w_o.takes(h) and mlp.gate_up.takes(h) and w.post_attention_norm.dtype == torch.float32:
        o, panels = o_latent.reshape(h.shape[0], -1), (mlp.gate_up.panels, mlp.down.panels, mlp.down.shape[0])
        return cpu_kernels.dense_layer_output(o, a.w_o.panels, h, w.post_attention_norm, c.rms_norm_eps, *panels)
    h = add_attention_output(w, h, o_latent)
    return add_mlp(mlp, ffn_input(w, c, h), h)


def moe_input(
    w: DecodeLayerWeights, c: ModelConfig, h: torch.Tensor, o_latent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer from the merged o_latent [T, H, kv_lora] to its gate: h + attention output [T, D], the FFN input
    x [T, D], topk_idx int64 [T, k], topk_weights fp32 [T, k] (add_attention_output, ffn_input and moe_gate; one
    kernel call for a decode batch on the fp32 CPU path)."""
    a = w.attn
    if a.w_uv is None and a.w_o.takes(h) and w.gate.takes(h) and w.post_attention_norm.dtype == torch.float32:
        o, gate = o_latent.reshape(h.shape[0], -1), (w.gate.panels, w.gate.shape[1], w.gate_bias, _gate_rule(c))
        return cpu_kernels.moe_gate_input(o, a.w_o.panels, h, w.post_attention_norm, c.rms_norm_eps, *gate)
    h = add_attention_output(w, h, o_latent)
    x = ffn_input(w, c, h)
    return (h, x, *moe_gate(w, c, x))


def _gate_rule(c: ModelConfig) -> cpu_kernels.GateRule:
    return cpu_kernels.GateRule(
        c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor
    )


def moe_gate(w: DecodeLayerWeights, c: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> topk_idx int64 [T, k], topk_weights fp32 [T, k] (as models.moe_gate)."""
    t = x.shape[0]
    if cpu_kernels.usable(x):
        return cpu_kernels.moe_gate_topk(w.gate(x), w.gate_bias, _gate_rule(c))  # logits [T, E]
    scores = w.gate(x.float()).sigmoid_()  # [T, E]
    choice = scores + w.gate_bias
    if c.n_group > 1:
        grouped = choice.view(t, c.n_group, c.experts_per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        top_groups = group_scores.topk(c.topk_group, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, False)
        choice = grouped.masked_fill_(dropped[..., None], float("-inf")).view(t, -1)
    topk_idx = choice.topk(c.num_experts_per_tok, dim=-1).indices  # [T, k]
    topk_weights = scores.gather(1, topk_idx)
    if c.norm_topk_prob:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True).add_(1e-20)
    return topk_idx, topk_weights.mul_(c.routed_scaling_factor)


def grouped_experts(
    experts: GroupedExperts | None, source: torch.Tensor, rows: np.ndarray, local: np.ndarray
) -> torch.Tensor:
    """Run each received token through its expert: source [R, D] holds the tokens at `rows` [N] (int64), routed to
    local experts `local` [N] -> y [N, D], row i = expert local[i] applied to source[rows[i]].

    Decode batches on the fp32 CPU path take one fused kernel (cpu_kernels.grouped_expert_mlp: per expert, its
    tokens' rows straight from `source`, no padding). Otherwise decode batches group the tokens per expert into a
    zero-padded [E_local, max_count, D] batch (padding reads source row 0 and is never returned): all experts run as
    two bmm's whatever the routing. Very small batches (fewer than 2 tokens per expert: most experts idle) and large
    ones (prefill, SEGMENT_MIN_ROWS tokens per expert on average, where the library GEMMs win) sort the tokens by
    expert and run one GEMM pair per expert that has tokens, on its contiguous segment: no padding and no idle
    expert's weights read; the per-op overhead is small next to that or to the GEMMs."""
    n = len(rows)
    if n == 0:
        return source.new_empty(0, source.shape[1])
    num_experts = experts.gate_up.shape[0]
    large = n >= SEGMENT_MIN_ROWS * num_experts
    if not large and experts.gate_up_panels is not None and cpu_kernels.usable(source):
        return cpu_kernels.grouped_expert_mlp(source, rows, local, experts.gate_up_panels, experts.down_panels)
    counts = np.bincount(local, minlength=num_experts)
    order = np.argsort(local, kind="stable")
    starts = np.cumsum(counts) - counts
    if n < 2 * num_experts or large:
        xs = source.index_select(0, torch.from_numpy(rows[order]).to(source.device))  # [N, D] sorted by expert
        ys = torch.empty_like(xs)
        for e in np.nonzero(counts)[0].tolist():
            part = slice(int(starts[e]), int(starts[e] + counts[e]))
            torch.mm(swiglu(xs[part] @ experts.gate_up[e]), experts.down[e], out=ys[part])
        inverse = np.empty(n, dtype=np.int64)
        inverse[order] = np.arange(n)
        return ys.index_select(0, torch.from_numpy(inverse).to(ys.device))
    width = int(counts.max())
    slot = np.empty(n, dtype=np.int64)
    slot[order] = local[order] * width + np.arange(n) - starts[local[order]]  # padded slot of token i
    padded_rows = np.zeros(num_experts * width, dtype=np.int64)
    padded_rows[slot] = rows
    xp = source.index_select(0, torch.from_numpy(padded_rows).to(source.device)).view(num_experts, width, -1)
    yp = torch.bmm(swiglu(torch.bmm(xp, experts.gate_up)), experts.down)  # [E, width, D]
    return yp.view(num_experts * width, -1).index_select(0, torch.from_numpy(slot).to(yp.device))


def routed_experts_sum(
    experts: GroupedExperts, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """The routed part of a MoE layer with every expert local (the driver's prefill): x [T, D], topk_idx [T, k]
    (all chosen), topk_weights [T, k] -> sum over k of weight * expert(x) [T, D], accumulated in fp32. The (token,
    expert) pairs are sorted by expert; each expert gathers its tokens, runs one GEMM pair and adds its weighted
    outputs into their rows (one expert's working set at a time stays in cache)."""
    t, k = topk_idx.shape
    local = topk_idx.reshape(-1).cpu().numpy()
    order = np.argsort(local, kind="stable")  # pairs by (expert, token)
    counts = np.bincount(local, minlength=experts.gate_up.shape[0])
    starts = np.cumsum(counts) - counts
    token = torch.from_numpy(order // k).to(x.device)
    weight = topk_weights.reshape(-1)[torch.from_numpy(order).to(x.device)].float()[:, None]  # [T * k, 1]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for e in np.nonzero(counts)[0].tolist():
        part = slice(int(starts[e]), int(starts[e] + counts[e]))
        y = swiglu(x.index_select(0, token[part]) @ experts.gate_up[e]) @ experts.down[e]
        out.index_add_(0, token[part], y.float().mul_(weight[part]))
    return out.to(x.dtype)


def slab_experts(experts: GroupedExperts | None, recv_x: torch.Tensor, out: torch.Tensor) -> None:
    """Every local expert over its whole static receive slab: recv_x [E_local, rows, D] -> out (same shape). Rows
    without a token hold stale data; their outputs are never sent back."""
    if experts is None:  # an instance without experts receives no token
        return
    gate_up = torch.bmm(recv_x[: experts.gate_up.shape[0]], experts.gate_up)  # [E, rows, 2I]
    torch.bmm(swiglu(gate_up), experts.down, out=out[: experts.down.shape[0]])


def final_logits(w: DecodeWeights, h: torch.Tensor) -> torch.Tensor:
    """h [T, D] -> logits [T, vocab] (as models.logits)."""
    return w.lm_head(norm(h, w.norm, w.config.rms_norm_eps))
