// bfloat16 weights at few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T, W in its plain layout.
//
// oneDNN's bfloat16 GEMM is fast from a few dozen rows up (AVX512-BF16, AMX) but poor at one row: it
// read the default model's weights at about half the machine's bandwidth (the speed issue's profile:
// 28 ms a token in aten::mm on the AMX machine). A row of activations against bf16 weights is a
// stream of dot products: each thread reads a contiguous run of weight rows, one at a time, widens
// each bf16 to float32 (a 16-bit shift: bf16 is the top half of a float32) and multiplies in float32,
// so the machine's read bandwidth is the limit on any AVX2 CPU. The layers use it up to a few rows and
// oneDNN above (ops/cpu_linear.py); the output of a row does not depend on the rows beside it.
#include "aten.h"
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


// Weight row r against activation rows i0 .. i0 + G - 1. Per activation row, four accumulators of eight
// float32 lanes go over K 32 at a time (AVX2) (one chain would wait on FMA latency), then are summed, then the
// K % 32 tail in order: the same operations in the same order for any G, so a row's output does not
// depend on the rows beside it. The G rows share each widened weight chunk, so a few rows (a small batch,
// or speculative decoding's verification rows) cost one row's weight traffic and widening, not G.
// One weight row at a time: interleaving four weight rows' streams read at half the bandwidth (2-core AMD
// EPYC Zen 4: 15 against 34 GB/s, measured).
template <int G>
void bf16_row_group(const float* x, const uint16_t* wr, float* y, int64_t ldy, int64_t k, int64_t i0, int64_t r) {
  const int64_t k32 = k / 32 * 32;
  float sums[G];
#ifdef LLMACCEL_BF16_AVX2
  __m256 c[G][4];
  for (int g = 0; g < G; ++g) c[g][0] = c[g][1] = c[g][2] = c[g][3] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k32; j += 32) {
    const __m256 w0 = widen8(wr + j), w1 = widen8(wr + j + 8), w2 = widen8(wr + j + 16),
                 w3 = widen8(wr + j + 24);
    for (int g = 0; g < G; ++g) {
      const float* xr = x + (i0 + g) * k + j;
      c[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, c[g][0]);
      c[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, c[g][1]);
      c[g][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, c[g][2]);
      c[g][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, c[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    sums[g] = hsum8(_mm256_add_ps(_mm256_add_ps(c[g][0], c[g][1]), _mm256_add_ps(c[g][2], c[g][3])));
#else
  for (int g = 0; g < G; ++g) {
    const float* xr = x + (i0 + g) * k;
    sums[g] = 0.0f;
    for (int64_t j = 0; j < k32; ++j) sums[g] += xr[j] * bf16_to_float(wr[j]);
  }
#endif
  for (int g = 0; g < G; ++g) {
    const float* xr = x + (i0 + g) * k;
    for (int64_t j = k32; j < k; ++j) sums[g] += xr[j] * bf16_to_float(wr[j]);
    y[(i0 + g) * ldy + r] = sums[g];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same for activations that are bfloat16 values (xb: their bits): vdpbf16ps multiplies pairs of
// bfloat16 and adds them into float32 lanes, 32 products an instruction against 8 fused multiply-adds
// after widening, so a few rows stay bound by the weights' read rather than by arithmetic (on a 2-core
// Zen 4, 4 rows of the default model's layers: 13.8 ms with the widening kernel). Two accumulators of
// sixteen lanes a row over K 64 at a time, summed, then the K % 64 tail in order: any G gives a row the
// same result.
template <int G>
void bf16_dot_group(const uint16_t* xb, const uint16_t* wr, float* y, int64_t ldy, int64_t k, int64_t i0, int64_t r) {
  const int64_t k64 = k / 64 * 64;
  __m512 c[G][2];
  for (int g = 0; g < G; ++g) c[g][0] = c[g][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k64; j += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + j), w1 = (__m512bh)_mm512_loadu_si512(wr + j + 32);
    // From 2 rows the arithmetic leaves the memory idle between reads without a request ahead (a 1B layer at 8 rows:
    // 0.62x the time with it); one row reads fast enough alone (0.9x its speed with it, 2-core Zen 5).
    if (G > 1) prefetch_ahead(reinterpret_cast<const uint8_t*>(wr + j), 128);
    for (int g = 0; g < G; ++g) {
      const uint16_t* xr = xb + (i0 + g) * k + j;
      c[g][0] = _mm512_dpbf16_ps(c[g][0], (__m512bh)_mm512_loadu_si512(xr), w0);
      c[g][1] = _mm512_dpbf16_ps(c[g][1], (__m512bh)_mm512_loadu_si512(xr + 32), w1);
    }
  }
  for (int g = 0; g < G; ++g) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(c[g][0], c[g][1]));
    const uint16_t* xr = xb + (i0 + g) * k;
    for (int64_t j = k64; j < k; ++j) sum += bf16_to_float(xr[j]) * bf16_to_float(wr[j]);
    y[(i0 + g) * ldy + r] = sum;
  }
}
#endif

// Weight row r against every activation row (it stays in L1 between the groups), in groups of up to
// four rows. `xb`: the rows' bfloat16 bits when they are bfloat16 values and the CPU has AVX512-BF16.
void bf16_row(const float* x, const uint16_t* xb, const uint16_t* w, float* y, int64_t ldy, int64_t m, int64_t k,
              int64_t r) {
  const uint16_t* wr = w + r * k;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (xb != nullptr) {
    in_groups_of<kDotRows>(m, [&](auto g, int64_t i) { bf16_dot_group<decltype(g)::value>(xb, wr, y, ldy, k, i, r); });
    return;
  }
#endif
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) bf16_row_group<2>(x, wr, y, ldy, k, i, r);  // 8 accumulators: AVX2 has 16 registers
  if (i < m) bf16_row_group<1>(x, wr, y, ldy, k, i, r);
}

}  // namespace

LLMACCEL_ONE_COPY void bf16_columns(const float* x, const uint16_t* xb, const uint16_t* w, float* y, int64_t ldy,
                                    int64_t m, int64_t k, int64_t n0, int64_t n1) {
#if !(defined(__AVX512BF16__) && defined(__AVX512F__))
  xb = nullptr;  // no bfloat16 pairs to multiply on this CPU: the widening kernel reads x
#endif
  for (int64_t r = n0; r < n1; ++r) bf16_row(x, xb, w, y, ldy, m, k, r);
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
  // bfloat16 activations also go in as they are, for the pair kernel
  const auto xbf = x.scalar_type() == torch::kBFloat16 ? x.contiguous() : torch::Tensor();
  const auto* xb = xbf.defined() ? reinterpret_cast<const uint16_t*>(xbf.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, n, grain,
                   [&](int64_t n0, int64_t n1) { llmaccel::bf16_columns(xp, xb, wp, yp, n, m, k, n0, n1); });
  return y;
}
