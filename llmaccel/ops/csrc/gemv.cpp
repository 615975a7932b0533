// Weight-streaming products for linear layers with few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T.
//
// With one to a few rows a linear layer is bound by reading its weights once, so these kernels aim at
// the machine's read bandwidth: each thread streams a contiguous run of weight rows, several rows at a
// time, and applies every activation row to a weight row while it sits in L1.
// (float32 weights: linear_f32.cpp, one layout for every row count.)
// - INT8 weights (a scale per row, or per 32 inputs: GGUF Q8_0) and INT4 weights (32-wide groups, a
//   float16 scale and offset each: GGUF Q4_1's grid): the activations are quantized on the fly to INT8 in
//   blocks of 32, each with its own scale (llama.cpp's Q8 activations), and the products are integer
//   dot products (AVX2 maddubs), 32 multiply-adds an instruction, so the kernel waits on memory rather
//   than on arithmetic. Each block's integer sum is scaled once in float.
// Builds without AVX2 run the same arithmetic in plain C++ (same results up to float summation order).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMACCEL_AVX2 1
#endif

namespace llmaccel {
namespace {

inline float half_to_float(uint16_t h) {
#ifdef LLMACCEL_AVX2
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

}  // namespace

void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / kBlock;
  out.q.resize(m * k);
  out.d.resize(m * nb);
  out.dsum.resize(m * nb);
  for (int64_t i = 0; i < m * nb; ++i) {
    const float* src = x + i * kBlock;
    int8_t* dst = out.q.data() + i * kBlock;
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(src[j] * inv));
      dst[j] = static_cast<int8_t>(v);
      sum += v;
    }
    out.d[i] = d;
    out.dsum[i] = d * static_cast<float>(sum);
  }
}

namespace {

#ifdef LLMACCEL_AVX2
// u8 x s8 products summed four at a time into int32 lanes: one VNNI instruction where the CPU has it
// (AVX512-VNNI with VL, or AVX-VNNI), else maddubs (pairs into int16; these values cannot saturate it)
// and madd. Exact integer sums either way, so the results are the same.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Eight int32 partial sums of the 32 products w[j] * x[j], w and x signed (|x| <= 127, so the pairs
// maddubs adds stay below 2^15).
inline __m256i dot_i8_i8(__m256i w, __m256i x) {
  return dot_u8_s8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
}

// The same for unsigned 4-bit weights packed 16 bytes a group: byte j holds input j (low nibble) and
// input j + 16 (high nibble).
inline __m256i dot_u4_i8(const uint8_t* packed, __m256i x) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
  return dot_u8_s8(w, x);
}
#endif

// With four or more activation rows both weight formats go four weight rows a pass: four independent
// accumulation chains (1.2-1.5x one row a pass at 64 rows, measured); with fewer, one weight row a
// pass streams better (up to 2x faster at one row). An output's sum runs in the same order either way,
// so results do not depend on the grouping, nor therefore on the batch.
#ifdef LLMACCEL_AVX2
#define LLMACCEL_FOUR(step) step(0) step(1) step(2) step(3)
inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

// INT8 weights, rows r .. r + R - 1; `scale` holds one float per row (grouped == false) or one per 32 inputs.
template <int R>
void i8_pass(const QuantizedRows& a, const int8_t* w, const float* scale, bool grouped, float* y, int64_t m,
             int64_t ldy, int64_t k, int64_t r) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* xq = a.q.data() + i * k;
    const float* d = a.d.data() + i * nb;
    float sums[R];
#ifdef LLMACCEL_AVX2
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i xv = load32(xq + b * kBlock);
#define LLMACCEL_I8_ROW(j)                                                                           \
  if constexpr (R > j) {                                                                             \
    const float s = grouped ? d[b] * scale[(r + j) * nb + b] : d[b];                                 \
    const __m256i dot = dot_i8_i8(load32(w + (r + j) * k + b * kBlock), xv);                         \
    c##j = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(dot), c##j);                        \
  }
      LLMACCEL_FOUR(LLMACCEL_I8_ROW)
#undef LLMACCEL_I8_ROW
    }
    const __m256 c[4] = {c0, c1, c2, c3};
    for (int j = 0; j < R; ++j) sums[j] = hsum8(c[j]);
#else
    for (int j = 0; j < R; ++j) {
      const int8_t* wr = w + (r + j) * k;
      sums[j] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t e = 0; e < kBlock; ++e) dot += int32_t(wr[b * kBlock + e]) * int32_t(xq[b * kBlock + e]);
        sums[j] += (grouped ? d[b] * scale[(r + j) * nb + b] : d[b]) * static_cast<float>(dot);
      }
    }
#endif
    for (int j = 0; j < R; ++j) y[i * ldy + r + j] = grouped ? sums[j] : sums[j] * scale[r + j];
  }
}

// INT4 weights, rows r .. r + R - 1: w = q * scale + offset per 32-wide group, q in 0..15; `s` and `o`
// hold the rows' scales and offsets as floats, [R, K / 32]. A row's blocks alternate between two
// accumulators and its offsets' share (sum over blocks of offset x d x sum(q)) is one vector dot at
// the end: one chain through every block waited on FMA latency (4 cycles a block), and INT4 at one
// row is compute-bound.
template <int R>
void i4_pass(const QuantizedRows& a, const uint8_t* packed, const float* s, const float* o, float* y, int64_t m,
             int64_t ldy, int64_t k, int64_t r) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < m; ++i) {
    const int8_t* xq = a.q.data() + i * k;
    const float* d = a.d.data() + i * nb;
    const float* dsum = a.dsum.data() + i * nb;
    float sums[R];
#ifdef LLMACCEL_AVX2
    __m256 even[R], odd[R];
    for (int j = 0; j < R; ++j) even[j] = odd[j] = _mm256_setzero_ps();
#define LLMACCEL_I4_BLOCK(b, acc)                                                                      \
  {                                                                                                    \
    const __m256i xv = load32(xq + (b) * kBlock);                                                      \
    for (int j = 0; j < R; ++j) {                                                                      \
      const __m256i dot = dot_u4_i8(packed + (r + j) * (k / 2) + (b) * 16, xv);                        \
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * s[j * nb + (b)]), _mm256_cvtepi32_ps(dot), acc[j]); \
    }                                                                                                  \
  }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      LLMACCEL_I4_BLOCK(b, even)
      LLMACCEL_I4_BLOCK(b + 1, odd)
    }
    if (b < nb) LLMACCEL_I4_BLOCK(b, even)
#undef LLMACCEL_I4_BLOCK
    for (int j = 0; j < R; ++j) {
      __m256 off = _mm256_setzero_ps();
      int64_t e = 0;
      for (; e + 8 <= nb; e += 8)
        off = _mm256_fmadd_ps(_mm256_loadu_ps(o + j * nb + e), _mm256_loadu_ps(dsum + e), off);
      float tail = 0.0f;
      for (; e < nb; ++e) tail += o[j * nb + e] * dsum[e];
      sums[j] = hsum8(_mm256_add_ps(even[j], odd[j])) + (hsum8(off) + tail);
    }
#else
    for (int j = 0; j < R; ++j) {
      const uint8_t* wr = packed + (r + j) * (k / 2);
      sums[j] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t e = 0; e < 16; ++e) {
          dot += int32_t(wr[b * 16 + e] & 0x0F) * int32_t(xq[b * kBlock + e]);
          dot += int32_t(wr[b * 16 + e] >> 4) * int32_t(xq[b * kBlock + e + 16]);
        }
        sums[j] += d[b] * s[j * nb + b] * static_cast<float>(dot) + o[j * nb + b] * dsum[b];
      }
    }
#endif
    for (int j = 0; j < R; ++j) y[i * ldy + r + j] = sums[j];
  }
}

// float16 -> float32, eight at a time (one at a time was a third of the INT4 kernel's work at one row).
void halves_to_floats(const uint16_t* src, float* dst, int64_t count) {
  int64_t e = 0;
#ifdef LLMACCEL_AVX2
  for (; e + 8 <= count; e += 8)
    _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e))));
#endif
  for (; e < count; ++e) dst[e] = half_to_float(src[e]);
}

}  // namespace

LLMACCEL_ONE_COPY void i8_columns(const QuantizedRows& a, const int8_t* w, const float* scale, bool grouped, float* y, int64_t ldy,
                int64_t m, int64_t k, int64_t n0, int64_t n1) {
  int64_t r = n0;
  for (; m >= 4 && r + 4 <= n1; r += 4) i8_pass<4>(a, w, scale, grouped, y, m, ldy, k, r);
  for (; r < n1; ++r) i8_pass<1>(a, w, scale, grouped, y, m, ldy, k, r);
}

LLMACCEL_ONE_COPY void i4_columns(const QuantizedRows& a, const uint8_t* packed, const uint16_t* scale, const uint16_t* offset,
                float* y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
  const int64_t nb = k / kBlock;
  thread_local std::vector<float> s, o;  // this thread's rows' scales and offsets, as floats
  s.resize(4 * nb);
  o.resize(4 * nb);
  for (int64_t r = n0; r < n1;) {
    const int64_t rows = m >= 4 && r + 4 <= n1 ? 4 : 1;
    halves_to_floats(scale + r * nb, s.data(), rows * nb);
    halves_to_floats(offset + r * nb, o.data(), rows * nb);
    if (rows == 4)
      i4_pass<4>(a, packed, s.data(), o.data(), y, m, ldy, k, r);
    else
      i4_pass<1>(a, packed, s.data(), o.data(), y, m, ldy, k, r);
    r += rows;
  }
}

namespace {

// Splits the weight rows between ATen's threads in runs of `grain` (a multiple of four).
template <typename Fn>
void over_rows(int64_t n, Fn fn) {
  const int64_t threads = at::get_num_threads();
  int64_t grain = std::max<int64_t>(16, (n + threads - 1) / threads);
  grain = (grain + 3) / 4 * 4;
  at::parallel_for(0, n, grain, fn);
}

torch::Tensor as_float_rows(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  return x.to(torch::kFloat32).contiguous();
}

}  // namespace
}  // namespace llmaccel

using namespace llmaccel;

// w int8 [N, K]; scale float32 [N] (per row) or [N, K / 32] (per 32 inputs). K a multiple of 32.
torch::Tensor gemv_i8(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous(), "scale must be contiguous float32");
  const bool grouped = scale.dim() == 2;
  TORCH_CHECK(grouped ? (scale.size(0) == n && scale.size(1) == k / kBlock) : (scale.dim() == 1 && scale.size(0) == n),
              "scale must be [N] or [N, K / 32]");
  auto xf = as_float_rows(x, k);
  const int64_t m = xf.size(0);
  QuantizedRows a;
  quantize_rows(xf.data_ptr<float>(), m, k, a);
  auto y = torch::empty({m, n}, xf.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(n, [&](int64_t n0, int64_t n1) { i8_columns(a, wp, sp, grouped, yp, n, m, k, n0, n1); });
  return y;
}

// packed uint8 [N, K / 2] (see dot_u4_i8 for the nibble order); scale, offset float16 [N, K / 32].
torch::Tensor gemv_i4(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor offset) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K / 2]");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  for (const auto* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == k / kBlock,
                "scale and offset must be contiguous float16 [N, K / 32]");
  auto xf = as_float_rows(x, k);
  const int64_t m = xf.size(0);
  QuantizedRows a;
  quantize_rows(xf.data_ptr<float>(), m, k, a);
  auto y = torch::empty({m, n}, xf.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* op = reinterpret_cast<const uint16_t*>(offset.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  over_rows(n, [&](int64_t n0, int64_t n1) { i4_columns(a, wp, sp, op, yp, n, m, k, n0, n1); });
  return y;
}

bool gemv_vectorized() {
#ifdef LLMACCEL_AVX2
  return true;
#else
  return false;
#endif
}
