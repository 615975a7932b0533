// INT8, INT4 and K-quant weights at batches on AMX: y[M, N] = x[M, K] @ W[N, K]^T for bfloat16 activations, each
// block of 32 output columns of the weight (two of the streaming kernels' groups of 16 rows, gemv.cpp and
// gemv_int4.cpp, read in place) dequantized to bfloat16 in the AMX pair layout (linear_vnni.cpp) in a
// buffer of the calling thread, then multiplied by oneDNN's brgemm micro-kernel.
//
// The streaming kernels quantize the activations to INT8 and run integer dot products: bound by the
// weights' read at a few rows, but at 64 rows each weight byte meets 64 rows of dot-product instructions,
// and an INT8 model served 64 requests at 0.54x the bf16 model's rate on a 2-core Xeon with AMX (the
// bf16 projections run on AMX tiles there). Here a weight is unpacked once per step (~22 vector
// instructions for 64 weights) and the tiles do the rest. The activations stay bfloat16 (no INT8
// rounding of them); an INT8 weight with one scale a row goes in as its integers (exact in bfloat16)
// and the scale multiplies the float32 sums; a scale per 32 inputs (GGUF Q8_0) and INT4's scale and
// offset are applied before the weight is rounded to bfloat16; so are a K-quant sub-block's d sc and dmin m
// (kquant.cpp's records, whose nibbles lie as INT4's do). ops/kernel_choice.py times this against the
// streaming kernels per row count and uses it where it is faster.
#include "aten.h"
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace llmaccel {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
namespace {

constexpr int64_t kInt8BlockBytes = 512;  // 16 rows x 32 inputs (+ 32 bytes of float16 scales where they are inside)
constexpr int64_t kScaleAt4 = 256, kOffsetAt4 = 288;

// Lane l of a 16-lane vector covering 4 rows x 4 inputs belongs to row 4 q + l / 4: the per-row values
// of a group's 16 rows spread to those lanes.
inline __m512 spread(__m512 per_row, int q) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(4 * q),
                                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  return _mm512_permutexvar_ps(index, per_row);
}

// Four vectors of 4 rows x 4 consecutive inputs (rows 0-3, 4-7, 8-11, 12-15 of a group; row r's inputs
// i..i+3 in lanes 4 (r % 4)..), rounded to bfloat16, stored as the two pairs (i, i+1) and (i+2, i+3)
// of the group's 16 columns: `first` and `second` each get 16 columns' pairs.
inline void store_pairs(const __m512 f[4], uint32_t* first, uint32_t* second) {
  const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), b = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  _mm512_storeu_si512(first, _mm512_permutex2var_epi32(a, even, b));
  _mm512_storeu_si512(second, _mm512_permutex2var_epi32(a, odd, b));
}

// One 32-input block's four chunks of 16 rows' nibbles (+ the high bits `high` adds to each lane's code),
// weight = code * scale + offset with per-row vectors: scale[0], offset[0] for inputs 0-15 (chunks 0, 1) and,
// where Halves is 2, scale[1], offset[1] for inputs 16-31 (chunks 2, 3); into the pairs of block `b` of half `h`.
template <int Halves, typename High>
inline void unpack_codes(const uint8_t* nibbles, const __m512* scale, const __m512* offset, High high, uint32_t* out,
                         int64_t b, int h) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m512 s[4], o[4];
  for (int t = 0; t < 4; ++t) {  // chunk t: byte 4 r + j holds inputs 8 t + j (low) and 8 t + 4 + j (high)
    if (t == 0 || (Halves == 2 && t == 2))
      for (int q = 0; q < 4; ++q) s[q] = spread(scale[t / 2], q), o[q] = spread(offset[t / 2], q);
    __m512 lo[4], hi[4];
    for (int q = 0; q < 4; ++q) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + 64 * t + 16 * q));
      const __m128i low = _mm_or_si128(_mm_and_si128(bytes, nibble), high(t, q, 0));
      const __m128i up = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), high(t, q, 1));
      lo[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), s[q], o[q]);
      hi[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(up)), s[q], o[q]);
    }
    const int64_t pair = 16 * b + 4 * t;
    store_pairs(lo, out + pair * kVnniBlock + 16 * h, out + (pair + 1) * kVnniBlock + 16 * h);
    store_pairs(hi, out + (pair + 2) * kVnniBlock + 16 * h, out + (pair + 3) * kVnniBlock + 16 * h);
  }
}

struct NoHighBits {  // codes of four bits (INT4, Q4_K): a type of its own, so the call inlines
  __m128i operator()(int, int, int) const { return _mm_setzero_si128(); }
};

// Bits (x >> shift) & mask of each byte of the 16 at p, moved up to bit 4 (the code's high bits).
inline __m128i high_bits(const uint8_t* p, int shift, int mask) {
  const __m128i bits = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), shift),
                                     _mm_set1_epi8(static_cast<char>(mask)));
  return _mm_slli_epi16(bits, 4);  // (at most 0x30: no bit crosses into the next byte)
}

inline __m512 widen_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One group of 16 rows (all K) into half `h` of a packed block [K / 2, 32] of bf16 pairs.
void unpack_int8_group(const uint8_t* group, int64_t nb, int64_t stride, bool scaled, uint32_t* out, int h) {
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * stride;
    const __m512 scale =
        scaled ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kInt8BlockBytes)))
               : _mm512_setzero_ps();
    for (int t = 0; t < 8; ++t) {  // chunk t: row r's inputs 4 t .. 4 t + 3 at bytes 4 r .., plus 128
      __m512 f[4];
      for (int q = 0; q < 4; ++q) {
        const __m128i bytes = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * t + 16 * q)),
                                            flip);
        f[q] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        if (scaled) f[q] = _mm512_mul_ps(f[q], spread(scale, q));
      }
      const int64_t pair = 16 * b + 2 * t;
      store_pairs(f, out + pair * kVnniBlock + 16 * h, out + (pair + 1) * kVnniBlock + 16 * h);
    }
  }
}

void unpack_int4_group(const uint8_t* group, int64_t nb, uint32_t* out, int h) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = group + b * kInt4BlockBytes;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kScaleAt4)));
    const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kOffsetAt4)));
    unpack_codes<1>(block, &scale, &offset, NoHighBits{}, out, b, h);
  }
}

// One group of 16 rows of a K-quant (kquant.cpp's records: per 256 inputs 8 blocks of codes, then the scales and
// d, dmin as float16) into half `h`: Q4_K and Q5_K w = d sc q - dmin m per 32 inputs, Q6_K w = d sc (q - 32) per 16.
template <int64_t Kind>
void unpack_kq_group(const uint8_t* group, int64_t supers, uint32_t* out, int h) {
  constexpr int64_t kBlockBytes = Kind == 12 ? 256 : Kind == 13 ? 320 : 384;
  constexpr int64_t kRecord = 8 * kBlockBytes + (Kind == 14 ? 256 + 32 : 256 + 64);
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* record = group + sb * kRecord;
    const uint8_t* scales = record + 8 * kBlockBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 256)));
    for (int64_t b = 0; b < 8; ++b) {
      const uint8_t* block = record + b * kBlockBytes;
      if constexpr (Kind == 14) {  // two sub-blocks of 16, w = d sc (code - 32), code 0..63: the low nibble and
        // two bits of the pair bytes of chunks 0, 1 (then 2, 3), at 4 (t % 2) for the low input, + 2 for the high
        __m512 scale[2], offset[2];
        for (int half = 0; half < 2; ++half) {
          scale[half] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * (2 * b + half))))));
          offset[half] = _mm512_mul_ps(scale[half], _mm512_set1_ps(-32.0f));
        }
        unpack_codes<2>(block, scale, offset,
                        [&](int t, int q, int up) {
                          return high_bits(block + 256 + 64 * (t / 2) + 16 * q, 4 * (t % 2) + 2 * up, 3);
                        },
                        out, 8 * sb + b, h);
      } else {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 288)));
        const __m512 scale = _mm512_mul_ps(d, widen_u8(scales + 16 * b));
        const __m512 offset = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, widen_u8(scales + 128 + 16 * b)));
        if constexpr (Kind == 12) {
          unpack_codes<1>(block, &scale, &offset, NoHighBits{}, out, 8 * sb + b, h);
        } else {  // Q5_K: the fifth bit of input 8 t + j (low) at bit 2 t, of 8 t + 4 + j (high) at 2 t + 1
          unpack_codes<1>(block, &scale, &offset,
                          [&](int t, int q, int up) { return high_bits(block + 256 + 16 * q, 2 * t + up, 1); }, out,
                          8 * sb + b, h);
        }
      }
    }
  }
}

}  // namespace

LLMACCEL_ONE_COPY void dequant_brgemm_columns(const QuantizedWeight& w, const uint16_t* xb, int64_t ldx, int64_t m,
                                              bf16* y, int64_t ldy, int64_t c0, int64_t c1) {
  const int64_t nb = w.k / kBlock, groups = (w.n + 15) / 16, pairs = w.k / 2;
  thread_local std::vector<uint32_t> packed;
  packed.resize(pairs * kVnniBlock);
  const auto* block = reinterpret_cast<const uint16_t*>(packed.data());
  for (int64_t r0 = 0; r0 < m; r0 += kBrgemmChunkRows) {  // each chunk's blocks dequantized anew
    const int64_t r1 = std::min(m, r0 + kBrgemmChunkRows);
    for (int64_t c = c0; c < c1; c += kVnniBlock) {
      const int64_t g0 = c / 16, width = std::min<int64_t>(kVnniBlock, c1 - c);
      for (int h = 0; h < 2; ++h) {
        if (g0 + h >= groups) {  // a last block of one group: the other half multiplies zeros
          for (int64_t p = 0; p < pairs; ++p) std::memset(packed.data() + p * kVnniBlock + 16, 0, 64);
          continue;
        }
        if (w.kq_type) {
          const int64_t supers = w.k / 256;
          const uint8_t* group = w.blocks + (g0 + h) * supers * w.block_stride;
          if (w.kq_type == 12) unpack_kq_group<12>(group, supers, packed.data(), h);
          else if (w.kq_type == 13) unpack_kq_group<13>(group, supers, packed.data(), h);
          else unpack_kq_group<14>(group, supers, packed.data(), h);
        } else if (w.int4) {
          unpack_int4_group(w.blocks + (g0 + h) * nb * kInt4BlockBytes, nb, packed.data(), h);
        } else {
          unpack_int8_group(w.blocks + (g0 + h) * nb * w.block_stride, nb, w.block_stride, w.row_scale == nullptr,
                            packed.data(), h);
        }
      }
      brgemm_rows(xb, ldx, r0, r1, block, w.k, width, w.row_scale == nullptr ? nullptr : w.row_scale + c, y, ldy, c);
    }
  }
}

#else
void dequant_brgemm_columns(const QuantizedWeight&, const uint16_t*, int64_t, int64_t, bf16*, int64_t, int64_t,
                            int64_t) {
  TORCH_CHECK(false, "the AMX kernels for quantized weights need AVX512-BF16");
}
#endif

}  // namespace llmaccel

namespace {
torch::Tensor columns_on_amx(const torch::Tensor& x, llmaccel::QuantizedWeight& w) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == torch::kBFloat16,
              "x must be bfloat16 [rows, ", w.k, "]");
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.n;
  auto y = torch::empty({m, n}, xc.options());
  if (m == 0) return y;
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t units = (n + llmaccel::kVnniBlock - 1) / llmaccel::kVnniBlock;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    llmaccel::dequant_brgemm_columns(w, xb, w.k, m, yp, n, u0 * llmaccel::kVnniBlock,
                                     std::min(n, u1 * llmaccel::kVnniBlock));
    llmaccel::vnni_release();
  });
  return y;
}
}  // namespace

// x bfloat16 [M, K] against a K-quant (kquant.cpp's records, `kind` its GGML type) of n outputs -> bfloat16 [M, n].
torch::Tensor kquant_linear_amx(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t n) {
  TORCH_CHECK(llmaccel::vnni_compiled(), "the AMX kernels are not available on this CPU");
  llmaccel::check_kq_blocks(blocks, kind);
  llmaccel::check_groups_fit(blocks, n);
  llmaccel::QuantizedWeight w;
  w.blocks = blocks.data_ptr<uint8_t>();
  w.block_stride = blocks.size(2);  // a group's record per 256 inputs
  w.k = blocks.size(1) * 256;
  w.n = n;
  w.kq_type = kind;
  return columns_on_amx(x, w);
}

// x bfloat16 [M, K] against INT8 (gemv_i8's blocks and row scales) or INT4 (gemv_i4's blocks) weights of
// n outputs -> bfloat16 [M, n], the columns split between the threads 32 at a time.
torch::Tensor quant_linear_amx(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> row_scale,
                               int64_t n, bool int4) {
  TORCH_CHECK(llmaccel::vnni_compiled(), "the AMX kernels are not available on this CPU");
  llmaccel::QuantizedWeight w;
  if (int4) {
    llmaccel::check_int4_blocks(blocks);
    TORCH_CHECK(!row_scale, "INT4 blocks hold their own scales");
  } else {
    w.block_stride = llmaccel::check_int8_blocks(blocks, row_scale);
  }
  llmaccel::check_groups_fit(blocks, n);
  w.blocks = blocks.data_ptr<uint8_t>();
  w.row_scale = row_scale ? row_scale->data_ptr<float>() : nullptr;
  w.k = blocks.size(1) * llmaccel::kBlock;
  w.n = n;
  w.int4 = int4;
  return columns_on_amx(x, w);
}
