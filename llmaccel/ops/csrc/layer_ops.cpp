// The small operations between a decoder layer's matmuls, each one pass over its rows: RMSNorm (with
// the residual add folded in, as vLLM's fused_add_rms_norm), rotary embedding in place, SiLU-and-mul.
//
// At decode a row is 576 floats, and torch spends 4-40 us of dispatch and threading on each of the
// eight to ten ops these replace (F.rms_norm alone 37 us for one row, measured): ~15 ms of a 50 ms
// token on the default model. Here each is one call that does the arithmetic in float, in HF's formula:
// RMSNorm normalizes in float32 and casts before the weight multiply; RoPE is rotate-half.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMACCEL_EXP_AVX2 1
#endif

namespace llmaccel {

#ifdef LLMACCEL_EXP_AVX2
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n by the exponent bits; at the clamp's low end n = -126, still a normal float
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

LLMACCEL_ONE_COPY void exp_inplace(float* v, int64_t n) {
#ifdef LLMACCEL_EXP_AVX2
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
  if (i < n) {  // the tail through the same arithmetic
    alignas(32) float tail[8] = {};
    std::memcpy(tail, v + i, (n - i) * sizeof(float));
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    std::memcpy(v + i, tail, (n - i) * sizeof(float));
  }
#else
  for (int64_t i = 0; i < n; ++i) v[i] = std::exp(v[i]);
#endif
}

LLMACCEL_ONE_COPY void softcap_inplace(float* v, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) v[i] = 2.0f * v[i] / cap;
  exp_inplace(v, n);
  for (int64_t i = 0; i < n; ++i) v[i] = cap * (1.0f - 2.0f / (1.0f + v[i]));
}

LLMACCEL_ONE_COPY float softmax_inplace(float* v, int64_t n) {
  float total = 0.0f;
#ifdef LLMACCEL_EXP_AVX2
  int64_t i = 0;
  __m256 max8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; i + 8 <= n; i += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(v + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, max8);
  float m = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) m = std::max(m, v[i]);
  const __m256 shift = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), shift));
    _mm256_storeu_ps(v + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  if (i < n) {  // the tail through the same arithmetic; its padding lanes add nothing
    alignas(32) float tail[8] = {};
    std::memcpy(tail, v + i, (n - i) * sizeof(float));
    _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), shift)));
    std::memset(tail + (n - i), 0, (8 - (n - i)) * sizeof(float));
    std::memcpy(v + i, tail, (n - i) * sizeof(float));
    sum8 = _mm256_add_ps(sum8, _mm256_load_ps(tail));
  }
  total = hsum8(sum8);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, v[i]);
  for (int64_t i = 0; i < n; ++i) total += (v[i] = std::exp(v[i] - m));
#endif
  return total > 0 ? 1.0f / total : 0.0f;
}

namespace {


// Rows are split between threads only when there are enough of them to pay for the wake-up.
template <typename Fn>
void over_rows(int64_t rows, int64_t row_cost, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_cost));
  if (rows <= grain) return fn(0, rows);
  at::parallel_for(0, rows, grain, fn);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// float32 rounded to bfloat16 (to nearest even, NaN to 0x7fc0: c10's rule), returned as the rounded
// float32 or stored; with widen16 (kernels.h) for the loads. c10's conversions one element at a time
// kept the bf16 RoPE and norms scalar: 3 ns an element, 5% of a 64-sequence decode step.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                    _mm512_set1_epi32(1)));
  const __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x7fc0));
}
inline __m512 round16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
inline __m512 negated(__m512 v) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
#define LLMACCEL_LAYER_OPS_AVX512 1
#endif

template <typename T>
LLMACCEL_ONE_COPY void norm_row(const T* xr, T* res, const T* weight, T* dst, int64_t h, float eps) {
#ifdef LLMACCEL_LAYER_OPS_AVX512
  if constexpr (std::is_same_v<T, bf16>) {
    if (h % 16 == 0) {  // the same rounding as below; the sum of squares in 16 lanes
      __m512 sum16 = _mm512_setzero_ps();
      for (int64_t j = 0; j < h; j += 16) {
        __m512 v = widen16(xr + j);
        if (res != nullptr) {
          v = round16(_mm512_add_ps(widen16(res + j), v));
          store16(res + j, v);
        }
        sum16 = _mm512_fmadd_ps(v, v, sum16);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sum16) / static_cast<float>(h) + eps);
      const T* src = res != nullptr ? res : xr;
      const __m512 inv16 = _mm512_set1_ps(inv);
      for (int64_t j = 0; j < h; j += 16)
        store16(dst + j, _mm512_mul_ps(widen16(weight + j), round16(_mm512_mul_ps(widen16(src + j), inv16))));
      return;
    }
  }
#endif
  float sum = 0.0f;
  for (int64_t j = 0; j < h; ++j) {
    float v = to_float(xr[j]);
    if (res != nullptr) {  // residual += x, rounded to the activation dtype as the unfused add would be
      const T stored = round_to<T>(to_float(res[j]) + v);
      res[j] = stored;
      v = to_float(stored);
    }
    sum += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
  const T* src = res != nullptr ? res : xr;
  for (int64_t j = 0; j < h; ++j) dst[j] = round_to<T>(to_float(weight[j]) * rounded<T>(to_float(src[j]) * inv));
}

template <typename T>
LLMACCEL_ONE_COPY void rope_row(T* row, int64_t heads, int64_t d, const T* c, const T* s) {
  const int64_t half = d / 2;
#ifdef LLMACCEL_LAYER_OPS_AVX512
  if constexpr (std::is_same_v<T, bf16>) {
    if (half % 16 == 0) {  // the formula below, 16 pairs at a time
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* v = row + hd * d;
        for (int64_t j = 0; j < half; j += 16) {
          const __m512 a = widen16(v + j), b = widen16(v + j + half);
          const __m512 lo = _mm512_add_ps(round16(_mm512_mul_ps(a, widen16(c + j))),
                                          round16(_mm512_mul_ps(negated(b), widen16(s + j))));
          const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(b, widen16(c + j + half))),
                                          round16(_mm512_mul_ps(a, widen16(s + j + half))));
          store16(v + j, lo);
          store16(v + j + half, hi);
        }
      }
      return;
    }
  }
#endif
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = row + hd * d;
    for (int64_t j = 0; j < half; ++j) {
      const float a = to_float(v[j]), b = to_float(v[j + half]);
      // x * cos + rotate_half(x) * sin, each product rounded to T as torch's ops round it
      const T lo = round_to<T>(rounded<T>(a * to_float(c[j])) + rounded<T>(-b * to_float(s[j])));
      const T hi = round_to<T>(rounded<T>(b * to_float(c[j + half])) + rounded<T>(a * to_float(s[j + half])));
      v[j] = lo, v[j + half] = hi;
    }
  }
}

template <typename T>
LLMACCEL_ONE_COPY void silu_row(const T* g, const T* u, T* o, int64_t count) {
  constexpr int64_t kChunk = 64;
  float e[kChunk];  // exp(-gate) of a chunk
  for (int64_t j0 = 0; j0 < count; j0 += kChunk) {
    const int64_t len = std::min(kChunk, count - j0);
    for (int64_t j = 0; j < len; ++j) e[j] = -to_float(g[j0 + j]);
    exp_inplace(e, len);
    for (int64_t j = 0; j < len; ++j) {
      const float gv = to_float(g[j0 + j]);
      o[j0 + j] = round_to<T>(rounded<T>(gv / (1.0f + e[j])) * to_float(u[j0 + j]));
    }
  }
}

// GeLU's tanh approximation (torch's approximate="tanh") times up, with tanh(y) = 1 - 2 / (1 + exp(2y)) so
// the vectorised exp serves it (exp overflowing to infinity gives tanh = 1, as it should)
template <typename T>
LLMACCEL_ONE_COPY void gelu_row(const T* g, const T* u, T* o, int64_t count) {
  constexpr int64_t kChunk = 64;
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  float e[kChunk];  // exp(2y) of a chunk
  for (int64_t j0 = 0; j0 < count; j0 += kChunk) {
    const int64_t len = std::min(kChunk, count - j0);
    for (int64_t j = 0; j < len; ++j) {
      const float x = to_float(g[j0 + j]);
      e[j] = 2.0f * kAlpha * (x + 0.044715f * x * x * x);
    }
    exp_inplace(e, len);
    for (int64_t j = 0; j < len; ++j) {
      const float x = to_float(g[j0 + j]);
      const float gelu = 0.5f * x * (2.0f - 2.0f / (1.0f + e[j]));
      o[j0 + j] = round_to<T>(rounded<T>(gelu) * to_float(u[j0 + j]));
    }
  }
}

template <typename T>
void gelu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  over_rows(rows, inter, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gelu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
  });
}

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t h, float eps,
                   int64_t ld_x) {
  over_rows(rows, h, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(x + r * ld_x, residual == nullptr ? nullptr : residual + r * h, weight, out + r * h, h, eps);
  });
}

template <typename T>
void rope_rows(T* qk, int64_t ld_token, int64_t heads, int64_t d, const int64_t* positions, const T* cos,
               const T* sin, int64_t tokens) {
  over_rows(tokens, heads * d, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rope_row(qk + t * ld_token, heads, d, cos + positions[t] * d, sin + positions[t] * d);
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  over_rows(rows, inter, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

void rms_norm_row(const float* x, float* residual, const float* weight, float* out, int64_t h, float eps) {
  norm_row(x, residual, weight, out, h, eps);
}

void rope_heads(float* v, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  rope_row(v, heads, head_dim, cos, sin);
}

void silu_mul_row(const float* gate, const float* up, float* out, int64_t count) { silu_row(gate, up, out, count); }

void gelu_mul_row(const float* gate, const float* up, float* out, int64_t count) { gelu_row(gate, up, out, count); }

void rms_norm_row(const bf16* x, bf16* residual, const bf16* weight, bf16* out, int64_t h, float eps) {
  norm_row(x, residual, weight, out, h, eps);
}

void rope_heads(bf16* v, int64_t heads, int64_t head_dim, const bf16* cos, const bf16* sin) {
  rope_row(v, heads, head_dim, cos, sin);
}

void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t count) { silu_row(gate, up, out, count); }

void gelu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t count) { gelu_row(gate, up, out, count); }

}  // namespace llmaccel

using namespace llmaccel;

// RMSNorm of x's rows; with a residual, first residual += x (in place) and normalize the sum.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [", h, "] of x's dtype");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be contiguous and shaped and typed as x");
  }
  auto out = torch::empty({rows, h}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       rms_norm_rows<float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                                            weight.data_ptr<float>(), out.data_ptr<float>(), rows, h,
                                            static_cast<float>(eps), x.stride(0));
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       using T = at::BFloat16;
                       rms_norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr,
                                        weight.data_ptr<T>(), out.data_ptr<T>(), rows, h, static_cast<float>(eps),
                                        x.stride(0));
                     }));
  return out;
}

// Rotates the first `heads` heads of each token of qk [T, >= heads * D] in place (rotate-half RoPE);
// cos, sin: [max_positions, D] of qk's dtype; positions: [T] int64.
void rope_(torch::Tensor qk, int64_t heads, int64_t head_dim, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  check_rows(qk, "qk");
  TORCH_CHECK(head_dim % 2 == 0 && qk.size(1) >= heads * head_dim, "qk rows must hold ", heads, " heads of ",
              head_dim);
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == qk.size(0),
              "positions must be contiguous int64 [T]");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(1) == head_dim && t->scalar_type() == qk.scalar_type(),
                "cos and sin must be contiguous [max_positions, ", head_dim, "] of qk's dtype");
  const int64_t tokens = qk.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the rotary table of ",
                cos.size(0));
  AT_DISPATCH_SWITCH(qk.scalar_type(), "rope_",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       rope_rows<float>(qk.data_ptr<float>(), qk.stride(0), heads, head_dim,
                                        positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                        tokens);
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       using T = at::BFloat16;
                       rope_rows<T>(qk.data_ptr<T>(), qk.stride(0), heads, head_dim, positions.data_ptr<int64_t>(),
                                    cos.data_ptr<T>(), sin.data_ptr<T>(), tokens);
                     }));
}

// gate_up [T, 2I] -> silu(gate) * up, [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up must be contiguous [T, 2 * I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       silu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       using T = at::BFloat16;
                       silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
                     }));
  return out;
}

// gate_up [T, 2I] -> gelu_tanh(gate) * up, [T, I] (GeGLU: Gemma).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "gate_up must be contiguous [T, 2 * I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "gelu_tanh_mul",
                     AT_DISPATCH_CASE(torch::kFloat32, [&] {
                       gelu_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter);
                     }) AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                       using T = at::BFloat16;
                       gelu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, inter);
                     }));
  return out;
}
