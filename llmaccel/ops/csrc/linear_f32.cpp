// Float32 linear layers on one weight layout for every row count: y[M, N] = x[M, K] @ W[N, K]^T.
//
// The weight is stored once, in panels of 16 output columns: P[N / 16][K][16] (N padded up to 16), so
// a product reads each panel front to back. One micro-kernel serves every row count: up to six
// activation rows against one panel, in twelve AVX2 accumulators (BLIS's register tile), each output
// summed over k = 0 .. K-1 in order, one FMA a step. So:
// - one row (decode) streams the weights once, two panels at a time (two sequential reads, four FMA
//   chains; one panel's two chains wait on the FMA latency and one stream leaves the memory idle):
//   the machine's read bandwidth is the limit;
// - many rows (prefill, big batches) reuse each panel from L2 across a block of rows: compute-bound;
// - an output's value does not depend on how many rows share the call or where its row falls (batch
//   invariance): a request gets the same logits alone, in any batch, and when recomputed after
//   preemption.
// The panels may also hold bfloat16 or float16 weights (a bf16 / f16 checkpoint served in float32 on a CPU
// without bf16 arithmetic): each is widened to float32 exactly as it is loaded (a shift, or F16C's convert), so
// the sums are those of the float32 copy, bit for bit, from half the memory and half the read traffic.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMACCEL_LINEAR_AVX2 1
#endif

namespace llmaccel {
namespace {

constexpr int64_t kRowTile = 6;    // activation rows a micro-kernel call
constexpr int64_t kRowBlock = 128;  // activation rows a pass: up to 128 (decode batches), weights are read once
constexpr int64_t kDepth = 256;     // inputs a pass: the rows' slice (128 KiB) stays in L2 across the panels

// Accumulators are named variables, not arrays: GCC keeps arrays of __m256 on the stack, storing
// them every step (measured: 2.5x slower).
#ifdef LLMACCEL_LINEAR_AVX2
inline void load_row(const float* y, __m256& lo, __m256& hi, int64_t cols) {
  alignas(32) float in[kPanel] = {};
  std::memcpy(in, y, cols * sizeof(float));
  lo = _mm256_load_ps(in);
  hi = _mm256_load_ps(in + 8);
}

inline void store_row(float* y, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == kPanel) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float out[kPanel];
  _mm256_store_ps(out, lo);
  _mm256_store_ps(out + 8, hi);
  std::memcpy(y, out, cols * sizeof(float));
}
#endif

// y[r, 0:cols] = x[r, :] . panel for R rows (cols < 16 only in the last, padded panel); `resume` goes
// on from the sums already in y (stored exactly, so the summation order is unchanged).
// Weight element types of a panel: float32, bfloat16 bits, float16 bits.
struct Bf16Bits { uint16_t v; };
struct F16Bits { uint16_t v; };

inline float widen(float w) { return w; }
inline float widen(Bf16Bits w) {
  const uint32_t bits = static_cast<uint32_t>(w.v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float widen(F16Bits w) { return static_cast<float>(c10::Half(w.v, c10::Half::from_bits())); }

#ifdef LLMACCEL_LINEAR_AVX2
// Eight weights from p as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16Bits* p) { return widen8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const F16Bits* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

template <int R, typename W>
void tile(const float* x, int64_t ldx, int64_t k, const W* panel, float* y, int64_t ldy, int64_t cols, bool resume) {
#ifdef LLMACCEL_LINEAR_AVX2
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0, l3 = l0, h3 = l0, l4 = l0, h4 = l0,
         l5 = l0, h5 = l0;
  if (resume) {
#define LLMACCEL_LOAD(r) \
  if constexpr (R > r) load_row(y + r * ldy, l##r, h##r, cols);
    LLMACCEL_LOAD(0) LLMACCEL_LOAD(1) LLMACCEL_LOAD(2) LLMACCEL_LOAD(3) LLMACCEL_LOAD(4) LLMACCEL_LOAD(5)
#undef LLMACCEL_LOAD
  }
#define LLMACCEL_ROW(r)                                         \
  if constexpr (R > r) {                                        \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + j);       \
    l##r = _mm256_fmadd_ps(xv, w0, l##r);                       \
    h##r = _mm256_fmadd_ps(xv, w1, h##r);                       \
  }
  for (int64_t j = 0; j < k; ++j) {
    const __m256 w0 = load8(panel + j * kPanel);
    const __m256 w1 = load8(panel + j * kPanel + 8);
    LLMACCEL_ROW(0) LLMACCEL_ROW(1) LLMACCEL_ROW(2) LLMACCEL_ROW(3) LLMACCEL_ROW(4) LLMACCEL_ROW(5)
  }
#undef LLMACCEL_ROW
  const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, lo[r], hi[r], cols);
#else
  float acc[R][kPanel] = {};
  if (resume)
    for (int r = 0; r < R; ++r) std::memcpy(acc[r], y + r * ldy, cols * sizeof(float));
  for (int64_t j = 0; j < k; ++j)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + j] * widen(panel[j * kPanel + c]);
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, acc[r], cols * sizeof(float));
#endif
}

template <typename W>
void tile_rows(int64_t rows, const float* x, int64_t ldx, int64_t k, const W* panel, float* y, int64_t ldy, int64_t cols,
               bool resume) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, k, panel, y, ldy, cols, resume);
    case 2: return tile<2>(x, ldx, k, panel, y, ldy, cols, resume);
    case 3: return tile<3>(x, ldx, k, panel, y, ldy, cols, resume);
    case 4: return tile<4>(x, ldx, k, panel, y, ldy, cols, resume);
    case 5: return tile<5>(x, ldx, k, panel, y, ldy, cols, resume);
    default: return tile<6>(x, ldx, k, panel, y, ldy, cols, resume);
  }
}

// One row against two panels at once, with the software prefetch the quantized kernels use: the same sums as
// tile<1> on each (on a 2-core AMD EPYC Zen 3, one row of a 160 MB bf16 matrix read at 24-28 GB/s a panel at a
// time, 28-33 two at a time, interleaved medians; a sum over the same bytes 29-33).
template <typename W>
void two_panels(const float* x, int64_t k, const W* a, const W* b, float* ya, float* yb, int64_t cols_a,
                int64_t cols_b) {
#ifdef LLMACCEL_LINEAR_AVX2
  __m256 la = _mm256_setzero_ps(), ha = la, lb = la, hb = la;
  constexpr int64_t line_every = 64 / (kPanel * sizeof(W));  // inputs a 64-byte line of a panel holds
  for (int64_t j = 0; j < k; ++j) {
    if (j % line_every == 0) {
      prefetch_ahead(reinterpret_cast<const uint8_t*>(a + j * kPanel), 64);
      prefetch_ahead(reinterpret_cast<const uint8_t*>(b + j * kPanel), 64);
    }
    const __m256 xv = _mm256_broadcast_ss(x + j);
    la = _mm256_fmadd_ps(xv, load8(a + j * kPanel), la);
    ha = _mm256_fmadd_ps(xv, load8(a + j * kPanel + 8), ha);
    lb = _mm256_fmadd_ps(xv, load8(b + j * kPanel), lb);
    hb = _mm256_fmadd_ps(xv, load8(b + j * kPanel + 8), hb);
  }
  store_row(ya, la, ha, cols_a);
  store_row(yb, lb, hb, cols_b);
#else
  tile<1>(x, k, k, a, ya, 0, cols_a, false);
  tile<1>(x, k, k, b, yb, 0, cols_b, false);
#endif
}

template <typename W>
void panels_product(const float* xp, int64_t m, int64_t k, const W* pp, int64_t n, float* yp, int64_t ldy, int64_t p0,
                    int64_t p1) {
  const auto cols = [n](int64_t p) { return std::min(kPanel, n - p * kPanel); };
  if (m == 1) {  // decode of one sequence
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2)
      two_panels(xp, k, pp + p * k * kPanel, pp + (p + 1) * k * kPanel, yp + p * kPanel, yp + (p + 1) * kPanel,
                 cols(p), cols(p + 1));
    if (p < p1) tile<1>(xp, k, k, pp + p * k * kPanel, yp + p * kPanel, ldy, cols(p), false);
    return;
  }
  // A few rows stream each panel whole; more go through the inputs a slice at a time.
  const int64_t depth = m <= kRowTile ? k : kDepth;
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t r1 = std::min(m, r0 + kRowBlock);
    // Panels a chunk: the chunk's outputs for these rows (<= 256 KiB) stay in L2 while the input
    // slices pass (a wide layer such as the LM head otherwise streams its outputs through memory
    // once a slice).
    const int64_t chunk = std::max<int64_t>(1, (256 << 10) / ((r1 - r0) * kPanel * 4));
    for (int64_t c0 = p0; c0 < p1; c0 += chunk) {
      const int64_t c1 = std::min(p1, c0 + chunk);
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        for (int64_t p = c0; p < c1; ++p) {
          const W* panel = pp + (p * k + k0) * kPanel;
          for (int64_t i = r0; i < r1; i += kRowTile)
            tile_rows(std::min(kRowTile, r1 - i), xp + i * k + k0, k, std::min(depth, k - k0), panel,
                      yp + i * ldy + p * kPanel, ldy, cols(p), k0 > 0);
        }
      }
    }
  }
}

}  // namespace

LLMACCEL_ONE_COPY void f32_panels(const float* xp, int64_t m, int64_t k, const float* pp, int64_t n, float* yp, int64_t ldy,
                int64_t p0, int64_t p1) {
  panels_product(xp, m, k, pp, n, yp, ldy, p0, p1);
}

LLMACCEL_ONE_COPY void half_panels(const float* xp, int64_t m, int64_t k, const uint16_t* pp, bool bf16, int64_t n,
                                   float* yp, int64_t ldy, int64_t p0, int64_t p1) {
  if (bf16)
    panels_product(xp, m, k, reinterpret_cast<const Bf16Bits*>(pp), n, yp, ldy, p0, p1);
  else
    panels_product(xp, m, k, reinterpret_cast<const F16Bits*>(pp), n, yp, ldy, p0, p1);
}

}  // namespace llmaccel

using namespace llmaccel;

// x [M, K] float32 (other dtypes are converted), panels float32 [ceil(N / 16), K, 16] -> [M, N].
// Panels of bfloat16 or float16 weights widen each weight to float32 as they read it.
torch::Tensor linear_f32(torch::Tensor x, torch::Tensor panels, int64_t n) {
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  (type == torch::kFloat32 || type == torch::kBFloat16 || type == torch::kHalf),
              "panels must be contiguous float32, bfloat16 or float16 [N / 16, K, 16]");
  const int64_t num_panels = panels.size(0), k = panels.size(1);
  TORCH_CHECK(n > (num_panels - 1) * kPanel && n <= num_panels * kPanel, "n = ", n, " does not fit ", num_panels,
              " panels");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0);
  auto y = torch::empty({m, n}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (num_panels + threads - 1) / threads);
  if (type == torch::kFloat32) {
    const float* pp = panels.data_ptr<float>();
    at::parallel_for(0, num_panels, grain, [&](int64_t p0, int64_t p1) { f32_panels(xp, m, k, pp, n, yp, n, p0, p1); });
  } else {
    const auto* pp = static_cast<const uint16_t*>(panels.data_ptr());
    const bool bf16 = type == torch::kBFloat16;
    at::parallel_for(0, num_panels, grain,
                     [&](int64_t p0, int64_t p1) { half_panels(xp, m, k, pp, bf16, n, yp, n, p0, p1); });
  }
  return y;
}
