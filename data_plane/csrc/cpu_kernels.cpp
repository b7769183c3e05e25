// Fused fp32 CPU kernels of the eager decode path: its GEMMs and the small element-wise and routing steps between.
//
// On CPU every torch op costs several microseconds whatever its size, and a decode layer of the tiny model runs
// about 150 of them around its 7 GEMMs. Each kernel here does one of those runs of small ops in one pass over
// rows held in cache. The decode GEMMs run here on panel-packed weights (see "decode GEMMs" below: a few rows
// against a cold weight, which torch's GEMMs read slowly); the routed experts' GEMMs run per expert on unpadded
// rows. The torch formulation of each step in data_plane/decode_layers.py and data_plane/moe_exchange.py is the reference:
// tests/test_cpu_kernels.py compares every kernel with it on random inputs.
//
// Arrays come in as numpy views of torch tensors (nanobind checks dtype, rank and device); rows may be strided,
// the last dimension must be contiguous.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace nb = nanobind;

namespace {

template <int N>
using F32 = nb::ndarray<float, nb::ndim<N>, nb::device::cpu>;
template <int N>
using I64 = nb::ndarray<int64_t, nb::ndim<N>, nb::device::cpu>;
template <int N>
using I32 = nb::ndarray<int32_t, nb::ndim<N>, nb::device::cpu>;

// Rows may be strided; within a row the values must be contiguous (an empty array passes: numpy gives it
// arbitrary strides). A 1-D vector must be contiguous.
template <typename A>
void require_rows(const A& a, const char* name) {
  if (a.size() > 0 && a.stride(a.ndim() - 1) != 1 && a.shape(a.ndim() - 1) > 1)
    throw std::invalid_argument(std::string(name) + ": the last dimension must be contiguous");
}

// A check whose message is only built when it fails (checks run inside loops over rows and pairs).
#define REQUIRE(ok, message)                                  \
  do {                                                        \
    if (!(ok)) throw std::invalid_argument(message);          \
  } while (0)

std::string shape_of(size_t a, size_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

// One vector register of fp32 lanes: 16 with AVX-512, 8 with AVX, else 4 (SSE, NEON: a build without
// -march=native). The reductions below use them explicitly, because without -ffast-math the compiler keeps a float
// sum in order and does not vectorize it. The register tiles further down are sized by kLanes: 32 vector registers
// with AVX-512, 16 otherwise.
#if defined(__AVX512F__)
#define NANOCP_LANES 16
#elif defined(__AVX__)
#define NANOCP_LANES 8
#else
#define NANOCP_LANES 4
#endif
constexpr int64_t kLanes = NANOCP_LANES;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Calls f(std::integral_constant<int, B>{}, first) for the blocks [first, first + B) that cover [0, n), B = Max
// except for a shorter last block: the block size is a compile-time constant, so a register tile can be sized by it.
template <int B, typename F>
inline void call_block(int64_t size, int64_t first, F& f) {
  if constexpr (B > 0) {
    if (size == B) return f(std::integral_constant<int, B>{}, first);
    call_block<B - 1>(size, first, f);
  }
}

template <int Max, typename F>
inline void in_blocks(int64_t n, F&& f) {
  for (int64_t first = 0; first < n; first += Max) call_block<Max>(std::min<int64_t>(Max, n - first), first, f);
}

// The lanes added up as a tree (halves, quarters, ...): a chain of log2(kLanes) dependent adds instead of kLanes.
inline float lane_sum(Lanes v) {
  float s[kLanes];
  std::memcpy(s, &v, sizeof v);
  for (int64_t width = kLanes / 2; width > 0; width /= 2)
    for (int64_t i = 0; i < width; ++i) s[i] += s[i + width];
  return s[0];
}

// sum of a[i] * b[i] over n values.
inline float dot(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load_lanes(a + i) * load_lanes(b + i);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// sum of x[i]^2 over n values.
inline float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

// sum of x[i] over n values.
inline float total(const float* x, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load_lanes(x + i);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

// the largest of n >= 1 values.
inline float largest(const float* x, int64_t n) {
  float top = x[0];
  int64_t i = 0;
  if (n >= kLanes) {
    Lanes acc = load_lanes(x);
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      const Lanes v = load_lanes(x + i);
      acc = v > acc ? v : acc;
    }
    for (int64_t j = 0; j < kLanes; ++j) top = std::max(top, acc[j]);
  }
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x in fp32 (relative error below 6 * 2^-24 over [-87, 88]: 4.3 * 2^-24 without FMA, 3.9 with it, checked by
// tests/test_cpu_kernels.py; inputs are clamped to that range, so e^x < e^-87 comes back as e^-87) as plain arithmetic,
// for one value (V = float) or a vector of them (V = Lanes): e^x = 2^n * e^r with n = round(x / ln 2),
// |r| <= ln 2 / 2, e^r a degree-6 polynomial. Callers loop over whole vectors: GCC does not vectorize a scalar loop
// around it (it turns the clamp into branches and then finds control flow in the loop: 4 ns per value instead of
// well under 1 on AVX2).
template <typename V>
inline V fast_exp(V x) {
  if constexpr (std::is_same_v<V, float>) {
    x = std::min(std::max(x, -87.0f), 88.0f);
  } else {
    x = x < -87.0f ? V{} - 87.0f : x;
    x = x > 88.0f ? V{} + 88.0f : x;
  }
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: + 1.5 * 2^23, back
  const V r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: r is exact to fp32
  V p = V{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  if constexpr (std::is_same_v<V, float>) {
    int32_t bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits += static_cast<int32_t>(n) << 23;
    std::memcpy(&p, &bits, sizeof p);
  } else {
    IntLanes bits;
    std::memcpy(&bits, &p, sizeof bits);
    bits += __builtin_convertvector(n, IntLanes) << 23;
    std::memcpy(&p, &bits, sizeof p);
  }
  return p;
}

// y[i] = e^(x[i] - shift) over n values (whole vectors, then the tail one by one).
inline void exp_shifted(const float* x, float shift, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes e = fast_exp(load_lanes(x + i) - shift);
    std::memcpy(y + i, &e, sizeof e);
  }
  for (; i < n; ++i) y[i] = fast_exp(x[i] - shift);
}

// y = x * rsqrt(mean(x^2) + eps) * w over one row of n values.
inline void rms_norm_row(const float* x, const float* w, float eps, float* y, int64_t n) {
  const float ss = sum_squares(x, n);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// The rope pairs (x1_i, x2_i) of one row, side by side in pair order -> rotated and de-interleaved: [x1' | x2'].
// cs holds (cos_i, sin_i) pairs of the row's position. Safe in place.
inline void rotate_row(const float* x, const float* cs, float* y, int64_t half) {
  float tmp[256];
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    tmp[i] = a * c - b * s;
    tmp[half + i] = a * s + b * c;
  }
  std::copy(tmp, tmp + 2 * half, y);
}

// ---- attention side ------------------------------------------------------------------------------------------

// x [T, D] -> out [T, D] (RMSNorm with weight w [D]).
void rms_norm(F32<2> x, F32<1> w, float eps, F32<2> out) {
  require_rows(x, "x");
  require_rows(w, "weight");
  require_rows(out, "out");
  const int64_t t = x.shape(0), d = x.shape(1);
  REQUIRE(w.shape(0) == static_cast<size_t>(d) && out.shape(0) == x.shape(0) && out.shape(1) == x.shape(1),
          "rms_norm: x " + shape_of(x.shape(0), x.shape(1)) + ", weight [" + std::to_string(w.shape(0)) +
              "] and out " + shape_of(out.shape(0), out.shape(1)) + " disagree");
  for (int64_t r = 0; r < t; ++r)
    rms_norm_row(x.data() + r * x.stride(0), w.data(), eps, out.data() + r * out.stride(0), d);
}

// The step between MLA's two down-projection GEMMs. qkv [T, q_lora + lora + rope] (q_lora may be 0) ->
//   q_out [T, q_lora] = RMSNorm(qkv[:, :q_lora], q_norm)                         (when q_lora > 0)
//   kv_out [T, lora + rope] = [RMSNorm(qkv[:, q_lora:q_lora + lora], kv_norm) | rotated qkv[:, q_lora + lora:]]
// rope_cs [T, rope / 2, 2]: (cos, sin) of each row's position.
void mla_qkv_post(F32<2> qkv, F32<1> q_norm, F32<1> kv_norm, float eps, F32<3> rope_cs, F32<2> q_out,
                  F32<2> kv_out) {
  require_rows(qkv, "qkv");
  require_rows(q_norm, "q_norm");
  require_rows(kv_norm, "kv_norm");
  require_rows(q_out, "q_out");
  require_rows(kv_out, "kv_out");
  const int64_t t = qkv.shape(0), q_lora = q_out.shape(1), lora = kv_norm.shape(0);
  const int64_t half = rope_cs.shape(1), rope = 2 * half;
  REQUIRE(static_cast<int64_t>(qkv.shape(1)) == q_lora + lora + rope,
          "mla_qkv_post: qkv has " + std::to_string(qkv.shape(1)) + " columns, expected q_lora + kv_lora + rope = " +
              std::to_string(q_lora + lora + rope));
  REQUIRE(static_cast<int64_t>(rope_cs.shape(0)) == t && rope_cs.shape(2) == 2 && half <= 128,
          "mla_qkv_post: rope_cs must be [T, rope / 2, 2] with rope <= 256");
  REQUIRE(static_cast<int64_t>(kv_out.shape(0)) == t && static_cast<int64_t>(kv_out.shape(1)) == lora + rope,
          "mla_qkv_post: kv_out must be " + shape_of(t, lora + rope));
  REQUIRE(static_cast<int64_t>(q_out.shape(0)) == t && static_cast<int64_t>(q_norm.shape(0)) == q_lora,
          "mla_qkv_post: q_out must be [T, q_lora] and q_norm [q_lora]");
  REQUIRE(t == 0 || (rope_cs.stride(2) == 1 && rope_cs.stride(1) == 2),
          "mla_qkv_post: rope_cs rows must be contiguous");
  for (int64_t r = 0; r < t; ++r) {
    const float* row = qkv.data() + r * qkv.stride(0);
    if (q_lora) rms_norm_row(row, q_norm.data(), eps, q_out.data() + r * q_out.stride(0), q_lora);
    float* kv = kv_out.data() + r * kv_out.stride(0);
    rms_norm_row(row + q_lora, kv_norm.data(), eps, kv, lora);
    rotate_row(row + q_lora + lora, rope_cs.data() + r * rope_cs.stride(0), kv + lora, half);
  }
}

// q [T, H, width]: the rope dims q[:, :, offset:offset + rope] (pair order) rotated in place, de-interleaved.
void rope_heads_(F32<3> q, int64_t offset, F32<3> rope_cs) {
  require_rows(q, "q");
  const int64_t t = q.shape(0), heads = q.shape(1), half = rope_cs.shape(1);
  REQUIRE(static_cast<int64_t>(rope_cs.shape(0)) == t && rope_cs.shape(2) == 2 && half <= 128 &&
              (t == 0 || (rope_cs.stride(2) == 1 && rope_cs.stride(1) == 2)),
          "rope_heads_: rope_cs must be contiguous [T, rope / 2, 2] with rope <= 256");
  REQUIRE(offset >= 0 && offset + 2 * half <= static_cast<int64_t>(q.shape(2)),
          "rope_heads_: the rope dims do not fit the rows of q");
  for (int64_t r = 0; r < t; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = q.data() + r * q.stride(0) + h * q.stride(1) + offset;
      rotate_row(x, rope_cs.data() + r * rope_cs.stride(0), x, half);
    }
}

// ---- FFN / MoE side ------------------------------------------------------------------------------------------

// One row: gate_up [2I] (gate | up) -> y [I] = silu(gate) * up.
inline void silu_mul_row(const float* gate_up, float* y, int64_t inter) {
  const float* up = gate_up + inter;
  int64_t i = 0;
  for (; i + kLanes <= inter; i += kLanes) {
    const Lanes g = load_lanes(gate_up + i);
    const Lanes out = g / (1.0f + fast_exp(-g)) * load_lanes(up + i);
    std::memcpy(y + i, &out, sizeof out);
  }
  for (; i < inter; ++i) y[i] = gate_up[i] / (1.0f + fast_exp(-gate_up[i])) * up[i];
}

// gate_up [..., 2I] (gate | up) -> out [..., I] = silu(gate) * up, over rows of the flattened leading dims.
void silu_mul(F32<2> gate_up, F32<2> out) {
  require_rows(gate_up, "gate_up");
  require_rows(out, "out");
  const int64_t t = gate_up.shape(0), inter = out.shape(1);
  REQUIRE(static_cast<int64_t>(gate_up.shape(1)) == 2 * inter && out.shape(0) == gate_up.shape(0),
          "silu_mul: gate_up " + shape_of(gate_up.shape(0), gate_up.shape(1)) + " and out " +
              shape_of(out.shape(0), out.shape(1)) + " disagree");
  for (int64_t r = 0; r < t; ++r) silu_mul_row(gate_up.data() + r * gate_up.stride(0), out.data() + r * out.stride(0), inter);
}

// DeepSeek-V3's gate after its GEMM, on rows: logits [T, E] (rows logits_stride apart) -> topk_idx [T, k]
// (descending choice score), topk_w [T, k]. scores = sigmoid(logits); choice = scores + bias; with n_group > 1 only
// the topk_group groups with the largest sums of their two best choices compete; the weights are the chosen
// scores, normalised to sum 1 when `normalize`, times `scale`. Ties go to the lower expert id.
void gate_topk_rows(const float* logits, int64_t logits_stride, int64_t t, int64_t e, const float* bias,
                    int64_t n_group, int64_t topk_group, bool normalize, float scale, I64<2>& topk_idx,
                    F32<2>& topk_w) {
  const int64_t k = topk_idx.shape(1), per_group = e / n_group;
  std::vector<float> scores(e), choice(e), group_score(n_group);
  std::vector<char> allowed(e);
  for (int64_t r = 0; r < t; ++r) {
    const float* z = logits + r * logits_stride;
    for (int64_t j = 0; j < e; ++j) {
      scores[j] = 1.0f / (1.0f + fast_exp(-z[j]));
      choice[j] = scores[j] + bias[j];
    }
    std::fill(allowed.begin(), allowed.end(), 1);
    if (n_group > 1) {
      for (int64_t g = 0; g < n_group; ++g) {
        float a = -INFINITY, b = -INFINITY;  // the group's two best choices
        for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j) {
          if (choice[j] > a) {
            b = a;
            a = choice[j];
          } else if (choice[j] > b) {
            b = choice[j];
          }
        }
        group_score[g] = a + b;
      }
      std::vector<char> keep(n_group, 0);
      for (int64_t pick = 0; pick < topk_group; ++pick) {
        int64_t best = -1;
        for (int64_t g = 0; g < n_group; ++g)
          if (!keep[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
        keep[best] = 1;
      }
      for (int64_t j = 0; j < e; ++j) allowed[j] = keep[j / per_group];
    }
    int64_t* idx = topk_idx.data() + r * topk_idx.stride(0);
    float* w = topk_w.data() + r * topk_w.stride(0);
    float sum = 0.0f;
    for (int64_t pick = 0; pick < k; ++pick) {
      int64_t best = -1;
      for (int64_t j = 0; j < e; ++j)
        if (allowed[j] && (best < 0 || choice[j] > choice[best])) best = j;
      allowed[best] = 0;
      idx[pick * topk_idx.stride(1)] = best;
      w[pick * topk_w.stride(1)] = scores[best];
      sum += scores[best];
    }
    for (int64_t pick = 0; pick < k; ++pick) {
      float& v = w[pick * topk_w.stride(1)];
      v = (normalize ? v / (sum + 1e-20f) : v) * scale;
    }
  }
}

void require_gate(int64_t t, int64_t e, const F32<1>& bias, int64_t n_group, int64_t topk_group,
                  const I64<2>& topk_idx, const F32<2>& topk_w, const char* what) {
  require_rows(bias, "bias");
  const int64_t k = topk_idx.shape(1);
  REQUIRE(static_cast<int64_t>(bias.shape(0)) == e, std::string(what) + ": bias must have one value per expert");
  REQUIRE(n_group >= 1 && e % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
          std::string(what) + ": bad grouping (n_group " + std::to_string(n_group) + ", topk_group " +
              std::to_string(topk_group) + ", " + std::to_string(e) + " experts)");
  const int64_t per_group = e / n_group;
  REQUIRE(k >= 1 && k <= topk_group * per_group && (n_group == 1 || per_group >= 2),
          std::string(what) + ": top-k " + std::to_string(k) + " does not fit the allowed groups");
  REQUIRE(static_cast<int64_t>(topk_idx.shape(0)) == t && topk_w.shape(0) == topk_idx.shape(0) &&
              topk_w.shape(1) == topk_idx.shape(1),
          std::string(what) + ": topk_idx and topk_w must both be [T, k]");
}

// gate_topk_rows over logits [T, E].
void moe_gate_topk(F32<2> logits, F32<1> bias, int64_t n_group, int64_t topk_group, bool normalize, float scale,
                   I64<2> topk_idx, F32<2> topk_w) {
  require_rows(logits, "logits");
  const int64_t t = logits.shape(0), e = logits.shape(1);
  require_gate(t, e, bias, n_group, topk_group, topk_idx, topk_w, "moe_gate_topk");
  gate_topk_rows(logits.data(), t ? logits.stride(0) : 0, t, e, bias.data(), n_group, topk_group, normalize, scale,
                 topk_idx, topk_w);
}

// out[t] = base[t] + sum_j weights[t, j] * y[rows[t, j]] in fp32; a row < 0 contributes nothing.
// base may be out (in place).
void weighted_combine(F32<2> y, I64<2> rows, F32<2> weights, F32<2> base, F32<2> out) {
  require_rows(y, "y");
  require_rows(base, "base");
  require_rows(out, "out");
  const int64_t t = rows.shape(0), k = rows.shape(1), d = y.shape(1), n = y.shape(0);
  REQUIRE(weights.shape(0) == rows.shape(0) && weights.shape(1) == rows.shape(1),
          "weighted_combine: weights must be shaped like rows " + shape_of(t, k));
  REQUIRE(static_cast<int64_t>(base.shape(0)) == t && static_cast<int64_t>(base.shape(1)) == d &&
              out.shape(0) == base.shape(0) && out.shape(1) == base.shape(1),
          "weighted_combine: base and out must be " + shape_of(t, d));
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t src = rows.data()[r * rows.stride(0) + j * rows.stride(1)];
      REQUIRE(src < n, "weighted_combine: row " + std::to_string(src) + " outside y's " + std::to_string(n));
    }
  std::vector<float> acc(d);
  for (int64_t r = 0; r < t; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t src = rows.data()[r * rows.stride(0) + j * rows.stride(1)];
      if (src < 0) continue;
      const float wj = weights.data()[r * weights.stride(0) + j * weights.stride(1)];
      const float* yr = y.data() + src * y.stride(0);
      for (int64_t i = 0; i < d; ++i) acc[i] += wj * yr[i];
    }
    const float* b = base.data() + r * base.stride(0);
    float* o = out.data() + r * out.stride(0);
    for (int64_t i = 0; i < d; ++i) o[i] = b[i] + acc[i];
  }
}

// ---- MoE exchange bookkeeping ----------------------------------------------------------------------------------

// The packed dispatch layout (data_plane/moe_exchange.py): topk_idx [T, k] (-1 = no expert; rows idx_stride apart,
// contiguous within) -> the payload this rank sends, every peer's block back to back: per destination rank a header
// row then its (token, expert) pairs sorted by (expert, token). Writes source [n + ranks] (token of each payload
// row; 0 for headers), tags [n + ranks] (local expert of each pair; the pair count in each header), per_dst [ranks]
// and result_rows [T, k] (rows rr_stride apart: row of each pair's result in the sender's combine buffer, dst * cap
// + index within dst's block; -1 = none). Returns n, the number of pairs.
int64_t dispatch_layout(const int64_t* topk_idx, int64_t idx_stride, int64_t t, int64_t k, int64_t num_experts,
                        int64_t ranks, int64_t cap, int64_t* source, int64_t* tags, int64_t* per_dst,
                        int64_t* result_rows, int64_t rr_stride) {
  REQUIRE(ranks >= 1 && num_experts % ranks == 0, "moe_dispatch_layout: experts must split evenly over the ranks");
  const int64_t lx = num_experts / ranks;
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk_idx[r * idx_stride + j];
      REQUIRE(e >= -1 && e < num_experts, "moe_dispatch_layout: expert id " + std::to_string(e) + " outside [-1, " +
                                              std::to_string(num_experts) + ")");
      if (e >= 0) ++count[e];
    }
  // payload row of the first pair of each expert: after the headers of its rank and of every rank before it
  std::vector<int64_t> next(num_experts);
  int64_t row = 0, n = 0;
  for (int64_t d = 0; d < ranks; ++d) {
    int64_t pairs = 0;
    for (int64_t e = d * lx; e < (d + 1) * lx; ++e) pairs += count[e];
    REQUIRE(pairs <= cap, "moe_dispatch_layout: " + std::to_string(pairs) + " pairs for rank " + std::to_string(d) +
                              " exceed its capacity " + std::to_string(cap));
    per_dst[d] = pairs;
    source[row] = 0;
    tags[row] = pairs;
    ++row;
    for (int64_t e = d * lx; e < (d + 1) * lx; ++e) {
      next[e] = row;
      row += count[e];
    }
    n += pairs;
  }
  std::vector<int64_t> block_start(ranks);  // payload row of each rank's header
  for (int64_t d = 0, at = 0; d < ranks; ++d) {
    block_start[d] = at;
    at += per_dst[d] + 1;
  }
  for (int64_t r = 0; r < t; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk_idx[r * idx_stride + j];
      int64_t* out = result_rows + r * rr_stride + j;
      if (e < 0) {
        *out = -1;
        continue;
      }
      const int64_t d = e / lx, at = next[e]++;
      source[at] = r;
      tags[at] = e - d * lx;
      *out = d * cap + (at - block_start[d] - 1);
    }
  return n;
}

// dispatch_layout on arrays: source / tags [>= T * k + ranks], per_dst [ranks], result_rows [T, k].
int64_t moe_dispatch_layout(I64<2> topk_idx, int64_t num_experts, int64_t ranks, int64_t cap, I64<1> source,
                            I64<1> tags, I64<1> per_dst, I64<2> result_rows) {
  const int64_t t = topk_idx.shape(0), k = topk_idx.shape(1);
  REQUIRE(ranks >= 1, "moe_dispatch_layout: experts must split evenly over the ranks");
  REQUIRE(static_cast<int64_t>(source.shape(0)) >= t * k + ranks && tags.shape(0) == source.shape(0) &&
              static_cast<int64_t>(per_dst.shape(0)) == ranks && result_rows.shape(0) == topk_idx.shape(0) &&
              result_rows.shape(1) == topk_idx.shape(1) && source.stride(0) == 1 && tags.stride(0) == 1 &&
              per_dst.stride(0) == 1,
          "moe_dispatch_layout: output buffers have the wrong shapes");
  REQUIRE(t == 0 || k == 1 || (topk_idx.stride(1) == 1 && result_rows.stride(1) == 1),
          "moe_dispatch_layout: rows must be contiguous");
  return dispatch_layout(topk_idx.data(), t ? topk_idx.stride(0) : 0, t, k, num_experts, ranks, cap, source.data(),
                         tags.data(), per_dst.data(), result_rows.data(), t ? result_rows.stride(0) : 0);
}

// One payload row: [x row | tag], the tag an int32 in the float slot after the hidden values.
inline void pack_row(const float* x, int64_t hidden, int64_t tag, float* row) {
  std::memcpy(row, x, hidden * sizeof(float));
  const int32_t value = static_cast<int32_t>(tag);
  std::memcpy(row + hidden, &value, sizeof value);
}

// The rows of a dispatch payload (data_plane/moe_exchange.py): out[i] = [x[source[i]] | tags[i]], the hidden values
// of the row's token, then its tag as an int32 in the float slot after them. x [T, hidden], source / tags [n],
// out [n, hidden + 1] (fp32 rows: a 4-byte tag).
void pack_dispatch_rows(F32<2> x, I64<1> source, I64<1> tags, F32<2> out) {
  require_rows(x, "x");
  require_rows(out, "out");
  const int64_t n = source.shape(0), hidden = x.shape(1), t = x.shape(0);
  REQUIRE(static_cast<int64_t>(tags.shape(0)) == n && static_cast<int64_t>(out.shape(0)) == n &&
              static_cast<int64_t>(out.shape(1)) == hidden + 1,
          "pack_dispatch_rows: source [n], tags [n] and out [n, hidden + 1] disagree");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = source.data()[i * source.stride(0)];
    REQUIRE(src >= 0 && src < t, "pack_dispatch_rows: source row " + std::to_string(src) + " outside x's " +
                                     std::to_string(t) + " rows");
    pack_row(x.data() + src * x.stride(0), hidden, tags.data()[i * tags.stride(0)], out.data() + i * out.stride(0));
  }
}

// The whole packed dispatch in one pass: the layout of topk_idx [T, k] (dispatch_layout), each destination rank
// d's block (header row, then its pairs' [x row | local expert] rows) written into blocks[d] [cap + 1, hidden + 1]
// (where d's receive buffer takes this rank's block), result_rows [T, k] as dispatch_layout's.
void pack_dispatch(F32<2> x, I64<2> topk_idx, int64_t num_experts, int64_t cap, std::vector<F32<2>> blocks,
                   I64<2> result_rows) {
  require_rows(x, "x");
  const int64_t t = topk_idx.shape(0), k = topk_idx.shape(1), ranks = blocks.size(), hidden = x.shape(1);
  REQUIRE(static_cast<int64_t>(x.shape(0)) == t && result_rows.shape(0) == topk_idx.shape(0) &&
              result_rows.shape(1) == topk_idx.shape(1),
          "pack_dispatch: x [T, hidden], topk_idx [T, k] and result_rows [T, k] disagree");
  REQUIRE(t == 0 || k == 1 || (topk_idx.stride(1) == 1 && result_rows.stride(1) == 1),
          "pack_dispatch: rows must be contiguous");
  for (int64_t d = 0; d < ranks; ++d) {
    require_rows(blocks[d], "blocks");
    REQUIRE(static_cast<int64_t>(blocks[d].shape(0)) == cap + 1 &&
                static_cast<int64_t>(blocks[d].shape(1)) == hidden + 1,
            "pack_dispatch: blocks[" + std::to_string(d) + "] must be " + shape_of(cap + 1, hidden + 1));
  }
  std::vector<int64_t> source(t * k + ranks), tags(t * k + ranks), per_dst(ranks);
  dispatch_layout(topk_idx.data(), t ? topk_idx.stride(0) : 0, t, k, num_experts, ranks, cap, source.data(),
                  tags.data(), per_dst.data(), result_rows.data(), t ? result_rows.stride(0) : 0);
  for (int64_t d = 0, at = 0; d < ranks; ++d) {
    float* out = blocks[d].data();
    const int64_t stride = blocks[d].stride(0);
    const int32_t header = static_cast<int32_t>(per_dst[d]);  // the header's values are never read
    std::memcpy(out + hidden, &header, sizeof header);
    for (int64_t i = 1; i <= per_dst[d]; ++i)
      pack_row(x.data() + source[at + i] * x.stride(0), hidden, tags[at + i], out + i * stride);
    at += per_dst[d] + 1;
  }
}

// ---- decode GEMMs on panel-packed weights -----------------------------------------------------------------------

// A decode GEMM has few rows (the batch) and a weight that is cold: the other layers' weights went through the
// cache since it was last read. Its time is the weight's trip from memory, so the weight is read once, in order:
// packed at start-up into panels of kPanel columns, panels [ceil(n / kPanel), k, kPanel] (columns past n are zero),
// each panel one contiguous block. Read in place, a [k, n] weight's column block is k cache lines n floats apart,
// which the hardware prefetcher does not follow and which alias in the cache when n is a multiple of 1024
// (measured on an AVX2 machine, cold weights, 32 rows: [256, 1024] 2x and [256, 256] 1.5x faster packed).

// 6 rows x 4 vectors = 24 accumulators + 4 B vectors: 28 of AVX-512's 32 registers; with AVX2, 6 x 2 = 12 + 2 of
// its 16 (a 6 x 4 tile of AVX2 registers spills the accumulators to the stack on every FMA: ~7x slower).
constexpr int kTileRows = 6;
constexpr int kTileVectors = kLanes == 16 ? 4 : 2;
constexpr int64_t kPanel = kTileVectors * kLanes;  // columns per panel: one register tile wide

// Rows [MR, cols] of C = A rows [MR, k] @ one panel [k, kPanel] (+ the same rows of `base` when given): the MR x
// kTileVectors accumulators stay in registers over the whole k loop, each panel vector is used MR times. Rows are
// given by pointer, so a token's input row is read where it was received and its output written where the caller
// wants it (no gather, no scatter). cols <= kPanel: the panel's columns that exist.
template <int MR>
inline void panel_tile(int64_t k, const float* const* a, const float* panel, int64_t cols, const float* const* base,
                       float* const* c) {
  Lanes acc[MR][kTileVectors];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kTileVectors; ++j) acc[i][j] = Lanes{};
  for (int64_t p = 0; p < k; ++p) {
    Lanes bv[kTileVectors];
    // the panel is contiguous, but a prefetch 16 rows ahead still helps where a row is a single cache line
    __builtin_prefetch(panel + (p + 16) * kPanel);
    for (int j = 0; j < kTileVectors; ++j) bv[j] = load_lanes(panel + p * kPanel + kLanes * j);
    for (int i = 0; i < MR; ++i) {
      // scalar x vector: an FMA with the A value broadcast from memory (`Lanes{} + x` would add 0.0f first, which
      // the compiler must keep for -0.0, and broadcast from a register on the port the FMAs need)
      const float av = a[i][p];
      for (int j = 0; j < kTileVectors; ++j) acc[i][j] += av * bv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    float row[kPanel];
    std::memcpy(row, acc[i], sizeof row);
    if (base != nullptr) {
      for (int64_t j = 0; j < cols; ++j) c[i][j] = base[i][j] + row[j];
    } else {
      std::memcpy(c[i], row, cols * sizeof(float));
    }
  }
}

// C rows [m, n] = A rows [m, k] @ B (+ base rows), B [k, n] packed as panels [ceil(n / kPanel), k, kPanel]. Panels
// outside, row tiles inside: a panel (k x kPanel floats) comes from memory once and from cache for every row tile.
void gemm_panels(int64_t m, int64_t n, int64_t k, const float* const* a, const float* panels,
                 const float* const* base, float* const* c) {
  for (int64_t first = 0; first < n; first += kPanel) {
    const float* panel = panels + first * k;  // panel first / kPanel starts k * kPanel floats per panel in
    const int64_t cols = std::min<int64_t>(kPanel, n - first);
    in_blocks<kTileRows>(m, [&](auto rows, int64_t row) {
      constexpr int MR = decltype(rows)::value;
      float* c_tile[MR];
      const float* base_tile[MR];
      for (int t = 0; t < MR; ++t) {
        c_tile[t] = c[row + t] + first;
        if (base != nullptr) base_tile[t] = base[row + t] + first;
      }
      panel_tile<MR>(k, a + row, panel, cols, base != nullptr ? base_tile : nullptr, c_tile);
    });
  }
}

int64_t num_panels(int64_t n) { return (n + kPanel - 1) / kPanel; }

// Checks panels [P, k, kPanel] of a [k, n] weight (contiguous: each panel one block).
template <typename A>
void require_panels(const A& panels, int64_t k, int64_t n, const char* what) {
  REQUIRE(static_cast<int64_t>(panels.shape(panels.ndim() - 3)) == num_panels(n) &&
              static_cast<int64_t>(panels.shape(panels.ndim() - 2)) == k &&
              static_cast<int64_t>(panels.shape(panels.ndim() - 1)) == kPanel,
          std::string(what) + ": panels must be [" + std::to_string(num_panels(n)) + ", " + std::to_string(k) + ", " +
              std::to_string(kPanel) + "] for a [" + std::to_string(k) + ", " + std::to_string(n) + "] weight");
  const size_t d = panels.ndim();  // a dimension of size 1 may carry any stride
  REQUIRE(panels.size() == 0 || (panels.stride(d - 1) == 1 && (panels.shape(d - 2) == 1 || panels.stride(d - 2) == kPanel) &&
                                 (panels.shape(d - 3) == 1 || panels.stride(d - 3) == k * kPanel)),
          std::string(what) + ": panels must be contiguous");
}

// The rows of an optional residual `base` shaped like out (empty without one).
// The rows of a 2-D array (rows may be strided), as the GEMM takes them.
std::vector<float*> row_pointers(const F32<2>& a) {
  std::vector<float*> rows(a.shape(0));
  for (size_t r = 0; r < rows.size(); ++r) rows[r] = a.data() + r * a.stride(0);
  return rows;
}

// The rows [t, width] of a contiguous scratch block.
std::vector<float*> block_rows(float* block, int64_t t, int64_t width) {
  std::vector<float*> rows(t);
  for (int64_t r = 0; r < t; ++r) rows[r] = block + r * width;
  return rows;
}

std::vector<float*> base_rows(const std::optional<F32<2>>& base, const F32<2>& out, const char* what) {
  if (!base) return {};
  require_rows(*base, "base");
  REQUIRE(base->shape(0) == out.shape(0) && base->shape(1) == out.shape(1),
          std::string(what) + ": base must be " + shape_of(out.shape(0), out.shape(1)));
  return row_pointers(*base);
}

// out [T, n] = x [T, k] @ W (+ base [T, n]), W [k, n] given as its panels [ceil(n / kPanel), k, kPanel].
// base may be out (in place).
void linear_panels(F32<2> x, F32<3> panels, int64_t n, std::optional<F32<2>> base, F32<2> out) {
  require_rows(x, "x");
  require_rows(out, "out");
  const int64_t t = x.shape(0), k = x.shape(1);
  require_panels(panels, k, n, "linear_panels");
  REQUIRE(static_cast<int64_t>(out.shape(0)) == t && static_cast<int64_t>(out.shape(1)) == n,
          "linear_panels: out must be " + shape_of(t, n));
  const std::vector<float*> a = row_pointers(x), c = row_pointers(out), b = base_rows(base, out, "linear_panels");
  gemm_panels(t, n, k, a.data(), panels.data(), base ? b.data() : nullptr, c.data());
}

// SwiGLU MLP of decode rows: out rows [T, D] = (silu(x @ W_gate) * (x @ W_up)) @ W_down (+ base rows), gate_up
// [D, 2I] (gate | up) and down [I, D] as panels (contiguous). A base row may be its out row (in place).
void gated_mlp_rows(int64_t t, int64_t dim, int64_t inter, const float* const* x, const float* gate_up_panels,
                    const float* down_panels, const float* const* base, float* const* out) {
  std::vector<float> hidden(t * 3 * inter);  // [T, 2I] gate | up, then [T, I] the activation
  const std::vector<float*> gate_up = block_rows(hidden.data(), t, 2 * inter);
  const std::vector<float*> act = block_rows(hidden.data() + t * 2 * inter, t, inter);
  gemm_panels(t, 2 * inter, dim, x, gate_up_panels, nullptr, gate_up.data());
  for (int64_t r = 0; r < t; ++r) silu_mul_row(gate_up[r], act[r], inter);
  gemm_panels(t, dim, inter, act.data(), down_panels, base, out);
}

void require_mlp(int64_t dim, int64_t inter, const F32<3>& gate_up_panels, const F32<3>& down_panels,
                 const char* what) {
  REQUIRE(inter > 0, std::string(what) + ": the intermediate size must be positive");
  require_panels(gate_up_panels, dim, 2 * inter, (std::string(what) + ": gate_up").c_str());
  require_panels(down_panels, inter, dim, (std::string(what) + ": down").c_str());
}

// gated_mlp_rows over x [T, D] -> out [T, D] (+ base [T, D]). base may be out (in place).
void gated_mlp(F32<2> x, F32<3> gate_up_panels, F32<3> down_panels, int64_t inter, std::optional<F32<2>> base,
               F32<2> out) {
  require_rows(x, "x");
  require_rows(out, "out");
  const int64_t t = x.shape(0), dim = x.shape(1);
  require_mlp(dim, inter, gate_up_panels, down_panels, "gated_mlp");
  REQUIRE(out.shape(0) == x.shape(0) && out.shape(1) == x.shape(1), "gated_mlp: out must be " + shape_of(t, dim));
  const std::vector<float*> a = row_pointers(x), c = row_pointers(out), b = base_rows(base, out, "gated_mlp");
  gated_mlp_rows(t, dim, inter, a.data(), gate_up_panels.data(), down_panels.data(), base ? b.data() : nullptr,
                 c.data());
}

// The step after a layer's attention shared by its dense and MoE forms: h_rows = h + o [T, H * kv_lora] @ W_o (W_o
// as panels; an h_rows row may be its h row), x_rows = RMSNorm(h_rows, post_norm).
void attention_output_norm(const F32<2>& o, const F32<3>& w_o_panels, const F32<2>& h, const F32<1>& post_norm,
                           float eps, float* const* h_rows, float* const* x_rows, const char* what) {
  require_rows(o, "o");
  require_rows(h, "h");
  require_rows(post_norm, "post_norm");
  const int64_t t = o.shape(0), dim = h.shape(1);
  REQUIRE(static_cast<int64_t>(h.shape(0)) == t && static_cast<int64_t>(post_norm.shape(0)) == dim,
          std::string(what) + ": o [T, H * kv_lora], h, h_out, x_out [T, D] and post_norm [D] disagree");
  require_panels(w_o_panels, o.shape(1), dim, (std::string(what) + ": w_o").c_str());
  const std::vector<float*> a = row_pointers(o), base = row_pointers(h);
  gemm_panels(t, dim, o.shape(1), a.data(), w_o_panels.data(), base.data(), h_rows);
  for (int64_t r = 0; r < t; ++r) rms_norm_row(h_rows[r], post_norm.data(), eps, x_rows[r], dim);
}

// A dense layer from its merged attention output in one pass (decode_layers.dense_output):
//   h1 = h + o [T, H * kv_lora] @ W_o;  out [T, D] = h1 + SwiGLU MLP(RMSNorm(h1, post_norm)).
void dense_layer_output(F32<2> o, F32<3> w_o_panels, F32<2> h, F32<1> post_norm, float eps, F32<3> gate_up_panels,
                        F32<3> down_panels, int64_t inter, F32<2> out) {
  require_rows(out, "out");
  const int64_t t = o.shape(0), dim = h.shape(1);
  REQUIRE(out.shape(0) == h.shape(0) && out.shape(1) == h.shape(1),
          "dense_layer_output: o [T, H * kv_lora], h, h_out, x_out [T, D] and post_norm [D] disagree");
  require_mlp(dim, inter, gate_up_panels, down_panels, "dense_layer_output");
  std::vector<float> x(t * dim);
  const std::vector<float*> h1 = row_pointers(out), x_rows = block_rows(x.data(), t, dim);
  attention_output_norm(o, w_o_panels, h, post_norm, eps, h1.data(), x_rows.data(), "dense_layer_output");
  gated_mlp_rows(t, dim, inter, x_rows.data(), gate_up_panels.data(), down_panels.data(), h1.data(), h1.data());
}

// A MoE layer from its merged attention output to its gate in one pass (decode_layers.moe_input):
//   h_out [T, D] = h + o [T, H * kv_lora] @ W_o;  x_out [T, D] = RMSNorm(h_out, post_norm);
//   topk_idx, topk_w [T, k] = the gate (gate_topk_rows) of x_out @ W_gate [T, E].
// W_o [H * kv_lora, D] and W_gate [D, E] as panels. h_out may be h (in place).
void moe_gate_input(F32<2> o, F32<3> w_o_panels, F32<2> h, F32<1> post_norm, float eps, F32<3> gate_panels,
                    int64_t experts, F32<1> bias, int64_t n_group, int64_t topk_group, bool normalize, float scale,
                    F32<2> h_out, F32<2> x_out, I64<2> topk_idx, F32<2> topk_w) {
  require_rows(h_out, "h_out");
  require_rows(x_out, "x_out");
  const int64_t t = o.shape(0), dim = h.shape(1);
  REQUIRE(h_out.shape(0) == h.shape(0) && h_out.shape(1) == h.shape(1) && x_out.shape(0) == h.shape(0) &&
              x_out.shape(1) == h.shape(1),
          "moe_gate_input: o [T, H * kv_lora], h, h_out, x_out [T, D] and post_norm [D] disagree");
  require_panels(gate_panels, dim, experts, "moe_gate_input: gate");
  require_gate(t, experts, bias, n_group, topk_group, topk_idx, topk_w, "moe_gate_input");
  std::vector<float> logits(t * experts);
  const std::vector<float*> h_rows = row_pointers(h_out), x_rows = row_pointers(x_out);
  const std::vector<float*> logit_rows = block_rows(logits.data(), t, experts);
  attention_output_norm(o, w_o_panels, h, post_norm, eps, h_rows.data(), x_rows.data(), "moe_gate_input");
  gemm_panels(t, experts, dim, x_rows.data(), gate_panels.data(), nullptr, logit_rows.data());
  gate_topk_rows(logits.data(), experts, t, experts, bias.data(), n_group, topk_group, normalize, scale, topk_idx,
                 topk_w);
}

// MLA's projection of decode rows with the absorbed query (decode_layers.project's steps in one pass), h [T, D] ->
//   x = RMSNorm(h, input_norm); qkv = x @ W_qkv_a [T, q_lora + lora + rope];
//   kv_out [T, lora + rope] = [RMSNorm(qkv latent, kv_norm) | rotated qkv rope dims];
//   q_out [T, H, lora + rope] = RMSNorm(qkv[:, :q_lora], q_norm) @ W_q_b (x @ W_q_b without q_lora), each head's
//   rope dims (pair order) rotated, de-interleaved.
// W_qkv_a and W_q_b as panels; rope_cs [T, rope / 2, 2] (cos, sin); eps for input_norm, latent_eps for the latent
// norms. q_norm may be empty (no q_lora).
// With kv_cache [N, lora + rope] and kv_slots [T], row r's kv_out is also stored in kv_cache row kv_slots[r]
// (-1: not stored), the decode step's KV write into the paged pool.
void mla_project(F32<2> h, F32<1> input_norm, float eps, F32<3> qkv_a_panels, F32<1> q_norm, F32<1> kv_norm,
                 float latent_eps, F32<3> rope_cs, F32<3> q_b_panels, F32<3> q_out, F32<2> kv_out,
                 std::optional<F32<2>> kv_cache, std::optional<I64<1>> kv_slots) {
  require_rows(h, "h");
  require_rows(kv_out, "kv_out");
  const int64_t t = h.shape(0), dim = h.shape(1), q_lora = q_norm.shape(0), lora = kv_norm.shape(0);
  const int64_t half = rope_cs.shape(1), rope = 2 * half, heads = q_out.shape(1), width = lora + rope;
  const int64_t qkv_width = q_lora + lora + rope, q_in = q_lora ? q_lora : dim;
  REQUIRE(static_cast<int64_t>(input_norm.shape(0)) == dim, "mla_project: input_norm must be [" +
                                                                  std::to_string(dim) + "]");
  require_panels(qkv_a_panels, dim, qkv_width, "mla_project: qkv_a");
  require_panels(q_b_panels, q_in, heads * width, "mla_project: q_b");
  REQUIRE(static_cast<int64_t>(rope_cs.shape(0)) == t && rope_cs.shape(2) == 2 && half <= 128 &&
              (t == 0 || (rope_cs.stride(2) == 1 && rope_cs.stride(1) == 2)),
          "mla_project: rope_cs must be contiguous [T, rope / 2, 2] with rope <= 256");
  REQUIRE(static_cast<int64_t>(q_out.shape(0)) == t && static_cast<int64_t>(q_out.shape(2)) == width &&
              (t == 0 || heads <= 1 || q_out.stride(1) == width) && (t == 0 || q_out.stride(2) == 1),
          "mla_project: q_out must be [T, H, kv_lora + rope] with contiguous rows");
  REQUIRE(static_cast<int64_t>(kv_out.shape(0)) == t && static_cast<int64_t>(kv_out.shape(1)) == width,
          "mla_project: kv_out must be " + shape_of(t, width));
  REQUIRE(kv_cache.has_value() == kv_slots.has_value(), "mla_project: kv_cache and kv_slots come together");
  if (kv_cache) {
    require_rows(*kv_cache, "kv_cache");
    REQUIRE(static_cast<int64_t>(kv_cache->shape(1)) == width && static_cast<int64_t>(kv_slots->shape(0)) == t,
            "mla_project: kv_cache must be [N, " + std::to_string(width) + "] and kv_slots [" + std::to_string(t) +
                "]");
    for (int64_t r = 0; r < t; ++r) {
      const int64_t slot = kv_slots->data()[r * kv_slots->stride(0)];
      REQUIRE(slot >= -1 && slot < static_cast<int64_t>(kv_cache->shape(0)),
              "mla_project: kv slot " + std::to_string(slot) + " outside the cache's " +
                  std::to_string(kv_cache->shape(0)) + " rows");
    }
  }
  std::vector<float> x(t * dim), qkv(t * qkv_width), q_lat(q_lora ? t * q_lora : 0);
  std::vector<const float*> a(t);
  std::vector<float*> c(t);
  for (int64_t r = 0; r < t; ++r) {
    rms_norm_row(h.data() + r * h.stride(0), input_norm.data(), eps, x.data() + r * dim, dim);
    a[r] = x.data() + r * dim;
    c[r] = qkv.data() + r * qkv_width;
  }
  gemm_panels(t, qkv_width, dim, a.data(), qkv_a_panels.data(), nullptr, c.data());
  for (int64_t r = 0; r < t; ++r) {
    const float* row = qkv.data() + r * qkv_width;
    const float* cs = rope_cs.data() + r * rope_cs.stride(0);
    if (q_lora) {
      rms_norm_row(row, q_norm.data(), latent_eps, q_lat.data() + r * q_lora, q_lora);
      a[r] = q_lat.data() + r * q_lora;
    }
    float* kv = kv_out.data() + r * kv_out.stride(0);
    rms_norm_row(row + q_lora, kv_norm.data(), latent_eps, kv, lora);
    rotate_row(row + q_lora + lora, cs, kv + lora, half);
    const int64_t slot = kv_cache ? kv_slots->data()[r * kv_slots->stride(0)] : -1;
    if (slot >= 0) std::memcpy(kv_cache->data() + slot * kv_cache->stride(0), kv, width * sizeof(float));
    c[r] = q_out.data() + r * q_out.stride(0);
  }
  gemm_panels(t, heads * width, q_in, a.data(), q_b_panels.data(), nullptr, c.data());
  for (int64_t r = 0; r < t; ++r)
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* q = c[r] + hd * width + lora;
      rotate_row(q, rope_cs.data() + r * rope_cs.stride(0), q, half);
    }
}

// The routed experts of a decode batch without padding (the CPU counterpart of a grouped GEMM over a contiguous
// layout): token i is the row x[i] through local expert local[i], its output written to the row y[i],
//   y[i] = (silu(x @ gate_up[e][:, :I]) * (x @ gate_up[e][:, I:])) @ down[e],
// gate_up [E, D, 2I] and down [E, I, D] as panels (gate_up_panels [E, P, D, kPanel], down_panels [E, P', I,
// kPanel]; one expert's panels `*_stride` floats apart). Tokens are taken expert by expert (counting sort, arrival
// order within an expert); idle experts' weights are never read. local[i] must be in [0, experts).
void expert_rows_mlp(int64_t n, const float* const* x, const int64_t* local, float* const* y, int64_t experts,
                     int64_t dim, int64_t inter, const float* gate_up, int64_t gate_up_stride, const float* down,
                     int64_t down_stride) {
  std::vector<int64_t> count(experts + 1, 0);  // then: each expert's first position in `order`
  for (int64_t i = 0; i < n; ++i) ++count[local[i] + 1];
  for (int64_t e = 0; e < experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> order(n);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < n; ++i) order[next[local[i]]++] = i;

  int64_t widest = 0;
  for (int64_t e = 0; e < experts; ++e) widest = std::max(widest, count[e + 1] - count[e]);
  std::vector<float> hidden(widest * 3 * inter);  // [widest, 2I] gate | up, then [widest, I] the activation
  std::vector<const float*> a(widest);
  std::vector<float*> c(widest);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = count[e + 1] - count[e];
    if (m == 0) continue;
    const int64_t* tokens = order.data() + count[e];
    float* gate_up_out = hidden.data();
    float* act = hidden.data() + widest * 2 * inter;
    for (int64_t t = 0; t < m; ++t) {
      a[t] = x[tokens[t]];
      c[t] = gate_up_out + t * 2 * inter;
    }
    gemm_panels(m, 2 * inter, dim, a.data(), gate_up + e * gate_up_stride, nullptr, c.data());
    for (int64_t t = 0; t < m; ++t) {
      silu_mul_row(c[t], act + t * inter, inter);
      a[t] = act + t * inter;
      c[t] = y[tokens[t]];
    }
    gemm_panels(m, dim, inter, a.data(), down + e * down_stride, nullptr, c.data());
  }
}

void require_expert_panels(const F32<4>& gate_up_panels, const F32<4>& down_panels, int64_t dim, int64_t inter,
                           const char* what) {
  REQUIRE(inter > 0 && down_panels.shape(0) == gate_up_panels.shape(0),
          std::string(what) + ": gate_up [E, D, 2I] and down [E, I, D] disagree");
  require_panels(gate_up_panels, dim, 2 * inter, (std::string(what) + ": gate_up").c_str());
  require_panels(down_panels, inter, dim, (std::string(what) + ": down").c_str());
}

// expert_rows_mlp over rows of one source array: token i is source[rows[i]] through local expert local[i] ->
// y [N, D] (source [R, D], rows/local [N]).
void grouped_expert_mlp(F32<2> source, I64<1> rows, I64<1> local, F32<4> gate_up_panels, F32<4> down_panels,
                        int64_t inter, F32<2> y) {
  require_rows(source, "source");
  require_rows(y, "y");
  const int64_t n = rows.shape(0), experts = gate_up_panels.shape(0), dim = source.shape(1);
  REQUIRE(static_cast<int64_t>(local.shape(0)) == n && static_cast<int64_t>(y.shape(0)) == n,
          "grouped_expert_mlp: rows, local and y must have the same length");
  REQUIRE(static_cast<int64_t>(y.shape(1)) == dim, "grouped_expert_mlp: source [R, D] and y [N, D] disagree");
  require_expert_panels(gate_up_panels, down_panels, dim, inter, "grouped_expert_mlp");
  std::vector<const float*> x(n);
  std::vector<float*> out(n);
  std::vector<int64_t> expert(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = local.data()[i * local.stride(0)];
    REQUIRE(e >= 0 && e < experts, "grouped_expert_mlp: local expert " + std::to_string(e) + " outside [0, " +
                                       std::to_string(experts) + ")");
    const int64_t r = rows.data()[i * rows.stride(0)];
    REQUIRE(r >= 0 && r < static_cast<int64_t>(source.shape(0)),
            "grouped_expert_mlp: row " + std::to_string(r) + " outside the source's " +
                std::to_string(source.shape(0)) + " rows");
    expert[i] = e;
    x[i] = source.data() + r * source.stride(0);
    out[i] = y.data() + i * y.stride(0);
  }
  expert_rows_mlp(n, x.data(), expert.data(), out.data(), experts, dim, inter, gate_up_panels.data(),
                  gate_up_panels.stride(0), down_panels.data(), down_panels.stride(0));
}

// The routed experts of one packed MoE dispatch (data_plane/moe_exchange.py), read straight from the receive
// buffer and written straight to where each source's combine reads them. recv [ranks * (cap + 1), D + 1]: source
// s's block starts at row s * (cap + 1) with a header row whose tag (the int32 in the row's last slot) is the
// number of pairs n_s it sent, then n_s rows [values | local expert]. outs[s] [>= n_s, D]: row i gets the output of
// source s's i-th pair. Returns [n_s]. A count outside [0, cap] or an expert outside [0, E) is a corrupt dispatch.
std::vector<int64_t> received_expert_mlp(F32<2> recv, int64_t cap, F32<4> gate_up_panels, F32<4> down_panels,
                                         int64_t inter, std::vector<F32<2>> outs) {
  require_rows(recv, "recv");
  const int64_t ranks = outs.size(), dim = static_cast<int64_t>(recv.shape(1)) - 1;
  const int64_t experts = gate_up_panels.shape(0), block = cap + 1;
  REQUIRE(cap >= 0 && static_cast<int64_t>(recv.shape(0)) == ranks * block,
          "received_expert_mlp: recv must have ranks * (cap + 1) = " + std::to_string(ranks * block) + " rows");
  require_expert_panels(gate_up_panels, down_panels, dim, inter, "received_expert_mlp");
  auto tag = [&](int64_t row) {
    int32_t value;
    std::memcpy(&value, recv.data() + row * recv.stride(0) + dim, sizeof value);
    return static_cast<int64_t>(value);
  };
  std::vector<int64_t> counts(ranks);
  std::vector<const float*> x;
  std::vector<float*> y;
  std::vector<int64_t> expert;
  for (int64_t s = 0; s < ranks; ++s) {
    const int64_t n = counts[s] = tag(s * block);
    REQUIRE(n >= 0 && n <= cap, "received_expert_mlp: corrupt dispatch: source " + std::to_string(s) + " sent " +
                                    std::to_string(n) + " pairs, outside [0, " + std::to_string(cap) + "]");
    require_rows(outs[s], "outs");
    REQUIRE(static_cast<int64_t>(outs[s].shape(0)) >= n && static_cast<int64_t>(outs[s].shape(1)) == dim,
            "received_expert_mlp: outs[" + std::to_string(s) + "] must hold [" + std::to_string(n) + ", " +
                std::to_string(dim) + "]");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = s * block + 1 + i, e = tag(row);
      REQUIRE(e >= 0 && e < experts, "received_expert_mlp: corrupt dispatch: local expert " + std::to_string(e) +
                                         " outside [0, " + std::to_string(experts) + ")");
      expert.push_back(e);
      x.push_back(recv.data() + row * recv.stride(0));
      y.push_back(outs[s].data() + i * outs[s].stride(0));
    }
  }
  expert_rows_mlp(x.size(), x.data(), expert.data(), y.data(), experts, dim, inter, gate_up_panels.data(),
                  gate_up_panels.stride(0), down_panels.data(), down_panels.stride(0));
  return counts;
}

// ---- shard attention -----------------------------------------------------------------------------------------

// The lane sums of kLanes vectors as one vector: out[i] = sum of the lanes of v[i]. A transpose-and-add tree
// (halves, quarters, ..., single lanes): kLanes - 1 adds of two shuffles each, where separate lane sums take kLanes
// shuffle chains and kLanes scalar results. Each lane's sum is added up in lane_sum's order.
inline Lanes lane_sums(const Lanes* v) {
#if (defined(__clang__) || __GNUC__ >= 12) && NANOCP_LANES == 16
  Lanes w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)  // w[j]: 8 partial sums of v[2j], then 8 of v[2j + 1]
    w[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  for (int k = 0; k < 4; ++k)  // x[k]: 4 partial sums of each of v[4k .. 4k + 3]
    x[k] = __builtin_shufflevector(w[2 * k], w[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(w[2 * k], w[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  for (int l = 0; l < 2; ++l)  // y[l]: 2 partial sums of each of v[8l .. 8l + 7]
    y[l] = __builtin_shufflevector(x[2 * l], x[2 * l + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                   29) +
           __builtin_shufflevector(x[2 * l], x[2 * l + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif (defined(__clang__) || __GNUC__ >= 12) && NANOCP_LANES == 8
  Lanes x[4], y[2];
  for (int k = 0; k < 4; ++k)  // x[k]: 4 partial sums of v[2k], then 4 of v[2k + 1]
    x[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int l = 0; l < 2; ++l)  // y[l]: 2 partial sums of each of v[4l .. 4l + 3]
    y[l] = __builtin_shufflevector(x[2 * l], x[2 * l + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(x[2 * l], x[2 * l + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  Lanes out;
  for (int i = 0; i < kLanes; ++i) out[i] = lane_sum(v[i]);
  return out;
#endif
}

// Scores of a tile of HB heads x TB kv rows: score[h * stride + t] = scale * q_h . kv_t (q rows q_stride apart).
// The tile loads each q and kv chunk once for TB or HB products; a full tile (HB * TB = kLanes) reduces its sums
// together.
template <int HB, int TB>
inline void score_tile(const float* q, int64_t q_stride, const float* kv, int64_t dqk, float scale, float* score,
                       int64_t stride) {
  Lanes acc[HB * TB];
  for (int i = 0; i < HB * TB; ++i) acc[i] = Lanes{};
  int64_t c = 0;
  for (; c + kLanes <= dqk; c += kLanes) {
    Lanes k[TB];
    for (int t = 0; t < TB; ++t) k[t] = load_lanes(kv + t * dqk + c);
    for (int h = 0; h < HB; ++h) {
      const Lanes qv = load_lanes(q + h * q_stride + c);
      for (int t = 0; t < TB; ++t) acc[h * TB + t] += qv * k[t];
    }
  }
  float sums[HB * TB];
  if constexpr (HB * TB == kLanes) {
    const Lanes all = lane_sums(acc);
    std::memcpy(sums, &all, sizeof all);
  } else {
    for (int i = 0; i < HB * TB; ++i) sums[i] = lane_sum(acc[i]);
  }
  for (int h = 0; h < HB; ++h)
    for (int t = 0; t < TB; ++t) {
      float sum = sums[h * TB + t];
      for (int64_t i = c; i < dqk; ++i) sum += q[h * q_stride + i] * kv[t * dqk + i];
      score[h * stride + t] = scale * sum;
    }
}

// Score tiles of 4 heads x kScoreRows kv rows: 16 accumulators + 4 kv vectors + 1 q of AVX-512's 32 registers;
// with AVX2, 8 + 2 + 1 of its 16.
constexpr int kScoreRows = kLanes / 4;

// score [H, stride] <- the scaled scores of `rows` consecutive kv rows for every head (q rows q_stride apart).
void rows_scores(const float* q, int64_t q_stride, int64_t heads, const float* kv, int64_t rows, int64_t dqk,
                 float scale, float* score, int64_t stride) {
  in_blocks<4>(heads, [&](auto hb, int64_t h) {
    constexpr int HB = decltype(hb)::value;
    const float* qh = q + h * q_stride;
    float* sh = score + h * stride;
    // rows in tiles of kScoreRows, the rest one by one (a tile per tail size made the loop slower)
    int64_t t = 0;
    for (; t + kScoreRows <= rows; t += kScoreRows)
      score_tile<HB, kScoreRows>(qh, q_stride, kv + t * dqk, dqk, scale, sh + t, stride);
    for (; t < rows; ++t) score_tile<HB, 1>(qh, q_stride, kv + t * dqk, dqk, scale, sh + t, stride);
  });
}

// acc[h, :v_dim] += sum over `rows` kv rows t of weight[h * stride + t] * v_t, for HB heads from h: each element
// summed over t in order, each v chunk loaded once for the HB heads.
template <int HB>
inline void value_heads(const float* weight, int64_t stride, const float* kv, int64_t rows, int64_t dqk,
                        int64_t v_dim, float* acc) {
  int64_t i = 0;
  for (; i + kLanes <= v_dim; i += kLanes) {
    Lanes a[HB];
    for (int h = 0; h < HB; ++h) a[h] = load_lanes(acc + h * v_dim + i);
    for (int64_t t = 0; t < rows; ++t) {
      const Lanes v = load_lanes(kv + t * dqk + i);
      for (int h = 0; h < HB; ++h) a[h] += weight[h * stride + t] * v;
    }
    for (int h = 0; h < HB; ++h) std::memcpy(acc + h * v_dim + i, &a[h], sizeof(Lanes));
  }
  for (; i < v_dim; ++i)
    for (int h = 0; h < HB; ++h)
      for (int64_t t = 0; t < rows; ++t) acc[h * v_dim + i] += weight[h * stride + t] * kv[t * dqk + i];
}

// acc [H, v_dim] += weight [H, stride] (softmax numerators) x the first v_dim values of `rows` consecutive kv rows.
void rows_values(const float* weight, int64_t stride, int64_t heads, const float* kv, int64_t rows, int64_t dqk,
                 int64_t v_dim, float* acc) {
  in_blocks<4>(heads, [&](auto hb, int64_t h) {
    value_heads<decltype(hb)::value>(weight + h * stride, stride, kv, rows, dqk, v_dim, acc + h * v_dim);
  });
}

// Ask for n floats from p to come into L2, every cache line: the next page a shard reads. A page's rows are
// contiguous, but a shard's pages are scattered over the pool, so the hardware prefetcher cannot see the next one
// coming, and in a decode step the pages are cold (the other layers went through the cache since this pool was
// read). In a decode run this made a layer's attention 20-25% faster; on pages already in cache it costs ~10%.
inline void prefetch_rows(const float* p, int64_t n) {
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  for (int64_t i = 0; i < n; i += kLineFloats) __builtin_prefetch(p + i, 0, 1);
}

constexpr int64_t kAttentionChunk = 64;  // kv rows whose scores are computed before their softmax and values

// MLA decode attention of each shard over its pages, straight from the paged pool (no gather): the H query heads
// of shard s attend over its lens[s] latent rows, one KV head shared by all (k = the whole row, v = its first
// v_dim values). q [S, H, Dqk], kv_pages [P, page, Dqk], block_table [S, B] (page ids), lens [S] ->
// o [S, H, v_dim] and lse [S, H] (natural log of the softmax denominator of the scaled scores); an empty shard gives
// o = 0 and lse = -inf. The contract of models.mla_paged_attention_with_lse.
void mla_paged_attention(F32<3> q, F32<3> kv_pages, I32<2> block_table, I64<1> lens, float scale, F32<3> o,
                         F32<2> lse) {
  require_rows(q, "q");
  const int64_t row_width = kv_pages.shape(2), page_width = kv_pages.shape(1) * kv_pages.shape(2);
  const bool pool_contiguous =
      kv_pages.stride(2) == 1 && kv_pages.stride(1) == row_width && kv_pages.stride(0) == page_width;
  REQUIRE(kv_pages.size() == 0 || pool_contiguous, "mla_paged_attention: kv_pages must be contiguous");
  const int64_t shards = q.shape(0), heads = q.shape(1), dqk = q.shape(2), v_dim = o.shape(2);
  const int64_t pages = kv_pages.shape(0), page = kv_pages.shape(1), blocks = block_table.shape(1);
  REQUIRE(static_cast<int64_t>(kv_pages.shape(2)) == dqk && v_dim <= dqk,
          "mla_paged_attention: kv rows must be as wide as the queries (" + std::to_string(dqk) +
              ") and v_dim <= that");
  REQUIRE(static_cast<int64_t>(block_table.shape(0)) == shards && static_cast<int64_t>(lens.shape(0)) == shards &&
              o.shape(0) == q.shape(0) && o.shape(1) == q.shape(1) && lse.shape(0) == q.shape(0) &&
              lse.shape(1) == q.shape(1),
          "mla_paged_attention: q [S, H, Dqk], block_table [S, B], lens [S], o [S, H, v_dim], lse [S, H] disagree");
  require_rows(o, "o");
  require_rows(lse, "lse");
  REQUIRE(shards == 0 || blocks == 0 || block_table.stride(1) == 1,
          "mla_paged_attention: block_table rows must be contiguous");
  for (int64_t s = 0; s < shards; ++s) {
    const int64_t len = lens.data()[s * lens.stride(0)];
    REQUIRE(len >= 0 && len <= blocks * page, "mla_paged_attention: shard length " + std::to_string(len) +
                                                  " outside [0, " + std::to_string(blocks * page) + "]");
    const int32_t* table = block_table.data() + s * block_table.stride(0);
    for (int64_t b = 0; b < (len + page - 1) / page; ++b)
      REQUIRE(table[b] >= 0 && table[b] < pages, "mla_paged_attention: page " + std::to_string(table[b]) +
                                                     " outside the pool's " + std::to_string(pages));
  }
  // Each shard in chunks of whole pages (at least one): the chunk's scores for every head, then one softmax step
  // per head (the running max and sum of an online softmax across chunks), then its weighted values, while the
  // chunk's rows are still in cache. Short shards are one chunk: no rescaling at all.
  const int64_t chunk = std::max<int64_t>(page, kAttentionChunk / std::max<int64_t>(page, 1) * page);
  std::vector<float> score(heads * chunk);  // [H, chunk]: the chunk's scaled scores, then softmax numerators
  std::vector<float> acc(heads * v_dim);    // [H, v_dim]: weighted sum of v under the running max
  std::vector<float> top(heads), sum(heads);
  const float* pool = kv_pages.data();
  auto page_rows = [&](const int32_t* table, int64_t b) { return pool + static_cast<int64_t>(table[b]) * page * dqk; };
  for (int64_t s = 0; s < shards; ++s) {
    const int64_t len = lens.data()[s * lens.stride(0)];
    const int32_t* table = block_table.data() + s * block_table.stride(0);
    const float* qs = q.data() + s * q.stride(0);
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(top.begin(), top.end(), -INFINITY);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t start = 0; start < len; start += chunk) {
      const int64_t n = std::min(chunk, len - start);
      for (int64_t first = 0; first < n; first += page) {
        const int64_t b = (start + first) / page;
        if (start + first + page < len) {
          prefetch_rows(page_rows(table, b + 1), page * dqk);
        } else if (s + 1 < shards && lens.data()[(s + 1) * lens.stride(0)] > 0) {
          prefetch_rows(page_rows(block_table.data() + (s + 1) * block_table.stride(0), 0), page * dqk);
        }
        rows_scores(qs, q.stride(1), heads, page_rows(table, b), std::min(page, n - first), dqk, scale,
                    score.data() + first, chunk);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* w = score.data() + h * chunk;
        const float chunk_top = largest(w, n);
        if (chunk_top > top[h]) {  // a new running max: rescale what was summed under the old one
          const float shrink = fast_exp(top[h] - chunk_top);
          sum[h] *= shrink;
          for (int64_t i = 0; i < v_dim; ++i) acc[h * v_dim + i] *= shrink;
          top[h] = chunk_top;
        }
        exp_shifted(w, top[h], w, n);
        sum[h] += total(w, n);
      }
      for (int64_t first = 0; first < n; first += page)
        rows_values(score.data() + first, chunk, heads, page_rows(table, (start + first) / page),
                    std::min(page, n - first), dqk, v_dim, acc.data());
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* out = o.data() + s * o.stride(0) + h * o.stride(1);
      const float norm = len ? 1.0f / sum[h] : 0.0f;
      for (int64_t i = 0; i < v_dim; ++i) out[i] = acc[h * v_dim + i] * norm;
      lse.data()[s * lse.stride(0) + h * lse.stride(1)] = len ? top[h] + std::log(sum[h]) : -INFINITY;
    }
  }
}

}  // namespace

// The build's name: CMakeLists.txt builds this file several times side by side, as _cpu_kernels (width "native") and
// at narrower widths (_cpu_kernels_avx2, _cpu_kernels_portable); see data_plane/cpu_kernels.py.
#ifndef NANOCP_CPU_KERNELS_MODULE
#define NANOCP_CPU_KERNELS_MODULE _cpu_kernels
#endif
#ifndef NANOCP_CPU_KERNELS_WIDTH
#define NANOCP_CPU_KERNELS_WIDTH "native"
#endif
#define NANOCP_NB_MODULE(name, variable) NB_MODULE(name, variable)  // expands the module name macro first

// Every array argument is noconvert: a wrong dtype is a TypeError, never a converted temporary copy (whose
// results, for the arrays a kernel writes, would be lost).
NANOCP_NB_MODULE(NANOCP_CPU_KERNELS_MODULE, m) {
  m.doc() = "nanocp fused fp32 CPU kernels of the eager decode path (tests compare each with its torch reference)";
  m.attr("width") = NANOCP_CPU_KERNELS_WIDTH;
  m.attr("vector_lanes") = kLanes;
#if defined(NANOCP_MARCH_NATIVE)
  m.attr("native_build") = true;
#else
  m.attr("native_build") = false;
#endif
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  m.attr("fma") = true;  // a * b + c contracted into one rounding (GCC's default -ffp-contract=fast)
#else
  m.attr("fma") = false;
#endif
  m.attr("panel_width") = kPanel;
  // What this CPU can run (read with cpuid at import): the builds at other widths are imported only where it has
  // their instructions (importing one elsewhere could die of an illegal instruction).
  nb::dict cpu;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  cpu["avx"] = static_cast<bool>(__builtin_cpu_supports("avx"));
  cpu["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
  cpu["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
  cpu["bmi"] = static_cast<bool>(__builtin_cpu_supports("bmi"));
  cpu["bmi2"] = static_cast<bool>(__builtin_cpu_supports("bmi2"));
  cpu["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
#endif
  m.attr("cpu_supports") = cpu;
  auto array = [](const char* name) { return nb::arg(name).noconvert(); };
  // The kernels' e^x (fast_exp) on every value of x, in place: for the tests, whose error bounds assume its accuracy.
  m.def(
      "exp_",
      [](F32<1> x) {
        require_rows(x, "x");
        exp_shifted(x.data(), 0.0f, x.data(), static_cast<int64_t>(x.shape(0)));
      },
      array("x"));
  m.def("rms_norm", &rms_norm, array("x"), array("weight"), nb::arg("eps"), array("out"));
  m.def("mla_qkv_post", &mla_qkv_post, array("qkv"), array("q_norm"), array("kv_norm"), nb::arg("eps"),
        array("rope_cs"), array("q_out"), array("kv_out"));
  m.def("rope_heads_", &rope_heads_, array("q"), nb::arg("offset"), array("rope_cs"));
  m.def("silu_mul", &silu_mul, array("gate_up"), array("out"));
  m.def("moe_gate_topk", &moe_gate_topk, array("logits"), array("bias"), nb::arg("n_group"), nb::arg("topk_group"),
        nb::arg("normalize"), nb::arg("scale"), array("topk_idx"), array("topk_w"));
  m.def("moe_dispatch_layout", &moe_dispatch_layout, array("topk_idx"), nb::arg("num_experts"), nb::arg("ranks"),
        nb::arg("cap"), array("source"), array("tags"), array("per_dst"), array("result_rows"));
  m.def("grouped_expert_mlp", &grouped_expert_mlp, array("source"), array("rows"), array("local"),
        array("gate_up_panels"), array("down_panels"), nb::arg("inter"), array("y"));
  m.def("received_expert_mlp", &received_expert_mlp, array("recv"), nb::arg("cap"), array("gate_up_panels"),
        array("down_panels"), nb::arg("inter"), array("outs"));
  m.def("mla_project", &mla_project, array("h"), array("input_norm"), nb::arg("eps"), array("qkv_a_panels"),
        array("q_norm"), array("kv_norm"), nb::arg("latent_eps"), array("rope_cs"), array("q_b_panels"),
        array("q_out"), array("kv_out"), array("kv_cache").none() = nb::none(), array("kv_slots").none() = nb::none());
  m.def("moe_gate_input", &moe_gate_input, array("o"), array("w_o_panels"), array("h"), array("post_norm"),
        nb::arg("eps"), array("gate_panels"), nb::arg("experts"), array("bias"), nb::arg("n_group"),
        nb::arg("topk_group"), nb::arg("normalize"), nb::arg("scale"), array("h_out"), array("x_out"),
        array("topk_idx"), array("topk_w"));
  m.def("dense_layer_output", &dense_layer_output, array("o"), array("w_o_panels"), array("h"), array("post_norm"),
        nb::arg("eps"), array("gate_up_panels"), array("down_panels"), nb::arg("inter"), array("out"));
  m.def("gated_mlp", &gated_mlp, array("x"), array("gate_up_panels"), array("down_panels"), nb::arg("inter"),
        array("base").none(), array("out"));
  m.def("linear_panels", &linear_panels, array("x"), array("panels"), nb::arg("n"), array("base").none(),
        array("out"));
  m.def("mla_paged_attention", &mla_paged_attention, array("q"), array("kv_pages"), array("block_table"),
        array("lens"), nb::arg("scale"), array("o"), array("lse"));
  m.def("pack_dispatch_rows", &pack_dispatch_rows, array("x"), array("source"), array("tags"), array("out"));
  m.def("pack_dispatch", &pack_dispatch, array("x"), array("topk_idx"), nb::arg("num_experts"), nb::arg("cap"),
        array("blocks"), array("result_rows"));
  m.def("weighted_combine", &weighted_combine, array("y"), array("rows"), array("weights"), array("base"),
        array("out"));
}
