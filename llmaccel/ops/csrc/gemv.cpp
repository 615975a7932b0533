// Weight-streaming products for linear layers with few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T.
//
// With one to a few rows a linear layer is bound by reading its weights once, so these kernels aim at
// the machine's read bandwidth: each thread streams a contiguous run of weight rows, several rows at a
// time, and applies every activation row to a weight row while it sits in L1.
// (float32 weights: linear_f32.cpp, one layout for every row count.)
// (INT4 weights: gemv_int4.cpp, its own interleaved layout.)
// - INT8 weights (a scale per row, or per 32 inputs: GGUF Q8_0): the activations are quantized on the fly
//   to INT8 in blocks of 32, each with its own scale (llama.cpp's Q8 activations; the INT4 kernel reads
//   the same), and the products are integer dot products (AVX2 maddubs), 32 multiply-adds an
//   instruction, so the kernel waits on memory rather than on arithmetic. Each block's integer sum is
//   scaled once in float.
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

}  // namespace

LLMACCEL_ONE_COPY void i8_columns(const QuantizedRows& a, const int8_t* w, const float* scale, bool grouped, float* y, int64_t ldy,
                int64_t m, int64_t k, int64_t n0, int64_t n1) {
  int64_t r = n0;
  for (; m >= 4 && r + 4 <= n1; r += 4) i8_pass<4>(a, w, scale, grouped, y, m, ldy, k, r);
  for (; r < n1; ++r) i8_pass<1>(a, w, scale, grouped, y, m, ldy, k, r);
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

bool gemv_vectorized() {
#ifdef LLMACCEL_AVX2
  return true;
#else
  return false;
#endif
}
