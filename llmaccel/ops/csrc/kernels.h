// The kernels' inner loops, shared by their torch entry points (one file each) and the fused decode
// stack (decode_stack.cpp), which calls them from inside one parallel region: each works on a range
// (of output columns, rows or attention items) that the caller has given to the calling thread, and
// none of them starts threads of its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

// Under -ffast-math the compiler may vectorise a reduction differently wherever a loop is inlined, so
// these are never inlined: the torch entry points and the decode stack run one compiled copy of each
// and agree to the bit.
#define LLMACCEL_ONE_COPY __attribute__((noipa))

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace llmaccel {

#if defined(__AVX2__) && defined(__FMA__)
// The sum of a vector's eight lanes, always in this order (the kernels' results depend on it).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 bfloat16 (as bits) as float32 in a register.
inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
// 16 bfloat16 as float32 in a register (bf16 is the top half of a float32).
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// The last group of in_groups_of: `rest` (1 .. R) rows from i.
template <int R, typename Group>
inline void rest_group(int64_t rest, int64_t i, Group& group) {
  if constexpr (R >= 1) {
    if (rest == R) group(std::integral_constant<int, R>{}, i);
    else rest_group<R - 1>(rest, i, group);
  }
}

// m activation rows in groups of G, then one group of the rest: group(std::integral_constant<int, g>, i0) for
// rows i0 .. i0 + g - 1 (the streaming bf16 kernels' dot groups: g accumulator pairs a weight row).
template <int G, typename Group>
inline void in_groups_of(int64_t m, Group&& group) {
  int64_t i = 0;
  for (; i + G <= m; i += G) group(std::integral_constant<int, G>{}, i);
  if (i < m) rest_group<G - 1>(m - i, i, group);
}

// Activation rows the AVX512-BF16 streaming kernels take against a weight row at once: 8 keep 16 accumulators in
// registers, and a weight row is read (and the compact layout's decoded) once for 8 rows where groups of 4 read
// it twice, the second time with the memory idle.
constexpr int kDotRows = 8;

constexpr int64_t kBlock = 32;  // inputs per INT8 activation block (and per INT4 group)
constexpr int64_t kPanel = 16;  // output columns a float32 weight panel
constexpr int64_t kGroupRows = 16;       // weight rows a group of the INT8 and INT4 kernels' blocks
constexpr int64_t kInt4BlockBytes = 320;  // an INT4 block: 16 rows x 32 inputs, their scales and offsets
// How far ahead of its reads a weight-streaming kernel prefetches (into L2): on a 2-core AMD EPYC Zen 3 the hardware
// prefetcher alone kept a thread's INT4 / K-quant stream at a third of a plain read's bandwidth at one row; 40 KB
// ahead took the pair of threads from ~12 to ~19 GB/s against ~25 for a sum (a 160 MB matrix, medians).
constexpr int64_t kPrefetchBytes = 40 << 10;
inline void prefetch_ahead(const uint8_t* at, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(at + kPrefetchBytes + line, 0, 2);
}

// Activation rows quantized to INT8 in blocks of 32: q = round(x / d) with d = max|x| / 127.
struct QuantizedRows {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d;     // [M, K / 32]
  std::vector<float> dsum;  // [M, K / 32]: d * sum(q) of each block (what an INT4 offset multiplies)
  std::vector<int32_t> qsum;  // [M, K / 32]: sum(q) of each block (the INT8 kernel's +128 correction)
  std::vector<int32_t> qsum16;  // [M, K / 16]: sum(q) of each half block (Q6_K's -32 correction, kquant.cpp)
};

// Rows i0 .. i0 + MR - 1 of quantized activations for a pass of the INT8 and INT4 kernels (past the real `rows` the
// last again: those sums are not stored): their INT8 codes four at a time and their blocks' d, d * sum(q), sum(q).
template <int MR>
struct PassRows {
  const int32_t* q[MR];
  const float* d[MR];
  const float* dsum[MR];
  const int32_t* qsum[MR];
  PassRows(const QuantizedRows& a, int64_t i0, int rows, int64_t k) {
    const int64_t nb = k / kBlock;
    for (int r = 0; r < MR; ++r) {
      const int64_t i = i0 + std::min(r, rows - 1);
      q[r] = reinterpret_cast<const int32_t*>(a.q.data() + i * k);
      d[r] = a.d.data() + i * nb;
      dsum[r] = a.dsum.data() + i * nb;
      qsum[r] = a.qsum.data() + i * nb;
    }
  }
};

// The block kernels' batches (gemv.cpp, gemv_int4.cpp, kquant.cpp; AVX512-VNNI): from kTileFromRows rows on, passes
// of kTileRows activation rows x kTileGroups weight groups, kSweepRows rows at a time over the groups (their INT8
// codes stay in L2/L3 while the groups pass). gemv.cpp's tile_pass says why.
constexpr int64_t kTileFromRows = 3;
constexpr int kTileRows = 4, kTileGroups = 2;
constexpr int64_t kSweepRows = 256;

// Rows [0, m) x groups [g0, g1) in tiles; `pass(g, width, i0, rows, sums)` fills sums [rows][width x 16] for groups
// g .. g + width - 1 (width 1 for an odd share's last group) and rows i0 .. i0 + rows - 1, which go to y (times
// row_scale, where given) for the columns below n.
template <typename Pass>
void tile_sweep(int64_t m, int64_t n, int64_t g0, int64_t g1, const float* row_scale, float* y, int64_t ldy,
                Pass&& pass) {
  alignas(64) float sums[kTileRows * kTileGroups * kGroupRows];
  for (int64_t r0 = 0; r0 < m; r0 += kSweepRows) {
    const int64_t r1 = std::min(m, r0 + kSweepRows);
    for (int64_t g = g0; g < g1; g += kTileGroups) {
      const int width = static_cast<int>(std::min<int64_t>(kTileGroups, g1 - g));
      for (int64_t i0 = r0; i0 < r1; i0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, r1 - i0));
        pass(g, width, i0, rows, sums);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < width; ++j) {
            const int64_t col0 = (g + j) * kGroupRows, cols = std::min(kGroupRows, n - col0);
            const float* sum = sums + (r * width + j) * kGroupRows;
            float* out = y + (i0 + r) * ldy + col0;
            if (row_scale)
              for (int64_t c = 0; c < cols; ++c) out[c] = sum[c] * row_scale[col0 + c];
            else
              std::memcpy(out, sum, cols * sizeof(float));
          }
      }
    }
  }
}

// Blocks 0 .. nb - 1 into two sums by turns (even, odd), unrolled in pairs so the loop has no branch: the INT8 and
// INT4 kernels' passes (`step(b, sums)` adds block b into sums).
template <typename Step, typename Sums>
inline void alternate_blocks(int64_t nb, Step&& step, Sums even, Sums odd) {
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    step(b, even);
    step(b + 1, odd);
  }
  if (b < nb) step(b, even);
}

// Fills `out` (reusing its storage) with the M x K rows x, float32 or bfloat16 (as bits).
void quantize_rows(const float* x, int64_t m, int64_t k, QuantizedRows& out);
void quantize_rows(const uint16_t* x, int64_t m, int64_t k, QuantizedRows& out);
// The same for a torch entry point's input [M, K] (bfloat16 read as it is, else as float32), the rows'
// blocks split between ATen's threads, into the calling thread's storage (kept for its next call).
const QuantizedRows& quantize_input(const at::Tensor& x);

// y[i, r] for rows i < m and output columns r in [n0, n1), y's rows `ldy` apart.
// INT8 weights in gemv.cpp's blocks [ceil(N / 16), K / 32, 512 (+ 32 with their float16 scales)]: the row groups
// g0 .. g1 - 1; row_scale [16 ceil(N / 16)] for one scale a row, or nullptr for the blocks' own.
void i8_groups(const QuantizedRows& a, const uint8_t* blocks, const float* row_scale, float* y, int64_t ldy,
               int64_t m, int64_t k, int64_t n, int64_t g0, int64_t g1);
// INT4 weights in gemv_int4.cpp's blocks [ceil(N / 16), K / 32, 320]: the row groups g0 .. g1 - 1, i.e.
// output columns 16 g0 .. min(16 g1, n) - 1.
void i4_groups(const QuantizedRows& a, const uint8_t* blocks, float* y, int64_t ldy, int64_t m, int64_t k,
               int64_t n, int64_t g0, int64_t g1);
// Checks of the INT8 and INT4 blocks as the kernels read them (gemv.cpp), for every caller that hands
// them blocks: an INT8 weight's blocks are 544 bytes with their float16 scales, 512 with the scales apart in
// row_scale (returned: the block stride); `n` output rows must fill the last of the groups of 16.
int64_t check_int8_blocks(const at::Tensor& blocks, const c10::optional<at::Tensor>& row_scale);
void check_int4_blocks(const at::Tensor& blocks);
// llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) in kquant.cpp's blocks [ceil(N / 16), K / 256, record bytes]: the row
// groups g0 .. g1 - 1. `kind` is the GGML type (12, 13, 14); check_kq_blocks checks the layout for it.
void kq_groups(const QuantizedRows& a, const uint8_t* blocks, int64_t kind, float* y, int64_t ldy, int64_t m,
               int64_t k, int64_t n, int64_t g0, int64_t g1);
void check_kq_blocks(const at::Tensor& blocks, int64_t kind);
void check_groups_fit(const at::Tensor& blocks, int64_t n);
// Float32 weights in panels [ceil(N / 16), K, 16]: the panels p0 .. p1 - 1, i.e. columns 16 p0 .. <= 16 p1.
// bfloat16 weights w [N, K] (bits as uint16), plain layout: columns n0 .. n1 - 1. `xb`: the same rows as
// bfloat16 bits when they are bfloat16 values, else null (the products then run as bfloat16 pairs where
// the CPU has AVX512-BF16; x is read otherwise).
void bf16_columns(const float* x, const uint16_t* xb, const uint16_t* w, float* y, int64_t ldy, int64_t m, int64_t k,
                  int64_t n0, int64_t n1);
void f32_panels(const float* x, int64_t m, int64_t k, const float* panels, int64_t n, float* y, int64_t ldy,
                int64_t p0, int64_t p1);
// The same for panels of bfloat16 (bf16) or float16 weights, widened to float32 as they are read.
void half_panels(const float* x, int64_t m, int64_t k, const uint16_t* panels, bool bf16, int64_t n, float* y,
                 int64_t ldy, int64_t p0, int64_t p1);

// The bfloat16 GEMM (gemm_bf16.cpp; AVX512-BF16 only, bf16_gemm_compiled() says): activations packed
// by pack_pairs as [K / 2, packed_rows(M)] pairs (x[i, 2p], x[i, 2p + 1]), the padding rows zero; then
// y[i, c] for rows i < m and columns c in [n0, n1), rounded to bfloat16, from bf16 weights w [N, K].
inline int64_t packed_rows(int64_t m) { return (m + 15) / 16 * 16; }
// Weight rows (output columns) a tile of the bf16 GEMM takes for m activation rows (gemm_bf16.cpp): 8 while the
// rows fit two registers, whose 4 columns left 4 or 8 chains of vdpbf16ps waiting on its latency; else 4.
inline int64_t gemm_tile_cols(int64_t m) { return packed_rows(m) <= 32 ? 8 : 4; }

// The float16 stored at p (GGUF's scales, unaligned), as float32.
inline float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}
void pack_pairs(const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t k, std::vector<uint32_t>& out);
// `ahead`: bytes to request into L2 meanwhile (the next rows of a compact weight), spread over the work.
void bf16_gemm_columns(const uint32_t* packed, int64_t m, const uint16_t* w, int64_t k, c10::BFloat16* y,
                       int64_t ldy, int64_t n0, int64_t n1, const uint8_t* ahead = nullptr, int64_t ahead_bytes = 0);
bool bf16_gemm_compiled();
// y [M, N] bfloat16 for bfloat16 rows x [M, K] by a GEMM on packed pairs (gemm_bf16.cpp): the rows in chunks
// packed by pack_pairs, each chunk's columns shared out between threads in panels of 16; `columns(pairs,
// rows, y of the chunk, c0, c1)` computes columns [c0, c1) of a chunk (rows `N` apart).
using GemmColumns = std::function<void(const uint32_t*, int64_t, c10::BFloat16*, int64_t, int64_t)>;
// Readies weight rows [c0, c1) for every chunk of rows that follows (the compact layout decodes them once).
using GemmPass = std::function<void(int64_t, int64_t)>;
// Rows a chunk of gemm_in_row_chunks takes at K inputs: their packed pairs stay in L2 while a tile's columns pass.
inline int64_t gemm_chunk_rows(int64_t k) { return std::max<int64_t>(32, (256 * 1024 / (2 * k)) / 32 * 32); }
at::Tensor gemm_in_row_chunks(const at::Tensor& x, int64_t n, const GemmColumns& columns,
                              const GemmPass& pass = nullptr);

// bfloat16 weights packed for AMX (linear_vnni.cpp): blocks of 32 output columns, each [K / 2, 32, 2].
// Columns [c0, c1) of y (float32 sums rounded to bfloat16, rows `ldy` apart) for m rows of bfloat16
// bits xb (rows `ldx` apart); c0 a multiple of 32. `vnni_stream_columns` streams the blocks (few rows, AVX512-BF16),
// `vnni_brgemm_columns` runs oneDNN's brgemm micro-kernel (AMX tiles) on them: a thread that ran it
// calls vnni_release() before it leaves its parallel region. vnni_compiled(): both are usable here.
constexpr int64_t kVnniBlock = 32;
void vnni_stream_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k, const uint16_t* packed,
                         c10::BFloat16* y, int64_t ldy, int64_t c0, int64_t c1);
void vnni_brgemm_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k, const uint16_t* packed,
                         c10::BFloat16* y, int64_t ldy, int64_t c0, int64_t c1);
void vnni_release();
bool vnni_compiled();
// The same columns summed in the bf16 GEMM's order (gemm_bf16.cpp: every output's pairs in one chain from
// zero, then rounded once), so that a row's result does not depend on how many rows share the call: few rows
// streamed (`vnni_ordered_columns`) or the GEMM on rows packed by pack_pairs (`bf16_gemm_vnni_columns`), the
// same bits either way and the same as bf16_gemm_columns' on the plain layout. AVX512-BF16 (bf16_gemm_compiled).
void vnni_ordered_columns(const uint16_t* xb, int64_t ldx, int64_t m, int64_t k, const uint16_t* packed,
                          c10::BFloat16* y, int64_t ldy, int64_t c0, int64_t c1);
void bf16_gemm_vnni_columns(const uint32_t* packed, int64_t m, const uint16_t* w, int64_t k, c10::BFloat16* y,
                            int64_t ldy, int64_t n0, int64_t n1);
// Rows a brgemm kernel takes through every block of its columns while they sit in L2 (at 1,024 rows,
// 0.77x the time of one pass over all rows, measured on a 2-core Xeon).
constexpr int64_t kBrgemmChunkRows = 256;
void check_vnni(const at::Tensor& packed, int64_t n);

// bfloat16 weights in the compact layout (bf16_compact.cpp: 12 bits a weight, lossless): blocks of 64 weights,
// 32 bytes of 4-bit codes for the high bytes then the 64 low bytes, or (flagged in a bitmap) kept whole.
constexpr int64_t kCompactBlock = 64;
constexpr int64_t kCompactBytes = 96;
struct CompactView {
  const uint8_t* blocks = nullptr;       // [N, K / 64] blocks of 96 bytes
  const uint64_t* bitmap = nullptr;      // [N, words]: bit b of a row set where block b is kept whole
  const int64_t* first_whole = nullptr;  // [N + 1]: the index of each row's first whole block
  const uint16_t* whole = nullptr;       // the whole blocks, 64 bfloat16 each, in row order
  int64_t n = 0, k = 0, words = 0;
  uint8_t high[16] = {};  // the high byte each code stands for
};
CompactView compact_view(const at::Tensor& packed);  // checks the tensor is one
inline bool compact_is_whole(const CompactView& w, int64_t r, int64_t b) {
  return (w.bitmap[r * w.words + b / 64] >> (b % 64)) & 1;
}
// Whether row r keeps any block whole (most rows keep none, and their blocks need no test).
inline bool compact_row_has_whole(const CompactView& w, int64_t r) { return w.first_whole[r + 1] > w.first_whole[r]; }
#if defined(__AVX512BW__)
inline __m512i compact_table(const CompactView& w) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.high)));
}
// A block's 64 weights as the plain layout's two loads: codes zero-extended to 16 bits, each nibble moved
// into its own byte, looked up (vpshufb reads an index's low 4 bits), interleaved with the low bytes.
inline void compact_decode(const uint8_t* block, __m512i table, __m512i& w0, __m512i& w1) {
  const __m512i nibbles = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  const __m512i codes = _mm512_ternarylogic_epi64(nibbles, _mm512_slli_epi16(nibbles, 4),
                                                  _mm512_set1_epi16(0x0f0f), 0xA8);  // (a | b) & c
  const __m512i high = _mm512_shuffle_epi8(table, codes);
  const __m512i low = _mm512_loadu_si512(block + 32);
  w0 = _mm512_unpacklo_epi8(low, high);
  w1 = _mm512_unpackhi_epi8(low, high);
}
#endif
// Rows [r0, r1) in the plain layout into out [r1 - r0, K]; the streaming kernel's float32 sums for columns
// [n0, n1) of m rows of bfloat16 bits xb (bf16_columns' to the bit); the GEMM's (bf16_gemm_columns' to the bit).
void compact_unpack_rows(const CompactView& w, int64_t r0, int64_t r1, uint16_t* out);
void compact_columns(const uint16_t* xb, const CompactView& w, float* y, int64_t ldy, int64_t m, int64_t n0,
                     int64_t n1);
void compact_gemm_columns(const uint32_t* packed, int64_t m, const CompactView& w, c10::BFloat16* y, int64_t ldy,
                          int64_t n0, int64_t n1);
bool compact_compiled();

// INT8, INT4 or K-quant weights in the streaming kernels' blocks (gemv.cpp, gemv_int4.cpp, kquant.cpp), as
// quant_amx.cpp reads them: columns [c0, c1) of y = x W^T for m rows of bfloat16 bits xb, rounded to bfloat16,
// each group of 16 columns dequantized a block at a time into AMX tiles (c0 a multiple of 16; the call gives the
// tiles back before it returns). quant_amx_compiled(): built with AMX, on an AMX CPU, the tile state granted.
struct QuantizedWeight {
  const uint8_t* blocks = nullptr;
  const float* row_scale = nullptr;  // INT8 with a scale per row; null: scales inside the blocks
  int64_t block_stride = 0;          // INT8: 512 or 544 bytes
  int64_t k = 0, n = 0;
  bool int4 = false;
  int64_t kq_type = 0;  // a K-quant's GGML type (12 Q4_K, 13 Q5_K, 14 Q6_K) in kquant.cpp's records; 0: INT8/INT4
};
void amx_quant_columns(const QuantizedWeight& w, const uint16_t* xb, int64_t ldx, int64_t m, c10::BFloat16* y,
                       int64_t ldy, int64_t c0, int64_t c1);
bool quant_amx_compiled();

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// v rounded to T: for bfloat16 to nearest even, NaN to 0x7fc0, exactly as c10 rounds, but in integer
// operations the compiler vectorises (c10's conversion, one element at a time, kept the bf16 norms,
// RoPE and SiLU scalar: 7% of a 64-sequence decode step).
template <typename T>
inline T round_to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    const uint16_t bits = v != v ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return c10::BFloat16(bits, c10::BFloat16::from_bits());
  }
}
// The float value of round_to<T>(v).
template <typename T>
inline float rounded(float v) { return to_float(round_to<T>(v)); }

// v[i] = exp(v[i]) eight at a time (a Cephes-style polynomial, within 2 ulp of expf). The build keeps
// -fno-finite-math-only, so glibc's vector exp is not used and every std::exp was a scalar call: a
// fifth of the attention kernel's time and most of SiLU's. Each value's result depends on the value
// alone, wherever it sits in the array.
void exp_inplace(float* v, int64_t n);
// v[i] = exp(v[i] - max v) by exp_inplace's arithmetic; returns 1 / sum (0 for an empty or all-zero
// sum). The max and the sum run in vector lanes: as scalar chains they were a fifth of a bf16 decode
// attention item's time.
float softmax_inplace(float* v, int64_t n);
// v[i] = cap * tanh(v[i] / cap) (Gemma 2's soft cap on attention scores), tanh through exp_inplace.
void softcap_inplace(float* v, int64_t n, float cap);

// One row of the step operations, in HF's formulas; float32, or bfloat16 rounded where torch rounds.
// out = norm(x) * weight; with a residual, first residual += x and normalize the sum.
void rms_norm_row(const float* x, float* residual, const float* weight, float* out, int64_t h, float eps);
// Rotate-half RoPE of `heads` heads of `head_dim` lying one after another at v.
void rope_heads(float* v, int64_t heads, int64_t head_dim, const float* cos, const float* sin);
// out[j] = silu(gate[j]) * up[j] for j < count.
void silu_mul_row(const float* gate, const float* up, float* out, int64_t count);
// out[j] = gelu_tanh(gate[j]) * up[j] for j < count (GeGLU).
void gelu_mul_row(const float* gate, const float* up, float* out, int64_t count);
using bf16 = c10::BFloat16;
void rms_norm_row(const bf16* x, bf16* residual, const bf16* weight, bf16* out, int64_t h, float eps);
void rope_heads(bf16* v, int64_t heads, int64_t head_dim, const bf16* cos, const bf16* sin);
void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t count);
void gelu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t count);

// Decode attention of one (sequence, KV head) item: the `group` query heads at q (contiguous, scaled
// inside; the scores capped at `softcap` where it is > 0) attend to keys first .. len - 1 of the sequence's block table; writes the group's outputs.
struct AttentionScratch {
  std::vector<float> acc, qf, scores, inv_sum, widened;
};
void attend_item(const float* q, const float* k_cache, const float* v_cache, const int32_t* table, int64_t len,
                 int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, float softcap, float* out, AttentionScratch& scratch);
void attend_item(const bf16* q, const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t len,
                 int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, float softcap, bf16* out, AttentionScratch& scratch);
// Requests an item's keys and values into L2 (call it for the next item before attending this one).
void prefetch_item(const float* k_cache, const float* v_cache, const int32_t* table, int64_t len, int64_t window,
                   int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size);
void prefetch_item(const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t len, int64_t window,
                   int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size);

// The INT8 KV cache (kv_int8.cpp): rows of head_dim int8 values and their float16 scale, head_dim + 2
// bytes. quantize_kv_row writes one; attend_item and prefetch_item as above, on such pools.
void quantize_kv_row(const float* x, int64_t head_dim, int8_t* out);
void quantize_kv_row(const bf16* x, int64_t head_dim, int8_t* out);
void attend_item(const float* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* table, int64_t len,
                 int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, float softcap, float* out, AttentionScratch& scratch);
void attend_item(const bf16* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* table, int64_t len,
                 int64_t window, int64_t kv_head, int64_t group, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, float scale, float softcap, bf16* out, AttentionScratch& scratch);
void prefetch_item(const int8_t* k_cache, const int8_t* v_cache, const int32_t* table, int64_t len, int64_t window,
                   int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size);

}  // namespace llmaccel
