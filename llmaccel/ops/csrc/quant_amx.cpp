// INT8, INT4 and K-quant weights at batches on AMX: y[M, N] = x[M, K] @ W[N, K]^T for bfloat16 activations.
// Each group of 16 output columns (the streaming kernels' groups, gemv.cpp, gemv_int4.cpp, kquant.cpp, read in
// place) is dequantized a block of 32 inputs at a time into one AMX B tile (16 pairs of inputs x 16 columns of
// bfloat16, the pair layout of linear_vnni.cpp) in L1, which the tiles multiply right away by up to four 16-row
// tiles of x; rows past the first 64 reuse the group's dequantized tiles (a panel of K x 32 bytes, in L2).
//
// The streaming kernels quantize the activations to INT8 and run integer dot products: bound by the
// weights' read at a few rows, but at 64 rows each weight byte meets 64 rows of dot-product instructions.
// Here a weight is unpacked once per step (~22 vector instructions for 64 weights) and the tiles do the rest.
// The first version dequantized a block of 32 columns for all K into a buffer and called oneDNN's brgemm on
// it: on a 2-core Xeon with AMX it ran a Q8_0 projection at 64 rows at 0.5-0.76x the bf16 model's brgemm,
// the weights streamed through the buffer to L2 and back, and each brgemm call reloaded x's tiles from L2 at
// a stride that aliased in L1. Now x is laid out once per call as its tiles ([16 rows x 32 inputs] of 1 KB,
// contiguous), each B tile is used while it is in L1, and the weights are prefetched 40 KB ahead (kernels.h): the
// same projection runs at ~1.4x the bf16 brgemm (Q4_K ~1.45x, Q6_K ~1.24x) with the weights coming from memory.
// The activations stay bfloat16 (no INT8 rounding of them); an INT8 weight with one scale a row goes in as its
// integers (exact in bfloat16) and the scale multiplies the float32 sums; a scale per 32 inputs (GGUF Q8_0)
// and INT4's scale and offset are applied before the weight is rounded to bfloat16; so are a K-quant
// sub-block's d sc and dmin m (kquant.cpp's records, whose nibbles lie as INT4's do). The sums run over K in
// order, 32 inputs a tile instruction, as brgemm's did (equal to the first version's to the bit on Q8_0 in a
// probe). ops/kernel_choice.py times this against the streaming kernels per row count and uses it where faster.
#include "aten.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLMACCEL_AMX 1
#endif

namespace llmaccel {

#if defined(LLMACCEL_AMX)
namespace {

constexpr int64_t kInt8BlockBytes = 512;  // 16 rows x 32 inputs (+ 32 bytes of float16 scales where they are inside)
constexpr int64_t kScaleAt4 = 256, kOffsetAt4 = 288;
constexpr int64_t kTileWords = 256;       // a B tile: 16 pairs of inputs x 16 columns, as 32-bit pairs
constexpr int64_t kXTileWords = 16 * 32;  // an A tile: 16 rows x 32 bfloat16 inputs
constexpr int64_t kPassRows = 64;         // C tiles 0-3: four tiles of 16 rows
// x's tiles a chunk of rows, which every group passes over in L2 (2 MB a core on the Xeon): at 2,048 rows x 2,048
// inputs a chunk of 1 MB ran 1.35x faster than 2 MB and 2x faster than all rows at once (x falling out of L2)
constexpr int64_t kChunkBytes = 1 << 20;

// Linux hands out the AMX tile state on request only (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// oneDNN asks too, so this is a no-op where brgemm ran first.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Tiles 0-3 C (16 rows x 16 float32), 4 and 6 A (16 rows x 32 bf16), 5 B (16 pairs x 16 columns): 64 bytes a row.
void load_tile_config() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 7; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// Lane l of a 16-lane vector covering 4 rows x 4 inputs belongs to row 4 q + l / 4: the per-row values
// of a group's 16 rows spread to those lanes.
inline __m512 spread(__m512 per_row, int q) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(4 * q),
                                         _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  return _mm512_permutexvar_ps(index, per_row);
}

// Four vectors of 4 rows x 4 consecutive inputs (rows 0-3, 4-7, 8-11, 12-15 of a group; row r's inputs
// i..i+3 in lanes 4 (r % 4)..), rounded to bfloat16, stored as the tile rows of the pairs (i, i+1) and (i+2, i+3).
inline void store_pairs(const __m512 f[4], uint32_t* first, uint32_t* second) {
  const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), b = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  _mm512_store_si512(first, _mm512_permutex2var_epi32(a, even, b));
  _mm512_store_si512(second, _mm512_permutex2var_epi32(a, odd, b));
}

// One 32-input block's four chunks of 16 rows' nibbles (+ the high bits `high(t, up)` adds to the codes of
// chunk t's low (up 0) or high (up 1) nibbles, 64 bytes at once), weight = code * scale + offset with per-row
// vectors: scale[0], offset[0] for inputs 0-15 (chunks 0, 1) and, where Halves is 2, scale[1], offset[1] for
// inputs 16-31 (chunks 2, 3); into the B tile `tile`. The bit work runs on whole chunks (64 bytes an
// instruction, not 16), which took a Q6_K block from ~1.4x a Q8_0 block's time toward a Q4_K block's.
template <int Halves, typename High>
inline void unpack_codes(const uint8_t* nibbles, const __m512* scale, const __m512* offset, High high, uint32_t* tile) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  alignas(64) uint8_t codes[2][64];
  __m512 s[4], o[4];
  for (int t = 0; t < 4; ++t) {  // chunk t: byte 4 r + j holds inputs 8 t + j (low) and 8 t + 4 + j (high)
    if (t == 0 || (Halves == 2 && t == 2))
      for (int q = 0; q < 4; ++q) s[q] = spread(scale[t / 2], q), o[q] = spread(offset[t / 2], q);
    const __m512i bytes = _mm512_loadu_si512(nibbles + 64 * t);
    _mm512_store_si512(codes[0], _mm512_or_si512(_mm512_and_si512(bytes, nibble), high(t, 0)));
    _mm512_store_si512(codes[1], _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble), high(t, 1)));
    __m512 lo[4], hi[4];
    for (int q = 0; q < 4; ++q) {
      const auto widen = [&](int up) {
        const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(codes[up] + 16 * q));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c)), s[q], o[q]);
      };
      lo[q] = widen(0), hi[q] = widen(1);
    }
    uint32_t* pair = tile + 4 * t * 16;
    store_pairs(lo, pair, pair + 16);
    store_pairs(hi, pair + 32, pair + 48);
  }
}

struct NoHighBits {  // codes of four bits (INT4, Q4_K): a type of its own, so the call inlines
  __m512i operator()(int, int) const { return _mm512_setzero_si512(); }
};

// Bits (x >> shift) & (mask 1 or 3) of each of the 64 bytes at p, moved to bit 4 (a code's high bits): one
// shift of the 16-bit lanes and one mask, as no bit that the mask keeps crosses from the byte beside it.
inline __m512i high_bits(const uint8_t* p, int shift, int mask) {
  const __m512i v = _mm512_loadu_si512(p);
  const __m512i moved = shift <= 4 ? _mm512_slli_epi16(v, 4 - shift) : _mm512_srli_epi16(v, shift - 4);
  return _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(mask << 4)));
}

inline __m512 widen_u8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One INT8 block of a group (16 rows x 32 inputs + 128, then float16 scales where `scaled`) into its B tile.
inline void unpack_int8_block(const uint8_t* block, bool scaled, uint32_t* tile) {
  __m512 s[4], o[4];
  const __m512 scale =
      scaled ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kInt8BlockBytes)))
             : _mm512_set1_ps(1.0f);
  for (int q = 0; q < 4; ++q) s[q] = spread(scale, q), o[q] = _mm512_mul_ps(s[q], _mm512_set1_ps(-128.0f));
  for (int t = 0; t < 8; ++t) {  // chunk t: row r's inputs 4 t .. 4 t + 3 at bytes 4 r .., plus 128
    __m512 f[4];
    for (int q = 0; q < 4; ++q) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * t + 16 * q));
      f[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), s[q], o[q]);
    }
    store_pairs(f, tile + 2 * t * 16, tile + (2 * t + 1) * 16);
  }
}

inline void unpack_int4_block(const uint8_t* block, uint32_t* tile) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kScaleAt4)));
  const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kOffsetAt4)));
  unpack_codes<1>(block, &scale, &offset, NoHighBits{}, tile);
}

// One super-block of 256 inputs of a K-quant group (kquant.cpp's record: 8 blocks of codes, then the scales and
// d, dmin as float16) into 8 B tiles: Q4_K and Q5_K w = d sc q - dmin m per 32 inputs, Q6_K w = d sc (q - 32) per 16.
template <int64_t Kind>
void unpack_kq_super(const uint8_t* record, uint32_t* tiles) {
  constexpr int64_t kBlockBytes = Kind == 12 ? 256 : Kind == 13 ? 320 : 384;
  const uint8_t* scales = record + 8 * kBlockBytes;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 256)));
  for (int64_t b = 0; b < 8; ++b) {
    const uint8_t* block = record + b * kBlockBytes;
    uint32_t* tile = tiles + b * kTileWords;
    if constexpr (Kind == 14) {  // two sub-blocks of 16, w = d sc (code - 32), code 0..63: the low nibble and
      // two bits of the pair bytes of chunks 0, 1 (then 2, 3), at 4 (t % 2) for the low input, + 2 for the high
      __m512 scale[2], offset[2];
      for (int half = 0; half < 2; ++half) {
        scale[half] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * (2 * b + half))))));
        offset[half] = _mm512_mul_ps(scale[half], _mm512_set1_ps(-32.0f));
      }
      unpack_codes<2>(block, scale, offset,
                      [&](int t, int up) { return high_bits(block + 256 + 64 * (t / 2), 4 * (t % 2) + 2 * up, 3); },
                      tile);
    } else {
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 288)));
      const __m512 scale = _mm512_mul_ps(d, widen_u8(scales + 16 * b));
      const __m512 offset = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, widen_u8(scales + 128 + 16 * b)));
      if constexpr (Kind == 12) {
        unpack_codes<1>(block, &scale, &offset, NoHighBits{}, tile);
      } else {  // Q5_K: the fifth bit of input 8 t + j (low) at bit 2 t, of 8 t + 4 + j (high) at 2 t + 1
        unpack_codes<1>(block, &scale, &offset,
                        [&](int t, int up) { return high_bits(block + 256, 2 * t + up, 1); }, tile);
      }
    }
  }
}

// The B tiles of one unit of a group's inputs (a block of 32 for INT8 and INT4, a super-block of 256 for a
// K-quant) into `tiles`; returns how many blocks of 32 the unit holds.
int64_t unpack_unit(const QuantizedWeight& w, const uint8_t* group, int64_t unit, uint32_t* tiles) {
  switch (w.kq_type) {
    case 12: unpack_kq_super<12>(group + unit * w.block_stride, tiles); return 8;
    case 13: unpack_kq_super<13>(group + unit * w.block_stride, tiles); return 8;
    case 14: unpack_kq_super<14>(group + unit * w.block_stride, tiles); return 8;
    default: break;
  }
  if (w.int4) unpack_int4_block(group + unit * kInt4BlockBytes, tiles);
  else unpack_int8_block(group + unit * w.block_stride, w.row_scale == nullptr, tiles);
  return 1;
}

// Bytes of one unit of a group (unpack_unit's): a K-quant record of 256 inputs or a block of 32.
int64_t unit_bytes(const QuantizedWeight& w) { return w.kq_type || !w.int4 ? w.block_stride : kInt4BlockBytes; }

const uint8_t* group_blocks(const QuantizedWeight& w, int64_t g) {
  return w.blocks + g * (w.k / (w.kq_type ? 256 : kBlock)) * unit_bytes(w);
}

// C tiles 0 .. R-1 += R tiles of x (A, alternately tiles 4 and 6) times the B tile in tile 5.
template <int R>
inline void multiply(const uint16_t* xa, int64_t row_tile_words) {
  _tile_loadd(4, xa, 64);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (R > 1) {
    _tile_loadd(6, xa + row_tile_words, 64);
    _tile_dpbf16ps(1, 6, 5);
  }
  if constexpr (R > 2) {
    _tile_loadd(4, xa + 2 * row_tile_words, 64);
    _tile_dpbf16ps(2, 4, 5);
  }
  if constexpr (R > 3) {
    _tile_loadd(6, xa + 3 * row_tile_words, 64);
    _tile_dpbf16ps(3, 6, 5);
  }
}

// How a pass gets its B tiles: dequantized into the group's panel for the passes after it (Fill), read back from
// the panel (Reuse), or dequantized into two slots of a unit that stay in L1 (Ring, the only pass of a group: at
// 2,048 inputs a panel is 64 KB, past L1, and a tile load waiting on stores that missed L1 stalled the tiles).
enum class Tiles { kFill, kReuse, kRing };
constexpr int64_t kRingWords = 2 * 8 * kTileWords;  // two units of up to 8 tiles (a K-quant super-block)

// Up to 64 rows (R row tiles of `xt`, laid out by tile_rows) against one group, its B tiles as `tiles` says;
// the float32 sums into c [16 R rows][16].
template <int R>
void pass(const QuantizedWeight& w, const uint8_t* group, const uint16_t* xt, Tiles tiles, uint32_t* panel,
          uint32_t* ring, float* c) {
  const int64_t nb = w.k / kBlock, row_tile_words = nb * kXTileWords;
  _tile_zero(0);
  if constexpr (R > 1) _tile_zero(1);
  if constexpr (R > 2) _tile_zero(2);
  if constexpr (R > 3) _tile_zero(3);
  for (int64_t b = 0, unit = 0; b < nb; ++unit) {
    uint32_t* dst = tiles == Tiles::kRing ? ring + (unit & 1) * (kRingWords / 2) : panel + b * kTileWords;
    if (tiles != Tiles::kReuse) prefetch_ahead(group + unit * unit_bytes(w), unit_bytes(w));  // (kernels.h: why)
    const int64_t blocks = tiles == Tiles::kReuse ? nb : unpack_unit(w, group, unit, dst);
    for (int64_t i = 0; i < blocks; ++i, ++b) {
      _tile_loadd(5, dst + i * kTileWords, 64);
      multiply<R>(xt + b * kXTileWords, row_tile_words);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (R > 1) _tile_stored(1, c + 256, 64);
  if constexpr (R > 2) _tile_stored(2, c + 512, 64);
  if constexpr (R > 3) _tile_stored(3, c + 768, 64);
}

// Rows [r0, r0 + rows) of x as A tiles: [ceil(rows / 16)][K / 32][16 rows][32 inputs], the missing rows zero.
void tile_rows(const uint16_t* xb, int64_t ldx, int64_t r0, int64_t rows, int64_t k, uint16_t* out) {
  const int64_t nb = k / kBlock, row_tiles = (rows + 15) / 16;
  for (int64_t r = 0; r < 16 * row_tiles; ++r) {
    uint16_t* dst = out + (r / 16) * nb * kXTileWords + (r % 16) * kBlock;
    for (int64_t b = 0; b < nb; ++b) {
      if (r < rows) std::memcpy(dst + b * kXTileWords, xb + (r0 + r) * ldx + b * kBlock, 2 * kBlock);
      else std::memset(dst + b * kXTileWords, 0, 2 * kBlock);
    }
  }
}

// A thread's buffer of `words` 32-bit words on a 64-byte boundary (the tiles load and store whole lines).
template <int Which>
uint32_t* aligned_buffer(int64_t words) {
  thread_local std::vector<uint32_t> buffer;
  buffer.resize(words + 16);
  return reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

}  // namespace

bool quant_amx_compiled() { return vnni_compiled() && amx_permitted(); }

LLMACCEL_ONE_COPY void amx_quant_columns(const QuantizedWeight& w, const uint16_t* xb, int64_t ldx, int64_t m, bf16* y,
                                         int64_t ldy, int64_t c0, int64_t c1) {
  TORCH_CHECK(amx_permitted(), "the kernel could not obtain the AMX tile state from Linux");
  const int64_t nb = w.k / kBlock;
  const int64_t chunk = std::max(kPassRows, kChunkBytes / (2 * w.k) / kPassRows * kPassRows);
  uint16_t* xt = reinterpret_cast<uint16_t*>(aligned_buffer<0>((std::min(m, chunk) + 15) / 16 * 16 * w.k / 2));
  uint32_t* panel = aligned_buffer<1>(nb * kTileWords);
  uint32_t* ring = aligned_buffer<2>(kRingWords);
  alignas(64) float c[kPassRows * 16];
  load_tile_config();
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t rows = std::min(chunk, m - r0);
    tile_rows(xb, ldx, r0, rows, w.k, xt);
    for (int64_t g = c0 / 16; g * 16 < c1; ++g) {
      const uint8_t* group = group_blocks(w, g);
      const int64_t width = std::min<int64_t>(16, c1 - 16 * g);
      const __mmask16 mask = width >= 16 ? __mmask16(0xffff) : __mmask16((1u << width) - 1);
      const __m512 scale = w.row_scale ? _mm512_maskz_loadu_ps(mask, w.row_scale + 16 * g) : _mm512_set1_ps(1.0f);
      for (int64_t p = 0; p < rows; p += kPassRows) {
        const uint16_t* xa = xt + p / 16 * nb * kXTileWords;
        const Tiles tiles = rows <= kPassRows ? Tiles::kRing : p == 0 ? Tiles::kFill : Tiles::kReuse;
        switch (std::min<int64_t>(4, (rows - p + 15) / 16)) {
          case 1: pass<1>(w, group, xa, tiles, panel, ring, c); break;
          case 2: pass<2>(w, group, xa, tiles, panel, ring, c); break;
          case 3: pass<3>(w, group, xa, tiles, panel, ring, c); break;
          default: pass<4>(w, group, xa, tiles, panel, ring, c); break;
        }
        for (int64_t r = 0; r < std::min(kPassRows, rows - p); ++r) {
          __m512 sums = _mm512_load_ps(c + r * 16);
          if (w.row_scale) sums = _mm512_mul_ps(sums, scale);
          _mm256_mask_storeu_epi16(y + (r0 + p + r) * ldy + 16 * g, mask, (__m256i)_mm512_cvtneps_pbh(sums));
        }
      }
    }
  }
  vnni_release();  // the tiles back, and brgemm's next call sets its own configuration again
}

#else
bool quant_amx_compiled() { return false; }

void amx_quant_columns(const QuantizedWeight&, const uint16_t*, int64_t, int64_t, bf16*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the AMX kernels for quantized weights need a build with AMX (-mamx-tile -mamx-bf16)");
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
  at::parallel_for(0, (n + 15) / 16, 1, [&](int64_t g0, int64_t g1) {
    llmaccel::amx_quant_columns(w, xb, w.k, m, yp, n, 16 * g0, std::min(n, 16 * g1));
  });
  return y;
}
}  // namespace

// x bfloat16 [M, K] against a K-quant (kquant.cpp's records, `kind` its GGML type) of n outputs -> bfloat16 [M, n].
torch::Tensor kquant_linear_amx(torch::Tensor x, torch::Tensor blocks, int64_t kind, int64_t n) {
  TORCH_CHECK(llmaccel::quant_amx_compiled(), "the AMX kernels are not available on this CPU or build");
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
// n outputs -> bfloat16 [M, n], the columns split between the threads 16 at a time.
bool quant_amx_available() { return llmaccel::quant_amx_compiled(); }

torch::Tensor quant_linear_amx(torch::Tensor x, torch::Tensor blocks, c10::optional<torch::Tensor> row_scale,
                               int64_t n, bool int4) {
  TORCH_CHECK(llmaccel::quant_amx_compiled(), "the AMX kernels are not available on this CPU or build");
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
