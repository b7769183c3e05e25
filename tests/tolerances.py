"""fp32 error bounds for comparing a kernel with its reference, derived from the arithmetic.

No tolerance here comes from what one machine produced. The model is the standard one (Higham, *Accuracy and
Stability of Numerical Algorithms*, ch. 2-3): an fp32 operation rounds to nearest, fl(a op b) = (a op b)(1 + d) with
|d| <= u = 2^-24, and

- a sum of n terms, added in ANY order, errs by at most gamma(n - 1) * sum |terms|, a dot product of length n by
  gamma(n) * sum |a_i b_i| (with or without FMA), gamma(n) = n u / (1 - n u); a chain of k roundings (products,
  quotients) errs by gamma(k) relatively. The vector width only changes the order (4, 8 or 16 partial sums and a
  tree; FMA or not), so one bound covers every width the kernels are built for;
- exp, log, sigmoid and the like err by at most FUNC = 6 u relatively (3 ulp; counted as 6 roundings): the
  kernels' fast_exp (4.3 u at most without FMA, 3.9 u with it: checked on a dense sweep by
  tests/test_cpu_kernels.py), libm's and torch's SLEEF functions (1 ulp, at most 2 u). An argument x rounded before
  exp adds u |x| relatively (e^(x(1 + d)) = e^x e^(x d)): large score gaps cost accuracy;
- log turns a relative error r of its argument into an absolute error -log(1 - r): next to 1 (a softmax over
  few rows) the log is small and that absolute error is the whole story, so lse bounds are absolute, not relative;
- results below fp32's normal range (2^-126) lose relative accuracy: TINY = 2^-120 absolute covers them and the
  kernels' exp clamp (e^x for x < -87 comes back as e^-87);
- errors of the inputs propagate by the derivative: |d silu| <= SILU_SLOPE, |d lse / d s_t| = p_t,
  |d o / d s_t| = p_t |v_t - o|, RMSNorm's Jacobian below.

A `Bounded` holds an exact value (fp64, computed from the same fp32 inputs) and `err`, the bound elementwise on the
absolute error of an fp32 evaluation of it, scaled by the actual magnitudes (|x| @ |w|, sum |terms|), never by a
norm of the whole result. Bounds are first order in u plus gamma's own higher-order terms; products of two error
terms (each < 2^-10 here) are covered by the 2^-10 relative margin of `assert_within`. Two fp32 evaluations of
the same value (a kernel and its torch reference, two summation orders) differ by at most the sum of their bounds.
These are worst cases: the errors seen come near them for sums of two or three terms (a rope pair) and are up to
10^4 times smaller through a chain of GEMMs (rounding errors mostly cancel, growing like sqrt(n) u, and |W| |x|
exceeds |W x|); a wrong index, a missing term or a wrong scale is still far outside them.

They bound single steps (a kernel, a layer's projection, an MLP, an attention, a merge). Whole-model comparisons
(several layers, MoE routing, the data plane against the single-instance reference) check the project's accuracy
requirement instead, fp32 logits within 1e-5 of the reference's largest: chained through layers, a componentwise
bound grows by sum |w| at every GEMM (sqrt(k) times faster than errors do) and after one layer it exceeds the gaps
between MoE gate choices, where the routing (discontinuous) may differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

U = 2.0**-24  # fp32 unit roundoff
FUNC = 6  # exp / log / sigmoid, any implementation in play: relative error <= FUNC u (3 ulp)
TINY = 2.0**-120  # absolute: subnormal results, the kernels' exp clamp (e^-87 < 2^-125)
SILU_SLOPE = 1.0999  # max |d/dx x sigmoid(x)| (1.0998 at x = 2.40)
MARGIN = 2.0**-10  # relative: second-order terms


def gamma(n: int | float | torch.Tensor, unit: float = U) -> float | torch.Tensor:
    """gamma(n) = n u / (1 - n u): the relative error bound of n roundings (n u < 1); `unit` = 2^-8 for bf16."""
    return n * unit / (1 - n * unit)


@dataclass
class Bounded:
    """An exact value (fp64) and the bound on the absolute error of an fp32 evaluation of it (fp64, same shape)."""

    value: torch.Tensor
    err: torch.Tensor

    @property
    def mag(self) -> torch.Tensor:
        """The largest magnitude the fp32 evaluation can have: |value| + err."""
        return self.value.abs() + self.err

    def __getitem__(self, index) -> Bounded:
        return Bounded(self.value[index], self.err[index])

    def map(self, f) -> Bounded:
        """The same layout change (view, transpose, flatten, ...) of value and err."""
        return Bounded(f(self.value), f(self.err))


def cat(parts: list[Bounded | torch.Tensor], dim: int = -1) -> Bounded:
    parts = [as_bounded(p) for p in parts]
    return Bounded(torch.cat([p.value for p in parts], dim), torch.cat([p.err for p in parts], dim))


def exact(t: torch.Tensor) -> Bounded:
    """An fp32 input: exact."""
    v = t.double()
    return Bounded(v, torch.zeros_like(v))


def rounded(value: torch.Tensor) -> Bounded:
    """A value computed in higher precision and rounded to fp32 once (e.g. a weight product made in fp64)."""
    v = value.double()
    return Bounded(v, U * v.abs())


def as_bounded(x: Bounded | torch.Tensor) -> Bounded:
    return x if isinstance(x, Bounded) else exact(x)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - want| <= bound (1 + MARGIN) + TINY elementwise; want and bound fp64 (or fp32 of a second evaluation:
    then bound must be the sum of both evaluations' bounds). Infinities must match exactly."""
    got, want, bound = got.double(), want.double(), torch.as_tensor(bound, dtype=torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    inf = torch.isinf(want)
    if inf.any():
        assert torch.equal(got[inf], want[inf]), f"{what}: infinities differ"
    diff = (got - want).abs().where(~inf, torch.zeros_like(want))
    allowed = bound.expand_as(diff) * (1 + MARGIN) + TINY
    bad = ~(diff <= allowed)  # NaN fails too
    if bad.any():
        ratio = (diff / allowed).where(~torch.isnan(diff), torch.full_like(diff, math.inf)).flatten()
        i = int(ratio.argmax())
        at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), diff.shape))
        g, w, d, a = (float(t.flatten()[i]) for t in (got, want, diff, allowed))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {diff.numel()} values outside the fp32 error bound; worst at {at}: "
            f"got {g!r}, want {w!r}, |diff| {d:.3e} > bound {a:.3e} ({float(ratio[i]):.2f}x)"
        )


# ---- linear algebra ----------------------------------------------------------------------------------------------


def linear(x: Bounded | torch.Tensor, w: Bounded | torch.Tensor, base: Bounded | torch.Tensor | None = None) -> Bounded:
    """x [..., k] @ w [k, n] (+ base [..., n]): a dot product of k terms (+ 1 for the base) in any order; the
    inputs' errors carried through (|dx| @ |w| + |x| @ |dw|)."""
    x, w = as_bounded(x), as_bounded(w)
    value = x.value @ w.value
    err = x.err @ w.mag + x.value.abs() @ w.err
    k = x.value.shape[-1]
    if base is None:
        return Bounded(value, err + gamma(k) * (x.mag @ w.mag))
    base = as_bounded(base)
    return Bounded(value + base.value, err + base.err + gamma(k + 1) * (x.mag @ w.mag + base.mag))


def product(a: Bounded | torch.Tensor, b: Bounded | torch.Tensor, roundings: int = 1) -> Bounded:
    """a * b elementwise (broadcasting), the product rounded `roundings` times."""
    a, b = as_bounded(a), as_bounded(b)
    value = a.value * b.value
    return Bounded(value, a.err * b.mag + a.value.abs() * b.err + gamma(roundings) * a.mag * b.mag)


def add(a: Bounded | torch.Tensor, b: Bounded | torch.Tensor) -> Bounded:
    a, b = as_bounded(a), as_bounded(b)
    value = a.value + b.value
    return Bounded(value, a.err + b.err + U * (a.mag + b.mag))


def scaled(a: Bounded, s: float) -> Bounded:
    """a times a Python scalar s (s rounded to fp32 and the product rounded: 2 roundings)."""
    return Bounded(a.value * s, a.err * abs(s) + gamma(2) * a.mag * abs(s))


# ---- element-wise / row-wise steps -------------------------------------------------------------------------------


def rms_norm(x: Bounded | torch.Tensor, weight: torch.Tensor, eps: float) -> Bounded:
    """x [..., n] -> x * rsqrt(mean(x^2) + eps) * weight. Rounding: mean(x^2) + eps is a sum of n positive terms, a
    division and an add (and eps rounded): n + 2 roundings relatively; the square root halves that and adds one,
    the reciprocal and the two products one each: gamma(ceil((n + 2) / 2) + 5) relatively (one more for sqrt's
    halving of a bound that is not exactly a product of roundings). The input's error carried through the
    Jacobian: dy_i = w_i r (dx_i - x_i r^2 sum_j x_j dx_j / n), r = rsqrt(mean(x^2) + eps)."""
    x = as_bounded(x)
    n = x.value.shape[-1]
    w = weight.double()
    r = torch.rsqrt(x.value.pow(2).mean(-1, keepdim=True) + eps)
    value = x.value * r * w
    coupling = (x.value.abs() * x.err).sum(-1, keepdim=True) / n
    propagated = w.abs() * r * (x.err + x.value.abs() * r.pow(2) * coupling)
    return Bounded(value, propagated + gamma(math.ceil((n + 2) / 2) + 5) * value.abs())


def rotate(x1: Bounded | torch.Tensor, x2: Bounded | torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Bounded:
    """Rope of the pairs (x1, x2) by (cos, sin) (fp32 table values, exact): [x1 c - x2 s | x2 c + x1 s], each a dot
    product of 2 terms."""
    x1, x2 = as_bounded(x1), as_bounded(x2)
    c, s = cos.double(), sin.double()
    first = Bounded(
        x1.value * c - x2.value * s,
        x1.err * c.abs() + x2.err * s.abs() + gamma(2) * (x1.mag * c.abs() + x2.mag * s.abs()),
    )
    second = Bounded(
        x2.value * c + x1.value * s,
        x2.err * c.abs() + x1.err * s.abs() + gamma(2) * (x2.mag * c.abs() + x1.mag * s.abs()),
    )
    return Bounded(torch.cat([first.value, second.value], -1), torch.cat([first.err, second.err], -1))


def silu_mul(gate: Bounded | torch.Tensor, up: Bounded | torch.Tensor) -> Bounded:
    """silu(gate) * up = gate / (1 + e^-gate) * up: exp (FUNC, its error shrunk by e / (1 + e) <= 1 in the
    denominator), the add, the division (or a reciprocal and a product) and the product with up: FUNC + 4
    roundings. Inputs' errors through |d silu| <= SILU_SLOPE. For gate < -87 the kernels' exp clamp returns
    gate * e^-88 * up instead of gate * e^gate * up: at most |gate * up| 2^-125 apart."""
    gate, up = as_bounded(gate), as_bounded(up)
    silu = torch.nn.functional.silu(gate.value)
    silu_mag = silu.abs() + SILU_SLOPE * gate.err
    value = silu * up.value
    err = SILU_SLOPE * gate.err * up.mag + silu.abs() * up.err + gamma(FUNC + 4) * silu_mag * up.mag
    return Bounded(value, err + gate.mag * up.mag * 2.0**-125)


def swiglu_mlp(
    x: Bounded | torch.Tensor,
    gate_up: Bounded | torch.Tensor,
    down: Bounded | torch.Tensor,
    base: Bounded | torch.Tensor | None = None,
) -> Bounded:
    """(silu(x @ W_gate) * (x @ W_up)) @ W_down (+ base); gate_up [D, 2I] (gate | up), down [I, D]."""
    h = linear(x, gate_up)
    inter = h.value.shape[-1] // 2
    a = silu_mul(Bounded(h.value[..., :inter], h.err[..., :inter]), Bounded(h.value[..., inter:], h.err[..., inter:]))
    return linear(a, down, base)


def sigmoid(z: Bounded | torch.Tensor) -> Bounded:
    """1 / (1 + e^-z): exp (FUNC, shrunk by e / (1 + e) <= 1), the add and the division: FUNC + 2 roundings; below
    -87 the kernels' exp clamp errs by at most e^-87 < TINY absolutely; z's error through |sigmoid'| <= 1/4."""
    z = as_bounded(z)
    value = torch.sigmoid(z.value)
    return Bounded(value, gamma(FUNC + 2) * value + TINY + z.err / 4)


# ---- attention ---------------------------------------------------------------------------------------------------


@dataclass
class Attention:
    o: Bounded  # [S, H, v_dim]
    lse: Bounded  # [S, H]; -inf (err 0) for an empty shard


def attention(
    q: Bounded | torch.Tensor,
    kv: Bounded | torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    v_dim: int = 0,
    chunk: int | None = None,
    v: Bounded | torch.Tensor | None = None,
) -> Attention:
    """MLA attention of q [S, H, D] over the first lens[s] rows of kv [S, N, D] (k = the row, v = its first v_dim
    values), scores scale * q.k: o = sum_t p_t v_t, lse = log sum_t e^(s_t), p = softmax(s). `lens` may instead be
    a mask of the rows each query sees, [S, H, N] or broadcastable to it (causal attention), and `v` [S, N, Dv] the
    values when they are not the rows' first v_dim values.

    The fp32 evaluation bounded is either the fused kernel's online softmax (`chunk` rows at a time: a running max
    m, exp(s_t - m), running sums rescaled by exp(m_old - m_new) when the max rises, o = acc / sum) or, with
    chunk=None, the reference's one-pass form (models.mla_attention_with_lse: lse = logsumexp(s), then
    p_t = exp(s_t - lse), o = sum p_t v_t). Per row and head, with x_t = s_t - max s <= 0, S = sum e^(x_t):

    - scores: D products and the scale (itself rounded): e_t = gamma(D + 2) scale |q| . |k_t| (+ the inputs'
      errors); they move lse by sum p_t e_t and o by sum p_t |v_t - o| e_t (times e^(2 max e_t), the most a p_t
      can grow over the perturbation);
    - each exp(x_t): FUNC + u |x_t| relatively; the sums of n terms (+ one add per chunk): gamma(n + chunks)
      relatively (all terms >= 0); each of the (chunks - 1) rescales: FUNC + u (max |x| + 1). With r the relative
      error of S so found, log S errs by -log(1 - r) + FUNC |log S| and the final add m + log S by u |lse|;
    - kernel o = acc / S: acc errs like S, elementwise with |v_t|, then |o| r and the reciprocal and product
      (gamma(2)); reference o: every p_t carries lse's rounding error e^(dl) - 1, its exp's FUNC + u |s_t - lse|,
      and the sum of n products gamma(n).
    """
    q, kv = as_bounded(q), as_bounded(kv)
    shards, heads, dqk = q.value.shape
    n_rows = kv.value.shape[1]
    if n_rows == 0:  # no rows at all: o = 0, lse = -inf, exactly
        dv = v_dim if v is None else as_bounded(v).value.shape[-1]
        o, lse = torch.zeros(shards, heads, dv, dtype=torch.float64), torch.full((shards, heads), -math.inf)
        return Attention(Bounded(o, torch.zeros_like(o)), Bounded(lse.double(), torch.zeros_like(lse).double()))
    if lens.dtype == torch.bool:
        mask = lens.expand(shards, heads, n_rows)
    else:
        mask = (torch.arange(n_rows)[None, :] < lens.long()[:, None])[:, None, :].expand(shards, heads, n_rows)
    scores = torch.einsum("shd,snd->shn", q.value, kv.value) * scale
    score_err = abs(scale) * (
        torch.einsum("shd,snd->shn", q.err, kv.mag)
        + torch.einsum("shd,snd->shn", q.value.abs(), kv.err)
        + gamma(dqk + 2) * torch.einsum("shd,snd->shn", q.mag, kv.mag)
    )
    score_err = score_err.where(mask, torch.zeros_like(score_err))
    s = scores.masked_fill(~mask, -math.inf)
    top = s.amax(-1, keepdim=True)  # [S, H, 1]
    top_finite = top.where(torch.isfinite(top), torch.zeros_like(top))
    x = (s - top_finite).where(mask, torch.zeros_like(s))  # exp arguments, <= 0 on valid rows
    e = torch.exp(x).where(mask, torch.zeros_like(x))
    total = e.sum(-1, keepdim=True)  # S, >= 1 where any row is valid
    nonempty = total > 0
    safe_total = total.where(nonempty, torch.ones_like(total))
    p = e / safe_total
    if v is None:
        v, v_err = kv.value[..., :v_dim], kv.err[..., :v_dim]
    else:
        v = as_bounded(v)
        v, v_err = v.value, v.err
    o = torch.einsum("shn,snc->shc", p, v)
    log_total = torch.log(safe_total)
    lse = (
        (top_finite + log_total).squeeze(-1).where(nonempty.squeeze(-1), torch.full_like(total.squeeze(-1), -math.inf))
    )

    # the scores' errors, carried through the softmax
    eps = score_err.amax(-1, keepdim=True)  # [S, H, 1]
    grow = torch.exp(2 * eps)
    lse_from_scores = (grow * (p * score_err).sum(-1, keepdim=True)).squeeze(-1)
    # |v_t - o| for every row t, [S, H, N, v_dim], plus the most o itself moves: (e^(2 eps) - 1) sum p_t |v_t|
    moved = torch.expm1(2 * eps)[..., None] * torch.einsum("shn,snc->shc", p, v.abs())[:, :, None, :]
    dev = (v[:, None, :, :] - o[:, :, None, :]).abs() + moved
    o_from_scores = grow * torch.einsum("shn,shnc->shc", p * score_err, dev)
    o_from_v = grow * torch.einsum("shn,snc->shc", p, v_err)

    # rounding, given the scores
    n = mask.sum(-1, keepdim=True).double()  # [S, H, 1] rows each query sees
    chunks = torch.ones_like(n) if chunk is None else torch.ceil(n / chunk).clamp(min=1)
    x_max = (-x).where(mask, torch.zeros_like(x)).amax(-1, keepdim=True)
    exp_rel = gamma(FUNC) + U * (-x)  # [S, H, N], per term
    term_err = (e * exp_rel + TINY).where(mask, torch.zeros_like(e))
    rescale = (chunks - 1) * (gamma(FUNC) + U * (x_max + 1))
    sum_rel = gamma(n + chunks) + rescale
    total_err = term_err.sum(-1, keepdim=True) + sum_rel * total
    r = (total_err / safe_total).clamp(max=0.5)
    log_err = -torch.log1p(-r) + gamma(FUNC) * log_total.abs()
    lse_round = log_err + U * (top_finite.abs() + log_total.abs()) * (1 + r)
    lse_err = (grow.squeeze(-1) * lse_round.squeeze(-1) + lse_from_scores).where(
        nonempty.squeeze(-1), torch.zeros_like(lse_from_scores)
    )

    weighted_v = torch.einsum("shn,snc->shc", e, v.abs())  # sum e_t |v_t|
    if chunk is not None:  # kernel: o = acc / S
        acc_err = torch.einsum("shn,snc->shc", term_err, v.abs()) + sum_rel * weighted_v
        o_round = (acc_err + o.abs() * total_err) / safe_total + gamma(2) * o.abs()
    else:  # reference: p_t = exp(s_t - lse), o = sum p_t v_t
        dl = torch.expm1(lse_round)  # [S, H, 1]
        x_lse = (s - top_finite - log_total).where(mask, torch.zeros_like(s)).abs()
        prob_rel = dl + gamma(FUNC) + U * x_lse  # [S, H, N]
        o_round = torch.einsum("shn,snc->shc", p * prob_rel + TINY, v.abs()) + gamma(n) * (weighted_v / safe_total)
    o_err = grow * o_round + o_from_scores + o_from_v
    o_err = o_err.where(nonempty, torch.zeros_like(o_err))
    o = o.where(nonempty, torch.zeros_like(o))
    return Attention(Bounded(o, o_err), Bounded(lse, lse_err))


def merge(o: Bounded | torch.Tensor, lse: Bounded | torch.Tensor) -> Attention:
    """Merge K partial attentions over disjoint KV parts: o [K, ..., Dv], lse [K, ...] (-inf: an empty part) ->
    lse = logsumexp_k lse_k, o = sum_k w_k o_k with w_k = e^(lse_k - lse). Either fp32 form: w_k = exp(lse_k - lse)
    after the lse (models.merge_attention_partials) or sum_k e^(lse_k - m) o_k / S (an online merge); the bound is
    the larger of the two. The inputs' errors carried: d lse = sum w_k d lse_k, d o = sum w_k (|o_k - o| d lse_k +
    d o_k)."""
    o, lse = as_bounded(o), as_bounded(lse)
    k = lse.value.shape[0]
    finite = torch.isfinite(lse.value)
    top = lse.value.amax(0, keepdim=True)
    nonempty = torch.isfinite(top)
    top = top.where(nonempty, torch.zeros_like(top))
    x = (lse.value - top).where(finite, torch.full_like(top.expand_as(lse.value), -math.inf))
    e = torch.exp(x)
    total = e.sum(0, keepdim=True)
    safe_total = total.where(nonempty, torch.ones_like(total))
    w = e / safe_total
    log_total = torch.log(safe_total)
    merged_lse = (top + log_total).where(nonempty, torch.full_like(top, -math.inf))
    merged_o = (w[..., None] * o.value).sum(0)
    x_abs = (-x).where(finite, torch.zeros_like(x))
    lse_in = lse.err.where(finite, torch.zeros_like(lse.err))
    eps = lse_in.amax(0, keepdim=True)
    grow = torch.exp(2 * eps)
    term_err = e * (gamma(FUNC) + U * x_abs) + TINY * finite
    r = ((term_err.sum(0, keepdim=True) + gamma(k) * total) / safe_total).clamp(max=0.5)
    lse_round = -torch.log1p(-r) + gamma(FUNC) * log_total.abs() + U * (top.abs() + log_total.abs()) * (1 + r)
    lse_err = grow * lse_round + grow * (w * lse_in).sum(0, keepdim=True)
    dev = (o.value - merged_o[None]).abs()
    weighted_o = (w[..., None] * o.mag).sum(0)
    o_from_inputs = grow[..., None] * (w[..., None] * (dev * lse_in[..., None] + o.err)).sum(0)
    # online form: (sum e_k o_k (1 + exp err) + gamma(k) sum e_k |o_k|) / S, then |o| r and 2 roundings
    online = (term_err[..., None] * o.mag).sum(0) / safe_total[..., None] + gamma(k) * weighted_o
    online = online + merged_o.abs() * r[..., None] + gamma(2) * merged_o.abs()
    # after-lse form: each w_k with lse's rounding, its exp and argument, then a sum of k products
    w_rel = torch.expm1(lse_round) + gamma(FUNC) + U * (x_abs + log_total.abs())
    after = (w[..., None] * w_rel[..., None] * o.mag).sum(0) + gamma(k) * weighted_o + TINY
    o_err = (grow[..., None] * torch.maximum(online, after) + o_from_inputs).squeeze(0)  # [..., Dv]
    keep = nonempty.squeeze(0)
    return Attention(
        Bounded(
            merged_o.where(keep[..., None], torch.zeros_like(merged_o)),
            o_err.where(keep[..., None], torch.zeros_like(o_err)),
        ),
        Bounded(merged_lse.squeeze(0), lse_err.squeeze(0).where(keep, torch.zeros_like(lse_err.squeeze(0)))),
    )


# ---- the MoE gate --------------------------------------------------------------------------------------------------


def check_gate(
    logits: Bounded | torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scale: float,
    idx: torch.Tensor,
    weights: torch.Tensor,
    what: str = "gate",
) -> None:
    """DeepSeek-V3's gate (sigmoid scores, choice = score + bias, the topk_group groups with the best sums of their
    two best choices, the top-k choices inside them, weights = the chosen scores normalised and scaled) of logits
    [T, E] (fp32 inputs, or Bounded when computed): `idx`, `weights` [T, k] must be what an fp32 evaluation can
    give. A choice differs from its exact value by at most sigmoid's bound plus the add's rounding, so the exact
    choices decide every comparison except between values closer than their bounds: there either order is valid.
    Checked in pick order: each pick lies in a group that can be among the topk_group best, and can beat every
    expert not yet picked of every group that is surely kept. The weights of the picks: the scores (FUNC + 2
    roundings), their sum (k - 1 adds), + 1e-20, the division and the scale (rounded, then a product):
    gamma(2 (FUNC + 2) + k + 3) relatively (gamma(FUNC + 4) without normalising), plus the logits' errors carried
    through sigmoid' <= 1/4 and the normalisation."""
    score = sigmoid(logits)
    b = bias.double()
    choice = score.value + b
    delta = score.err + U * (choice.abs() + score.err) + TINY  # one evaluation's error on each choice
    lo, hi = choice - delta, choice + delta
    tokens, experts = choice.shape
    k = idx.shape[1]
    per = experts // n_group
    for t in range(tokens):
        chosen = [int(j) for j in idx[t]]
        assert len(set(chosen)) == k and all(0 <= j < experts for j in chosen), f"{what}: token {t} picks {chosen}"
        if n_group > 1:
            g_lo = lo[t].view(n_group, per).topk(2, -1).values.sum(-1) * (1 - U) - TINY
            g_hi = hi[t].view(n_group, per).topk(2, -1).values.sum(-1) * (1 + U) + TINY
            surely_beaten = torch.tensor([int((g_lo > g_hi[g]).sum()) for g in range(n_group)])
            maybe_beaten = torch.tensor([int((g_hi >= g_lo[g]).sum()) - 1 for g in range(n_group)])
            possible, sure = surely_beaten < topk_group, maybe_beaten < topk_group
        else:
            possible = sure = torch.ones(1, dtype=torch.bool)
        group_of = torch.arange(experts) // per if n_group > 1 else torch.zeros(experts, dtype=torch.long)
        remaining = set(int(j) for j in torch.nonzero(sure[group_of]).flatten())
        for pick, j in enumerate(chosen):
            assert bool(possible[group_of[j]]), (
                f"{what}: token {t} pick {pick} (expert {j}) is in group {int(group_of[j])}, which cannot be kept"
            )
            rivals = [i for i in remaining if i != j and not bool(hi[t, j] >= lo[t, i])]
            assert not rivals, (
                f"{what}: token {t} pick {pick} (expert {j}, choice {choice[t, j]:.9g}) cannot beat expert "
                f"{rivals[0]} (choice {choice[t, rivals[0]]:.9g}), bounds {delta[t, j]:.2e} / {delta[t, rivals[0]]:.2e}"
            )
            remaining.discard(j)
    picked = score.value.gather(1, idx.long())
    picked_err = (as_bounded(logits).err / 4).gather(1, idx.long())  # the scores' error from the logits' errors
    if normalize:
        total = picked.sum(-1, keepdim=True) + 1e-20
        want = picked / total * scale
        rel = gamma(2 * (FUNC + 2) + k + 3)
        # d(w_i) = scale (d s_i / total - s_i sum_j d s_j / total^2)
        carried = scale * (picked_err / total + picked * picked_err.sum(-1, keepdim=True) / total**2)
    else:
        want = picked * scale
        rel = gamma(FUNC + 4)
        carried = scale * picked_err
    assert_within(weights, want, rel * want.abs() + carried, f"{what} weights")
