"""Fused fp32 CPU kernels of the eager decode path (C++: data_plane/csrc/cpu_kernels.cpp), as torch functions.

Each kernel replaces a run of small torch ops (norms, rope, SwiGLU, the MoE gate's top-k, the weighted combine, the
paged attention); on CPU a torch op costs microseconds whatever its size, so at decode batch sizes those runs cost
more than the arithmetic. The decode GEMMs run here too, on weights packed into panels once (`pack_panels`): a
decode GEMM has few rows and a cold weight, and a panel is read once, in order (`linear`, and inside `gated_mlp`,
`mla_project` and `grouped_expert_mlp`: every local expert's small GEMM pair on its own tokens, unpadded). The torch
formulation in decode_layers.py / moe_exchange.py stays the reference and the path for every other dtype and
device; tests/test_cpu_kernels.py compares the two.

`usable(t)` says whether a tensor can take the fused path: fp32, on CPU, the extension built, and the path not
switched off with NANOCP_CPU_KERNELS=0 (or `set_enabled(False)`, which tests and the benchmark use to run the
torch reference side by side).

The extension is built at several vector widths side by side (CMakeLists.txt): "native" (-march=native: 16 fp32
lanes with AVX-512, 8 with AVX2), "avx2" (x86-64-v3: 8 lanes, FMA) and "portable" (x86-64's SSE2: 4 lanes). The
kernels run the "native" build unless NANOCP_CPU_KERNELS_WIDTH names another (an error where that build is missing
or this CPU cannot run it); `use_width` switches at run time (tests/test_cpu_kernels.py runs every width this
machine can run). Panels packed by `pack_panels` fit the width they were packed for only.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

try:
    from nanocp.data_plane import _cpu_kernels as _native
except ImportError:  # a source tree without the built extension: the torch path only
    _native = None

# The builds of the kernels by width name -> (module, the CPU features it needs beyond x86-64's baseline).
WIDTHS: dict[str, tuple[str, tuple[str, ...]]] = {
    "native": ("_cpu_kernels", ()),
    "avx2": ("_cpu_kernels_avx2", ("avx", "avx2", "fma", "bmi", "bmi2")),
    "portable": ("_cpu_kernels_portable", ()),
}


def _load_width(width: str) -> tuple[ModuleType | None, str | None]:
    """(the build of the kernels at `width`, None) or (None, why it cannot be used on this machine)."""
    if width not in WIDTHS:
        raise ValueError(f"unknown CPU kernel width {width!r}: one of {', '.join(WIDTHS)}")
    if _native is None:
        return None, "the extension nanocp.data_plane._cpu_kernels is not built"
    if width == "native":
        return _native, None
    module, needs = WIDTHS[width]
    missing = [f for f in needs if not _native.cpu_supports.get(f, False)]
    if missing:  # checked before the import: a module using instructions this CPU lacks could die loading
        return None, f"this CPU lacks {', '.join(missing)}"
    try:
        return importlib.import_module(f"nanocp.data_plane.{module}"), None
    except ImportError:
        return None, f"nanocp.data_plane.{module} is not built (CMake option NANOCP_WIDTH_BUILDS, x86-64 compilers)"


def width_unavailable_reason(width: str) -> str | None:
    """Why the kernels' build at `width` cannot run here (None when it can)."""
    return _load_width(width)[1]


def _select(width: str) -> ModuleType:
    module, reason = _load_width(width)
    if module is None:
        raise RuntimeError(f"CPU kernels at width {width!r}: {reason}")
    return module


_width = os.environ.get("NANOCP_CPU_KERNELS_WIDTH", "native")
_k = _select(_width) if _width != "native" else _native
_enabled = _k is not None and os.environ.get("NANOCP_CPU_KERNELS", "1") != "0"


def current_width() -> str:
    """The width name of the kernels in use ("native" also when the extension is not built)."""
    return _width


def use_width(width: str) -> str:
    """Run the kernels' build at `width` from now on (a RuntimeError where it cannot run here); returns the width
    used before. Weights packed with `pack_panels` must be packed again: panel widths differ between builds."""
    global _k, _width
    module = _select(width)
    previous = _width
    _k, _width = module, width
    return previous


def unavailable_reason() -> str | None:
    """Why the fused kernels are not used (None when they are)."""
    if _k is None:
        return "the extension nanocp.data_plane._cpu_kernels is not built"
    if not _enabled:
        return "switched off (NANOCP_CPU_KERNELS=0 or set_enabled(False))"
    return None


def vector_lanes() -> int | None:
    """fp32 lanes of the vector registers the kernels in use were built for (16: AVX-512, 8: AVX2, 4: SSE in a
    portable build); None without the extension."""
    return None if _k is None else int(_k.vector_lanes)


def set_enabled(enabled: bool) -> bool:
    """Switch the fused path on or off (it stays off without the extension); returns the previous setting."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled) and _k is not None
    return previous


def usable(t: torch.Tensor) -> bool:
    return _enabled and t.dtype == torch.float32 and t.is_cpu


def _np(t: torch.Tensor) -> np.ndarray:
    """The numpy view of an activation (no grad: the decode path runs under no_grad)."""
    return t.numpy()


def _weight(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a weight (a weight may require grad; the kernels only read it)."""
    return t.detach().numpy()


def _empty(*shape: int, dtype=np.float32) -> tuple[torch.Tensor, np.ndarray]:
    """A new tensor and its numpy view (numpy allocates faster than torch.empty)."""
    a = np.empty(shape, dtype=dtype)
    return torch.from_numpy(a), a


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] -> RMSNorm(x) * weight [T, D]."""
    out, o = _empty(*x.shape)
    _k.rms_norm(_np(x), _weight(weight), eps, o)
    return out


def mla_qkv_post(
    qkv: torch.Tensor, q_norm: torch.Tensor | None, kv_norm: torch.Tensor, eps: float, rope_cs: np.ndarray
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """qkv [T, q_lora + kv_lora + rope] (rope dims in pair order), rope_cs [T, rope / 2, 2] (cos, sin) ->
    q_in [T, q_lora] normed (None without q_lora), kv_new [T, kv_lora + rope]: normed latent | rotated rope."""
    t = qkv.shape[0]
    q_lora = 0 if q_norm is None else q_norm.shape[0]
    q_in, q = _empty(t, q_lora)
    kv_new, kv = _empty(t, qkv.shape[1] - q_lora)
    q_weight = _weight(q_norm) if q_norm is not None else np.empty(0, dtype=np.float32)
    _k.mla_qkv_post(_np(qkv), q_weight, _weight(kv_norm), eps, rope_cs, q, kv)
    return (q_in if q_norm is not None else None), kv_new


def rope_heads_(q: torch.Tensor, offset: int, rope_cs: np.ndarray) -> torch.Tensor:
    """q [T, H, W]: rotate the pair-ordered dims [offset, offset + rope) of every head in place (de-interleaved)."""
    _k.rope_heads_(_np(q), offset, rope_cs)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    out, o = _empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _k.silu_mul(_np(gate_up), o)
    return out


class GateRule(NamedTuple):
    """DeepSeek-V3's choice of experts from the gate's logits (the kernels' gate arguments)."""

    n_group: int
    topk_group: int
    top_k: int
    normalize: bool
    scale: float


def moe_gate_topk(logits: torch.Tensor, bias: torch.Tensor, rule: GateRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, E] (before the sigmoid) -> topk_idx int64 [T, k], topk_weights fp32 [T, k]."""
    idx, i = _empty(logits.shape[0], rule.top_k, dtype=np.int64)
    weights, w = _empty(logits.shape[0], rule.top_k)
    _k.moe_gate_topk(_np(logits), _weight(bias), rule.n_group, rule.topk_group, rule.normalize, rule.scale, i, w)
    return idx, weights


def weighted_combine(
    y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, base: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out [T, D] = base + sum_j weights[:, j] * y[rows[:, j]] (fp32); rows int64 [T, k], -1 = no contribution."""
    if out is None:
        out = _empty(*base.shape)[0]
    _k.weighted_combine(_np(y), _np(rows), _np(weights), _np(base), _np(out))
    return out


def moe_dispatch_layout(
    topk_idx: np.ndarray, num_experts: int, ranks: int, cap: int
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """topk_idx int64 [T, k] (-1 = no expert) -> (n pairs, source [n + ranks], tags [n + ranks], per_dst [ranks],
    result_rows [T, k]): the packed dispatch payload layout of data_plane/moe_exchange.py."""
    t, k = topk_idx.shape
    source = np.empty(t * k + ranks, dtype=np.int64)
    tags = np.empty(t * k + ranks, dtype=np.int64)
    per_dst = np.empty(ranks, dtype=np.int64)
    result_rows = np.empty((t, k), dtype=np.int64)
    idx = np.ascontiguousarray(topk_idx)
    n = _k.moe_dispatch_layout(idx, num_experts, ranks, cap, source, tags, per_dst, result_rows)
    return n, source[: n + ranks], tags[: n + ranks], per_dst, result_rows


def pack_dispatch_rows(x: torch.Tensor, source: np.ndarray, tags: np.ndarray, out: torch.Tensor) -> None:
    """x [T, hidden], source / tags int64 [n] -> out [n, hidden + 1] rows: x[source[i]] then tags[i] as an int32
    in the last slot (the packed dispatch payload of data_plane/moe_exchange.py, fp32)."""
    _k.pack_dispatch_rows(_np(x), source, tags, _np(out))


def pack_dispatch(
    x: torch.Tensor, topk_idx: np.ndarray, num_experts: int, cap: int, blocks: list[np.ndarray], result_rows: np.ndarray
) -> None:
    """The packed dispatch of data_plane/moe_exchange.py in one call: x [T, hidden], topk_idx int64 [T, k] (-1 = no
    expert) -> each destination rank d's block (a header row with its pair count, then [values | local expert] rows
    by (expert, token)) in blocks[d] [cap + 1, hidden + 1]; result_rows int64 [T, k] as moe_dispatch_layout's."""
    _k.pack_dispatch(_np(x), topk_idx, num_experts, cap, blocks, result_rows)


def panel_width() -> int | None:
    """Columns per weight panel of the GEMM kernels (one register tile: 16 with AVX2, 64 with AVX-512)."""
    return None if _k is None else int(_k.panel_width)


def pack_panels(w: torch.Tensor) -> np.ndarray:
    """w [..., k, n] -> its panels [..., ceil(n / W), k, W] fp32 (W = panel_width(); columns past n are 0): the
    layout the GEMM kernels read, each panel one contiguous block. A numpy array: only the kernels read it, and
    they take it as it is (no conversion per call)."""
    width = panel_width()
    k, n = w.shape[-2:]
    panels = -(-n // width)
    padded = torch.nn.functional.pad(w.detach().float(), (0, panels * width - n))  # [..., k, P * W]
    return padded.unflatten(-1, (panels, width)).transpose(-3, -2).contiguous().numpy()


def linear(x: torch.Tensor, panels: np.ndarray, n: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, k] @ W (+ base [T, n]) -> [T, n], W [k, n] given as pack_panels(W)."""
    out, o = _empty(x.shape[0], n)
    _k.linear_panels(_np(x), panels, n, None if base is None else _np(base), o)
    return out


def mla_project(
    h: torch.Tensor,
    input_norm: torch.Tensor,
    eps: float,
    qkv_a: np.ndarray,
    q_norm: torch.Tensor | None,
    kv_norm: torch.Tensor,
    latent_eps: float,
    rope_cs: np.ndarray,
    q_b: np.ndarray,
    heads: int,
    kv_cache: torch.Tensor | None = None,
    kv_slots: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's projection with the absorbed query in one call: h [T, D] -> q_latent [T, H, kv_lora + rope] (rope
    rotated), kv_new [T, kv_lora + rope] (normed latent | rotated rope). qkv_a [D, q_lora + kv_lora + rope] and q_b
    [q_in, H * (kv_lora + rope)] as pack_panels; rope_cs [T, rope / 2, 2]. With kv_cache [N, kv_lora + rope] and
    kv_slots int64 [T], row r of kv_new is also stored in kv_cache row kv_slots[r] (-1: not stored)."""
    t, width = h.shape[0], kv_norm.shape[0] + 2 * rope_cs.shape[1]
    q_latent, q = _empty(t, heads, width)
    kv_new, kv = _empty(t, width)
    q_weight = _weight(q_norm) if q_norm is not None else np.empty(0, dtype=np.float32)
    cache = None if kv_cache is None else _np(kv_cache)
    args = (latent_eps, rope_cs, q_b, q, kv, cache, kv_slots)
    _k.mla_project(_np(h), _weight(input_norm), eps, qkv_a, q_weight, _weight(kv_norm), *args)
    return q_latent, kv_new


def moe_gate_input(
    o: torch.Tensor,
    w_o: np.ndarray,
    h: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    gate: np.ndarray,
    experts: int,
    bias: torch.Tensor,
    rule: GateRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer from its merged attention output to its gate in one call: o [T, H * kv_lora], h [T, D] ->
    h + o @ W_o [T, D], x = RMSNorm(that) [T, D], topk_idx int64 [T, k], topk_weights [T, k] (moe_gate_topk of
    x @ W_gate). W_o [H * kv_lora, D] and W_gate [D, experts] as pack_panels, bias [experts]."""
    t, dim = h.shape
    h_out, h_np = _empty(t, dim)
    x, x_np = _empty(t, dim)
    idx, i = _empty(t, rule.top_k, dtype=np.int64)
    weights, w = _empty(t, rule.top_k)
    args = (_weight(bias), rule.n_group, rule.topk_group, rule.normalize, rule.scale, h_np, x_np, i, w)
    _k.moe_gate_input(_np(o), w_o, _np(h), _weight(post_norm), eps, gate, experts, *args)
    return h_out, x, idx, weights


def dense_layer_output(
    o: torch.Tensor,
    w_o: np.ndarray,
    h: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    gate_up: np.ndarray,
    down: np.ndarray,
    inter: int,
) -> torch.Tensor:
    """A dense layer from its merged attention output in one call: o [T, H * kv_lora], h [T, D] -> h1 +
    SwiGLU(RMSNorm(h1)) [T, D], h1 = h + o @ W_o. W_o, gate_up [D, 2I] (gate | up) and down [I, D] as
    pack_panels."""
    out, o_np = _empty(*h.shape)
    _k.dense_layer_output(_np(o), w_o, _np(h), _weight(post_norm), eps, gate_up, down, inter, o_np)
    return out


def gated_mlp(
    x: torch.Tensor, gate_up: np.ndarray, down: np.ndarray, inter: int, base: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU MLP: x [T, D] -> (silu(x @ W_gate) * (x @ W_up)) @ W_down (+ base [T, D]), gate_up [D, 2I] (gate | up)
    and down [I, D] given as pack_panels."""
    out, o = _empty(x.shape[0], x.shape[1])
    _k.gated_mlp(_np(x), gate_up, down, inter, None if base is None else _np(base), o)
    return out


def grouped_expert_mlp(
    source: torch.Tensor, rows: np.ndarray, local: np.ndarray, gate_up_panels: np.ndarray, down_panels: np.ndarray
) -> torch.Tensor:
    """source [R, D], rows / local int64 [N], the experts' gate_up [E, D, 2I] and down [E, I, D] as pack_panels ->
    y [N, D]: row i is local expert local[i]'s SwiGLU MLP of source[rows[i]] (no padding; idle experts cost
    nothing)."""
    y, out = _empty(len(rows), source.shape[1])
    inter = down_panels.shape[-2]
    _k.grouped_expert_mlp(_np(source), rows, local, gate_up_panels, down_panels, inter, out)
    return y


def received_expert_mlp(
    recv: np.ndarray, cap: int, gate_up_panels: np.ndarray, down_panels: np.ndarray, outs: list[np.ndarray]
) -> list[int]:
    """The routed experts of one packed dispatch (data_plane/moe_exchange.py) in place: recv [ranks * (cap + 1),
    D + 1] the receive buffer (per source a header row with its pair count, then [values | local expert] rows),
    outs[s] [cap, D] where the outputs of source s's pairs go, in its order -> the pair count of each source."""
    return _k.received_expert_mlp(recv, cap, gate_up_panels, down_panels, down_panels.shape[-2], outs)


def mla_paged_attention(
    q: torch.Tensor, kv_pages: torch.Tensor, block_table: torch.Tensor, lens: np.ndarray, scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S, H, Dqk], kv_pages [P, page, Dqk], block_table int32 [S, B], lens int64 [S] -> o [S, H, v_dim],
    lse [S, H] (natural log; -inf and o = 0 for an empty shard), read straight from the pages."""
    o, o_np = _empty(q.shape[0], q.shape[1], v_dim)
    lse, lse_np = _empty(q.shape[0], q.shape[1])
    _k.mla_paged_attention(_np(q), _np(kv_pages), _np(block_table), lens, scale, o_np, lse_np)
    return o, lse
