// INT4 weight-only products y[M, N] = x[M, K] @ W[N, K]^T, W = q * scale + offset per 32-wide group
// (GGUF Q4_1's grid), for every row count.
//
// Layout (ops/gemv.py `pack_int4_blocks`): weight rows in groups of 16, each group a run of K / 32
// blocks of 320 bytes, one block per 32 inputs:
//   bytes 0..255    4 chunks of 64 bytes; in chunk t, byte 4 r + j holds row r's input 8 t + j (low
//                   nibble) and 8 t + 4 + j (high nibble), j < 4;
//   bytes 256..287  the 16 rows' scales, float16;   bytes 288..319  their offsets, float16.
// So one 64-byte load and a mask give 16 rows x 4 inputs, exactly one u8 x s8 dot-product instruction
// against 4 broadcast activation bytes (AVX512-VNNI vpdpbusd: 64 multiply-adds), and a thread streams
// one contiguous run of memory. The row-major layout this replaces spent ~10 instructions on every 16
// weight bytes (one row at a time, a horizontal sum per row) and read INT4 at ~16-20 GB/s where INT8
// reached ~35-40; this one runs at ~0.9x a plain read of the same bytes (2-core AMD EPYC Zen 4).
//
// Activations are quantized to INT8 per 32 inputs as for the INT8 kernel (gemv.cpp); a block's integer
// sum is exact, then scaled once: y += (d * scale) * dot + offset * (d * sum(xq)). Every output row's sum
// runs in the same order whatever M is and whichever rows share a pass, so a request's results do not
// depend on its batch. Builds without AVX-512 VNNI run 8 rows a vector with AVX2, or plain C++.
#include "aten.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace llmaccel {
namespace {

constexpr int64_t kScaleAt = 256, kOffsetAt = 288;

inline float half_bits_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Writes the first `cols` of 16 sums to y.
inline void store_row(const float* sums, float* y, int64_t cols) { std::memcpy(y, sums, cols * sizeof(float)); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Rows i0 .. i0 + rows - 1 (rows <= MR; spare lanes repeat the last row, not stored) of x against one group:
// 16 outputs each. Block pairs unrolled (even, odd) with no branch, activations broadcast straight from memory
// (copied out first, each went through a general register: gemv.cpp's INT8 kernel says what that cost).
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 even[MR], odd[MR];
  for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const PassRows<MR> x(a, i0, rows, k);
  auto step = [&](int64_t b, __m512* accs) {
    const uint8_t* block = group + b * kInt4BlockBytes;
    __m512i lo[4], hi[4];
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(block + 64 * t);
      lo[t] = _mm512_and_si512(v, nibble);
      hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kScaleAt)));
    const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kOffsetAt)));
    for (int r = 0; r < MR; ++r) {
      const int32_t* x4 = x.q[r] + 8 * b;  // the block's 32 activation bytes, four at a time
      __m512i dot_lo = _mm512_setzero_si512(), dot_hi = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        dot_lo = _mm512_dpbusd_epi32(dot_lo, lo[t], _mm512_set1_epi32(x4[2 * t]));
        dot_hi = _mm512_dpbusd_epi32(dot_hi, hi[t], _mm512_set1_epi32(x4[2 * t + 1]));
      }
      const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(x.d[r][b]));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dot_lo, dot_hi));
      // the block's offset term joins its accumulator by FMA, after its dot: a fixed order of builtins the
      // compiler may not reassociate under -ffast-math (a third accumulator summed at the end was, for one
      // row a pass and not for more, so a row's result depended on the rows beside it)
      accs[r] = _mm512_fmadd_ps(ds, dot, accs[r]);
      accs[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.dsum[r][b]), accs[r]);
    }
  };
  alternate_blocks(nb, step, even, odd);
  for (int r = 0; r < rows; ++r) {
    alignas(64) float sums[kGroupRows];
    _mm512_store_ps(sums, _mm512_add_ps(even[r], odd[r]));
    store_row(sums, y + (i0 + r) * ldy, cols);
  }
}
constexpr int kPassRows = 2;  // one or two rows: three and more take tile_pass (below)

#define LLMACCEL_I4_TILES 1
// Three rows and more (batched decode steps, prefill chunks): MR rows x NR groups a pass, each chunk unpacked once
// for the MR rows and each broadcast activation used for NR groups, one integer chain a sum (gemv.cpp's INT8 tiles
// say why). Each element's steps are group_pass's in its order, so a row's result does not depend on its pass. A
// 1B-shaped layer's four projections: 0.83x group_pass's time at 2,048 rows, 0.88x at 64 (2-core AMD EPYC Zen 5).
template <int MR, int NR>
void tile_pass(const QuantizedRows& a, const uint8_t* group0, int64_t group_bytes, int64_t nb, int64_t k, int64_t i0,
               int rows, float* sums) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 even[MR][NR], odd[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < NR; ++g) even[r][g] = odd[r][g] = _mm512_setzero_ps();
  const PassRows<MR> x(a, i0, rows, k);
  auto step = [&](int64_t b, __m512 (*accs)[NR]) {
    const uint8_t* block[NR];
    for (int g = 0; g < NR; ++g) block[g] = group0 + g * group_bytes + b * kInt4BlockBytes;
    __m512i dot[MR][NR];
    for (int r = 0; r < MR; ++r)
      for (int g = 0; g < NR; ++g) dot[r][g] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      __m512i lo[NR], hi[NR];
      for (int g = 0; g < NR; ++g) {
        const __m512i v = _mm512_loadu_si512(block[g] + 64 * t);
        lo[g] = _mm512_and_si512(v, nibble);
        hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i x0 = _mm512_set1_epi32(x.q[r][8 * b + 2 * t]), x1 = _mm512_set1_epi32(x.q[r][8 * b + 2 * t + 1]);
        for (int g = 0; g < NR; ++g) dot[r][g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][g], lo[g], x0), hi[g], x1);
      }
    }
    for (int g = 0; g < NR; ++g) {
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[g] + kScaleAt)));
      const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[g] + kOffsetAt)));
      for (int r = 0; r < MR; ++r) {
        const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(x.d[r][b]));
        accs[r][g] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot[r][g]), accs[r][g]);
        accs[r][g] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.dsum[r][b]), accs[r][g]);
      }
    }
  };
  alternate_blocks(nb, step, even, odd);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < NR; ++g) _mm512_storeu_ps(sums + (r * NR + g) * kGroupRows, _mm512_add_ps(even[r][g], odd[r][g]));
}
void i4_tiles(const QuantizedRows& a, const uint8_t* blocks, float* y, int64_t ldy, int64_t m, int64_t k, int64_t n,
              int64_t g0, int64_t g1) {
  const int64_t nb = k / kBlock, group_bytes = nb * kInt4BlockBytes;
  tile_sweep(m, n, g0, g1, nullptr, y, ldy, [&](int64_t g, int width, int64_t i0, int rows, float* sums) {
    const uint8_t* group = blocks + g * group_bytes;
    if (width == kTileGroups) tile_pass<kTileRows, kTileGroups>(a, group, group_bytes, nb, k, i0, rows, sums);
    else tile_pass<kTileRows, 1>(a, group, group_bytes, nb, k, i0, rows, sums);
  });
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMACCEL_I4_AVX2 1
// One activation row (a lone decode step) takes both 8-row halves of the group in one pass, so its blocks stream
// once (gemv.cpp's INT8 kernel says why); more rows take a half a pass, for the registers.
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  constexpr int H = MR == 1 ? 2 : 1;  // halves a pass
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t half0 = 0; half0 < 2 && half0 * 8 < cols; half0 += H) {
    __m256 acc[MR][H];
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = group + b * kInt4BlockBytes;
      if (half0 == 0) prefetch_ahead(block, kInt4BlockBytes);
      __m256i wide[MR][H];
      for (int t = 0; t < 4; ++t) {
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * (half0 + h)));
          const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int r = 0; r < MR; ++r) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.data() + (i0 + r) * k + b * kBlock) + 2 * t;
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4[0])),
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4[1])));
            wide[r][h] = t == 0 ? pair : _mm256_add_epi16(wide[r][h], pair);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const auto* halves = reinterpret_cast<const __m128i*>(block + kScaleAt + 16 * (half0 + h));
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(halves));
        const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(halves + 2));
        for (int r = 0; r < MR; ++r) {
          const int64_t i = i0 + r;
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(wide[r][h], ones));
          acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(a.d[i * nb + b])), dot, acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(a.dsum[i * nb + b]), acc[r][h]);
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t half = half0 + h;
      if (half * 8 >= cols) break;
      for (int r = 0; r < MR; ++r) {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, acc[r][h]);
        store_row(sums, y + (i0 + r) * ldy + 8 * half, std::min<int64_t>(8, cols - 8 * half));
      }
    }
  }
  (void)rows;
}
constexpr int kPassRows = 4;  // 2 weight registers + 2 a row: 10 of 16 ymm

#else
// The same arithmetic in plain C++, one row at a time.
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    float even[kGroupRows] = {}, odd[kGroupRows] = {}, off[kGroupRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = group + b * kInt4BlockBytes;
      const int8_t* xq = a.q.data() + i * k + b * kBlock;
      const auto* halves = reinterpret_cast<const uint16_t*>(block + kScaleAt);
      for (int64_t row = 0; row < kGroupRows; ++row) {
        int32_t dot = 0;
        for (int t = 0; t < 4; ++t)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = block[64 * t + 4 * row + j];
            dot += int32_t(byte & 0x0F) * xq[8 * t + j] + int32_t(byte >> 4) * xq[8 * t + 4 + j];
          }
        const float ds = half_bits_to_float(halves[row]) * a.d[i * nb + b];
        (b & 1 ? odd : even)[row] += ds * static_cast<float>(dot);
        off[row] += half_bits_to_float(halves[kGroupRows + row]) * a.dsum[i * nb + b];
      }
    }
    float sums[kGroupRows];
    for (int64_t row = 0; row < kGroupRows; ++row) sums[row] = even[row] + odd[row] + off[row];
    store_row(sums, y + i * ldy, cols);
  }
}
constexpr int kPassRows = 1;
#endif

}  // namespace

LLMACCEL_ONE_COPY void i4_groups(const QuantizedRows& a, const uint8_t* blocks, float* y, int64_t ldy, int64_t m,
                                 int64_t k, int64_t n, int64_t g0, int64_t g1) {
#ifdef LLMACCEL_I4_TILES
  if (m >= kTileFromRows) return i4_tiles(a, blocks, y, ldy, m, k, n, g0, g1);
#endif
  const int64_t nb = k / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = blocks + g * nb * kInt4BlockBytes;
    const int64_t cols = std::min(kGroupRows, n - g * kGroupRows);
    for (int64_t i0 = 0; i0 < m; i0 += kPassRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPassRows, m - i0));
      float* out = y + g * kGroupRows;
      // a pass of exactly the rows left (a row's arithmetic is the same in any pass)
      if (kPassRows >= 4 && rows == 4) group_pass<(kPassRows >= 4 ? 4 : 1)>(a, group, nb, k, i0, rows, out, ldy, cols);
      else if (kPassRows >= 3 && rows == 3) group_pass<(kPassRows >= 3 ? 3 : 1)>(a, group, nb, k, i0, rows, out, ldy, cols);
      else if (kPassRows >= 2 && rows == 2) group_pass<(kPassRows >= 2 ? 2 : 1)>(a, group, nb, k, i0, rows, out, ldy, cols);
      else group_pass<1>(a, group, nb, k, i0, rows, out, ldy, cols);
    }
  }
}

}  // namespace llmaccel
