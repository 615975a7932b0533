// bfloat16 weights at few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T, W in its plain layout.
//
// oneDNN's bfloat16 GEMM is fast from a few dozen rows up (AVX512-BF16, AMX) but poor at one row: it
// read the default model's weights at about half the machine's bandwidth (the speed issue's profile:
// 28 ms a token in aten::mm on the AMX machine). A row of activations against bf16 weights is a
// stream of dot products: each thread reads a contiguous run of weight rows, one at a time, widens
// each bf16 to float32 (a 16-bit shift: bf16 is the top half of a float32) and multiplies in float32,
// so the machine's read bandwidth is the limit on any AVX2 CPU. The layers use it up to a few rows and
// oneDNN above (ops/cpu_linear.py); the output of a row does not depend on the rows beside it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMACCEL_BF16_AVX2 1
#endif

namespace llmaccel {
namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

#ifdef LLMACCEL_BF16_AVX2
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// Weight row r against every activation row (it stays in L1 between them). Four accumulators of eight
// float32 lanes go over K 32 at a time (one chain would wait on FMA latency), then are summed, then the
// K % 32 tail in order. One weight row at a time: interleaving four rows' streams read at half the
// bandwidth (2-core AMD EPYC Zen 4: 15 against 34 GB/s, measured).
void bf16_row(const float* x, const uint16_t* w, float* y, int64_t ldy, int64_t m, int64_t k, int64_t r) {
  const uint16_t* wr = w + r * k;
  const int64_t k32 = k / 32 * 32;
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * k;
    float sum;
#ifdef LLMACCEL_BF16_AVX2
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (int64_t j = 0; j < k32; j += 32) {
      c0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j), load_bf16x8(wr + j), c0);
      c1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 8), load_bf16x8(wr + j + 8), c1);
      c2 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 16), load_bf16x8(wr + j + 16), c2);
      c3 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j + 24), load_bf16x8(wr + j + 24), c3);
    }
    sum = hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
#else
    sum = 0.0f;
    for (int64_t j = 0; j < k32; ++j) sum += xr[j] * bf16_to_float(wr[j]);
#endif
    for (int64_t j = k32; j < k; ++j) sum += xr[j] * bf16_to_float(wr[j]);
    y[i * ldy + r] = sum;
  }
}

}  // namespace

LLMACCEL_ONE_COPY void bf16_columns(const float* x, const uint16_t* w, float* y, int64_t ldy, int64_t m, int64_t k,
                                    int64_t n0, int64_t n1) {
  for (int64_t r = n0; r < n1; ++r) bf16_row(x, w, y, ldy, m, k, r);
}

}  // namespace llmaccel

// x [M, K] (any float dtype; read as float32), w bfloat16 [N, K] -> float32 [M, N].
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0);
  auto y = torch::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(16, (n + threads - 1) / threads + 3) / 4 * 4;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) { llmaccel::bf16_columns(xp, wp, yp, n, m, k, n0, n1); });
  return y;
}
