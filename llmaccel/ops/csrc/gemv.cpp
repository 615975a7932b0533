// Weight-streaming products for linear layers with few rows (decode): y[M, N] = x[M, K] @ W[N, K]^T.
//
// With one to a few rows a linear layer is bound by reading its weights once, so these kernels aim at
// the machine's read bandwidth: each thread streams a contiguous run of weight rows, several rows at a
// time, and applies every activation row to a weight row while it sits in L1.
// (float32 weights: linear_f32.cpp, one layout for every row count.)
// (INT4 weights: gemv_int4.cpp, the same scheme with 4-bit blocks; its torch entry point is here.)
// - INT8 weights (a scale per row, or per 32 inputs: GGUF Q8_0): the activations are quantized on the fly
//   to INT8 in blocks of 32, each with its own scale (llama.cpp's Q8 activations; the INT4 kernel reads
//   the same), and the products are integer dot products. The weights live in blocks of 16 rows x 32
//   inputs (ops/gemv.py `pack_int8_blocks`): 8 chunks of 64 bytes, byte 4 r + j of chunk t holding row
//   r's input 4 t + j plus 128 (as unsigned), then, for per-32 scales, the 16 rows' float16 scales (GGUF Q8_0's d as
//   the file has it: 544 bytes a block, 8.5 bits a weight as in the file; float32 scales made it 9). One
//   chunk is one AVX512-VNNI vpdpbusd (u8 x s8, 64 multiply-adds) against 4 broadcast activation bytes;
//   the +128 comes off exactly as 128 x the block's activation sum. One weight row at a time (the layout
//   before) took a horizontal sum a row and 32 multiply-adds an instruction: at 64 rows it ran at half
//   the 4-bit kernel's speed. Each block's integer sum is scaled once in float, in the same order for
//   any number of rows, so results do not depend on the batch. One or two rows take group_pass; three
//   and more (batched decode steps, prefill chunks) take tiles of 4 rows x 2 groups (tile_pass), which
//   reach ~1.45x oneDNN's bf16 GEMM rate where group_pass reached ~1x.
// Builds without AVX-512 VNNI run 8 rows a vector with AVX2 (maddubs), or plain C++.
#include "aten.h"
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

// A float32 or bfloat16 row's values as float32, 16 or 8 at a time.
inline float value_at(const float* x, int64_t j) { return x[j]; }
inline float value_at(const uint16_t* x, int64_t j) {
  return to_float(c10::BFloat16(x[j], c10::BFloat16::from_bits()));
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) { return widen16(reinterpret_cast<const c10::BFloat16*>(x)); }
#elif defined(LLMACCEL_AVX2)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) { return widen8(x); }
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}
#endif

// One block of 32 inputs: q = round(x / d) (to nearest even, as the vector conversions round) with
// d = max|x| / 127, and the sums of q's halves. The vector paths compute exactly what the scalar one does
// (the maximum and integer sums do not depend on their order), and ran ~20x faster: as scalar code the
// quantization of a 2,048-row chunk took ~3.8 ns an input, a sixth of an INT8 projection's time.
template <typename T>
inline float quantize_block(const T* src, int8_t* dst, int32_t* halves) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 a = load16(src), b = load16(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#elif defined(LLMACCEL_AVX2)
  const __m256 v[4] = {load8(src), load8(src + 8), load8(src + 16), load8(src + 24)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
  top = _mm256_max_ps(top, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
#else
  float amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(value_at(src, j)));
#endif
  const float d = amax / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qb));
  halves[0] = _mm512_reduce_add_epi32(qa);
  halves[1] = _mm512_reduce_add_epi32(qb);
#elif defined(LLMACCEL_AVX2)
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
  // packs interleave 128-bit lanes: dwords come out as (q0 lo, q1 lo, q2 lo, q3 lo, q0 hi, ...)
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  halves[0] = hsum8_epi32(_mm256_add_epi32(q[0], q[1]));
  halves[1] = hsum8_epi32(_mm256_add_epi32(q[2], q[3]));
#else
  halves[0] = halves[1] = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(value_at(src, j) * inv));
    dst[j] = static_cast<int8_t>(v);
    halves[j / 16] += v;
  }
#endif
  return d;
}

// Blocks [b0, b1) of the rows (m x k / 32 of them, row-major) into `out`, sized already.
template <typename T>
void quantize_blocks(const T* x, int64_t b0, int64_t b1, QuantizedRows& out) {
  for (int64_t i = b0; i < b1; ++i) {
    int32_t* halves = out.qsum16.data() + 2 * i;
    const float d = quantize_block(x + i * kBlock, out.q.data() + i * kBlock, halves);
    const int32_t sum = halves[0] + halves[1];
    out.d[i] = d;
    out.dsum[i] = d * static_cast<float>(sum);
    out.qsum[i] = sum;
  }
}

void size_for(int64_t m, int64_t k, QuantizedRows& out) {
  const int64_t nb = k / kBlock;
  out.q.resize(m * k);
  out.d.resize(m * nb);
  out.dsum.resize(m * nb);
  out.qsum.resize(m * nb);
  out.qsum16.resize(2 * m * nb);
}

}  // namespace

void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out) {
  size_for(m, k, out);
  quantize_blocks(x, 0, m * (k / kBlock), out);
}

void quantize_rows(const uint16_t* x, int64_t m, int64_t k, QuantizedRows& out) {
  size_for(m, k, out);
  quantize_blocks(x, 0, m * (k / kBlock), out);
}

const QuantizedRows& quantize_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x must be [rows, a multiple of 32]");
  static thread_local QuantizedRows kept;  // its storage reused: fresh, a chunk's rows were zeroed and faulted in
  QuantizedRows& out = kept;  // by reference: inside the lambda below, `kept` would name each worker's own
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  auto xc = bf16 ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), blocks = m * (k / kBlock);
  size_for(m, k, out);
  at::parallel_for(0, blocks, 256, [&](int64_t b0, int64_t b1) {
    if (bf16)
      quantize_blocks(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), b0, b1, out);
    else
      quantize_blocks(xc.data_ptr<float>(), b0, b1, out);
  });
  return out;
}

namespace {

constexpr int64_t kWeightBytes = 512;  // a block's weights: 8 chunks of 16 rows x 4 inputs

// Rows i0 .. i0 + rows - 1 (rows <= MR) of x against one group of 16 weight rows: their sums
// sum_b d_b * scale_b * dot_b (grouped) or sum_b d_b * dot_b (the row scale applied by the caller).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kPassRows = 2;  // one or two rows: three and more take tile_pass (below)

// Blocks alternate between two sums (even, odd: alternate_blocks, kernels.h); activations, their scales and sums
// are broadcast straight from memory (the compiler's GPR round trip and a branch a block kept the kernel at ~0.6x
// of its vpdpbusd rate at 2,048 rows).
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t stride, bool grouped, int64_t k,
                int64_t i0, int rows, float* sums) {
  __m512 even[MR], odd[MR];
  for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const PassRows<MR> x(a, i0, rows, k);
  auto step = [&](int64_t b, __m512* acc) {
    const uint8_t* block = group + b * stride;
    __m512i w[8];  // the weights + 128, unsigned: one u8 x s8 instruction a chunk, corrected below
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(block + 64 * t);
    const __m512 scale =
        grouped ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kWeightBytes)))
                : _mm512_set1_ps(1.0f);
    for (int r = 0; r < MR; ++r) {
      const int32_t* x4 = x.q[r] + 8 * b;
      __m512i dot_a = _mm512_setzero_si512(), dot_b = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        dot_a = _mm512_dpbusd_epi32(dot_a, w[t], _mm512_set1_epi32(x4[t]));
        dot_b = _mm512_dpbusd_epi32(dot_b, w[t + 1], _mm512_set1_epi32(x4[t + 1]));
      }
      // (w + 128) . x - 128 * sum(x) = w . x, exactly
      const __m512i dot =
          _mm512_sub_epi32(_mm512_add_epi32(dot_a, dot_b), _mm512_slli_epi32(_mm512_set1_epi32(x.qsum[r][b]), 7));
      const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(x.d[r][b]));
      acc[r] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot), acc[r]);
    }
  };
  alternate_blocks(nb, step, even, odd);
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(sums + r * kGroupRows, _mm512_add_ps(even[r], odd[r]));
}

#elif defined(LLMACCEL_AVX2)
constexpr int kPassRows = 4;
// |w| . (x * sign(w)), as llama.cpp's AVX2 dot products: the stored w + 128 is turned back into signed w,
// maddubs takes |w| as its unsigned operand (|-128| reads as 128 there) and the activation with w's sign
// (|x| <= 127, so a pair sums to at most 2 x 128 x 127 < 2^15). The other way round, sign(w, x) of
// w = -128 wrapped to -128 and misread every such weight that met a negative activation. A chunk's w and |w|
// are made once for the MR rows of a pass (one row a pass re-made them for every row: 64 rows ran at half
// the speed of the INT4 kernel).
// One activation row (a lone decode step) takes both 8-row halves of the group in one pass, so its blocks stream
// once (a half a pass read them twice: one row streamed at ~19 GB/s against ~27 for a sum, a 160 MB matrix on a
// 2-core AMD EPYC Zen 3); more rows take a half a pass, for the registers.
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t stride, bool grouped, int64_t k,
                int64_t i0, int rows, float* sums) {
  constexpr int H = MR == 1 ? 2 : 1;  // halves a pass
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t half0 = 0; half0 < 2; half0 += H) {
    __m256 acc[MR][H];
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = group + b * stride;
      if (half0 == 0) prefetch_ahead(block, stride);
      __m256i dot[MR][H];
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < H; ++h) dot[r][h] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        for (int h = 0; h < H; ++h) {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * (half0 + h))), flip);
          const __m256i aw = _mm256_abs_epi8(w);
          for (int r = 0; r < MR; ++r) {
            const int32_t* x4 = reinterpret_cast<const int32_t*>(a.q.data() + (i0 + r) * k + b * kBlock) + t;
            const __m256i x = _mm256_set1_epi32(*x4);
            dot[r][h] = _mm256_add_epi32(dot[r][h],
                                         _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones));
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256 scale = grouped ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                           block + kWeightBytes + 16 * (half0 + h))))
                                     : _mm256_set1_ps(1.0f);
        for (int r = 0; r < MR; ++r) {
          const __m256 ds = _mm256_mul_ps(scale, _mm256_set1_ps(a.d[(i0 + r) * nb + b]));
          acc[r][h] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(dot[r][h]), acc[r][h]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(sums + r * kGroupRows + 8 * (half0 + h), acc[r][h]);
  }
  (void)rows;
}

#else
constexpr int kPassRows = 1;
template <int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t nb, int64_t stride, bool grouped, int64_t k,
                int64_t i0, int rows, float* sums) {
  float even[kGroupRows] = {}, odd[kGroupRows] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * stride;
    const int8_t* xq = a.q.data() + i0 * k + b * kBlock;
    for (int64_t row = 0; row < kGroupRows; ++row) {
      int32_t dot = 0;
      for (int t = 0; t < 8; ++t)
        for (int j = 0; j < 4; ++j) dot += (int32_t(block[64 * t + 4 * row + j]) - 128) * xq[4 * t + j];
      const float scale = grouped ? half_bits_to_float(block + kWeightBytes + 2 * row) : 1.0f;
      (b & 1 ? odd : even)[row] += scale * a.d[i0 * nb + b] * static_cast<float>(dot);
    }
  }
  for (int64_t row = 0; row < kGroupRows; ++row) sums[row] = even[row] + odd[row];
  (void)rows;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMACCEL_I8_TILES 1
// Three rows and more (batched decode steps, prefill chunks): MR rows x NR groups a pass, so a 64-byte weight chunk
// feeds MR rows and a broadcast activation NR groups; the +128 correction seeds the integer sum (three operations
// after it in group_pass) and one chain makes each sum (two there). Each element's arithmetic is group_pass's
// exactly (the same integer dot, ds = scale * d, one fma into the block's parity sum), so a row's result does not
// depend on the rows beside it. With 4 x 2 a 1B-shaped layer's four projections at 2,048 rows ran at ~1,440 GOP/s
// against group_pass's 930-1,000 (0.68x oneDNN's bfloat16 GEMM time; 8 x 1 tiles: 0.99x), and at 8-64 rows in
// 0.6-0.7x group_pass's time (2-core AMD EPYC Zen 5; the VNNI unit peaks near 2,000 GOP/s there).
template <int MR, int NR>
void tile_pass(const QuantizedRows& a, const uint8_t* group0, int64_t group_bytes, int64_t nb, int64_t stride,
               bool grouped, int64_t k, int64_t i0, int rows, float* sums) {
  __m512 even[MR][NR], odd[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < NR; ++g) even[r][g] = odd[r][g] = _mm512_setzero_ps();
  const PassRows<MR> x(a, i0, rows, k);
  auto step = [&](int64_t b, __m512 (*acc)[NR]) {
    const uint8_t* block[NR];
    for (int g = 0; g < NR; ++g) block[g] = group0 + g * group_bytes + b * stride;
    __m512i dot[MR][NR];
    for (int r = 0; r < MR; ++r) {
      const __m512i start = _mm512_set1_epi32(-(x.qsum[r][b] << 7));  // (w + 128) . x - 128 * sum(x) = w . x
      for (int g = 0; g < NR; ++g) dot[r][g] = start;
    }
    for (int t = 0; t < 8; ++t) {
      __m512i w[NR];
      for (int g = 0; g < NR; ++g) w[g] = _mm512_loadu_si512(block[g] + 64 * t);
      for (int r = 0; r < MR; ++r) {
        const __m512i xt = _mm512_set1_epi32(x.q[r][8 * b + t]);
        for (int g = 0; g < NR; ++g) dot[r][g] = _mm512_dpbusd_epi32(dot[r][g], w[g], xt);
      }
    }
    for (int g = 0; g < NR; ++g) {
      const __m512 scale =
          grouped ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[g] + kWeightBytes)))
                  : _mm512_set1_ps(1.0f);
      for (int r = 0; r < MR; ++r) {
        const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(x.d[r][b]));
        acc[r][g] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot[r][g]), acc[r][g]);
      }
    }
  };
  alternate_blocks(nb, step, even, odd);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < NR; ++g) _mm512_storeu_ps(sums + (r * NR + g) * kGroupRows, _mm512_add_ps(even[r][g], odd[r][g]));
}

void i8_tiles(const QuantizedRows& a, const uint8_t* blocks, const float* row_scale, float* y, int64_t ldy,
              int64_t m, int64_t k, int64_t n, int64_t g0, int64_t g1) {
  const int64_t nb = k / kBlock, stride = kWeightBytes + (row_scale ? 0 : 2 * kGroupRows), group_bytes = nb * stride;
  const bool grouped = row_scale == nullptr;
  tile_sweep(m, n, g0, g1, row_scale, y, ldy, [&](int64_t g, int width, int64_t i0, int rows, float* sums) {
    const uint8_t* group = blocks + g * group_bytes;
    if (width == kTileGroups) tile_pass<kTileRows, kTileGroups>(a, group, group_bytes, nb, stride, grouped, k, i0, rows, sums);
    else tile_pass<kTileRows, 1>(a, group, group_bytes, nb, stride, grouped, k, i0, rows, sums);
  });
}
#endif

}  // namespace

LLMACCEL_ONE_COPY void i8_groups(const QuantizedRows& a, const uint8_t* blocks, const float* row_scale, float* y,
                                 int64_t ldy, int64_t m, int64_t k, int64_t n, int64_t g0, int64_t g1) {
  const int64_t nb = k / kBlock, stride = kWeightBytes + (row_scale ? 0 : 2 * kGroupRows);
#ifdef LLMACCEL_I8_TILES
  if (m >= kTileFromRows) return i8_tiles(a, blocks, row_scale, y, ldy, m, k, n, g0, g1);
#endif
  alignas(64) float sums[kPassRows * kGroupRows];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = blocks + g * nb * stride;
    const int64_t cols = std::min(kGroupRows, n - g * kGroupRows);
    for (int64_t i0 = 0; i0 < m; i0 += kPassRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPassRows, m - i0));
      const bool grouped = row_scale == nullptr;  // a pass of exactly the rows left (a row's arithmetic is the same)
      if (kPassRows >= 4 && rows == 4) group_pass<(kPassRows >= 4 ? 4 : 1)>(a, group, nb, stride, grouped, k, i0, rows, sums);
      else if (kPassRows >= 3 && rows == 3) group_pass<(kPassRows >= 3 ? 3 : 1)>(a, group, nb, stride, grouped, k, i0, rows, sums);
      else if (kPassRows >= 2 && rows == 2) group_pass<(kPassRows >= 2 ? 2 : 1)>(a, group, nb, stride, grouped, k, i0, rows, sums);
      else group_pass<1>(a, group, nb, stride, grouped, k, i0, rows, sums);
      for (int r = 0; r < rows; ++r) {
        float* out = y + (i0 + r) * ldy + g * kGroupRows;
        if (row_scale)
          for (int64_t c = 0; c < cols; ++c) out[c] = sums[r * kGroupRows + c] * row_scale[g * kGroupRows + c];
        else
          std::memcpy(out, sums + r * kGroupRows, cols * sizeof(float));
      }
    }
  }
}

int64_t check_int8_blocks(const torch::Tensor& blocks, const c10::optional<torch::Tensor>& row_scale) {
  const int64_t want = row_scale ? kWeightBytes : kWeightBytes + 2 * kGroupRows;
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.size(2) == want,
              "blocks must be contiguous uint8 [ceil(N / 16), K / 32, ", want, "]");
  if (row_scale)
    TORCH_CHECK(row_scale->scalar_type() == torch::kFloat32 && row_scale->is_contiguous() &&
                    row_scale->numel() == blocks.size(0) * kGroupRows,
                "row_scale must be contiguous float32 [16 ceil(N / 16)]");
  return want;
}

void check_int4_blocks(const torch::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.size(2) == kInt4BlockBytes,
              "blocks must be contiguous uint8 [ceil(N / 16), K / 32, ", kInt4BlockBytes, "]");
}

void check_groups_fit(const torch::Tensor& blocks, int64_t n) {
  TORCH_CHECK(n > (blocks.size(0) - 1) * kGroupRows && n <= blocks.size(0) * kGroupRows,
              "n = ", n, " does not fit ", blocks.size(0), " groups of 16 rows");
}

namespace {

// y = x W^T [M, n] for weights held in 16-row blocks (checked by the caller): x's rows quantized once,
// the row groups split between ATen's threads, `groups_fn(a, y, m, k, g0, g1)` computing each share.
template <typename GroupsFn>
torch::Tensor blocks_product(const torch::Tensor& x, const torch::Tensor& blocks, int64_t n, GroupsFn groups_fn) {
  check_groups_fit(blocks, n);
  const int64_t k = blocks.size(1) * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  const int64_t m = x.size(0);
  const QuantizedRows& a = quantize_input(x);
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  const int64_t groups = blocks.size(0), threads = at::get_num_threads();
  at::parallel_for(0, groups, (groups + threads - 1) / threads,
                   [&](int64_t g0, int64_t g1) { groups_fn(a, yp, m, k, g0, g1); });
  return y;
}

}  // namespace
}  // namespace llmaccel

using namespace llmaccel;

// blocks uint8 [ceil(N / 16), K / 32, 512 or 544] (ops/gemv.py `pack_int8_blocks`); row_scale float32
// [16 ceil(N / 16)] for one scale a row, or None where each block holds its rows' scales (GGUF Q8_0).
torch::Tensor gemv_i8(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> row_scale, int64_t n) {
  check_int8_blocks(blocks, row_scale);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* sp = row_scale ? row_scale->data_ptr<float>() : nullptr;
  return blocks_product(x, blocks, n, [&](const QuantizedRows& a, float* y, int64_t m, int64_t k, int64_t g0,
                                          int64_t g1) { i8_groups(a, wp, sp, y, n, m, k, n, g0, g1); });
}

// blocks uint8 [ceil(N / 16), K / 32, 320] (gemv_int4.cpp's layout; ops/gemv.py `pack_int4_blocks`).
torch::Tensor gemv_i4(torch::Tensor x, torch::Tensor blocks, int64_t n) {
  check_int4_blocks(blocks);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  return blocks_product(x, blocks, n, [&](const QuantizedRows& a, float* y, int64_t m, int64_t k, int64_t g0,
                                          int64_t g1) { i4_groups(a, wp, y, n, m, k, n, g0, g1); });
}

// Rows `ids` of the INT8 weight in `blocks` (as gemv_i8 takes them), dequantized to float32 [T, K]: an
// embedding lookup from the copy the kernel reads (a torch gather took ~0.1 ms a token).
torch::Tensor int8_rows(torch::Tensor blocks, c10::optional<torch::Tensor> row_scale, torch::Tensor ids) {
  const int64_t stride = check_int8_blocks(blocks, row_scale);
  auto index = ids.to(torch::kInt64).contiguous();
  const int64_t count = index.numel(), nb = blocks.size(1), k = nb * kBlock;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < blocks.size(0) * kGroupRows, "row ", id[t], " is outside the weight");
  auto out = torch::empty({count, k}, torch::kFloat32);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < count; ++t) {
    const int64_t g = id[t] / kGroupRows, r = id[t] % kGroupRows;
    const float one = row_scale ? row_scale->data_ptr<float>()[id[t]] : 1.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = wp + (g * nb + b) * stride;
      const float scale = row_scale ? one : half_bits_to_float(block + kWeightBytes + 2 * r);
      for (int64_t c = 0; c < 8; ++c)
        for (int64_t j = 0; j < 4; ++j)
          op[t * k + b * kBlock + 4 * c + j] = static_cast<float>(int32_t(block[64 * c + 4 * r + j]) - 128) * scale;
    }
  }
  return out;
}

bool gemv_vectorized() {
#ifdef LLMACCEL_AVX2
  return true;
#else
  return false;
#endif
}
