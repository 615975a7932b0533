// llama.cpp's K-quants at every row count: y[M, N] = x[M, K] @ W[N, K]^T for W in Q4_K, Q5_K or Q6_K, and the
// repacking of a GGUF file's quantized tensors (those and Q8_0, Q4_0, Q4_1) into the kernels' blocks.
//
// A K-quant super-block covers 256 inputs of one row: Q4_K and Q5_K hold 8 sub-blocks of 32 with 6-bit scales
// and mins under a float16 d and dmin (w = d sc q - dmin m, q 4 or 5 bits), Q6_K 16 sub-blocks of 16 with int8
// scales under one d (w = d sc (q - 32), q 6 bits). GGUF stores each row's super-blocks one after another;
// here 16 rows go side by side (as gemv_int4.cpp's INT4 blocks, whose chunk layout the low nibbles keep), so one
// 32-byte load feeds 8 rows x 4 inputs to an unsigned x signed byte dot product against 4 broadcast activation
// bytes, and a thread streams one contiguous run. A group's record for each super-block:
//   Q4_K (2368 B): 8 x 256 B of nibbles (per 32 inputs, 4 chunks of 64 B: byte 4 r + j of chunk t holds row r's
//                  input 8 t + j in its low nibble and 8 t + 4 + j in its high nibble); sc [8][16] u8;
//                  m [8][16] u8; d [16] f16; dmin [16] f16.
//   Q5_K (2880 B): per 32 inputs the 256 B of nibbles then 64 B of fifth bits (byte 4 r + j: bit 2 t for input
//                  8 t + j, bit 2 t + 1 for 8 t + 4 + j); then sc, m, d, dmin as Q4_K.
//   Q6_K (3360 B): per 32 inputs the 256 B of low nibbles then 2 x 64 B of high bit pairs (byte 4 r + j of the
//                  first: bits 2 f, 2 f + 1 for field f = 2 t + s of chunks t = 0, 1, s = 0 for the low input,
//                  1 for the high; the second the same for chunks 2, 3); sc [16][16] int8; d [16] f16.
// The 6-bit scales are kept as integers and d, dmin as the file's float16: nothing is rounded, so a weight here is
// the GGUF weight exactly (tests hold the kernel to the dequantized tensor), at 4.63 / 5.63 / 6.56 bits a
// weight against GGUF's 4.5 / 5.5 / 6.56.
//
// Activations are INT8 in blocks of 32 (quantize_rows, as the INT4 and INT8 kernels take them); a block's integer
// sums are exact and scaled once in float32, and every output row's sum runs in the same order whatever M is.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace llmaccel {
namespace {

constexpr int64_t kSuper = 256;
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;            // GGML type numbers
constexpr int64_t kQ8_0 = 8, kQ4_0 = 2, kQ4_1 = 3;
constexpr int64_t kNibbles = 256;                              // a 32-input block's nibbles, 16 rows

int64_t block_bytes(int64_t kind) { return kind == kQ4K ? 256 : kind == kQ5K ? 320 : 384; }  // per 32 inputs
int64_t record_bytes(int64_t kind) { return 8 * block_bytes(kind) + (kind == kQ6K ? 256 + 32 : 256 + 64); }

// ---- the kernels ----------------------------------------------------------------------------------------

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLMACCEL_KQ_LANES8 1
namespace lanes8 {
// The value as it is, hidden from the optimiser: under -ffast-math it may reassociate a product chain such as
// (sc d) dx into sc (d dx) in one instantiation of a pass and not another, and a row's result would then depend
// on how many rows shared its pass.
inline __m256 opaque(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline __m256 widen_u8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen_s8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <int Shift>
inline __m256i bits_to(__m256i v, __m256i mask) {  // (v shifted left by Shift, or right by -Shift) & mask
  if constexpr (Shift > 0) return _mm256_and_si256(_mm256_slli_epi16(v, Shift), mask);
  else if constexpr (Shift < 0) return _mm256_and_si256(_mm256_srli_epi16(v, -Shift), mask);
  else return _mm256_and_si256(v, mask);
}

// u8 x s8 products of one 32-byte chunk against 4 broadcast activation bytes, summed in pairs into int16 lanes
// (maddubs; a pair is at most 2 x 63 x 127 < 2^15). Several are added in int16 before one madd widens them:
// a Q4 code sums 8 pairs to at most 30480, a Q5 code 4, a Q6 code 2, all below 2^15.
inline __m256i pair_products(__m256i u, const int32_t* x4) {
  return _mm256_maddubs_epi16(u, _mm256_set1_epi32(*x4));
}

// One group of 16 weight rows (8 a half) against activation rows i0 .. i0 + rows - 1: their sums into y. Each
// 32-byte chunk is unpacked once for the MR rows of a pass; the rows' integer sums stay in registers. One activation
// row (a lone decode step) takes both halves in one pass, so the group's record streams once; more rows take a
// half a pass, for the registers (the second pass reads the record from L2).
template <int64_t Kind, int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t supers, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  constexpr int H = MR == 1 ? 2 : 1;  // halves a pass
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t nb = k / kBlock, record = record_bytes(Kind), bb = block_bytes(Kind);
  const int8_t* xq[MR];
  for (int r = 0; r < MR; ++r) xq[r] = a.q.data() + (i0 + std::min(r, rows - 1)) * k;  // (spare lanes repeat a row)
  for (int64_t half0 = 0; half0 < 2 && half0 * 8 < cols; half0 += H) {
    __m256 acc[MR][H];
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; ++s) {
      const uint8_t* rec = group + s * record;
      const uint8_t* tail = rec + 8 * bb;  // scales, then d (and dmin)
      __m256 d[H];
      for (int h = 0; h < H; ++h)
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 256 + 16 * (half0 + h))));
      for (int64_t sb = 0; sb < 8; ++sb) {
        const uint8_t* block = rec + sb * bb;
        const int64_t b = s * 8 + sb;
        if (half0 == 0) prefetch_ahead(rec + sb * (record / 8), record / 8);  // (kernels.h: why)
        __m256i dot[MR][H][2];
        for (int r = 0; r < MR; ++r)
          for (int h = 0; h < H; ++h) dot[r][h][0] = dot[r][h][1] = _mm256_setzero_si256();
        __m256i wide[MR][H];  // int16 sums not yet widened
        for (int t = 0; t < 4; ++t) {
          for (int h = 0; h < H; ++h) {
            const int64_t half = half0 + h;
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * half));
            __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            if constexpr (Kind == kQ5K) {  // the fifth bits: bit 2 t for the low input, 2 t + 1 for the high
              const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kNibbles + 32 * half));
              const __m256i bit = _mm256_set1_epi8(0x10);
              if (t == 0) lo = _mm256_or_si256(lo, bits_to<4>(hb, bit)), hi = _mm256_or_si256(hi, bits_to<3>(hb, bit));
              if (t == 1) lo = _mm256_or_si256(lo, bits_to<2>(hb, bit)), hi = _mm256_or_si256(hi, bits_to<1>(hb, bit));
              if (t == 2) lo = _mm256_or_si256(lo, bits_to<0>(hb, bit)), hi = _mm256_or_si256(hi, bits_to<-1>(hb, bit));
              if (t == 3) lo = _mm256_or_si256(lo, bits_to<-2>(hb, bit)), hi = _mm256_or_si256(hi, bits_to<-3>(hb, bit));
            }
            if constexpr (Kind == kQ6K) {  // the high bit pairs of chunks 0, 1 (then 2, 3): fields 2 (t % 2) + s
              const __m256i hb = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(block + kNibbles + 64 * (t / 2) + 32 * half));
              const __m256i pairs = _mm256_set1_epi8(0x30);
              if (t % 2 == 0) lo = _mm256_or_si256(lo, bits_to<4>(hb, pairs)), hi = _mm256_or_si256(hi, bits_to<2>(hb, pairs));
              else lo = _mm256_or_si256(lo, bits_to<0>(hb, pairs)), hi = _mm256_or_si256(hi, bits_to<-2>(hb, pairs));
            }
            for (int r = 0; r < MR; ++r) {
              const int32_t* x4 = reinterpret_cast<const int32_t*>(xq[r] + b * kBlock) + 2 * t;
              const __m256i pair = _mm256_add_epi16(pair_products(lo, x4), pair_products(hi, x4 + 1));
              if constexpr (Kind == kQ4K) {
                wide[r][h] = t == 0 ? pair : _mm256_add_epi16(wide[r][h], pair);
                if (t == 3) dot[r][h][0] = _mm256_madd_epi16(wide[r][h], ones);
              } else if constexpr (Kind == kQ5K) {
                wide[r][h] = t % 2 == 0 ? pair : _mm256_add_epi16(wide[r][h], pair);
                if (t % 2 == 1) dot[r][h][0] = _mm256_add_epi32(dot[r][h][0], _mm256_madd_epi16(wide[r][h], ones));
              } else {  // Q6_K: inputs 0..15 (chunks 0, 1) and 16..31 (chunks 2, 3) have scales of their own
                dot[r][h][t / 2] = _mm256_add_epi32(dot[r][h][t / 2], _mm256_madd_epi16(pair, ones));
              }
            }
          }
        }
        for (int h = 0; h < H; ++h) {
          const int64_t half = half0 + h;
          if constexpr (Kind == kQ6K) {
            const __m256 sc0 = opaque(_mm256_mul_ps(widen_s8(tail + (2 * sb) * 16 + 8 * half), d[h]));
            const __m256 sc1 = opaque(_mm256_mul_ps(widen_s8(tail + (2 * sb + 1) * 16 + 8 * half), d[h]));
            for (int r = 0; r < MR; ++r) {
              const int64_t i = i0 + std::min(r, rows - 1);
              const int32_t* sums16 = a.qsum16.data() + 2 * (i * nb + b);
              const __m256 dx = _mm256_set1_ps(a.d[i * nb + b]);
              const __m256i v0 = _mm256_sub_epi32(dot[r][h][0], _mm256_set1_epi32(32 * sums16[0]));
              const __m256i v1 = _mm256_sub_epi32(dot[r][h][1], _mm256_set1_epi32(32 * sums16[1]));
              acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(sc0, dx), _mm256_cvtepi32_ps(v0), acc[r][h]);
              acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(sc1, dx), _mm256_cvtepi32_ps(v1), acc[r][h]);
            }
          } else {
            const __m256 scale = opaque(_mm256_mul_ps(widen_u8(tail + sb * 16 + 8 * half), d[h]));
            const __m256 offset = opaque(_mm256_mul_ps(
                widen_u8(tail + 128 + sb * 16 + 8 * half),
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 288 + 16 * half)))));
            for (int r = 0; r < MR; ++r) {
              const int64_t i = i0 + std::min(r, rows - 1);
              const __m256 ds = _mm256_mul_ps(scale, _mm256_set1_ps(a.d[i * nb + b]));
              acc[r][h] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(dot[r][h][0]), acc[r][h]);
              acc[r][h] = _mm256_fnmadd_ps(offset, _mm256_set1_ps(a.dsum[i * nb + b]), acc[r][h]);
            }
          }
        }
      }
    }
    for (int h = 0; h < H; ++h) {
      const int64_t half = half0 + h;
      if (half * 8 >= cols) break;
      for (int r = 0; r < rows; ++r) {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, acc[r][h]);
        std::memcpy(y + (i0 + r) * ldy + 8 * half, sums, std::min<int64_t>(8, cols - 8 * half) * sizeof(float));
      }
    }
  }
}
}  // namespace lanes8
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLMACCEL_KQ_LANES16 1
namespace lanes16 {
// A group's 16 rows in one 512-bit vector: one 64-byte load and a mask give 16 rows x 4 inputs, one AVX512-VNNI
// vpdpbusd (u8 x s8, 64 multiply-adds into int32) against 4 broadcast activation bytes, where AVX2 spends a
// maddubs, an add and a madd on half as many rows. The integer sums are the AVX2 kernel's exactly and the float
// steps the same in the same order, so both builds give the same bits (tests/test_gguf_types.py holds them to it).
inline __m512 opaque(__m512 v) {  // as the AVX2 kernel's: no reassociation across instantiations
  asm("" : "+v"(v));
  return v;
}
inline __m512 widen_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 widen_s8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <int Shift>
inline __m512i bits_to(__m512i v, __m512i mask) {  // (v shifted left by Shift, or right by -Shift) & mask
  if constexpr (Shift > 0) return _mm512_and_si512(_mm512_slli_epi16(v, Shift), mask);
  else if constexpr (Shift < 0) return _mm512_and_si512(_mm512_srli_epi16(v, -Shift), mask);
  else return _mm512_and_si512(v, mask);
}
// One chunk's 8 inputs of 16 rows against x4[0..1]: two vpdpbusd. Chunks sum in a tree, not one chain, so a lone
// activation row (a decode step) is not held to the instruction's latency (one chain read 37 GB/s, AVX2 45).
inline __m512i chunk_dot(__m512i lo, __m512i hi, const int32_t* x4) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi32(x4[0])), hi,
                             _mm512_set1_epi32(x4[1]));
}

// Rows i0 .. i0 + rows - 1 (rows <= MR; spare lanes repeat the last row) against one group of 16 weight rows.
template <int64_t Kind, int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t supers, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int64_t nb = k / kBlock, record = record_bytes(Kind), bb = block_bytes(Kind);
  const int8_t* xq[MR];
  for (int r = 0; r < MR; ++r) xq[r] = a.q.data() + (i0 + std::min(r, rows - 1)) * k;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rec = group + s * record;
    const uint8_t* tail = rec + 8 * bb;  // scales, then d (and dmin)
    const __m512 d = halves(tail + 256);
    for (int64_t sb = 0; sb < 8; ++sb) {
      const uint8_t* block = rec + sb * bb;
      const int64_t b = s * 8 + sb;
      prefetch_ahead(rec + sb * (record / 8), record / 8);  // (kernels.h: why)
      __m512i lo[4], hi[4];
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(block + 64 * t);
        lo[t] = _mm512_and_si512(v, nibble);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      if constexpr (Kind == kQ5K) {  // the fifth bits: bit 2 t for the low input, 2 t + 1 for the high
        const __m512i hb = _mm512_loadu_si512(block + kNibbles), bit = _mm512_set1_epi8(0x10);
        lo[0] = _mm512_or_si512(lo[0], bits_to<4>(hb, bit)), hi[0] = _mm512_or_si512(hi[0], bits_to<3>(hb, bit));
        lo[1] = _mm512_or_si512(lo[1], bits_to<2>(hb, bit)), hi[1] = _mm512_or_si512(hi[1], bits_to<1>(hb, bit));
        lo[2] = _mm512_or_si512(lo[2], bits_to<0>(hb, bit)), hi[2] = _mm512_or_si512(hi[2], bits_to<-1>(hb, bit));
        lo[3] = _mm512_or_si512(lo[3], bits_to<-2>(hb, bit)), hi[3] = _mm512_or_si512(hi[3], bits_to<-3>(hb, bit));
      }
      if constexpr (Kind == kQ6K) {  // the high bit pairs of chunks 0, 1 (then 2, 3): fields 2 (t % 2) + s
        const __m512i pairs = _mm512_set1_epi8(0x30);
        for (int t = 0; t < 4; t += 2) {
          const __m512i hb = _mm512_loadu_si512(block + kNibbles + 64 * (t / 2));
          lo[t] = _mm512_or_si512(lo[t], bits_to<4>(hb, pairs)), hi[t] = _mm512_or_si512(hi[t], bits_to<2>(hb, pairs));
          lo[t + 1] = _mm512_or_si512(lo[t + 1], bits_to<0>(hb, pairs));
          hi[t + 1] = _mm512_or_si512(hi[t + 1], bits_to<-2>(hb, pairs));
        }
      }
      if constexpr (Kind == kQ6K) {  // inputs 0..15 (chunks 0, 1) and 16..31 (chunks 2, 3) have scales of their own
        const __m512 sc0 = opaque(_mm512_mul_ps(widen_s8(tail + (2 * sb) * 16), d));
        const __m512 sc1 = opaque(_mm512_mul_ps(widen_s8(tail + (2 * sb + 1) * 16), d));
        for (int r = 0; r < MR; ++r) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xq[r] + b * kBlock);
          const __m512i dot0 = _mm512_add_epi32(chunk_dot(lo[0], hi[0], x4), chunk_dot(lo[1], hi[1], x4 + 2));
          const __m512i dot1 = _mm512_add_epi32(chunk_dot(lo[2], hi[2], x4 + 4), chunk_dot(lo[3], hi[3], x4 + 6));
          const int64_t i = i0 + std::min(r, rows - 1);
          const int32_t* sums16 = a.qsum16.data() + 2 * (i * nb + b);
          const __m512 dx = _mm512_set1_ps(a.d[i * nb + b]);
          const __m512i v0 = _mm512_sub_epi32(dot0, _mm512_set1_epi32(32 * sums16[0]));
          const __m512i v1 = _mm512_sub_epi32(dot1, _mm512_set1_epi32(32 * sums16[1]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc0, dx), _mm512_cvtepi32_ps(v0), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sc1, dx), _mm512_cvtepi32_ps(v1), acc[r]);
        }
      } else {
        const __m512 scale = opaque(_mm512_mul_ps(widen_u8(tail + sb * 16), d));
        const __m512 offset = opaque(_mm512_mul_ps(widen_u8(tail + 128 + sb * 16), halves(tail + 288)));
        for (int r = 0; r < MR; ++r) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xq[r] + b * kBlock);
          const __m512i dot = _mm512_add_epi32(
              _mm512_add_epi32(chunk_dot(lo[0], hi[0], x4), chunk_dot(lo[1], hi[1], x4 + 2)),
              _mm512_add_epi32(chunk_dot(lo[2], hi[2], x4 + 4), chunk_dot(lo[3], hi[3], x4 + 6)));
          const int64_t i = i0 + std::min(r, rows - 1);
          const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(a.d[i * nb + b]));
          acc[r] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot), acc[r]);
          acc[r] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(a.dsum[i * nb + b]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    alignas(64) float sums[kGroupRows];
    _mm512_store_ps(sums, acc[r]);
    std::memcpy(y + (i0 + r) * ldy, sums, std::min<int64_t>(kGroupRows, cols) * sizeof(float));
  }
}

// One chunk t of a group's block unpacked to its low and high codes (with Q5_K's fifth bits, Q6_K's high pairs).
template <int64_t Kind>
inline void unpack_chunk(const uint8_t* block, int t, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(block + 64 * t);
  lo = _mm512_and_si512(v, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  if constexpr (Kind == kQ5K) {
    const __m512i hb = _mm512_loadu_si512(block + kNibbles), bit = _mm512_set1_epi8(0x10);
    switch (t) {
      case 0: lo = _mm512_or_si512(lo, bits_to<4>(hb, bit)), hi = _mm512_or_si512(hi, bits_to<3>(hb, bit)); break;
      case 1: lo = _mm512_or_si512(lo, bits_to<2>(hb, bit)), hi = _mm512_or_si512(hi, bits_to<1>(hb, bit)); break;
      case 2: lo = _mm512_or_si512(lo, bits_to<0>(hb, bit)), hi = _mm512_or_si512(hi, bits_to<-1>(hb, bit)); break;
      default: lo = _mm512_or_si512(lo, bits_to<-2>(hb, bit)), hi = _mm512_or_si512(hi, bits_to<-3>(hb, bit));
    }
  }
  if constexpr (Kind == kQ6K) {
    const __m512i hb = _mm512_loadu_si512(block + kNibbles + 64 * (t / 2)), pairs = _mm512_set1_epi8(0x30);
    if (t % 2 == 0) lo = _mm512_or_si512(lo, bits_to<4>(hb, pairs)), hi = _mm512_or_si512(hi, bits_to<2>(hb, pairs));
    else lo = _mm512_or_si512(lo, bits_to<0>(hb, pairs)), hi = _mm512_or_si512(hi, bits_to<-2>(hb, pairs));
  }
}

// Three rows and more (batched decode steps, prefill chunks): MR rows x NR groups a pass, so a chunk unpacked
// once feeds MR rows and a broadcast activation NR groups; one integer chain a sum (Q6_K's -32 correction seeding
// it). Each element's integer sums and float steps are group_pass's, in its order, so a row's result does not depend
// on the rows beside it and both builds still give the same bits. Sums go to sums[MR][NR x 16]. With 4 x 2, a
// 1B-shaped layer's four projections at 2,048 rows took 0.82x (Q4_K) and 0.84x (Q6_K) the 8-row passes' time
// (2-core AMD EPYC Zen 5); 3 x 3, 6 x 2 and 8 x 1 tiles measured within noise of it or slower.
template <int64_t Kind, int MR, int NR>
void tile_pass(const QuantizedRows& a, const uint8_t* group0, int64_t group_bytes, int64_t supers, int64_t k,
               int64_t i0, int rows, float* sums) {
  const int64_t nb = k / kBlock, record = record_bytes(Kind), bb = block_bytes(Kind);
  const int32_t* xq[MR];
  int64_t row[MR];
  for (int r = 0; r < MR; ++r) {
    row[r] = i0 + std::min(r, rows - 1);  // (spare rows repeat the last; not stored)
    xq[r] = reinterpret_cast<const int32_t*>(a.q.data() + row[r] * k);
  }
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < NR; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* rec[NR];
    __m512 d[NR];
    for (int g = 0; g < NR; ++g) {
      rec[g] = group0 + g * group_bytes + s * record;
      d[g] = halves(rec[g] + 8 * bb + 256);
    }
    for (int64_t sb = 0; sb < 8; ++sb) {
      const int64_t b = s * 8 + sb;
      __m512i dot[MR][NR];
      // chunks [t0, t0 + count) into dot, seeded with `seed(r)`
      auto dots = [&](int t0, int count, auto seed) {
        for (int r = 0; r < MR; ++r) {
          const __m512i start = seed(r);
          for (int g = 0; g < NR; ++g) dot[r][g] = start;
        }
        for (int t = t0; t < t0 + count; ++t) {
          __m512i lo[NR], hi[NR];
          for (int g = 0; g < NR; ++g) unpack_chunk<Kind>(rec[g] + sb * bb, t, lo[g], hi[g]);
          for (int r = 0; r < MR; ++r) {
            const __m512i x0 = _mm512_set1_epi32(xq[r][8 * b + 2 * t]), x1 = _mm512_set1_epi32(xq[r][8 * b + 2 * t + 1]);
            for (int g = 0; g < NR; ++g) dot[r][g] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][g], lo[g], x0), hi[g], x1);
          }
        }
      };
      if constexpr (Kind == kQ6K) {  // inputs 0..15 (chunks 0, 1) and 16..31 (chunks 2, 3) have scales of their own
        for (int half = 0; half < 2; ++half) {
          dots(2 * half, 2, [&](int r) { return _mm512_set1_epi32(-32 * a.qsum16[2 * (row[r] * nb + b) + half]); });
          for (int g = 0; g < NR; ++g) {
            const __m512 sc = opaque(_mm512_mul_ps(widen_s8(rec[g] + 8 * bb + (2 * sb + half) * 16), d[g]));
            for (int r = 0; r < MR; ++r)
              acc[r][g] = _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(a.d[row[r] * nb + b])),
                                          _mm512_cvtepi32_ps(dot[r][g]), acc[r][g]);
          }
        }
      } else {
        dots(0, 4, [](int) { return _mm512_setzero_si512(); });
        for (int g = 0; g < NR; ++g) {
          const uint8_t* tail = rec[g] + 8 * bb;
          const __m512 scale = opaque(_mm512_mul_ps(widen_u8(tail + sb * 16), d[g]));
          const __m512 offset = opaque(_mm512_mul_ps(widen_u8(tail + 128 + sb * 16), halves(tail + 288)));
          for (int r = 0; r < MR; ++r) {
            const __m512 ds = _mm512_mul_ps(scale, _mm512_set1_ps(a.d[row[r] * nb + b]));
            acc[r][g] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(dot[r][g]), acc[r][g]);
            acc[r][g] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(a.dsum[row[r] * nb + b]), acc[r][g]);
          }
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < NR; ++g) _mm512_storeu_ps(sums + (r * NR + g) * kGroupRows, acc[r][g]);
}
}  // namespace lanes16
#endif

#if !defined(LLMACCEL_KQ_LANES8)
namespace plain {
// The same arithmetic in plain C++, one activation row at a time.
inline int code(int64_t kind, const uint8_t* block, int64_t row, int64_t input) {
  const int64_t t = input / 8, s = (input % 8) / 4, j = input % 4;
  const uint8_t byte = block[64 * t + 4 * row + j];
  int q = s ? byte >> 4 : byte & 0x0F;
  if (kind == kQ5K) q |= ((block[kNibbles + 4 * row + j] >> (2 * t + s)) & 1) << 4;
  if (kind == kQ6K) q |= ((block[kNibbles + 64 * (t / 2) + 4 * row + j] >> (2 * (2 * (t % 2) + s))) & 3) << 4;
  return q;
}

template <int64_t Kind, int MR>
void group_pass(const QuantizedRows& a, const uint8_t* group, int64_t supers, int64_t k, int64_t i0, int rows,
                float* y, int64_t ldy, int64_t cols) {
  const int64_t nb = k / kBlock, record = record_bytes(Kind), bb = block_bytes(Kind);
  for (int r = 0; r < rows; ++r) {
    const int64_t i = i0 + r;
    for (int64_t row = 0; row < cols; ++row) {
      float acc = 0.0f, off = 0.0f;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* rec = group + s * record;
        const uint8_t* tail = rec + 8 * bb;
        const float d = half_bits_to_float(tail + 256 + 2 * row);
        const float dmin = Kind != kQ6K ? half_bits_to_float(tail + 288 + 2 * row) : 0.0f;
        for (int64_t sb = 0; sb < 8; ++sb) {
          const int64_t b = s * 8 + sb;
          const int8_t* xq = a.q.data() + i * k + b * kBlock;
          int32_t dots[2] = {0, 0};
          for (int64_t in = 0; in < kBlock; ++in) dots[in / 16] += code(Kind, rec + sb * bb, row, in) * xq[in];
          if (Kind == kQ6K) {
            const int32_t* sums16 = a.qsum16.data() + 2 * (i * nb + b);
            const float dx = a.d[i * nb + b];
            acc += static_cast<int8_t>(tail[(2 * sb) * 16 + row]) * d * dx * static_cast<float>(dots[0] - 32 * sums16[0]);
            off += static_cast<int8_t>(tail[(2 * sb + 1) * 16 + row]) * d * dx *
                   static_cast<float>(dots[1] - 32 * sums16[1]);
          } else {
            acc += tail[sb * 16 + row] * d * a.d[i * nb + b] * static_cast<float>(dots[0] + dots[1]);
            off += tail[128 + sb * 16 + row] * dmin * a.dsum[i * nb + b];
          }
        }
      }
      y[i * ldy + row] = Kind == kQ6K ? acc + off : acc - off;
    }
  }
}
}  // namespace plain
#endif

// One pass of `rows` activation rows against a group. With AVX512-VNNI only 1-2 rows come here (tiles_of takes
// more): two rows a 16-lane pass, but a lone row (a decode step) the 8-lane kernel's: it streams memory faster on one row and gives the same bits (both are
// exact integer sums, then the same float steps in the same order). Measured on a 2-core Zen 4 (Q4_K, 28 x 29 MB
// on huge pages, the two kernels alternating): from memory the 8-lane kernel reads 46-51 GB/s where the machine's
// sum reads ~62, the 16-lane one 38-42 (0.79-0.88x); where the sum reads ~33 they tie (0.97x); only with the
// weights in cache is the 16-lane one faster (1.31x). A 256-bit VNNI form of the 8-lane kernel, and the 16-lane one
// reading two or three groups side by side, measured alike (0.81-0.91x from memory), so neither is used.
template <int64_t Kind>
void one_pass(const QuantizedRows& a, const uint8_t* group, int64_t supers, int64_t k, int64_t i0, int rows, float* y,
              int64_t ldy, int64_t cols) {
#if defined(LLMACCEL_KQ_LANES16)
  switch (rows) {
    case 2: return lanes16::group_pass<Kind, 2>(a, group, supers, k, i0, rows, y, ldy, cols);
    default: return lanes8::group_pass<Kind, 1>(a, group, supers, k, i0, rows, y, ldy, cols);
  }
#elif defined(LLMACCEL_KQ_LANES8)
  switch (rows) {
    case 4: return lanes8::group_pass<Kind, 4>(a, group, supers, k, i0, rows, y, ldy, cols);
    case 3: return lanes8::group_pass<Kind, 3>(a, group, supers, k, i0, rows, y, ldy, cols);
    case 2: return lanes8::group_pass<Kind, 2>(a, group, supers, k, i0, rows, y, ldy, cols);
    default: return lanes8::group_pass<Kind, 1>(a, group, supers, k, i0, rows, y, ldy, cols);
  }
#else
  plain::group_pass<Kind, 1>(a, group, supers, k, i0, rows, y, ldy, cols);
#endif
}

#if defined(LLMACCEL_KQ_LANES16)
constexpr int kPassRows = 2;  // three rows and more take tiles_of
#elif defined(LLMACCEL_KQ_LANES8)
constexpr int kPassRows = 4;
#else
constexpr int kPassRows = 1;
#endif

#if defined(LLMACCEL_KQ_LANES16)
template <int64_t Kind>
void tiles_of(const QuantizedRows& a, const uint8_t* blocks, float* y, int64_t ldy, int64_t m, int64_t k, int64_t n,
              int64_t g0, int64_t g1) {
  const int64_t supers = k / kSuper, group_bytes = supers * record_bytes(Kind);
  tile_sweep(m, n, g0, g1, nullptr, y, ldy, [&](int64_t g, int width, int64_t i0, int rows, float* sums) {
    const uint8_t* group = blocks + g * group_bytes;
    if (width == kTileGroups)
      lanes16::tile_pass<Kind, kTileRows, kTileGroups>(a, group, group_bytes, supers, k, i0, rows, sums);
    else
      lanes16::tile_pass<Kind, kTileRows, 1>(a, group, group_bytes, supers, k, i0, rows, sums);
  });
}
#endif

template <int64_t Kind>
void groups_of(const QuantizedRows& a, const uint8_t* blocks, float* y, int64_t ldy, int64_t m, int64_t k, int64_t n,
               int64_t g0, int64_t g1) {
#if defined(LLMACCEL_KQ_LANES16)
  // (fewer rows: group_pass, whose 8-lane kernel streams a lone row from memory faster)
  if (m >= kTileFromRows) return tiles_of<Kind>(a, blocks, y, ldy, m, k, n, g0, g1);
#endif
  const int64_t supers = k / kSuper, record = record_bytes(Kind);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = blocks + g * supers * record;
    const int64_t cols = std::min(kGroupRows, n - g * kGroupRows);
    for (int64_t i0 = 0; i0 < m; i0 += kPassRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPassRows, m - i0));
      one_pass<Kind>(a, group, supers, k, i0, rows, y + g * kGroupRows, ldy, cols);
    }
  }
}

// ---- repacking a GGUF tensor -----------------------------------------------------------------------------

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes (llama.cpp's get_scale_min_k4).
inline void scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q5_K's 256 codes of one GGUF super-block (0..31) into codes[256].
void q5k_codes(const uint8_t* src, uint8_t* codes) {
  const uint8_t* qs = src + 48;
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l)
      codes[32 * j + l] = static_cast<uint8_t>(((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F) |
                                               (((src[16 + l] >> j) & 1) << 4));
}

// Row r's 32 Q5_K codes of one block into the chunk layout: the nibbles, then the fifth bits.
void place_q5k_block(const uint8_t* q, int64_t r, uint8_t* block) {
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j) {
      const uint8_t low = q[8 * t + j], high = q[8 * t + 4 + j];
      block[64 * t + 4 * r + j] = static_cast<uint8_t>((low & 0x0F) | ((high & 0x0F) << 4));
      block[kNibbles + 4 * r + j] |= static_cast<uint8_t>((((low >> 4) & 1) << (2 * t)) | (((high >> 4) & 1) << (2 * t + 1)));
    }
}

// Four codes a time, as 32-bit words: bytes a (inputs 8 t .. 8 t + 3) and b (8 t + 4 ..) shifted right by `shift`,
// `mask`ed: the chunk word of row r is a | b << 4 (the low nibbles), the words of Q6_K's high bit pairs likewise.
inline uint32_t word(const uint8_t* p, int shift, uint32_t mask) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return (v >> shift) & mask;
}

// Q4_K's and Q6_K's codes straight from the file's bytes into row r's chunk words, four at a time (the bulk of a
// load: built code by code and placed a byte at a time, as Q5_K's still are, the 8B Q4_K_M repack took 7.0 s, not 3.8).
void place_q4k_fast(const uint8_t* src, int64_t r, uint8_t* rec) {
  const uint8_t* qs = src + 16;  // sub-block j: nibble j % 2 of qs[32 (j / 2) + l]
  for (int sb = 0; sb < 8; ++sb) {
    const uint8_t* q = qs + 32 * (sb / 2);
    const int shift = 4 * (sb % 2);
    uint8_t* block = rec + sb * 256;
    for (int t = 0; t < 4; ++t) {
      const uint32_t v = word(q + 8 * t, shift, 0x0F0F0F0Fu) | word(q + 8 * t + 4, shift, 0x0F0F0F0Fu) << 4;
      std::memcpy(block + 64 * t + 4 * r, &v, 4);
    }
  }
}

void place_q6k_fast(const uint8_t* src, int64_t r, uint8_t* rec) {
  for (int sb = 0; sb < 8; ++sb) {  // inputs 32 sb + i: low nibble of ql[64 h + 32 (sb % 2) + i] >> 4 ((sb % 4) / 2),
    const int h = sb / 4;           // high pair of qh[32 h + i] >> 2 (sb % 4), h = sb / 4
    const uint8_t* low = src + 64 * h + 32 * (sb % 2);
    const uint8_t* high = src + 128 + 32 * h;
    const int low_shift = 4 * ((sb % 4) / 2), high_shift = 2 * (sb % 4);
    uint8_t* block = rec + sb * 384;
    uint32_t pairs[2] = {0, 0};
    for (int t = 0; t < 4; ++t) {
      const uint32_t v = word(low + 8 * t, low_shift, 0x0F0F0F0Fu) | word(low + 8 * t + 4, low_shift, 0x0F0F0F0Fu) << 4;
      std::memcpy(block + 64 * t + 4 * r, &v, 4);
      pairs[t / 2] |= word(high + 8 * t, high_shift, 0x03030303u) << (4 * (t % 2)) |
                      word(high + 8 * t + 4, high_shift, 0x03030303u) << (4 * (t % 2) + 2);
    }
    std::memcpy(block + kNibbles + 4 * r, &pairs[0], 4);
    std::memcpy(block + kNibbles + 64 + 4 * r, &pairs[1], 4);
  }
}

// One K-quant super-block of row r (GGUF bytes `src`) into the group's record.
void place_super(int64_t kind, const uint8_t* src, int64_t r, uint8_t* rec) {
  const int64_t bb = block_bytes(kind);
  if (kind == kQ4K) {
    place_q4k_fast(src, r, rec);
  } else if (kind == kQ6K) {
    place_q6k_fast(src, r, rec);
  } else {
    uint8_t codes[256];
    q5k_codes(src, codes);
    for (int sb = 0; sb < 8; ++sb) place_q5k_block(codes + 32 * sb, r, rec + sb * bb);
  }
  uint8_t* tail = rec + 8 * bb;
  if (kind == kQ6K) {
    for (int j = 0; j < 16; ++j) tail[j * 16 + r] = src[192 + j];
    std::memcpy(tail + 256 + 2 * r, src + 208, 2);  // d, float16 as the file has it
    return;
  }
  for (int j = 0; j < 8; ++j) scale_min(j, src + 4, tail[j * 16 + r], tail[128 + j * 16 + r]);
  std::memcpy(tail + 256 + 2 * r, src, 2);      // d
  std::memcpy(tail + 288 + 2 * r, src + 2, 2);  // dmin
}

// Q8_0 / Q4_0 / Q4_1 block of row r (GGUF bytes `src`, 32 weights) into gemv.cpp's INT8 block (544 B: weights + 128,
// then 16 float16 scales, the file's d) or gemv_int4.cpp's INT4 block (320 B: nibbles, 16 float16 scales, 16 float16 offsets).
void place_block32(int64_t type, const uint8_t* src, int64_t r, uint8_t* block) {
  if (type == kQ8_0) {
    for (int t = 0; t < 8; ++t)
      for (int j = 0; j < 4; ++j) block[64 * t + 4 * r + j] = static_cast<uint8_t>(static_cast<int8_t>(src[2 + 4 * t + j]) + 128);
    std::memcpy(block + 512 + 2 * r, src, 2);  // d, float16 as the file has it
    return;
  }
  const uint8_t* qs = src + (type == kQ4_0 ? 2 : 4);
  uint8_t q[32];
  for (int l = 0; l < 16; ++l) {
    q[l] = qs[l] & 0x0F;
    q[l + 16] = qs[l] >> 4;
  }
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j) block[64 * t + 4 * r + j] = static_cast<uint8_t>(q[8 * t + j] | (q[8 * t + 4 + j] << 4));
  // w = q * scale + offset: Q4_1's d and m as they are; Q4_0's d and -8 d (exact in float16)
  std::memcpy(block + 256 + 2 * r, src, 2);
  if (type == kQ4_1) {
    std::memcpy(block + 288 + 2 * r, src + 2, 2);
  } else {
    const c10::Half offset(-8.0f * half_bits_to_float(src));
    std::memcpy(block + 288 + 2 * r, &offset.x, 2);
  }
}

}  // namespace

void check_kq_blocks(const torch::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(kind == kQ4K || kind == kQ5K || kind == kQ6K, "K-quant kind must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.size(2) == record_bytes(kind),
              "blocks must be contiguous uint8 [ceil(N / 16), K / 256, ", record_bytes(kind), "]");
}

LLMACCEL_ONE_COPY void kq_groups(const QuantizedRows& a, const uint8_t* blocks, int64_t kind, float* y, int64_t ldy,
                                 int64_t m, int64_t k, int64_t n, int64_t g0, int64_t g1) {
  if (kind == kQ4K) return groups_of<kQ4K>(a, blocks, y, ldy, m, k, n, g0, g1);
  if (kind == kQ5K) return groups_of<kQ5K>(a, blocks, y, ldy, m, k, n, g0, g1);
  return groups_of<kQ6K>(a, blocks, y, ldy, m, k, n, g0, g1);
}

}  // namespace llmaccel

using namespace llmaccel;

// x [M, K] -> [M, n] float32, for K-quant weights in kquant.cpp's blocks of GGML type `kind`.
torch::Tensor gemv_kq(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t n) {
  check_kq_blocks(blocks, kind);
  check_groups_fit(blocks, n);
  const int64_t k = blocks.size(1) * kSuper;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  const int64_t m = x.size(0);
  const QuantizedRows& a = quantize_input(x);
  auto y = torch::empty({m, n}, x.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const int64_t groups = blocks.size(0), threads = at::get_num_threads();
  at::parallel_for(0, groups, (groups + threads - 1) / threads,
                   [&](int64_t g0, int64_t g1) { kq_groups(a, wp, kind, yp, n, m, k, n, g0, g1); });
  return y;
}

// A GGUF tensor's bytes raw [R, row bytes] of GGML type `type` (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) -> the blocks of
// llmaccel's kernel for it (gemv_i8 with scales inside, gemv_i4, gemv_kq), output row i taken from raw row
// rows[i] (llama.cpp's q/k row order undone), rows past R zero. K is the row length in weights. Written into
// `out` where given (a view of the model's weight mapping: no second copy at load), else into a new tensor.
torch::Tensor gguf_repack(torch::Tensor raw, int64_t type, torch::Tensor rows, int64_t k,
                          c10::optional<torch::Tensor> out_given) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.stride(1) == 1,
              "raw must be uint8 [rows, row bytes] with contiguous rows");
  const bool super = type == kQ4K || type == kQ5K || type == kQ6K;
  TORCH_CHECK(super || type == kQ8_0 || type == kQ4_0 || type == kQ4_1, "GGML type ", type, " is not repacked here");
  const int64_t unit = super ? kSuper : kBlock;
  const int64_t src_bytes = super ? (type == kQ4K ? 144 : type == kQ5K ? 176 : 210) : (type == kQ8_0 ? 34 : type == kQ4_0 ? 18 : 20);
  TORCH_CHECK(k % unit == 0 && raw.size(1) == k / unit * src_bytes, "a row of ", k, " weights of type ", type,
              " is ", k / unit * src_bytes, " bytes, not ", raw.size(1));
  auto index = rows.to(torch::kInt64).contiguous();
  const int64_t n = index.numel(), groups = (n + kGroupRows - 1) / kGroupRows, units = k / unit;
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < raw.size(0), "row index ", idx[i], " is outside");
  const int64_t out_bytes = super ? record_bytes(type) : type == kQ8_0 ? 512 + 2 * kGroupRows : kInt4BlockBytes;
  torch::Tensor out;
  if (out_given.has_value()) {
    out = *out_given;
    TORCH_CHECK(out.scalar_type() == torch::kUInt8 && out.is_contiguous() && out.dim() == 3 && out.size(0) == groups &&
                    out.size(1) == units && out.size(2) == out_bytes,
                "out must be contiguous uint8 [", groups, ", ", units, ", ", out_bytes, "]");
  } else {
    out = torch::empty({groups, units, out_bytes}, torch::kUInt8);
  }
  uint8_t* op = out.data_ptr<uint8_t>();
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  const int64_t ld = raw.stride(0);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      std::memset(op + g * units * out_bytes, 0, units * out_bytes);  // bits are or-ed in; spare rows stay zero
      for (int64_t r = 0; r < kGroupRows && g * kGroupRows + r < n; ++r) {
        const uint8_t* src = rp + idx[g * kGroupRows + r] * ld;
        for (int64_t u = 0; u < units; ++u) {
          uint8_t* dst = op + (g * units + u) * out_bytes;
          if (super)
            place_super(type, src + u * src_bytes, r, dst);
          else
            place_block32(type, src + u * src_bytes, r, dst);
        }
      }
    }
  });
  return out;
}
